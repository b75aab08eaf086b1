"""Decoding at length: time per output token and tau vs prompt length, autoregressive against speculative.

For each length one prompt of the ``long-context`` suite (``--domain``; the default, specdraft's source and a
question on it, comes within a few tokens of the length asked for) is decoded greedily by plain autoregressive
decoding, ngram and the reference drafter shipped for the embedded target (taking turns, so load on a shared
machine hits all alike); every output must equal the autoregressive one (the benchmark stops otherwise).
Prints a table and one JSON object.

``--peak-rss`` measures instead the memory one batched prefill costs: two rows (the longest length and half
of it) decoded for 2 tokens, as the process's peak resident set (``ru_maxrss``) before and after.

  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --lengths 512,2048,4096,7000 --max-new-tokens 24
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --forward-path prepacked,prepacked+gqa --drafters none,ngram
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --lengths 7000 --peak-rss
"""

from __future__ import annotations

import json
import resource

from _common import benchmark_parser, load_benchmark_target
from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--lengths", default="512,2048,4096,7000", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--domain", default="specdraft-source", help="long-context suite domain the prompts come from")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument("--drafters", default="none,ngram,reference", help="comma-separated: none (the baseline), ngram, reference")
    parser.add_argument("--peak-rss", action="store_true", help="measure the peak RSS of one batched prefill instead")
    parser.add_argument("--forward-path", default="auto", help="the target's forward path (utils/forward_path.py); several, comma-"
                        "separated, take turns with every decoder on each, e.g. prepacked,prepacked+gqa for the cost of copying the "
                        "cache per grouped head")
    args = parser.parse_args()

    from specdraft.decode.runtime import decoder_for_target
    from specdraft.eval.suites import long_context
    from specdraft.reference import reference_drafter
    from specdraft.utils.forward_path import use_path

    target = load_benchmark_target(args)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    prompts = [p.token_ids(target.tokenizer) for p in long_context(target=args.target, lengths=lengths, per_length=1,
                                                                    domains=(args.domain,), max_new_tokens=args.max_new_tokens)]
    sampling = SamplingConfig()
    if args.peak_rss:
        decoder = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=2), sampling=sampling)
        decoder.generate([prompts[-1][:64]])
        before = peak_rss_mb()
        rows = [prompts[-1], prompts[-1][: len(prompts[-1]) // 2]]
        ttft = decoder.generate(rows).metrics.ttft_s
        after = peak_rss_mb()
        print(json.dumps({"rows": [len(r) for r in rows], "peak_rss_mb_before_prefill": round(before), "peak_rss_mb_after": round(after),
                          "prefill_peak_mb": round(after - before), "prefill_s": round(ttft, 1)}))
        return

    def config(name: str, path: str) -> DecodeConfig:
        common = {"max_new_tokens": args.max_new_tokens, "forward_path": path}
        if name == "reference":
            return DecodeConfig(drafter="dspark", drafter_path=str(reference_drafter(args.target)), **common)
        return DecodeConfig(drafter=name, **common)

    names, paths = args.drafters.split(","), args.forward_path.split(",")
    if names[0] != "none":
        raise SystemExit("--drafters must start with 'none', the baseline")
    label = (lambda name, path: name) if len(paths) == 1 else (lambda name, path: f"{name}@{path}")
    decoders = {label(n, p): (p, decoder_for_target(target, config=config(n, p), sampling=sampling, scheduler=SchedulerConfig()))
                for p in paths for n in names}
    for _, decoder in decoders.values():
        use_path(target.model, decoder.forward_path.name)
        decoder.generate([prompts[0][:64]])
    labels = list(decoders)
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt_tokens": len(prompt)}
        outputs = {}
        for key in labels[i % len(labels):] + labels[: i % len(labels)]:  # taking turns: load hits every decoder alike
            _, decoder = decoders[key]
            use_path(target.model, decoder.forward_path.name)  # the target is shared: each decoder's own path
            result = decoder.generate([prompt])
            outputs[key] = result.outputs[0].tokens
            row[key] = {"tpot_ms": result.metrics.time_per_output_token_s * 1e3, "ttft_s": result.metrics.ttft_s, "tau": result.metrics.tau}
        for path in paths:
            base = label("none", path)
            for name in names[1:]:
                key = label(name, path)
                if outputs[key] != outputs[base]:
                    raise SystemExit(f"{key} output differs from autoregressive decoding at {len(prompt)} prompt tokens")
                row[key]["tpot_vs_ar"] = row[key]["tpot_ms"] / row[base]["tpot_ms"]
            if outputs[base] != outputs[label("none", paths[0])]:
                print(f"note: autoregressive outputs differ between paths {paths[0]} and {path} at {len(prompt)} tokens (float reassociation)")
        rows.append(row)

    for path in paths:
        base = label("none", path)
        print(f"\n{decoders[base][1].forward_path.name}:\n")
        print("| prompt tokens | AR ms/token | AR TTFT s | " + " | ".join(f"{n} ms/token (vs AR) | {n} tau" for n in names[1:]) + " |")
        print("|" + " ---: |" * (3 + 2 * (len(names) - 1)))
        for row in rows:
            cells = [f"{row[label(n, path)]['tpot_ms']:.1f} ({row[label(n, path)]['tpot_vs_ar']:.2f}x) | {row[label(n, path)]['tau']:.2f}" for n in names[1:]]
            print(f"| {row['prompt_tokens']} | {row[base]['tpot_ms']:.1f} | {row[base]['ttft_s']:.2f} | " + " | ".join(cells) + " |")
    print(json.dumps({"max_new_tokens": args.max_new_tokens, "domain": args.domain,
                      "forward_paths": {p: decoders[label("none", p)][1].forward_path.name for p in paths},
                      "identical_to_autoregressive": True, "rows": rows}))


if __name__ == "__main__":
    main()
