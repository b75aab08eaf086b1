"""Serving speed through vLLM's OpenAI server: the target alone vs the target with a drafter.

Sends the same greedy requests (one at a time, ``--max-tokens`` each, EOS ignored) to each server
and reports completion tokens/s, plus acceptance rate and tau from ``/metrics`` for the drafter.
Server start-up is excluded and one warm-up request per server is not timed. Prints one JSON object.

  .venv/bin/python benchmarks/vllm_serve.py --drafter runs/bench-train/train-eagle3/final
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short poem about the sea.",
    "What are the main causes of inflation?",
    "Give three tips for writing clean Python code.",
]


def timed_requests(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    from specdraft.integrations.vllm.engine import complete

    start = time.perf_counter()
    tokens = sum(complete(url, p, max_tokens=max_tokens, ignore_eos=True)["usage"]["completion_tokens"] for p in prompts)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="drafter checkpoint directory (eagle3 or dflash on vLLM-CPU)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    parser.add_argument(
        "--requests", type=int, default=len(PROMPTS), help=f"requests per server, at most {len(PROMPTS)} (default: %(default)s)"
    )
    parser.add_argument(
        "--vllm-args", default="--max-model-len 1024 --dtype float32", help="extra vLLM api_server flags (default: %(default)s)"
    )
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args()

    from specdraft.integrations.vllm.engine import VllmServer, complete
    from specdraft.integrations.vllm.metrics import read_spec_decode_metrics
    from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info
    from specdraft.targets import load_target, resolve_target_dir

    info = read_drafter_info(args.drafter)
    target = load_target(info.target)
    prompts = [
        target.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        for p in PROMPTS[: args.requests]
    ]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    result: dict = {
        "target": info.target,
        "drafter": args.drafter,
        "method": info.method,
        "max_tokens": args.max_tokens,
        "requests": len(prompts),
        "vllm_args": args.vllm_args,
    }

    started = time.perf_counter()
    with VllmServer(resolve_target_dir(info.target), shlex.split(args.vllm_args)) as server:
        up = time.perf_counter() - started
        complete(server.url, prompts[0], max_tokens=8, ignore_eos=True)  # warm-up
        tokens, seconds = timed_requests(server.url, prompts, args.max_tokens)
    result["target_only"] = {
        "startup_seconds": round(up, 1),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }

    started = time.perf_counter()
    with drafter_server(ServeConfig(drafter=args.drafter, vllm_args=args.vllm_args)) as server:
        up = time.perf_counter() - started
        complete(server.url, prompts[0], max_tokens=8, ignore_eos=True)  # warm-up
        before = read_spec_decode_metrics(server.url)
        tokens, seconds = timed_requests(server.url, prompts, args.max_tokens)
        used = read_spec_decode_metrics(server.url) - before
    result["with_drafter"] = {
        "startup_seconds": round(up, 1), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
        "acceptance_rate": round(used.acceptance_rate, 3), "tau": round(used.mean_accepted_length, 3),
        "accepted_per_position": used.accepted_per_position,
    }  # fmt: skip
    result["speedup"] = round(result["with_drafter"]["tokens_per_s"] / result["target_only"]["tokens_per_s"], 3)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
