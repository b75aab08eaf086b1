"""Extraction throughput through vLLM (our connector) vs specdraft's HF path, same samples and slots.

The vLLM figure excludes the server start (reported separately): it is paid once per run, and a
real extraction job runs long enough to amortise it. Both stores are compared at the end (max
absolute difference of the stored states). Prints one JSON object.

  .venv/bin/python benchmarks/vllm_extract.py --samples 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="target name or directory (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=32, help="ShareGPT samples to prepare and extract (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=512, help="skip longer samples when preparing (default: %(default)s)")
    parser.add_argument("--method", default="dspark", help="layer preset (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="storage dtype (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="HF batch size = vLLM requests in flight (default: %(default)s)")
    parser.add_argument("--vllm-args", default="", help="extra vLLM api_server flags, e.g. --vllm-args=--enforce-eager")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args()

    import shlex

    from specdraft.data.dataset import PreparedDataset
    from specdraft.data.prepare import PrepareConfig, prepare
    from specdraft.hidden_states.backends.file import FileBackend
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states
    from specdraft.integrations.vllm.engine import SERVED_NAME, VllmServer
    from specdraft.integrations.vllm.extract import ExtractionClient, extraction_args, send_samples
    from specdraft.targets import load_target

    with tempfile.TemporaryDirectory(prefix="specdraft-vllm-bench-") as tmp:
        tmp = Path(tmp)
        data = str(tmp / "data")
        prepare(PrepareConfig(out=data, target=args.target, max_samples=args.samples, max_length=args.max_length), progress=False)
        dataset = PreparedDataset(data)
        target = load_target(args.target)
        config = ExtractConfig(dataset=data, out=str(tmp / "hf"), method=args.method, dtype=args.dtype, batch_size=args.batch_size)
        slots = config.resolve_slots(target.num_layers)
        rows = list(range(len(dataset)))

        hf = extract_hidden_states(config, target=target, progress=False)

        store = FileBackend(tmp / "vllm")
        lengths = dataset.lengths()
        started = time.perf_counter()
        server_args = extraction_args(
            store=store.location, backend="file", dtype=args.dtype, target_dtype="float32", target_info=target.describe(),
            slots=slots, max_model_len=int(lengths.max()) + 1, max_num_seqs=args.batch_size,
        ) + shlex.split(args.vllm_args)  # fmt: skip
        with VllmServer(target.path, server_args) as server:
            startup = time.perf_counter() - started
            client = ExtractionClient(server.url, store, target.describe(), model=SERVED_NAME, max_model_len=None)
            send_samples(client, dataset, rows[:1], slots=slots, dtype=args.dtype, concurrency=1)
            store.delete(dataset.sample_ids[0])  # the warm-up sample is timed below like every other one
            start = time.perf_counter()
            tokens, nbytes = send_samples(client, dataset, rows, slots=slots, dtype=args.dtype, concurrency=args.batch_size)
            seconds = time.perf_counter() - start

        hf_store = FileBackend(tmp / "hf")
        pairs = [(hf_store.get(k), store.get(k)) for k in store.keys()]  # noqa: SIM118 - a backend's keys(), not a dict's
        diffs = [(a.hidden_states.float() - b.hidden_states.float()).abs() for a, b in pairs]
        scale = max(float(a.hidden_states.float().abs().max()) for a, _ in pairs)

    result = {
        "target": args.target, "slots": [str(s) for s in slots], "dtype": args.dtype, "batch_size": args.batch_size,
        "samples": len(rows), "tokens": tokens, "vllm_args": args.vllm_args,
        "hf": {"seconds": hf.seconds, "samples_per_s": round(hf.samples_per_second, 3), "tokens_per_s": round(hf.tokens_per_second, 1)},
        "vllm": {"startup_seconds": round(startup, 1), "seconds": round(seconds, 3), "samples_per_s": round(len(rows) / seconds, 3),
                 "tokens_per_s": round(tokens / seconds, 1), "bytes_per_token": round(nbytes / tokens, 1)},
        "hidden_states_vs_hf": {"max_abs_diff": max(float(d.max()) for d in diffs), "max_abs_value": scale,
                                "mean_abs_diff": sum(float(d.mean()) for d in diffs) / len(diffs)},
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
