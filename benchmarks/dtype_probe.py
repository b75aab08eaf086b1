"""What ``--dtype auto`` (training) and ``--draft-dtype auto`` (decoding) measure and choose on this machine.

Runs the same probes as the trainer and the decoder on the quickstart's drafter for the embedded
target: forward + backward of the step at ``--pack-tokens`` (``tuning/dtype.py``) and a
draft round (``DrafterProposer.round_seconds``), in fp32 and bf16 autocast, into a fresh scratch
cache (so it always measures), and prints the seconds and choices as JSON.

  .venv/bin/python benchmarks/dtype_probe.py --pack-tokens 512 --threads 2
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from _common import benchmark_parser, load_benchmark_target, quickstart_drafter


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--pack-tokens", type=int, default=512, help="tokens per training step (the quickstart's 512)")
    args = parser.parse_args()

    import torch

    from specdraft.decode.proposers.drafters import BlockDrafterProposer
    from specdraft.train.step import StepModule, measure_train_dtype, synthetic_batch
    from specdraft.tuning.measured import machine_identity, measured_choice

    target = load_benchmark_target(args)
    drafter = quickstart_drafter(target)
    slots = len(drafter.config.slots())
    batch = synthetic_batch(rows=1, tokens=args.pack_tokens, slots=slots, hidden=target.hidden_size, vocab=target.vocab_size)
    with tempfile.TemporaryDirectory() as scratch:
        train = measure_train_dtype(
            StepModule(drafter), batch, device=torch.device("cpu"), context={"pack_tokens": args.pack_tokens}, cache_dir=Path(scratch)
        )
        proposer = BlockDrafterProposer(drafter.eval(), provides_confidences=True)
        draft = measured_choice(
            "draft-dtype",
            {},
            {d: (lambda d=d: proposer.round_seconds(d)) for d in ("fp32", "bf16")},
            preferred="fp32",
            cache_dir=Path(scratch),
        )
    print(
        json.dumps(
            {
                "machine": machine_identity(),
                "pack_tokens": args.pack_tokens,
                "train_step_seconds": train.seconds,
                "train_dtype": train.choice,
                "draft_round_seconds": draft.seconds,
                "draft_dtype": draft.choice,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
