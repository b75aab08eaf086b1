"""The draft gate's floor: with the gate closed, decoding must cost at most 3% more than autoregressive.

Loads the target once and decodes the same prompts with plain autoregressive decoding and with
each DSpark drafter under the scheduled policy *with its draft gate held shut* (every round is a
plain step), interleaved prompt by prompt and repeated, so machine load hits all of them alike.
Reports the median time per output token of each (over prompt x repeat samples) and its ratio to
autoregressive (the median of the per-sample ratios to autoregressive decoding of the same prompt in the
same pass), the same for CPU seconds of the process per output token (far less sensitive to
other jobs on a shared machine than wall time), and how many tokens were drafted (none must be). Drafters:

* ``quickstart``: a fresh DSpark drafter with the quickstart's recipe (``dspark``, 16 anchors);
  untrained weights cost what trained ones do;
* ``reference``: the drafter shipped for the target (``src/specdraft/reference``);
* ``autoregressive+capture``: plain decoding that also captures the reference drafter's layer slots
  (the hooks and feature bookkeeping a closed gate keeps paying), to tell that cost from the rest.

Per decoder it also splits the time per output token into the target forward + verification
(``verify_s``), drafting (``draft_s``) and the rest of the loop.

  .venv/bin/python benchmarks/gate_floor.py --prompts 4 --max-new-tokens 32 --repeats 3
"""

from __future__ import annotations

import json
import statistics
import time

from _common import benchmark_parser, load_benchmark_target, quickstart_drafter


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--prompts", type=int, default=4, help="eval prompts (the quickstart suite's first ones)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts")
    args = parser.parse_args()

    import torch

    from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
    from specdraft.decode.proposers import PROPOSERS
    from specdraft.decode.proposers.drafters import BlockDrafterProposer
    from specdraft.decode.runtime import SpeculativeDecoder
    from specdraft.decode.scheduler import DraftGate
    from specdraft.decode.sps import load_or_measure_sps
    from specdraft.eval.report import paired_ratios
    from specdraft.eval.suites import load_prompts
    from specdraft.models.common.drafter import load_drafter
    from specdraft.reference import reference_drafter

    target = load_benchmark_target(args)
    prompts = [p.token_ids(target.tokenizer) for p in load_prompts("quick", None, None)[: args.prompts]]
    sps = load_or_measure_sps(target.model, fingerprint=target.fingerprint)
    config = DecodeConfig(drafter="none", max_new_tokens=args.max_new_tokens)
    decoders = {
        "autoregressive": SpeculativeDecoder(target.model, PROPOSERS.get("none")(config, target), config=config, sampling=SamplingConfig())
    }
    drafters = {"quickstart": quickstart_drafter(target), "reference": load_drafter(reference_drafter(args.target), target=target)}
    scheduled = SchedulerConfig(verify_policy="scheduled")
    for name, drafter in drafters.items():
        proposer = BlockDrafterProposer(drafter, provides_confidences=True, confidences_calibrated=True)
        decoders[name] = SpeculativeDecoder(
            target.model,
            proposer,
            config=DecodeConfig(drafter="dspark", max_new_tokens=args.max_new_tokens),
            sampling=SamplingConfig(),
            scheduler=scheduled,
            sps=sps,
        )
        decoders[name].draft_gates[1] = DraftGate(plain_rate=sps(1), skip_left=10**9)  # closed for the whole run

    capture = PROPOSERS.get("none")(config, target)
    capture.layer_slots = decoders["reference"].proposer.layer_slots
    decoders["autoregressive+capture"] = SpeculativeDecoder(target.model, capture, config=config, sampling=SamplingConfig())

    for decoder in decoders.values():
        decoder.generate([prompts[0][-16:]])  # one-off costs (allocator, lazy init)
    samples = {name: [] for name in decoders}
    cpu = {name: [] for name in decoders}
    drafted = dict.fromkeys(decoders, 0)
    outputs = {name: [] for name in decoders}
    parts = {name: {"verify_s": 0.0, "draft_s": 0.0, "other_s": 0.0, "tokens": 0} for name in decoders}
    order = list(decoders)
    for repeat in range(args.repeats):
        for p, prompt in enumerate(prompts):
            shift = (repeat * len(prompts) + p) % len(order)  # each decoder takes every place in the order in turn
            for name in order[shift:] + order[:shift]:
                decoder = decoders[name]
                started = time.process_time()
                result = decoder.generate([prompt])
                cpu[name].append((time.process_time() - started) / result.metrics.output_tokens)
                samples[name].append(result.metrics.time_per_output_token_s)
                drafted[name] += result.metrics.drafted
                outputs[name].append(result.outputs[0].tokens)
                m = result.metrics
                parts[name]["verify_s"] += m.verify_s
                parts[name]["draft_s"] += m.draft_s
                parts[name]["other_s"] += m.wall_s - m.ttft_s - m.verify_s - m.draft_s
                parts[name]["tokens"] += m.output_tokens - m.requests
    report = {
        "target": target.name,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "decoders": {
            name: {
                "median_ms_per_token": 1e3 * statistics.median(s),
                "min_ms_per_token": 1e3 * min(s),
                "cost_vs_autoregressive": statistics.median(paired_ratios(s, samples["autoregressive"])),  # paired, as eval does
                "median_cpu_ms_per_token": 1e3 * statistics.median(cpu[name]),
                "cpu_cost_vs_autoregressive": statistics.median(paired_ratios(cpu[name], cpu["autoregressive"])),
                "drafted_tokens": drafted[name],
                **{f"{k[:-2]}_ms_per_token": 1e3 * v / parts[name]["tokens"] for k, v in parts[name].items() if k != "tokens"},
                "identical_to_autoregressive": outputs[name] == outputs["autoregressive"],
            }
            for name, s in samples.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
