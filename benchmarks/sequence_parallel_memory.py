"""Sequence-parallel drafter training: peak RSS per rank and tokens/s at N = 1, 2, 4 on one long sample.

Each configuration is a real ``specdraft train`` run (``train.trainer.train``, DSpark, fp32, eager path, 1 CPU thread
per rank) of N gloo processes (spawned here with torchrun's environment) on one sample of T tokens of a tiny random
Qwen3 target with a context window of 32k+ tokens, built here from a transformers config. The sample is a
safetensors file read whole at every step, as a store's sample is. Every rank reports its peak RSS. tokens/s is rank
0's ``metrics.jsonl`` figure over the steps after the first.

    python benchmarks/sequence_parallel_memory.py --tokens 8192,32768 --groups 1,2 --out docs/results/sequence_parallel_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdraft.hidden_states.layers import LayerSlot
from specdraft.hidden_states.source import SampleSource

VOCAB, HIDDEN, LAYERS, WINDOW = 1024, 512, 6, 65536
MODEL = {"num_layers": 1, "block_size": 8, "max_anchors": 16, "markov_rank": 16, "intermediate_size": 512}


def target():
    """A tiny random Qwen3 (a long-context family) with a 64k context window: the drafter copies its shapes."""
    import transformers

    from specdraft.targets.base import Target

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=1024,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=WINDOW,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    return Target(name="tiny-qwen3-64k", path=Path("/nowhere"), model=model, tokenizer=None, fingerprint="f" * 16, tokenizer_hash="t" * 16)


class LongSample(SampleSource):
    """One sample, read whole from its safetensors file at every access (as a store reads one)."""

    def __init__(self, path: Path, slots: list[LayerSlot]):
        self.path, self.slots, self.sample_ids = path, slots, ["long/0"]
        self.target_info = {"name": "tiny-qwen3-64k", "fingerprint": "f" * 16, "num_layers": LAYERS, "hidden_size": HIDDEN}

    def __getitem__(self, index: int) -> dict:
        from safetensors.torch import load_file

        tensors = load_file(str(self.path))
        return {"sample_id": self.sample_ids[0], **tensors}


def write_sample(path: Path, tokens: int, slots: int) -> None:
    """Random token ids (the second half a reply) and bf16 hidden states of ``slots`` layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(tokens)
    mask = torch.zeros(tokens, dtype=torch.bool)
    mask[tokens // 2 :] = True
    save_file(
        {
            "token_ids": torch.randint(0, VOCAB, (tokens,), generator=g),
            "loss_mask": mask,
            "hidden_states": torch.randn(tokens, slots, HIDDEN, generator=g).to(torch.bfloat16),
            "last_hidden": torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16),
        },
        str(path),
    )


def rank_main(rank: int, size: int, port: int, sample: str, out: str, steps: int) -> None:
    """One rank of an N-process run: torchrun's environment, then the trainer; writes this rank's peak RSS."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
    )
    import specdraft.models  # noqa: F401  (registers the methods)
    from specdraft.models.base import METHODS
    from specdraft.train.config import TrainConfig
    from specdraft.train.trainer import train
    from specdraft.utils.memory import peak_rss_mb

    torch.set_num_threads(1)
    t = target()
    tokens = int(Path(sample).stem.split("-")[-1])
    slots = METHODS.get("dspark").run_slots(MODEL, LAYERS)
    start_rss = peak_rss_mb()
    cfg = TrainConfig(
        method="dspark",
        out=out,
        model=MODEL,
        max_steps=steps,
        pack_tokens=256,
        max_sample_tokens=tokens,
        val_fraction=0.0,
        eval_interval=0,
        checkpoint_interval=0,
        decode_prompts=0,
        dtype="fp32",
        forward_path="eager",
        num_threads=1,
        sequence_parallel=size,
    )
    train(cfg, target=t, dataset=LongSample(Path(sample), slots))
    Path(out, f"rss-{rank}.json").write_text(json.dumps({"start_mb": start_rss, "peak_mb": peak_rss_mb()}))


def run(tokens: int, size: int, scratch: Path, steps: int) -> dict:
    import torch.multiprocessing as mp

    from specdraft.models.base import METHODS

    sample = scratch / f"sample-{tokens}.safetensors"
    if not sample.exists():
        write_sample(sample, tokens, len(METHODS.get("dspark").run_slots(MODEL, LAYERS)))
    out = scratch / f"run-{tokens}-{size}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    mp.start_processes(rank_main, args=(size, port, str(sample), str(out), steps), nprocs=size, start_method="spawn")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train" and r["step"] > 1]
    rss = [json.loads((out / f"rss-{r}.json").read_text()) for r in range(size)]
    return {
        "tokens": tokens,
        "sequence_parallel": size,
        "peak_rss_mb": [round(r["peak_mb"]) for r in rss],
        "start_rss_mb": [round(r["start_mb"]) for r in rss],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "seconds_per_step": statistics.median(r["seconds"] for r in train),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768", help="sample lengths, a comma list")
    parser.add_argument("--groups", default="1,2", help="sequence-parallel sizes N, a comma list (N processes each)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (tokens/s: the median after the first)")
    parser.add_argument("--out", type=Path, help="JSON results file")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for tokens in map(int, args.tokens.split(",")):
            for size in map(int, args.groups.split(",")):
                results.append(run(tokens, size, Path(scratch), args.steps))
                print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]), "results": results}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
