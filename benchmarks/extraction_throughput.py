"""Extraction throughput: ``specdraft extract`` (hooks + async writer) vs a plain synchronous HF loop.

Both modes run the same samples of the same target with the same batch size and store the same
slots. The baseline is what one writes first: ``model(ids, attention_mask,
output_hidden_states=True)`` (full LM head included), pick the slots from the HF tuple and
``safetensors.save_file`` each sample before the next batch starts. Prints one JSON object and a
table (samples/s, tokens/s, bytes/token).

  .venv/bin/python benchmarks/extraction_throughput.py --samples 32
  .venv/bin/python benchmarks/extraction_throughput.py --dataset runs/main/data --samples 32
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def baseline(target, dataset, indices, slots, *, batch_size: int, dtype: str, out: Path) -> dict:
    import torch
    from safetensors.torch import save_file

    from specdraft.hidden_states.capture import pad_right
    from specdraft.hidden_states.payload import storage_dtype

    out.mkdir(parents=True)
    store = storage_dtype(dtype)
    order = sorted(indices, key=lambda i: -int(dataset.lengths()[i]))
    hf_ids = [s.hf_index(target.num_layers) for s in slots]
    tokens = nbytes = 0
    start = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        rows = [dataset[i] for i in order[lo : lo + batch_size]]
        ids, mask = pad_right([r["input_ids"] for r in rows])
        with torch.no_grad():
            hs = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        for b, row in enumerate(rows):
            n = int(row["input_ids"].shape[0])
            tensors = {
                "hidden_states": torch.stack([hs[k][b, :n] for k in hf_ids], dim=1).to(store).contiguous(),
                "token_ids": row["input_ids"].contiguous(),
                "last_hidden": hs[-1][b, :n].to(store).contiguous(),  # post-norm: all a plain loop can get
            }
            path = out / f"{lo + b}.safetensors"
            save_file(tensors, str(path))
            nbytes += path.stat().st_size
            tokens += n
    seconds = time.perf_counter() - start
    return {"samples": len(order), "tokens": tokens, "seconds": round(seconds, 3), "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", help="prepared dataset dir; default: prepare --samples ShareGPT rows for the target")
    parser.add_argument("--target", default="smollm2-135m", help="target name or directory (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=32, help="samples to extract (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=512, help="when preparing: skip longer samples (default: %(default)s)")
    parser.add_argument("--method", default="dspark", help="layer preset (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", help="storage dtype (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating; the fastest counts (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args()

    import torch

    from specdraft.data.dataset import PreparedDataset
    from specdraft.hidden_states.config import ExtractConfig
    from specdraft.hidden_states.extract import extract_hidden_states
    from specdraft.targets import load_target

    with tempfile.TemporaryDirectory(prefix="specdraft-bench-") as tmp:
        tmp = Path(tmp)
        if args.dataset is None:
            from specdraft.data.prepare import PrepareConfig, prepare

            args.dataset = str(tmp / "data")
            prepare(
                PrepareConfig(out=args.dataset, target=args.target, max_samples=args.samples, max_length=args.max_length), progress=False
            )
        dataset = PreparedDataset(args.dataset)
        target = load_target(args.target)
        config = ExtractConfig(
            dataset=args.dataset,
            out=str(tmp / "specdraft"),
            method=args.method,
            dtype=args.dtype,
            batch_size=args.batch_size,
            max_samples=args.samples,
        )
        slots = config.resolve_slots(target.num_layers)
        indices = list(range(min(args.samples, len(dataset))))
        with torch.no_grad():  # warm-up so neither mode pays first-call costs
            target.model(dataset[0]["input_ids"][None])

        runs: dict[str, list[dict]] = {"plain_hf_sync": [], "specdraft_async": []}
        for r in range(args.repeats):  # alternate so background load hits both modes alike
            runs["plain_hf_sync"].append(
                baseline(target, dataset, indices, slots, batch_size=args.batch_size, dtype=args.dtype, out=tmp / f"baseline{r}")
            )
            config.out = str(tmp / f"specdraft{r}")
            ours = extract_hidden_states(config, target=target, progress=False)
            runs["specdraft_async"].append(
                {"samples": ours.samples_extracted, "tokens": ours.tokens_extracted, "seconds": ours.seconds, "bytes": ours.bytes_written}
            )

    modes = {name: min(rs, key=lambda m: m["seconds"]) | {"all_seconds": [m["seconds"] for m in rs]} for name, rs in runs.items()}
    base, best = modes["plain_hf_sync"], modes["specdraft_async"]
    for m in modes.values():
        m["samples_per_s"] = round(m["samples"] / m["seconds"], 3)
        m["tokens_per_s"] = round(m["tokens"] / m["seconds"], 1)
        m["bytes_per_token"] = round(m["bytes"] / m["tokens"], 1)
    result = {
        "target": args.target,
        "slots": [str(s) for s in slots],
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "modes": modes,
        "repeats": args.repeats,
        "speedup": round(base["seconds"] / best["seconds"], 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'mode':<18}{'samples/s':>11}{'tokens/s':>11}{'bytes/token':>13}{'seconds':>10}")
    for name, m in modes.items():
        print(f"{name:<18}{m['samples_per_s']:>11.2f}{m['tokens_per_s']:>11.0f}{m['bytes_per_token']:>13.0f}{m['seconds']:>10.2f}")
    print(f"speedup (plain / specdraft): {result['speedup']:.2f}x")


if __name__ == "__main__":
    main()
