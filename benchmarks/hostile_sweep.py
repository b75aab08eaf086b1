"""Issue 17's hostile-input cases as a new user meets them: every command a `specdraft` CLI subprocess.

    PYTHONPATH=src python benchmarks/hostile_sweep.py [--json hostile_sweep.json] [--keep DIR]

A thin runner over the case list the tests run in process (``tests/hostile/sweep_cases.py``: the tiny
pipeline, the cases and the properties every run must keep), so both judge the same cases alike; here
each command is its own process, as from a shell, against whichever specdraft ``python -m
specdraft.cli.main`` imports (set PYTHONPATH to a checkout's ``src`` to compare releases). Prints a
markdown table (case, exit code, first line of the message, verdict, seconds) and writes the rows as
JSON. A few minutes on 2 CPU cores. The property sweep over flag values, config files and producer
requests is ``pytest tests/hostile/test_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "hostile")]  # the case list lives with the tests that run it

from sweep_cases import CASES, build_pipeline, run_subprocess  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="hostile_sweep.json", help="where to write the rows as JSON")
    parser.add_argument("--keep", default=None, help="work in this (new) directory and keep it, instead of a temporary one")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hostile-sweep-"))
    rows = []
    try:
        pipeline = build_pipeline(work, run_subprocess)
        for case in CASES:
            v = case.run(pipeline, run_subprocess)
            verdict = ("ok" if v.ok else "BUG") + (f": {v.detail}" if v.ok else f": expected {v.detail}")
            if v.problems:
                verdict = "BUG: " + "; ".join(p.splitlines()[0] for p in v.problems)
            rows.append({"case": case.name, "item": case.item, "exit": v.result.code if v.result else "-",
                         "message": (v.result.message if v.result else "").replace(str(work), "$W"), "verdict": verdict,
                         "seconds": v.result.seconds if v.result else 0, "xfail": case.xfail})
            print(f"[sweep] {case.name}: exit {rows[-1]['exit']} -> {verdict}", file=sys.stderr, flush=True)
    finally:
        lines = ["| # | case | exit | first line of message | verdict | s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['item']} | {r['case']} | {r['exit']} | {r['message'].replace('|', '/')} | {r['verdict']} | {r['seconds']} |" for r in rows]
        print("\n".join(lines))
        summary = {"seconds": round(time.monotonic() - started, 1), "rows": rows}
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"\n{len(rows)} cases in {summary['seconds']} s; rows in {args.json}", file=sys.stderr)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["verdict"].startswith("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
