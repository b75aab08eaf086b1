"""Training throughput per drafter method on the embedded target: tokens/s and anchors/s on this machine.

Builds (once, under --work) a small prepared ShareGPT dataset for the target and hidden-state
stores with each method's layer preset, then trains every method for --steps steps from its recipe
in ``specdraft/recipes/`` (checkpoints off) and reports the median over the steps after the first (warm-up)
of the per-step rates the trainer logs to metrics.jsonl.

    .venv/bin/python benchmarks/train_throughput.py --work runs/bench-train --steps 6 --threads 2

Compare one setting at a time, e.g. the compute dtype (``--dtype bf16``), anchor sampling
(``--model anchor_sampling=predictable``) or a warm start (``--set init_from_target=true``).

Output: one JSON line per method, then a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path


def ensure_stores(work: Path, target: str, samples: int, methods: list[str]) -> dict[str, Path]:
    """Prepared dataset + one store per distinct layer preset (reused when already complete)."""
    from specdraft.data.prepare import PrepareConfig, prepare
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states
    from specdraft.hidden_states.layers import LAYER_PRESETS

    data = work / "data"
    if not (data / "manifest.json").is_file():
        prepare(PrepareConfig(out=str(data), target=target, max_samples=samples, max_length=1024))
    stores: dict[str, Path] = {}
    by_slots: dict[tuple, Path] = {}
    for method in methods:
        key = tuple(map(str, LAYER_PRESETS.get(method)(30)))
        if key not in by_slots:
            by_slots[key] = work / f"hs-{method}"
            extract_hidden_states(ExtractConfig(dataset=str(data), out=str(by_slots[key]), method=method, target=target))
        stores[method] = by_slots[key]
    return stores


def measure(method: str, store: Path, out: Path, args: argparse.Namespace) -> dict:
    from specdraft.train.config import parse_overrides, resolve_config
    from specdraft.train.trainer import train

    shutil.rmtree(out, ignore_errors=True)
    overrides = {
        "data": str(store),
        "out": str(out),
        "max_steps": args.steps,
        "checkpoint_interval": 0,
        "eval_interval": 0,
        "val_fraction": 0.0,
        "num_threads": args.threads,
        "dtype": args.dtype,
        "pack_tokens": args.pack_tokens,
        **parse_overrides(args.set),
    }
    if args.model:
        overrides["model"] = args.model
    cfg = resolve_config(method, overrides)
    started = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - started
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["split"] == "train"][1:] or [r for r in recs if r["split"] == "train"]
    return {
        "method": method,
        "steps_timed": len(steps),
        "tokens_per_step": statistics.median(r["tokens"] for r in steps),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "anchors_per_s": statistics.median(r.get("anchors_per_s", 0.0) for r in steps),
        "s_per_step": statistics.median(r["seconds"] for r in steps),
        "loss_first_last": [recs[0]["loss"], steps[-1]["loss"]],
        "wall_s_including_setup": round(wall, 1),
        "pack_tokens": cfg.pack_tokens,
        "threads": args.threads,
        "dtype": cfg.dtype,
        "model": cfg.model,
        "set": args.set,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/bench-train", help="cache of the prepared dataset and stores")
    parser.add_argument("--target", default="smollm2-135m", help="target (embedded name or HF directory)")
    parser.add_argument("--samples", type=int, default=24, help="ShareGPT samples to prepare")
    parser.add_argument("--methods", default="dspark,dflash,eagle3", help="comma-separated methods")
    parser.add_argument("--steps", type=int, default=6, help="training steps per method (the first is not timed)")
    parser.add_argument("--pack-tokens", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="training compute dtype")
    parser.add_argument("--model", default="", help="method config overrides for every method, 'key=value,...'")
    parser.add_argument("--set", default="", help="TrainConfig overrides, 'key=value,...' (e.g. init_from_target=true)")
    args = parser.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.WARNING)
    work = Path(args.work)
    methods = [m for m in args.methods.split(",") if m]
    stores = ensure_stores(work, args.target, args.samples, methods)
    results = [measure(m, stores[m], work / f"train-{m}", args) for m in methods]
    for r in results:
        print(json.dumps(r))
    print(f"\n{'method':8} {'tokens/s':>10} {'anchors/s':>10} {'s/step':>8} {'tokens/step':>12}")
    for r in results:
        print(f"{r['method']:8} {r['tokens_per_s']:10.1f} {r['anchors_per_s']:10.1f} {r['s_per_step']:8.2f} {r['tokens_per_step']:12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
