"""What training runs cost and reached, side by side, from their ``metrics.jsonl``: steps, anchors, tokens, training
seconds, the longest row (real tokens) and the process's peak RSS (with the step it was first reached at), and the
last validation's decoded and teacher-forced tau. Prints a markdown table and one JSON object.

  python benchmarks/train_summary.py short=runs/long/S long=runs/long/L
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import labelled


def summarize(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("split") == "train"]
    if not steps:
        raise SystemExit(f"{run}/metrics.jsonl has no training records")
    if "peak_rss_mb" not in steps[-1]:
        raise SystemExit(f"{run}/metrics.jsonl predates peak-memory logging (no 'peak_rss_mb'): retrain with this release")
    val = [r for r in records if r.get("split") == "val"]
    peak = steps[-1]["peak_rss_mb"]
    return {
        "steps": steps[-1]["step"],
        "anchors": sum(r.get("anchors", 0) for r in steps),
        "tokens": int(sum(r["tokens"] for r in steps)),
        "train_seconds": round(sum(r["seconds"] for r in steps), 1),
        "longest_row_tokens": max(r["row_tokens"] for r in steps),
        "peak_rss_mb": peak,
        "peak_first_at_step": next(r["step"] for r in steps if r["peak_rss_mb"] == peak),
        "val_tau_decoded": val[-1].get("tau_decoded") if val else None,
        "val_tau_teacher_forced": val[-1].get("tau_teacher_forced") if val else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="training run directories, each optionally LABEL=DIR")
    args = parser.parse_args()
    runs = labelled(args.runs)
    table = {label: summarize(Path(run)) for label, run in runs.items()}
    keys = list(next(iter(table.values())))
    print("| run | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for label, row in table.items():
        print(f"| {label} | " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
