"""``RUN/quickstart.json``: what each stage of a run finished, verified on read, so that a rerun resumes."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specdraft.quickstart.config import QuickstartConfig
from specdraft.utils.io import atomic_write_json, sha256_bytes

log = logging.getLogger(__name__)


class Journal:
    """``quickstart.json``: per-stage status, seconds and facts; survives interruption.

    It is the only record that a stage finished, so it is verified on read: a JSON object whose ``stages``
    map each finished stage to ``{"status": "done", "seconds": S, "sha256": H, **facts}``, ``H`` the sha256
    of the entry's other keys (the facts are typed by the stage that wrote them; the digest vouches for
    them). A journal that is not that (truncated, another shape, an edited or an older release's entry) is
    no reason to stop: the stages it cannot vouch for are redone, with one WARNING, since each resumes
    from the verified work in its own directory. Once a stage is redone, so is every later one, which may
    have been made from its old output (a retrained ``train/final`` needs its calibration again).
    """

    def __init__(self, path: Path, config: QuickstartConfig):
        self.path = path
        self.state, problems = _read_journal(path)
        if problems:
            log.warning("%s: %s; the quickstart redoes the stage(s) it cannot vouch for and every later one", path, "; ".join(problems))
        self.state["config"] = asdict(config)
        self.redoing = False  # a stage ran in this invocation: every later one runs too

    def forget(self, name: str) -> None:
        self.state["stages"].pop(name, None)

    def run(self, name: str, fn: Callable[[], dict]) -> dict:
        stage = self.state["stages"].get(name)
        if stage is not None and not self.redoing:
            print(f"[quickstart] {name}: done earlier, skipped")
            return stage
        self.redoing = True
        print(f"[quickstart] {name} ..." + (" (again: an earlier stage was redone)" if stage is not None else ""), flush=True)
        started = time.perf_counter()
        facts = fn()
        stage = {"status": "done", "seconds": round(time.perf_counter() - started, 1), **facts}
        self.state["stages"][name] = {**stage, "sha256": _entry_sha256(stage)}
        atomic_write_json(self.path, self.state)
        return stage


def _entry_sha256(entry: dict) -> str:
    """The digest of a stage entry as JSON holds it (written or read back: tuples are lists, keys strings)."""
    content = json.loads(json.dumps({k: v for k, v in entry.items() if k != "sha256"}))
    return sha256_bytes(json.dumps(content, sort_keys=True).encode())


def _read_journal(path: Path) -> tuple[dict[str, Any], list[str]]:
    """The journal at ``path`` with only the stage entries it can vouch for (see ``Journal``), and what is wrong."""
    if not path.is_file():
        return {"stages": {}}, []
    try:
        state = json.loads(path.read_bytes())
    except ValueError as exc:  # bad JSON, or bytes that are not UTF-8
        return {"stages": {}}, [f"not valid JSON ({exc}; truncated?)"]
    if not isinstance(state, dict):
        return {"stages": {}}, [f"holds a JSON {type(state).__name__}, not an object"]
    stages = state.get("stages", {})
    if not isinstance(stages, dict):
        return {**state, "stages": {}}, [f"'stages' is a {type(stages).__name__}, not an object"]
    problems, trusted = [], {}
    for name, entry in stages.items():
        if not isinstance(entry, dict):
            problems.append(f"stage {name!r} is {json.dumps(entry)[:40]}, not an object")
        elif entry.get("sha256") != _entry_sha256(entry):
            problems.append(f"stage {name!r} does not match the sha256 it records (edited, or written by an older release)")
        else:
            trusted[name] = entry
    return {**state, "stages": trusted}, problems
