"""Decoding at length: time per output token and tau vs prompt length, autoregressive against speculative.

For each length ``--per-length`` prompts per domain of the ``long-context`` suite (``--domains``; the default,
specdraft's source and a question on it, comes within a few tokens of the length asked for) are decoded greedily by
plain autoregressive decoding and every drafter of ``--drafters`` (``ngram``, ``suffix``, ``reference`` or a
checkpoint directory, with ``+ngram``/``+suffix``/``@POLICY`` as in ``specdraft eval``, each optionally named
``LABEL=SPEC``), taking turns so load on a shared machine hits all alike; every output must equal the
autoregressive one (the benchmark stops otherwise). Prints a table per prompt and one per length bucket (tau and
time per output token merged over the bucket's prompts) and one JSON object; ``--out DIR`` also writes
``long_context.{json,md,png}`` (tau vs prompt length per drafter).

``--peak-rss`` measures instead the memory one batched prefill costs: two rows (the longest length and half
of it) decoded for 2 tokens, as the process's peak resident set (``ru_maxrss``) before and after.

  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --lengths 512,2048,4096,7000 --max-new-tokens 24
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --forward-path prepacked,prepacked+gqa --drafters none,ngram
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --domains stdlib-code,stdlib-docs \
      --drafters none,ngram,reference,long=RUN/final --out OUT
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/long_context.py --lengths 7000 --peak-rss
"""

from __future__ import annotations

import json
from pathlib import Path

from _common import benchmark_parser, labelled, load_benchmark_target

