"""Regeneration throughput (`specdraft prepare --regenerate`): HF batched generate vs a vLLM server.

Every run regenerates the same ShareGPT prompts with the same greedy settings through
``prepare()`` itself, so the figures are what a user gets. Tokens/s excludes the engine start
(vLLM's server start-up, reported separately: paid once per job). Greedy replies of different
runs may differ where the target's top two logits nearly tie (padding and kernel numerics); the
fraction of identical replies against the first HF run is reported. Prints one JSON line, then a
table; the load average is recorded because the figures depend on what else runs.

  .venv/bin/python benchmarks/regenerate_throughput.py --samples 64 --max-new-tokens 128 \\
      --runs hf:8 hf:32 vllm:32 vllm:32:bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path


def parse_run(text: str) -> dict:
    """``ENGINE:BATCH[:VLLM_DTYPE]``, e.g. ``hf:32`` or ``vllm:32:bfloat16`` (vLLM runs in the target's dtype by default)."""
    engine, batch, *dtype = text.split(":")
    return {"name": text, "engine": engine, "batch_size": int(batch), "dtype": dtype[0] if dtype else None}


def replies(directory: str) -> dict[str, list[int]]:
    from specdraft.data.dataset import PreparedDataset

    out = {}
    for item in PreparedDataset(directory):
        mask = item["loss_mask"].bool()
        out[item["sample_id"]] = item["input_ids"][mask].tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m", help="target name or directory (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=64, help="ShareGPT prompts (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="most tokens per reply (default: %(default)s)")
    parser.add_argument(
        "--runs",
        nargs="+",
        type=parse_run,
        default=[parse_run(r) for r in ("hf:8", "hf:32", "vllm:32")],
        help="ENGINE:BATCH[:VLLM_DTYPE] per run; the batch is vLLM's requests in flight (default: hf:8 hf:32 vllm:32)",
    )
    parser.add_argument("--vllm-args", default="", help="extra vLLM api_server flags for every vllm run, e.g. --vllm-args=--enforce-eager")
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args()

    from specdraft.data.prepare import PrepareConfig, prepare

    load_before = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory(prefix="specdraft-regen-bench-") as tmp:
        reference = None
        for run in args.runs:
            vllm_args = f"{args.vllm_args} --dtype {run['dtype']}".strip() if run["dtype"] else args.vllm_args
            out = str(Path(tmp) / run["name"].replace(":", "-"))
            config = PrepareConfig(
                out=out, target=args.target, data="sharegpt", max_samples=args.samples, regenerate=True,
                max_new_tokens=args.max_new_tokens, batch_size=run["batch_size"], engine=run["engine"],
                vllm_args=vllm_args if run["engine"] == "vllm" else "",
            )  # fmt: skip
            summary = prepare(config, progress=False)
            got = replies(out)
            reference = reference or got
            same = sum(got[k] == reference[k] for k in reference)
            results.append({
                "run": run["name"], "engine": run["engine"], "batch_size": run["batch_size"], "vllm_dtype": run["dtype"],
                "samples": summary["regenerated"], "generated_tokens": summary["generated_tokens"],
                "seconds": summary["generation_seconds"], "tokens_per_s": summary["generated_tokens_per_second"],
                "engine_start_seconds": summary["engine_start_seconds"], "identical_to_first": round(same / len(reference), 4),
            })  # fmt: skip
            print(f"{run['name']}: {summary['generated_tokens_per_second']} tok/s", flush=True)

    result = {
        "target": args.target, "samples": args.samples, "max_new_tokens": args.max_new_tokens, "vllm_args": args.vllm_args,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "runs": results,
    }  # fmt: skip
    print(json.dumps(result))
    header = f"{'run':<20} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'start s':>8} {'same as ' + results[0]['run']:>14}"
    print(header)
    for r in results:
        print(
            f"{r['run']:<20} {r['generated_tokens']:>7} {r['seconds']:>8.1f} {r['tokens_per_s']:>7.1f} "
            f"{r['engine_start_seconds']:>8.1f} {r['identical_to_first']:>14.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
