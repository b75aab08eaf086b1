"""Sequence-parallel drafter training: peak RSS per rank and tokens/s at N = 1, 2, 4 on one long sample.

Each configuration is a real ``specdraft train`` run (``train.trainer.train``, DSpark, fp32, eager path, 1 CPU thread
per rank) of N gloo processes (spawned here with torchrun's environment) on one sample of T tokens of a tiny random
Qwen3 target with a context window of 64k tokens, built here from a transformers config. The sample sits in a real
hidden-state store (a prepared dataset of one row plus a file store holding its bf16 payload), opened as ``train``
opens one (``batches.open_sample_source``): N = 1 reads the sample whole, a rank of N > 1 verifies it whole and loads
only its shard's rows (``hidden_states.dataset.SAMPLE_READS["windowed"]``). ``--reads whole`` makes every rank read
the sample whole instead (what every rank did before windowed reads): the comparison. Every rank reports its peak
RSS (after reading the sample and collating its shard once, before training: ``read_peak_rss_mb``; after training:
``peak_rss_mb``): its own ``VmHWM`` (Linux), not ``ru_maxrss``, which a spawned process inherits through ``exec`` from this
launcher (the peak it reached writing the store). tokens/s is rank 0's ``metrics.jsonl`` figure over the steps after
the first.

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


def write_store(root: Path, tokens: int, slots: list[LayerSlot]) -> Path:
    """A store of one sample: random token ids (the second half a reply) and bf16 hidden states of ``slots``."""
    from specdraft.data.dataset import write_prepared
    from specdraft.hidden_states.backends.base import STORE_FORMAT_NAME, STORE_FORMAT_VERSION, finish_manifest
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.hidden_states.payload import HiddenStatePayload

    info = target().describe()
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, VOCAB, (tokens,), generator=g)
    row = {"sample_id": "long/0", "source": "bench", "input_ids": ids.tolist(), "loss_mask": [int(i >= tokens // 2) for i in range(tokens)]}
    data = write_prepared(root / "data", [row], target_info=info, config={}, stats={}, vocab_size=VOCAB)
    backend = FileBackend(root / "hidden_states")
    payload = HiddenStatePayload.create(
        sample_id="long/0",
        target_info=info,
        slots=slots,
        token_ids=ids,
        hidden_states=torch.randn(tokens, len(slots), HIDDEN, generator=g, dtype=torch.bfloat16),
        last_hidden=torch.randn(tokens, HIDDEN, generator=g, dtype=torch.bfloat16),
        dtype="bfloat16",
    )
    backend.put("long/0", payload)
    manifest = {"format": STORE_FORMAT_NAME, "format_version": STORE_FORMAT_VERSION, "target": info, "dataset": {"path": str(data)}}
    manifest.update(slots=[s.to_json() for s in slots], dtype="bfloat16")
    backend.write_manifest(finish_manifest(manifest, {"long/0"}, ["long/0"]))
    return backend.root


def status_mb(field: str) -> float:
    """A ``/proc/self/status`` memory figure (``VmRSS``: now, ``VmHWM``: this process's peak), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark reads Linux's)")


