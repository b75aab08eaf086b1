"""Held-out expected acceptance length of a trained drafter, teacher-forced, by anchor sampling.

Decoding anchors a block at every response position, so the estimate that predicts decode-time tau
draws anchors uniformly. A ``predictable`` draw (the recipe's training sampler, which favours positions
the target finds easy) overstates it; before this benchmark's release the trainer's validation used
it for DSpark/DFlash, which is most of the gap between the held-out tau logged in training and the
tau measured by ``specdraft eval``. This script measures both on the same held-out split (the
trainer's, ``train/split.py``: the run's split.json with ``--split``, else whole conversations by
``--val-fraction``) and prints one JSON object.

  .venv/bin/python benchmarks/heldout_tau.py --drafter src/specdraft/reference/smollm2-135m-dspark \\
      --data runs/ref2/hidden_states --threads 2
"""

from __future__ import annotations

import json
from pathlib import Path

from _common import benchmark_parser, load_benchmark_target


def main() -> None:
    parser = benchmark_parser(__doc__, target=False)  # the target is the store's
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory (DSpark or DFlash)")
    parser.add_argument("--data", required=True, help="hidden-state store holding the drafter's layers")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of conversations (the training run's)")
    parser.add_argument("--split", default="", help="the training run's split.json (overrides --val-fraction)")
    parser.add_argument("--samplers", default="uniform,predictable", help="comma-separated anchor samplers to compare")
    parser.add_argument("--pack-tokens", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--max-rows", type=int, default=0, help="evaluate at most this many packed rows (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="anchor-sampling seed (the same for every sampler)")
    args = parser.parse_args()

    import dataclasses

    import torch
    from tqdm import tqdm

    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models.common.drafter import load_drafter
    from specdraft.train.batches import collate, pack_rows, select_slots
    from specdraft.train.metrics import MetricSums
    from specdraft.train.split import resolve_split

    dataset = HiddenStateDataset(args.data)
    target = load_benchmark_target(args, dataset.target_info["name"])
    drafter = load_drafter(args.drafter, target=target).eval()
    slot_index = select_slots(dataset.slots, drafter.config.slots(), where=args.data)
    held_out = resolve_split(dataset, val_fraction=args.val_fraction, seed=0, recorded=Path(args.split) if args.split else None).val
    rows = pack_rows(held_out, dataset.lengths(), args.pack_tokens)
    rows = rows[: args.max_rows] if args.max_rows else rows
    sums = {name: MetricSums() for name in args.samplers.split(",")}
    config = drafter.config
    with torch.no_grad():
        for row in tqdm(rows, desc="held-out", unit="row"):
            batch = collate([[dataset[i] for i in row]], sample_tokens=args.pack_tokens, slot_index=slot_index)
            tokens = int((batch.segment_ids >= 0).sum())
            for name, total in sums.items():
                torch.manual_seed(args.seed)
                drafter.config = dataclasses.replace(config, anchor_sampling=name)
                drafter.train(name != "uniform")  # eval mode draws uniformly; train mode uses the configured sampler
                total.add(drafter.training_forward(batch), tokens)
    result = {"drafter": args.drafter, "data": args.data, "held_out_samples": len(held_out), "rows": len(rows)}
    for name, total in sums.items():
        summary = total.summary()
        result[name] = {
            "expected_tau": round(summary["accept_len"], 4),
            "anchors": summary["anchors"],
            "position_cond_acc": summary["position_cond_acc"],
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
