"""Does training slow down as one process runs on? DSpark anchors/s per quarter of a run, with glibc's
malloc defaults or with the settings the CLI applies (``specdraft/utils/allocator.py``).

    .venv/bin/python benchmarks/train_drift.py --data runs/ref2/hidden_states --steps 100 --malloc default
    .venv/bin/python benchmarks/train_drift.py --data runs/ref2/hidden_states --steps 100 --malloc tuned

Each run trains the ``dspark`` recipe (checkpoints and validation off) into a scratch directory and prints
one JSON line: anchors/s over each quarter of the steps, peak RSS and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="hidden-state store")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--malloc", choices=["default", "tuned"], required=True, help="glibc malloc settings")
    parser.add_argument("--layers", default="output:1,output:8,output:14,output:20,output:27", help="drafter layers")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()

    if args.malloc == "tuned":
        from specdraft.utils.allocator import tune_malloc

        if not tune_malloc():
            raise SystemExit("could not apply the malloc settings (no glibc?)")
    from specdraft.train.config import resolve_config
    from specdraft.train.trainer import train
    from specdraft.utils.memory import peak_rss_mb

    with tempfile.TemporaryDirectory() as scratch:
        cfg = resolve_config(
            "dspark",
            {
                "data": args.data,
                "out": f"{scratch}/run",
                "max_steps": args.steps,
                "checkpoint_interval": 0,
                "eval_interval": 0,
                "num_threads": args.threads,
                "model": {"layers": args.layers},
            },
        )
        started = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - started
        with open(f"{scratch}/run/metrics.jsonl") as metrics:
            records = [json.loads(line) for line in metrics]
    steps = [r for r in records if r.get("split") == "train"]
    n = len(steps)
    quarters = []
    for q in range(4):
        part = steps[q * n // 4 : (q + 1) * n // 4]
        quarters.append(round(sum(r["anchors"] for r in part) / sum(r["seconds"] for r in part), 1))
    peak_mb = peak_rss_mb()
    print(
        json.dumps(
            {
                "malloc": args.malloc,
                "steps": n,
                "anchors_per_s_by_quarter": quarters,
                "peak_rss_mb": round(peak_mb),
                "wall_s": round(wall, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