def rank_main(rank: int, size: int, port: int, store: str, out: str, steps: int, reads: str) -> None:
    """One rank of an N-process run: torchrun's environment, then the trainer (its store opened by ``train`` itself,
    or with ``reads`` the ``SAMPLE_READS`` name every rank uses); writes this rank's peak RSS."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
    )
    import specdraft.models  # noqa: F401  (registers the methods)
    from specdraft.hidden_states.dataset import HiddenStateDataset
    from specdraft.train.batches import RowWindow, collate, open_sample_source
    from specdraft.train.config import TrainConfig
    from specdraft.train.trainer import train

    torch.set_num_threads(1)
    t = target()
    tokens = int(Path(store).parent.name.split("-")[-1])
    start_rss = status_mb("VmRSS")
    cfg = TrainConfig(
        method="dspark",
        data=store,
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
    # The read phase alone first: the sample read as the run reads it and this rank's shard collated, as a step does
    # before it frees the read (so the step's own peak may be higher and hide it).
    dataset = open_sample_source(cfg, rank=rank, world=size) if reads == "trainer" else HiddenStateDataset(store, reads=reads)
    shard = collate([[dataset[0]]], sample_tokens=tokens, window=RowWindow(rank, size))
    read_peak = status_mb("VmHWM")
    del dataset, shard
    train(cfg, target=t, dataset=None if reads == "trainer" else HiddenStateDataset(store, reads=reads))
    Path(out, f"rss-{rank}.json").write_text(json.dumps({"start_mb": start_rss, "read_peak_mb": read_peak, "peak_mb": status_mb("VmHWM")}))


def run(tokens: int, size: int, scratch: Path, steps: int, reads: str) -> dict:
    import torch.multiprocessing as mp

    from specdraft.models.base import METHODS

    store = scratch / f"store-{tokens}" / "hidden_states"
    if not store.exists():
        write_store(store.parent, tokens, METHODS.get("dspark").run_slots(MODEL, LAYERS))
    out = scratch / f"run-{tokens}-{size}-{reads}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    mp.start_processes(rank_main, args=(size, port, str(store), str(out), steps, reads), nprocs=size, start_method="spawn")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train" and r["step"] > 1]
    rss = [json.loads((out / f"rss-{r}.json").read_text()) for r in range(size)]
    return {
        "tokens": tokens,
        "sequence_parallel": size,
        "reads": reads,
        "peak_rss_mb": [round(r["peak_mb"]) for r in rss],
        "start_rss_mb": [round(r["start_mb"]) for r in rss],
        "read_peak_rss_mb": [round(r["read_peak_mb"]) for r in rss],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "seconds_per_step": statistics.median(r["seconds"] for r in train),
        "wall_s": round(time.perf_counter() - started, 1),
    }


def fit(paths: list[Path], limit_mb: float) -> list[dict]:
    """A least-squares line of the largest rank's peak RSS (after training, and of the read phase) against tokens,
    for each (reads, N) in the results files ``paths``, and the tokens at which it reaches ``limit_mb``: a projection
    past the measured lengths, as good as the line is."""
    rows: dict[tuple[str, int], list[dict]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            rows.setdefault((r.get("reads", "trainer"), r["sequence_parallel"]), []).append(r)
    fits = []
    for (reads, size), runs in sorted(rows.items()):
        tokens = [r["tokens"] for r in runs]
        line = {"reads": reads, "sequence_parallel": size, "tokens": tokens}
        for key in ("peak_rss_mb", "read_peak_rss_mb"):
            if len(set(tokens)) < 2 or not all(key in r for r in runs):
                continue
            slope, intercept = statistics.linear_regression(tokens, [max(r[key]) for r in runs])
            line[key] = {
                "mb_per_1k_tokens": round(slope * 1000, 2),
                "mb_at_0": round(intercept),
                "tokens_at_limit": round((limit_mb - intercept) / slope),
            }
        fits.append(line)
    return fits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8192,32768", help="sample lengths, a comma list")
    parser.add_argument("--groups", default="1,2", help="sequence-parallel sizes N, a comma list (N processes each)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run (tokens/s: the median after the first)")
    parser.add_argument(
        "--reads",
        default="trainer",
        choices=["trainer", "whole"],
        help="trainer: the store opened as train opens it (windowed reads for N > 1); whole: every rank reads the sample whole",
    )
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--fit", type=Path, nargs="+", help="instead of running: fit these results files (see fit())")
    parser.add_argument("--limit-mb", type=float, default=24 * 1024, help="--fit: the memory whose crossing is projected (MiB)")
    args = parser.parse_args(argv)
    if args.fit:
        for line in fit(args.fit, args.limit_mb):
            print(json.dumps(line))
        return 0
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for tokens in map(int, args.tokens.split(",")):
            for size in map(int, args.groups.split(",")):
                results.append(run(tokens, size, Path(scratch), args.steps, args.reads))
                print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps({"command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]), "results": results}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
