"""``provenance.json``: what a run directory (train, eval, quickstart) was made by, from and on.

A figure in a run directory is only comparable with another when both say which code, inputs and machine made
them; the logs say it once and are gone. So every run records, beside its outputs: specdraft's version and git
commit (from a source checkout), the package versions, the command line, the resolved config, the sha256 of the
manifest of each input it read (a prepared dataset's or store's ``manifest.json``, a drafter's ``config.json``,
which records its weights' checksum), the machine facts (``utils/environment.py``) and the machine choices the
run made (measured, read from the cache, or given: ``tuning/``). A rerun (a resume) replaces the file: it
describes the invocation that last wrote the directory.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "provenance.json"
FORMAT = "specdraft.provenance"
#: The file of an input directory that identifies its content, in the order looked for: a prepared dataset's or
#: hidden-state store's manifest (which records its rows' digests), a drafter checkpoint's config (its weights' sha256).
MANIFESTS = ("manifest.json", "config.json")


def input_record(source: str | os.PathLike) -> dict[str, Any]:
    """One input: its path and the sha256 of its manifest (a directory) or content (a file); ``sha256`` None where it
    is neither here (a URL, a registry name such as ``ngram``)."""
    from specdraft.utils.io import sha256_file

    path = Path(source).expanduser()
    if path.is_file():
        return {"path": str(path.resolve()), "sha256": sha256_file(path)}
    manifest = next((path / name for name in MANIFESTS if (path / name).is_file()), None) if path.is_dir() else None
    if manifest is not None:
        return {"path": str(path.resolve()), "manifest": manifest.name, "sha256": sha256_file(manifest)}
    return {"path": str(source), "sha256": None}


def jsonable(value: Any) -> Any:
    """``value`` as JSON holds it: dataclasses as mappings, paths and other objects as their ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def choices_in(facts: Mapping[str, Any]) -> dict[str, Any]:
    """The machine choices recorded in ``facts`` (a stage's or report's facts, nested mappings searched too), each in
    the convention the probes write (``threads``, ``threads_source``, ``threads_seconds``: ``tuning/threads.threads_facts``,
    ``PathChoice.to_json``), as ``{name: {"value", "source", "seconds"}}`` under the same nesting; the rest is left out."""
    found: dict[str, Any] = {}
    for key, value in facts.items():
        if isinstance(value, Mapping):
            if nested := choices_in(value):
                found[str(key)] = nested
        elif f"{key}_source" in facts:
            found[str(key)] = {
                "value": jsonable(value),
                "source": facts[f"{key}_source"],
                "seconds": jsonable(facts.get(f"{key}_seconds") or {}),
            }
    return found


def write_provenance(
    run_dir: str | os.PathLike,
    *,
    config: Any,
    target: Mapping[str, Any] | None = None,
    inputs: Iterable[str | os.PathLike | None] = (),
    measured: Any = None,
) -> Path:
    """Write ``RUN_DIR/provenance.json`` atomically and return its path.

    ``config`` is the run's resolved config (a dataclass or mapping); ``target`` the target's identity
    (``Target.describe()``: name, fingerprint, tokenizer hash); ``inputs`` the datasets, stores, drafters and
    files it read (None and empty entries are skipped, duplicates recorded once); ``measured`` the machine choices it
    made and why: a stage's ``MachineSettings`` (``tuning/settings.py``), or facts that record them (a report, a
    journal's stages), from which :func:`choices_in` keeps the choices.
    """
    from specdraft.utils.environment import git_commit, machine_facts, package_versions, specdraft_version
    from specdraft.utils.io import atomic_write_json

    path = Path(run_dir) / PROVENANCE_FILE
    record = {
        "format": FORMAT,
        "format_version": 1,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "specdraft": {"version": specdraft_version(), "git": git_commit()},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": {name: version for name, version in package_versions().items() if version},
        "command": list(sys.argv),
        "cwd": os.getcwd(),
        "config": jsonable(config),
        "target": jsonable(target),
        "inputs": [input_record(source) for source in dict.fromkeys(str(s) for s in inputs if s)],
        "machine": machine_facts(),
        "measured": jsonable(measured) if dataclasses.is_dataclass(measured) else choices_in(measured or {}),
    }
    atomic_write_json(path, record)
    return path
