"""speculators 0.9.0's own trainer on our data: convert a specdraft hidden-state store into the data
directory its trainer reads, then run its training entry point for N steps (on CPU if need be).

The conversion is ``specdraft export-speculators`` (``integrations/speculators/data.py``: the layout the peer's
``--data-path`` reads, our validation side last, the draft vocabulary from our counts).

On a machine without an accelerator the trainer stops before its first step (the exact error is
printed with ``--no-cpu-harness``): ``Trainer.setup_model`` moves the model to
``get_local_rank()``, the integer 0, which torch reads as ``cuda:0``. ``--cpu-harness`` (default)
patches names in the imported modules, never the installed files: ``get_local_rank`` returns
"cpu" in ``speculators.train.trainer``, autocast runs on the CPU device type, and
``torch.accelerator.synchronize`` (its step timer's) is a no-op in this process; and two of its own
options are set (``CPU_FLAGS``): ``--draft-attn-impl sdpa`` (FlexAttention, the default, has no
backward on CPU) and ``--loss-implementation eager`` (the fused losses need Triton).

``--decode-only`` then loads the peer's last checkpoint with specdraft (it reads speculators' format)
and decodes our first validation prompts in specdraft's runtime, as ``specdraft train`` logs its own
``tau_decoded``. Training runs in .venv-interop (speculators lives there; specdraft is read from
src/), decoding in .venv (the runtime needs the transformers version installed there):

  PYTHONPATH=src .venv-interop/bin/python benchmarks/peer_trainer.py --store STORE --target TARGET_DIR \\
      --method dspark --steps 4 --out runs/peer
  PYTHONPATH=src .venv/bin/python benchmarks/peer_trainer.py --store STORE --target TARGET_DIR \\
      --method dspark --out runs/peer --decode-only
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def decode_validation(
    store: str, target_dir: str, checkpoint: Path, *, val_fraction: float, split_seed: int, prompts: int, tokens: int
) -> dict:
    """Greedy decoded tau of ``checkpoint`` (ours or the peer's) on our first validation prompts, in our
    runtime, as ``specdraft train`` logs its own ``tau_decoded`` (``train/decoded_tau.py``)."""
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.models import load_drafter
    from specdraft.targets import load_target
    from specdraft.train.batches import token_rows
    from specdraft.train.decoded_tau import DecodeProbe
    from specdraft.train.split import dataset_split

    dataset = HiddenStateDataset(store)
    val = dataset_split(dataset, val_fraction=val_fraction, seed=split_seed).val
    probe = DecodeProbe.from_split(token_rows(dataset, val), [dataset.sample_ids[i] for i in val], count=prompts, tokens=tokens)
    target = load_target(target_dir)
    drafter = load_drafter(checkpoint, target=target)
    return {"checkpoint": str(checkpoint), "prompt_ids": list(probe.sample_ids), **probe.run(drafter, drafter.method, target)}


def last_checkpoint(run: Path) -> Path:
    """The peer's newest checkpoint directory under its ``--save-path`` (named by epoch or step)."""
    return max((p for p in run.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def record_metrics(path: Path) -> None:
    """Append every record of the peer's metric logger (``speculators.metrics``: per step its losses and
    ``profile``, the step timer's fetch/forward/backward/optimizer times) to ``path`` as JSON lines.
    The handler is added after the peer configures its loggers, which would drop an earlier one."""
    import logging

    import speculators.train.cli as peer_cli

    class JsonLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict):
                with path.open("a") as f:
                    f.write(json.dumps(record.msg, default=float) + "\n")

    setup = peer_cli.setup_metric_logger

    def setup_then_record(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(JsonLines())

    peer_cli.setup_metric_logger = setup_then_record


def step_summary(path: Path) -> dict:
    """Steps, tokens and seconds in steps (fetch + forward + backward + optimizer, validation excluded)
    from ``record_metrics``' file: what ``specdraft train`` sums into its ``tokens_per_s``."""
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in steps if r.get("profile") and "global_step" in r]
    seconds = sum(r["profile"]["step_ms"] for r in steps) / 1000
    tokens = sum(round(r["profile"]["tokens_per_s"] * r["profile"]["step_ms"] / 1000) for r in steps)
    return {"steps": len(steps), "tokens": tokens, "step_seconds": round(seconds, 3), "tokens_per_s": tokens / seconds if seconds else 0.0}


#: Configuration the peer needs on CPU: FlexAttention has no CPU backward, the fused losses need Triton.
CPU_FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]


def install_cpu_harness() -> bool:
    """Make the peer trainer run on CPU without touching its files (see the module docstring); True
    when there is no accelerator (then ``CPU_FLAGS`` are passed too)."""
    import speculators.train.trainer as peer_trainer
    import torch

    if torch.accelerator.current_accelerator() is None:
        peer_trainer.get_local_rank = lambda: "cpu"
        original_init = peer_trainer.Trainer.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.device_type = "cpu"  # autocast device: "cuda" is assumed when no accelerator is found

        peer_trainer.Trainer.__init__ = init
        # the step timer synchronises the accelerator before each timestamp; on CPU there is nothing to wait for
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        return True
    return False


def main() -> None:
    from specdraft.integrations.speculators.data import peer_methods

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="specdraft hidden-state store (its layers are the drafter's)")
    parser.add_argument("--target", required=True, help="the target's Hugging Face directory (the peer's --verifier-name-or-path)")
    parser.add_argument(
        "--method", default="dspark", choices=peer_methods(), help="the peer's --speculator-type (a registered decodable method)"
    )
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (the peer's --max-steps; 0 = as many as --epochs take)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training rows (the peer's --epochs)")
    parser.add_argument("--out", required=True, help="work directory: data/ (converted), run/ (the peer's checkpoints), metrics.jsonl")
    parser.add_argument(
        "--data-dir",
        default=None,
        help="where the converted data goes (default OUT/data; reused when converted from "
        "the same store, slots and split, e.g. by dspark and dflash, which read the same slots)",
    )
    parser.add_argument("--val-fraction", type=float, default=0.05, help="our split's val_fraction (its validation rows go last)")
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--total-seq-len", type=int, default=2048, help="the peer's packed sequence length")
    parser.add_argument("--dtype", default="bfloat16", help="the peer's --hidden-states-dtype (its default; float32 runs without autocast)")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="the peer's --draft-vocab-size, its mapping built from our store's counts (as our trainer builds its own)",
    )
    parser.add_argument(
        "--cpu-harness",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="patch the device choice so the trainer runs on CPU (see the module docstring)",
    )
    parser.add_argument(
        "--decode-only",
        action="store_true",
        help="instead of training: decode validation prompts with the peer's last checkpoint under --out, in "
        "specdraft's runtime (run this in .venv: the runtime needs its transformers)",
    )
    parser.add_argument("--decode-prompts", type=int, default=3, help="validation prompts decoded with --decode-only")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decoded prompt")
    parser.add_argument("--extra", default="", help="further peer flags, space-separated (e.g. '--num-layers 1 --block-size 4')")
    args = parser.parse_args()

    out = Path(args.out)
    if args.decode_only:
        print(
            json.dumps(
                decode_validation(
                    args.store,
                    args.target,
                    last_checkpoint(out / "run"),
                    val_fraction=args.val_fraction,
                    split_seed=args.split_seed,
                    prompts=args.decode_prompts,
                    tokens=args.decode_tokens,
                ),
                indent=1,
            )
        )
        return

    from speculators.train.cli import main as peer_main
    from speculators.train.config import TrainConfig

    from specdraft.integrations.speculators.data import ExportSpeculatorsConfig, export_speculators_data

    data = Path(args.data_dir) if args.data_dir else out / "data"
    facts = export_speculators_data(
        ExportSpeculatorsConfig(
            store=args.store,
            out=str(data),
            method=args.method,
            val_fraction=args.val_fraction,
            split_seed=args.split_seed,
            draft_vocab_size=args.draft_vocab_size,
        )
    )
    on_cpu = args.cpu_harness and install_cpu_harness()
    metrics = out / "metrics.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    metrics.unlink(missing_ok=True)
    record_metrics(metrics)
    argv = [
        "--speculator-type",
        args.method,
        "--verifier-name-or-path",
        args.target,
        "--data-path",
        str(data),
        "--save-path",
        str(out / "run"),
        "--log-dir",
        str(out / "logs"),
        "--epochs",
        str(args.epochs),
        *(["--max-steps", str(args.steps)] if args.steps else []),
        "--total-seq-len",
        str(args.total_seq_len),
        "--train-data-ratio",
        str(facts["train_data_ratio"]),
        "--hidden-states-dtype",
        args.dtype,
        "--num-workers",
        "0",
        "--on-missing",
        "raise",
        "--target-layer-ids",
        *map(str, facts["layer_ids"]),
        *(["--draft-vocab-size", str(args.draft_vocab_size)] if args.draft_vocab_size else []),
        *(CPU_FLAGS if on_cpu else []),
        *args.extra.split(),
    ]
    started = time.perf_counter()
    peer_main(TrainConfig.resolve(argv))
    facts.update(seconds=round(time.perf_counter() - started, 3), argv=argv, **step_summary(metrics))
    (out / "summary.json").write_text(json.dumps(facts, indent=1))
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    main()
