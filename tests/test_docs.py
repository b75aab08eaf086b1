"""The README and the docs site cannot drift from the code: generated reference pages are current, every documented
``specdraft`` command parses with the real argument parser, and every relative link resolves.

Nothing here runs a command: ``parse_args`` only.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```|~~~)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence) *$", re.M | re.S)
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SHELL_OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "2>", "2>&1"}


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def parser():
    from specdraft.cli.main import build_parser

    return build_parser()


def test_generated_pages_are_current():
    gen = _gen_docs()
    stale = [path for path, render in gen.PAGES.items() if not (ROOT / path).is_file() or (ROOT / path).read_text() != render()]
    assert not stale, f"stale generated docs: {', '.join(stale)}; run `python scripts/gen_docs.py` and commit the result"


def documented_commands(page: Path) -> list[tuple[int, list[str]]]:
    """``(line, argv)`` of every ``specdraft ...`` command in the page's shell code blocks: argv is what follows the
    program (``specdraft``, ``.venv/bin/specdraft`` or ``python -m specdraft.cli.main``), after env assignments,
    up to a shell operator; ``\\`` continuations are joined and ``#`` comments dropped."""
    text = page.read_text()
    found = []
    for block in FENCE.finditer(text):
        if block.group("info").strip().lower() not in SHELL_BLOCKS:
            continue
        first_line = text.count("\n", 0, block.start("body")) + 1
        logical: list[tuple[int, str]] = []
        pending, start = "", 0
        for offset, raw in enumerate(block.group("body").splitlines()):
            line = raw.strip()
            if not pending:
                start = first_line + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            logical.append((start, pending + line))
            pending = ""
        for lineno, line in logical:
            if not re.search(r"(^|[\s/])specdraft(\s|$)|specdraft\.cli\.main", line):
                continue  # a diagram, an output line or another program: not ours to parse
            try:
                words = shlex.split(line.removeprefix("$ "), comments=True)
            except ValueError as exc:  # an unbalanced quote: the documented command cannot be pasted either
                found.append((lineno, [f"<unparseable shell line: {exc}>"]))
                continue
            for i, word in enumerate(words):
                program = word == "specdraft" or word.endswith("/specdraft")
                module = word == "-m" and i + 1 < len(words) and words[i + 1] == "specdraft.cli.main"
                if not (program or module):
                    continue
                rest = words[i + (2 if module else 1) :]
                argv = []
                for arg in rest:
                    if arg in SHELL_OPERATORS:
                        break
                    argv.append(arg)
                found.append((lineno, argv))
                break
    return found


def test_documented_commands_parse(parser):
    failures, count = [], 0
    for page in PAGES:
        for lineno, argv in documented_commands(page):
            count += 1
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                if exc.code not in (0, None):  # --help exits 0
                    failures.append(f"{page.relative_to(ROOT)}:{lineno}: specdraft {shlex.join(argv)}")
    assert count >= 20, f"only {count} documented specdraft commands found: has the code-block scan broken?"
    assert not failures, "documented commands the CLI rejects (argparse's reason is printed above):\n" + "\n".join(failures)


def test_command_scan_reads_shell_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nSPECDRAFT_CACHE=C .venv/bin/specdraft train --config dspark \\\n  --data S --out R  # resume\n"
        "python -m specdraft.cli.main eval --out E && echo done\n```\n\n```text\nspecdraft not a command\n```\n"
    )
    assert documented_commands(page) == [(2, ["train", "--config", "dspark", "--data", "S", "--out", "R"]), (4, ["eval", "--out", "E"])]


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (mkdocs) gives a heading; GitHub's agrees on plain headings."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _prose(text: str) -> str:
    """``text`` without code blocks and inline code, where link syntax is only an example."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The heading anchors of ``page``, with those of the files it includes (``--8<-- "FILE"``, mkdocs snippets
    resolved from the repository root)."""
    text = page.read_text()
    for included in re.findall(r'^--8<-- "([^":]+)(?::[^"]*)?"$', text, re.M):
        text += "\n" + (ROOT / included).read_text()
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", _prose(text), re.M)}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)(?: \"[^\"]*\")?\)", _prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                broken.append(f"{where} (no such file)")
            elif page.is_relative_to(DOCS) and not resolved.is_relative_to(DOCS):
                broken.append(f"{where} (leaves docs/: the site cannot serve it; link a docs page instead)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{where} (no heading with anchor #{anchor})")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Add a target family", "add-a-target-family"),
        ("`specdraft store start`", "specdraft-store-start"),
        ("Serving with vLLM", "serving-with-vllm"),
    ],
)
def test_slug_matches_mkdocs(heading, anchor):
    assert slug(heading) == anchor