from specdraft.decode.config import SamplingConfig, SchedulerConfig
from specdraft.utils.memory import peak_rss_mb


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--lengths", default="512,2048,4096,7000", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--domains", default="specdraft-source", help="comma-separated long-context suite domains the prompts come from")
    parser.add_argument("--per-length", type=int, default=1, help="prompts per domain and length")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    parser.add_argument(
        "--drafters",
        default="none,ngram,reference",
        help="comma-separated, 'none' (the baseline) first: ngram, suffix, "
        "reference or checkpoint directories as in `specdraft eval --drafters`, each optionally LABEL=SPEC",
    )
    parser.add_argument("--lookup-corpus", default="", help="prepared dataset of the suffix drafters' corpus")
    parser.add_argument("--peak-rss", action="store_true", help="measure the peak RSS of one batched prefill instead")
    parser.add_argument(
        "--forward-path",
        default="auto",
        help="the target's forward path (tuning/forward_path.py); several, comma-"
        "separated, take turns with every decoder on each, e.g. prepacked,prepacked+gqa for the cost of copying the "
        "cache per grouped head",
    )
    parser.add_argument("--out", default="", help="directory for long_context.json, .md and .png")
    args = parser.parse_args()

    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.runtime import DecodeMetrics, decoder_for_target
    from specdraft.eval.runner import resolve_drafter
    from specdraft.eval.suites import bucket_label, long_context
    from specdraft.tuning.forward_path import use_path
    from specdraft.utils.lengths import length_bucket

    target = load_benchmark_target(args)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    suite = long_context(
        target=args.target,
        lengths=lengths,
        per_length=args.per_length,
        domains=tuple(args.domains.split(",")),
        max_new_tokens=args.max_new_tokens,
    )
    ordered = sorted(((p.token_ids(target.tokenizer), p) for p in suite), key=lambda pair: len(pair[0]))  # each rendered once
    prompts, suite = [ids for ids, _ in ordered], [p for _, p in ordered]
    sampling = SamplingConfig()
    if args.peak_rss:
        decoder = decoder_for_target(target, config=DecodeConfig(drafter="none", max_new_tokens=2), sampling=sampling)
        decoder.generate([prompts[-1][:64]])
        before = peak_rss_mb()
        rows = [prompts[-1], prompts[-1][: len(prompts[-1]) // 2]]
        ttft = decoder.generate(rows).metrics.ttft_s
        after = peak_rss_mb()
        print(
            json.dumps(
                {
                    "rows": [len(r) for r in rows],
                    "peak_rss_mb_before_prefill": round(before),
                    "peak_rss_mb_after": round(after),
                    "prefill_peak_mb": round(after - before),
                    "prefill_s": round(ttft, 1),
                }
            )
        )
        return

    specs = labelled(args.drafters.split(","))
    names, paths = list(specs), args.forward_path.split(",")
    if specs[names[0]] != "none":
        raise SystemExit("--drafters must start with 'none', the baseline")

    def decoder(name: str, path: str):
        spec = resolve_drafter(
            specs[name],
            num_draft_tokens=4,
            max_new_tokens=args.max_new_tokens,
            seed=0,
            target=args.target,
            forward_path=path,
            lookup_corpus=args.lookup_corpus,
        )
        return decoder_for_target(
            target, config=spec.decode, sampling=sampling, scheduler=SchedulerConfig(verify_policy=spec.verify_policy or "full")
        )

    label = (lambda name, path: name) if len(paths) == 1 else (lambda name, path: f"{name}@{path}")
    decoders = {label(n, p): (p, decoder(n, p)) for p in paths for n in names}
    for _, decoder in decoders.values():
        use_path(target.model, decoder.forward_path.name)
        decoder.generate([prompts[0][:64]])
    labels = list(decoders)
    rows, merged = [], {}
    for i, (prompt, eval_prompt) in enumerate(zip(prompts, suite)):
        bucket = bucket_label(length_bucket(len(prompt)))
        row = {"prompt": eval_prompt.prompt_id, "domain": eval_prompt.domain, "prompt_tokens": len(prompt), "bucket": bucket}
        outputs = {}
        for key in labels[i % len(labels) :] + labels[: i % len(labels)]:  # taking turns: load hits every decoder alike
            _, decoder = decoders[key]
            use_path(target.model, decoder.forward_path.name)  # the target is shared: each decoder's own path
            result = decoder.generate([prompt])
            outputs[key] = result.outputs[0].tokens
            row[key] = {"tpot_ms": result.metrics.time_per_output_token_s * 1e3, "ttft_s": result.metrics.ttft_s, "tau": result.metrics.tau}
            merged[bucket, key] = merged.get((bucket, key), DecodeMetrics()).merge(result.metrics)
        for path in paths:
            base = label(names[0], path)
            for name in names[1:]:
                key = label(name, path)
                if outputs[key] != outputs[base]:
                    raise SystemExit(
                        f"{key} output differs from autoregressive decoding on {eval_prompt.prompt_id} ({len(prompt)} prompt tokens)"
                    )
                row[key]["tpot_vs_ar"] = row[key]["tpot_ms"] / row[base]["tpot_ms"]
            if outputs[base] != outputs[label(names[0], paths[0])]:
                print(
                    f"note: autoregressive outputs differ between paths {paths[0]} and {path} at {len(prompt)} tokens (float reassociation)"
                )
        rows.append(row)
        print(json.dumps(row), flush=True)

    buckets = list(dict.fromkeys(row["bucket"] for row in rows))
    summary = []
    for bucket in buckets:
        entry = {"bucket": bucket, "prompts": sum(row["bucket"] == bucket for row in rows)}
        for path in paths:
            base = merged[bucket, label(names[0], path)].time_per_output_token_s
            for name in names:
                metrics = merged[bucket, label(name, path)]
                entry[label(name, path)] = {
                    "tau": metrics.tau,
                    "tpot_ms": metrics.time_per_output_token_s * 1e3,
                    "speedup": base / metrics.time_per_output_token_s,
                    "drafting_fraction": metrics.drafting_fraction,
                }
        summary.append(entry)
    tables = []
    for path in paths:

        def show(name: str) -> str:
            return label(name, path)

        lines = [
            f"{decoders[show(names[0])][1].forward_path.name}, per prompt:",
            "",
            "| prompt | tokens | AR ms/token | AR TTFT s | " + " | ".join(f"{n} ms/token (vs AR) | {n} tau" for n in names[1:]) + " |",
            "|" + " --- |" + " ---: |" * (3 + 2 * (len(names) - 1)),
        ]
        for row in rows:
            cells = [f"{row[show(n)]['tpot_ms']:.1f} ({row[show(n)]['tpot_vs_ar']:.2f}x) | {row[show(n)]['tau']:.2f}" for n in names[1:]]
            lines.append(
                f"| {row['prompt']} | {row['prompt_tokens']} | {row[show(names[0])]['tpot_ms']:.1f} | "
                f"{row[show(names[0])]['ttft_s']:.2f} | " + " | ".join(cells) + " |"
            )
        lines += [
            "",
            f"{decoders[show(names[0])][1].forward_path.name}, per length bucket (tau and time per output token over "
            "the bucket's prompts; speed-up = autoregressive time per token / the decoder's):",
            "",
            "| bucket | prompts | AR ms/token | " + " | ".join(f"{n} tau | {n} speed-up" for n in names[1:]) + " |",
            "|" + " --- |" + " ---: |" * (2 + 2 * (len(names) - 1)),
        ]
        for entry in summary:
            cells = [f"{entry[show(n)]['tau']:.2f} | {entry[show(n)]['speedup']:.2f}x" for n in names[1:]]
            lines.append(f"| {entry['bucket']} | {entry['prompts']} | {entry[show(names[0])]['tpot_ms']:.1f} | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    report = {
        "max_new_tokens": args.max_new_tokens,
        "domains": args.domains.split(","),
        "drafters": specs,
        "forward_paths": {p: decoders[label(names[0], p)][1].forward_path.name for p in paths},
        "identical_to_autoregressive": True,
        "buckets": summary,
        "rows": rows,
    }
    print("\n\n".join(tables))
    print(json.dumps(report))
    if args.out:
        write_report(Path(args.out), report, "\n\n".join(tables), [label(n, paths[0]) for n in names[1:]])


def write_report(out: Path, report: dict, tables: str, keys: list[str]) -> None:
    """long_context.json, .md (the tables) and .png (tau per length bucket, one line per drafter)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "long_context.md").write_text(tables + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    buckets = [entry["bucket"] for entry in report["buckets"]]
    for key in keys:
        ax.plot(buckets, [entry[key]["tau"] for entry in report["buckets"]], marker="o", label=key)
    ax.set_xlabel("prompt length bucket (tokens)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(f"tau vs prompt length ({len(report['domains'])} domains, {report['max_new_tokens']} new tokens)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "long_context.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
