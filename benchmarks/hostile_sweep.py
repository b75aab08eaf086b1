"""The hostile sweeps' cases as a new user meets them: every command a `specdraft` CLI subprocess.

    PYTHONPATH=src python benchmarks/hostile_sweep.py [--cases sweep|sweep3] [--only TEXT] [--json FILE] [--md FILE] [--keep DIR]

A thin runner over the case lists the tests run in process, so both judge the same cases alike:
``--cases sweep`` (default) is issue 17's list (``tests/hostile/sweep_cases.py``: the tiny pipeline, the cases
and the properties every run must keep); ``--cases sweep3`` is issue 37's own sweep (``tests/hostile/sweep3_cases.py``:
kill -9 at every stage, tampered caches and artifacts, concurrent writers on nested paths, resumes with changed
settings). Here each command is its own process, as from a shell, against whichever specdraft ``python -m
specdraft.cli.main`` imports (set PYTHONPATH to a checkout's ``src`` to compare releases). Prints a markdown table
(case, area, exit code, first line of the message, verdict, seconds, command) and writes the rows as JSON (and
``--md``: the table as a file). ``--only``: the cases whose name holds that text. The property sweep over flag values,
config files and producer requests is ``pytest tests/hostile/test_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "hostile")]  # the case lists live with the tests that run them

from sweep_cases import run_subprocess  # noqa: E402


def load(which: str, work: Path):
    """(cases, what each case is given): the list's fixture built under ``work`` with subprocesses."""
    if which == "sweep3":
        from sweep3_cases import CASES, build_sweep3

        return CASES, build_sweep3(work, run_subprocess)
    from sweep_cases import CASES, build_pipeline

    return CASES, build_pipeline(work, run_subprocess)


def first_line(result) -> str:
    """What the command said: its error line, else the last line it printed (not a progress bar on stderr)."""
    if result is None:
        return ""
    printed = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return (result.error_line or (printed[-1] if printed else result.message))[:300]


def row(case, verdict, work: Path) -> dict:
    result = verdict.result
    if verdict.detail.startswith("skipped"):
        text = verdict.detail
    elif verdict.ok:
        text = f"ok: {verdict.detail}"
    else:
        text = "BUG: " + "; ".join(p.splitlines()[0] for p in verdict.problems) if verdict.problems else f"BUG: expected {verdict.detail}"
    if text.startswith("BUG: ") and case.xfail:  # found before, not fixed yet: the tests expect it to fail
        text = "BUG (known): " + text[len("BUG: ") :]

    def hide(s: str) -> str:
        return s.replace(str(work), "$W")

    return {
        "case": case.name,
        "item": case.item,
        "exit": result.code if result else "-",
        "message": hide(first_line(result)),
        "verdict": hide(text),
        "seconds": result.seconds if result else 0,
        "xfail": case.xfail,
        "command": hide("specdraft " + shlex.join(result.args)) if result else "",
    }


def table(rows: list[dict]) -> str:
    def cell(s: object) -> str:
        return str(s).replace("|", "/").replace("\n", " ")

    lines = ["| # | case | area | exit | first line of message | verdict | s | command |", "|---|---|---|---|---|---|---|---|"]
    lines += [
        f"| {i} | {cell(r['case'])} | {r['item']} | {r['exit']} | {cell(r['message'])} | {cell(r['verdict'])} | {r['seconds']} | "
        f"`{cell(r['command'])}` |"
        for i, r in enumerate(rows, 1)
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", choices=("sweep", "sweep3"), default="sweep", help="which case list to run")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this text")
    parser.add_argument("--json", default="hostile_sweep.json", help="where to write the rows as JSON")
    parser.add_argument("--md", default=None, help="also write the markdown table here")
    parser.add_argument("--keep", default=None, help="work in this (new) directory and keep it, instead of a temporary one")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hostile-sweep-"))
    rows, built = [], None
    try:
        cases, fixture = load(args.cases, work)
        built = round(time.monotonic() - started, 1)
        for case in cases:
            if args.only and args.only not in case.name:
                continue
            try:
                rows.append(row(case, case.run(fixture, run_subprocess), work))
            except Exception as exc:  # noqa: BLE001 - a case that cannot run (its own set-up failed) is reported, not fatal
                why = f"BUG: the case could not run: {type(exc).__name__}: {exc}".replace(str(work), "$W")
                rows.append(
                    {
                        "case": case.name,
                        "item": case.item,
                        "exit": "-",
                        "message": "",
                        "seconds": 0,
                        "xfail": case.xfail,
                        "command": "",
                        "verdict": why,
                    }
                )
            print(f"[sweep] {case.name}: exit {rows[-1]['exit']} -> {rows[-1]['verdict'][:300]}", file=sys.stderr, flush=True)
    finally:
        text = table(rows)
        print(text)
        counts = {v: sum(r["verdict"].startswith(v) for r in rows) for v in ("ok", "BUG", "skipped")}
        summary = {
            "cases": args.cases,
            "seconds": round(time.monotonic() - started, 1),
            "fixture_seconds": built,
            "counts": counts,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
        if args.md:
            Path(args.md).write_text(text + "\n")
        print(f"\n{len(rows)} cases in {summary['seconds']} s: {counts}; rows in {args.json}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(not r["verdict"].startswith("BUG") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
