"""specdraft installed as a wheel, not from the checkout: package data present and found, nothing machine-specific shipped.

An editable install reads recipes, the native kernel's source and the reference drafter from ``src/``, so a file left
out of ``[tool.setuptools.package-data]`` or a path computed from the checkout's layout passes every other test and
breaks only for users. The slow test builds the wheel, installs it into a fresh virtual environment (which borrows
this one's dependencies through a ``.pth`` line, so the checkout's editable ``.pth`` is not read) and runs the
installed ``specdraft`` from a directory outside the checkout.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "specdraft"
#: An absolute path of some machine: a POSIX path under a top-level directory that holds users' or machines' files,
#: or a Windows drive path, after a quote, space, bracket or line start.
ABSOLUTE = re.compile(r"""(?:^|[\s"'`(=])((?:/(?:root|home|Users|tmp|work|mnt|opt|var|data|scratch|srv)/|[A-Za-z]:\\)[^\s"'`)]*)""", re.M)


def package_data_globs() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specdraft"]


def package_data() -> list[Path]:
    """Every file of the package that is not Python source (recipes, the kernel's C++, the reference drafter)."""
    return sorted(p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts)


def absolute_paths(text: str) -> list[str]:
    return ABSOLUTE.findall(text)


def test_the_absolute_path_scan_finds_what_it_looks_for():
    assert absolute_paths('{"name_or_path": "/root/.cache/specdraft/targets/smollm2-135m"}') == [
        "/root/.cache/specdraft/targets/smollm2-135m"
    ]
    assert absolute_paths("built in C:\\Users\\me") and absolute_paths("see /home/ci/x.yaml")
    assert not absolute_paths("runs/ref/data, docs/results/quickstart.md, 1/2, http://host/path, HuggingFaceTB/SmolLM2-135M-Instruct")


def test_package_data_is_declared_and_carries_no_absolute_path():
    files = package_data()
    assert {"dspark.yaml", "streamed_linear.cpp", "config.json", "model.safetensors"} <= {p.name for p in files}
    undeclared = [
        str(p.relative_to(PACKAGE)) for p in files if not any(fnmatch.fnmatch(str(p.relative_to(PACKAGE)), g) for g in package_data_globs())
    ]
    assert not undeclared, f"package files no [tool.setuptools.package-data] glob ships in the wheel: {undeclared}"
    machine = [str(Path.home()), str(ROOT)]
    found = {}
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # weights
        hits = absolute_paths(text) + [m for m in machine if m in text]
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    assert not found, f"package data naming a machine's absolute paths: {found}"


def _fresh_venv(directory: Path) -> Path:
    """A virtual environment of its own whose ``.pth`` adds this one's site-packages (torch, transformers, ...) as a
    plain directory: its ``.pth`` files, the checkout's editable install among them, are not processed there."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    python = directory / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


CHECKS = """
import json, sys
from pathlib import Path
import specdraft
from specdraft.reference import reference_drafter
from specdraft.train.config import recipe_path, resolve_config
from specdraft.tuning.streamed import SOURCE, build_failure, streamed_ops

recipe = resolve_config("dspark", {"out": "x"})
ops = streamed_ops()
print(json.dumps({"package": specdraft.__file__, "recipe": str(recipe_path("dspark")), "method": recipe.method,
                  "reference": str(reference_drafter("smollm2-135m")), "kernel_source": str(SOURCE),
                  "kernel": ops is not None, "kernel_failure": build_failure()}))
"""


@pytest.mark.slow
def test_the_wheel_installs_and_runs_with_its_package_data(tmp_path):
    source = tmp_path / "source"  # built from a copy: the build writes build/ and *.egg-info beside its sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source), "-w", str(tmp_path / "dist")],
        check=True,
        timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("specdraft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"specdraft/{p.relative_to(PACKAGE).as_posix()}" for p in package_data()}
    assert shipped <= names, f"missing from the wheel: {sorted(shipped - names)}"

    python = _fresh_venv(tmp_path / "venv")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        check=True,
        timeout=600,
    )
    work = tmp_path / "elsewhere"  # no checkout, no .venv-vllm here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECDRAFT_VLLM_PYTHON")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")  # the kernel is built from the installed source
    specdraft = [str(tmp_path / "venv" / "bin" / "specdraft")]

    def run(*argv: str) -> str:
        done = subprocess.run([*argv], capture_output=True, text=True, cwd=work, env=env, timeout=900)
        assert done.returncode == 0, f"{argv}: {done.stderr[-3000:]}"
        print(f"$ {' '.join(argv)}\n{done.stdout}")  # the output the issue asks to show (pytest -s)
        return done.stdout

    site = tmp_path / "venv" / "lib"
    facts = json.loads(run(str(python), "-c", CHECKS).strip().splitlines()[-1])
    for key in ("package", "recipe", "reference", "kernel_source"):
        assert Path(facts[key]).is_relative_to(site), f"{key} read from {facts[key]}, not from the installed wheel"
    assert facts["method"] == "dspark"
    assert facts["kernel"] or facts["kernel_failure"], "the kernel neither built nor said why"

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run(*specdraft, "--version").strip() == f"specdraft {version}"  # no checkout: no commit
    env_report = json.loads(run(*specdraft, "env", "--json"))
    assert env_report["specdraft"]["version"] == version
    assert env_report["specdraft"]["checkout"] is None and env_report["specdraft"]["git"] is None
    assert Path(env_report["specdraft"]["location"]).is_relative_to(site)
    assert "## measured choices" in run(*specdraft, "env")
    out = run(
        *specdraft,
        "generate",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "4",
        "--drafter",
        "dspark",
        "--drafter-path",
        facts["reference"],
        "--threads",
        "1",
    )
    assert "drafter=dspark" in out


def test_checkpoints_name_an_embedded_target_portably_and_serve_finds_it_by_name():
    from specdraft.integrations.vllm.serve import read_drafter_info
    from specdraft.models.common.drafter import portable_identity
    from specdraft.reference import reference_drafter

    embedded = {"name": "smollm2-135m", "path": "/root/.cache/specdraft/targets/smollm2-135m", "fingerprint": "748dc84065403f9c"}
    assert portable_identity(embedded) == {
        "name": "smollm2-135m",
        "fingerprint": "748dc84065403f9c",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",
    }
    local = {"name": "models/qwen", "path": "/data/models/qwen", "fingerprint": "0"}
    assert portable_identity(local) == local  # the user's own target stays where the user keeps it
    assert read_drafter_info(reference_drafter("smollm2-135m")).target == "smollm2-135m"
