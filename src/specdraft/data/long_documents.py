"""Long documents that ship offline, each with a task on it: the prompts of long samples and long evaluations.

Domains (``DOCUMENT_TASKS``):

* ``stdlib-code``       one standard-library module's source; continue the code where it stops.
* ``stdlib-docs``       one module's docstrings as reference documentation; explain one entry of it.
* ``specdraft-source``  specdraft's own source, file after file from a starting file; explain one definition.

Documents are split by name into a training side and a held-out side (``document_side``, by a hash of the
module's name, so a module's source and its docstrings fall on one side), as conversations are split for
validation: the ``long-documents`` training source (``training_rows``, for ``specdraft prepare --regenerate``)
reads the training side only and the long-context eval suite the held-out side, so a drafter trained on long
samples is never evaluated on a document it saw. specdraft's own source trains nothing (every starting file
gives the same text); it is a held-out domain whole.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

#: share of stdlib modules on the held-out side (the long-context eval suite's documents)
HELD_OUT_SHARE = 0.5
#: the training source's documents: at least this many characters (~1k tokens of code), cut at a line end
#: to at most ``TRAIN_MAX_CHARS`` (~7-8k tokens, under the embedded target's 8,192-token context with a reply)
TRAIN_MIN_CHARS, TRAIN_MAX_CHARS = 3_000, 24_000
TRAINING_DOMAINS = ("stdlib-code", "stdlib-docs")
SOURCE_NAME = "long-documents"

Task = Callable[[str, str, random.Random], tuple[dict, ...]]


def user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def document_side(module: str) -> str:
    """'held-out' or 'train' for a stdlib module (its path without the '.py'), fixed by a hash of the name."""
    draw = int.from_bytes(hashlib.sha256(f"{SOURCE_NAME}:{module}".encode()).digest()[:8], "big") / 2**64
    return "held-out" if draw < HELD_OUT_SHARE else "train"


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files() -> list[Path]:
    """The standard library's own modules (tests, IDLE, 2to3 and installed packages left out), sorted."""
    root = _stdlib_root()
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def _module(path: Path) -> str:
    return str(path.relative_to(_stdlib_root()).with_suffix(""))


def _docstrings(path: Path) -> str:
    """A module's documentation: its docstring, then every documented class and function as 'name: doc'."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    sections = [f"Module {path.stem}: {ast.get_docstring(tree) or ''}"]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (doc := ast.get_docstring(node)):
            sections.append(f"{path.stem}.{node.name}: {doc}")
    return "\n\n".join(sections) if len(sections) > 1 else ""


_DEFINITION = re.compile(r"^(?:def|class) ([A-Za-z_]\w*)", re.M)
_ENTRY = re.compile(r"^([\w.]+\.\w+): ", re.M)


def _pick(rng: random.Random, names: list[str], fallback: str) -> str:
    """One name from the middle half of ``names`` (the question's answer lies deep in the document)."""
    middle = names[len(names) // 4 : max(len(names) * 3 // 4, len(names) // 4 + 1)]
    return rng.choice(middle) if middle else fallback


def _code_task(name: str, code: str, rng: random.Random) -> tuple[dict, ...]:
    return user(
        f"Here is the start of `{name}` from the Python standard library.\n\n```python\n{code}\n```\n\n"
        "Continue the code from exactly where it stops."
    )


def _docs_task(name: str, text: str, rng: random.Random) -> tuple[dict, ...]:
    entry = _pick(rng, _ENTRY.findall(text), name)
    return user(
        f"Below is reference documentation from the Python standard library.\n\n{text}\n\n"
        f"Using only the documentation above, explain what `{entry}` does and when one would use it."
    )


def _source_task(name: str, code: str, rng: random.Random) -> tuple[dict, ...]:
    definition = _pick(rng, _DEFINITION.findall(code), "the first function")
    return user(
        f"Below is source code of specdraft, a speculative decoding library.\n\n```python\n{code}\n```\n\n"
        f"Explain what `{definition}` in the code above does and which other parts of the code use it."
    )


DOCUMENT_TASKS: dict[str, Task] = {"stdlib-code": _code_task, "stdlib-docs": _docs_task, "specdraft-source": _source_task}


def documents(domain: str, side: str) -> list[tuple[str, str]]:
    """(name, text) of one domain's documents on ``side`` ('train' or 'held-out'), in sorted order: single stdlib
    modules (source named by its file, docstrings by the module, e.g. 'json/decoder.py' and 'json/decoder'), or
    specdraft's source as one file-by-file concatenation per starting file
    (held-out only)."""
    if domain == "specdraft-source":
        if side != "held-out":
            return []
        package = Path(__file__).resolve().parents[1]
        files = sorted(package.rglob("*.py"))
        chunks = [f"# file: {p.relative_to(package.parent)}\n{p.read_text(encoding='utf-8')}" for p in files]
        return [(str(files[i].relative_to(package.parent)), "\n".join(chunks[i:] + chunks[:i])) for i in range(len(files))]
    files = [p for p in _stdlib_files() if document_side(_module(p)) == side]
    if domain == "stdlib-code":
        return [(str(p.relative_to(_stdlib_root())), p.read_text(encoding="utf-8", errors="replace")) for p in files]
    return [(_module(p), text) for p in files if (text := _docstrings(p))]


def cut_at_line(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a line end where it has one."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    return cut[: cut.rfind("\n")] if "\n" in cut else cut


def training_rows(seed: int = 0) -> Iterator[dict]:
    """Prompt-only OpenAI-form rows (``specdraft prepare --regenerate`` has the target answer them) over the training side's
    documents of ``TRAINING_DOMAINS`` of at least ``TRAIN_MIN_CHARS`` characters, cut to ``TRAIN_MAX_CHARS``:
    the domains alternate and each is in a seeded order, so the first N rows are a fair mix of both and of
    document lengths."""
    queues = []
    for domain in TRAINING_DOMAINS:
        docs = [(name, text) for name, text in documents(domain, "train") if len(text) >= TRAIN_MIN_CHARS]
        random.Random(f"{seed}:{domain}").shuffle(docs)
        queues.append([(domain, name, text) for name, text in docs])
    for rank in range(max(len(q) for q in queues)):
        for queue in queues:
            if rank < len(queue):
                domain, name, text = queue[rank]
                messages = DOCUMENT_TASKS[domain](name, cut_at_line(text, TRAIN_MAX_CHARS).rstrip(), random.Random(f"{seed}:{name}"))
                yield {"id": f"{domain}:{name}", "messages": list(messages)}
