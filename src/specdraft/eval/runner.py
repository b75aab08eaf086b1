"""Side-by-side evaluation: each drafter against plain autoregressive decoding of the same target, in the
same runtime, on the same prompts, batch by batch (so machine load hits both alike).

Prompts are grouped by domain and prompt-length bucket (``utils.lengths.length_bucket``) before batching, so
every batch is single-domain and single-bucket, and per-domain and per-bucket metrics are exact even at
concurrency > 1. Speed-up = drafter tokens/s / autoregressive tokens/s at the same concurrency. At
temperature 0 the report also says whether every output was identical to the autoregressive one (it
must be: verification is exact).

Timing is made fair three times over: the decoders take turns in a rotating order (batch b starts with
decoder b mod n), so none always runs right after the same other one (a drafter that verifies long
blocks leaves caches and the allocator in another state than plain decoding does); time per output
token is also reported as the median over batches, which one stalled batch cannot move; and its ratio
to autoregressive decoding is the median of the per-batch ratios, each decoder against autoregressive
decoding of the same prompts, so prompts of different lengths (and so different costs per token) do
not enter it: a ratio of the two medians can compare one prompt's time with another's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.report import EVAL_DIR
from specdraft.eval.suites import bucket_label, load_prompts
from specdraft.targets.base import Target
from specdraft.utils.lengths import length_bucket
from specdraft.utils.lock import claims_output

log = logging.getLogger(__name__)

AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class DrafterSpec:
    label: str  # how the drafter is named in tables and plots
    decode: DecodeConfig
    verify_policy: str | None = None  # None: the run's --verify-policy (trained drafters) or 'full'


def resolve_drafter(text: str, *, num_draft_tokens: int, max_new_tokens: int, seed: int, target: str = "",
                    draft_dtype: str = "auto", forward_path: str = "auto", lookup_corpus: str = "") -> DrafterSpec:
    """'ngram' / 'suffix' / 'none', 'reference' (the drafter shipped for the embedded ``target``), or a checkpoint
    directory whose config.json names its method, optionally followed by '+ngram' or '+suffix' (the hybrid of
    that drafter with prompt lookup, or with suffix drafting from ``lookup_corpus``) and by '@POLICY' to pick
    that drafter's verify policy (e.g. 'runs/x/final+ngram@scheduled')."""
    from specdraft.decode.proposers import PROPOSERS
    from specdraft.decode.proposers.hybrid import HYBRID_KINDS
    from specdraft.decode.scheduler import VERIFY_POLICIES
    from specdraft.reference import reference_drafter

    common = {"num_draft_tokens": num_draft_tokens, "max_new_tokens": max_new_tokens, "seed": seed, "draft_dtype": draft_dtype,
              "forward_path": forward_path, "lookup_corpus": lookup_corpus}
    name, _, policy = text.partition("@")
    if policy:
        VERIFY_POLICIES.get(policy)
    suffix = f"@{policy}" if policy else ""
    hybrid = next((kind for kind in HYBRID_KINDS if name.endswith(kind) and name != kind), "")
    name = name.removesuffix(hybrid)
    path = reference_drafter(target) if name == "reference" else Path(name)
    if path.is_dir():
        config_path = path / "config.json"
        try:
            method = json.loads(config_path.read_text())["speculators_model_type"]
        except (OSError, ValueError, KeyError) as exc:
            raise SpecdraftError(f"drafter {name}: cannot read 'speculators_model_type' from {config_path} ({exc})") from None
        PROPOSERS.get(method + hybrid)
        decode = DecodeConfig(drafter=method + hybrid, drafter_path=str(path), **common)
        return DrafterSpec(f"{method}{hybrid}:{path.name}{suffix}", decode, policy or None)
    if hybrid:
        raise SpecdraftError(f"drafter {text!r}: '{hybrid}' follows a checkpoint directory or 'reference', and {name!r} is neither")
    if name in ("ngram", "suffix", "none"):
        return DrafterSpec((AUTOREGRESSIVE if name == "none" else name) + suffix, DecodeConfig(drafter=name, **common), policy or None)
    raise SpecdraftError(f"drafter {name!r} is neither 'ngram', 'suffix', 'reference' nor a checkpoint directory")


@dataclass
class RunRecord:
    """Metrics of one drafter at one concurrency: overall and per domain (DecodeMetrics.to_json dicts)."""

    drafter: str
    concurrency: int
    overall: dict[str, Any]
    per_domain: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_bucket: dict[str, dict[str, Any]] = field(default_factory=dict)  # by prompt-length bucket
    tau_distribution: dict[str, float | None] = field(default_factory=dict)  # report.tau_distribution of the prompts' tau
    macro_tau: float | None = None  # mean over domains of their tau (each domain counts once, whatever its size)
    speedup: float | None = None  # tokens/s over autoregressive at the same concurrency
    median_tpot_s: float | None = None  # median over batches of their time per output token
    tpot_vs_autoregressive: float | None = None  # median over batches of TPOT / autoregressive TPOT on the same batch
    batch_tpot_s: list[float] = field(default_factory=list)  # time per output token of each batch, in batch order
    identical_to_autoregressive: int | None = None  # prompts whose output equals the AR output (greedy only)


def _scheduler_for(spec: DrafterSpec, default: SchedulerConfig) -> SchedulerConfig:
    """The drafter's own '@policy', else the run's policy for trained drafters; ngram and autoregressive
    decoding have no confidences, so they verify every draft unless told otherwise."""
    if spec.verify_policy is not None:
        return dataclasses.replace(default, verify_policy=spec.verify_policy)
    return default if spec.decode.drafter not in ("none", "ngram", "suffix") else SchedulerConfig()


def _dtype_facts(spec: DrafterSpec, proposer: Any) -> dict[str, Any]:
    """A trained drafter's resolved draft dtype and why (the ``--draft-dtype`` flag, or ``auto`` measured
    or cached, with the figures) in place of the requested value; ngram / autoregressive draft no tensors."""
    facts = getattr(proposer, "dtype_facts", None) or {"draft_dtype": None}
    path = {f"draft_{k}": v for k, v in (getattr(proposer, "path_facts", None) or {}).items()}
    return {**facts, **path, "draft_dtype_requested": spec.decode.draft_dtype}


def _batches(groups: list[tuple[str, int]], size: int) -> list[list[int]]:
    """Prompt indices grouped by their (domain, length bucket) into batches of at most ``size``."""
    by_group: dict[tuple[str, int], list[int]] = {}
    for i, group in enumerate(groups):
        by_group.setdefault(group, []).append(i)
    return [idx[s : s + size] for idx in by_group.values() for s in range(0, len(idx), size)]


@claims_output(EVAL_DIR)  # before the decoding: a foreign, locked or read-only --out costs nothing
def run_eval(
    config: EvalConfig,
    sampling: SamplingConfig = SamplingConfig(),
    scheduler: SchedulerConfig = SchedulerConfig(),
    *,
    target: Target | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the comparison and write ``report.json`` (+ ``report.md`` and plots) under ``config.out``."""
    import torch
    from tqdm import tqdm

    from specdraft.decode.runtime import decoder_for_target, resolve_decode_threads
    from specdraft.eval.report import macro_tau, paired_ratios, tau_distribution, write_report
    from specdraft.targets import load_target
    from specdraft.utils.threads import threads_facts

    setup_started = time.perf_counter()  # the thread probe, decoder builds and warm-ups count against --max-time too
    prompts = load_prompts(
        None if config.prompts else config.suite, config.prompts or None, config.limit_per_domain or None
    )
    if target is None:
        target = load_target(config.target, dtype=config.dtype, device=config.device)
    # before any decoder is built: the SPS profile and the draft-dtype probe are measured at the count used
    threads = resolve_decode_threads(target, config.threads)
    specs = [resolve_drafter("none", num_draft_tokens=0, max_new_tokens=config.max_new_tokens, seed=config.seed,
                             forward_path=config.forward_path)]  # one target: every decoder runs it on the same path
    specs += [resolve_drafter(d, num_draft_tokens=config.num_draft_tokens, max_new_tokens=config.max_new_tokens, seed=config.seed,
                              target=config.target, draft_dtype=config.draft_dtype, forward_path=config.forward_path,
                              lookup_corpus=config.lookup_corpus) for d in config.drafters]
    if len({s.label for s in specs}) != len(specs):
        raise SpecdraftError(f"--drafters names the same drafter twice: {config.drafters}")
    decoders = {s.label: decoder_for_target(target, config=s.decode, sampling=sampling, scheduler=_scheduler_for(s, scheduler))
                for s in specs}
    token_ids = [p.token_ids(target.tokenizer) for p in prompts]
    groups = [(p.domain, length_bucket(len(ids))) for p, ids in zip(prompts, token_ids)]
    warmup = token_ids[0][-16:]
    for decoder in decoders.values():  # first calls pay one-off costs (allocator, lazy init)
        decoder.generate([warmup])

    outputs: dict[int, dict[str, dict[str, Any]]] = {c: {label: {} for label in decoders} for c in config.concurrency}
    records: list[RunRecord] = []
    total = sum(len(_batches(groups, c)) for c in config.concurrency) * len(decoders)
    bar = tqdm(total=total, desc="eval", unit="batch", disable=not progress)
    started = time.perf_counter()
    max_time = max(config.max_time - (started - setup_started), 1e-9) if config.max_time else 0.0
    batches_done, cut_by_time = 0, False
    for concurrency in config.concurrency:
        merged: dict[str, Any] = {label: None for label in decoders}
        domain_metrics: dict[str, dict[str, Any]] = {label: {} for label in decoders}
        bucket_metrics: dict[str, dict[str, Any]] = {label: {} for label in decoders}
        tpots: dict[str, list[float]] = {label: [] for label in decoders}
        order = list(decoders)
        for batch in _batches(groups, concurrency):
            elapsed = time.perf_counter() - started
            if max_time and batches_done and elapsed + elapsed / batches_done > max_time:
                cut_by_time = True
                break
            batches_done += 1
            domain, bucket = groups[batch[0]]
            shift = batches_done % len(order)
            for label in order[shift:] + order[:shift]:
                result = decoders[label].generate([token_ids[i] for i in batch])
                tpots[label].append(result.metrics.time_per_output_token_s)
                merged[label] = result.metrics if merged[label] is None else merged[label].merge(result.metrics)
                for grouped, key in ((domain_metrics, domain), (bucket_metrics, bucket)):
                    previous = grouped[label].get(key)
                    grouped[label][key] = result.metrics if previous is None else previous.merge(result.metrics)
                for i, out, tau in zip(batch, result.outputs, result.metrics.request_tau):
                    outputs[concurrency][label][i] = {"tokens": out.tokens, "finish_reason": out.finish_reason, "tau": tau}
                bar.update(1)
                bar.set_postfix(drafter=label, c=concurrency)
        baseline = merged[AUTOREGRESSIVE]
        if baseline is None:  # the time limit came before this concurrency level started
            break
        for label in decoders:
            metrics = merged[label]
            ratios = paired_ratios(tpots[label], tpots[AUTOREGRESSIVE])
            same = None
            if sampling.greedy:
                same = sum(out["tokens"] == outputs[concurrency][AUTOREGRESSIVE][i]["tokens"] for i, out in outputs[concurrency][label].items())
            per_domain = {d: m.to_json() for d, m in sorted(domain_metrics[label].items())}
            records.append(RunRecord(
                drafter=label,
                concurrency=concurrency,
                overall=metrics.to_json(),
                per_domain=per_domain,
                per_bucket={bucket_label(b): m.to_json() for b, m in sorted(bucket_metrics[label].items())},
                tau_distribution=tau_distribution([out["tau"] for out in outputs[concurrency][label].values()]),
                macro_tau=macro_tau(per_domain),
                speedup=metrics.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None,
                median_tpot_s=statistics.median(tpots[label]),
                tpot_vs_autoregressive=statistics.median(ratios) if ratios else None,
                batch_tpot_s=tpots[label],
                identical_to_autoregressive=same,
            ))
    bar.close()

    per_prompt = []
    for i, prompt in enumerate(prompts):
        entry = {**prompt.to_json(), "prompt_tokens": len(token_ids[i]), "outputs": {}}
        for concurrency in config.concurrency:
            for label in decoders:
                out = outputs[concurrency][label].get(i)
                if out is not None:
                    text = target.tokenizer.decode(out["tokens"], skip_special_tokens=True)
                    entry["outputs"].setdefault(label, {})[str(concurrency)] = {**out, "text": text}
        if entry["outputs"]:
            per_prompt.append(entry)
    if cut_by_time:
        log.warning("--max-time %.0f s: evaluated %d of %d prompts", config.max_time, len(per_prompt), len(prompts))
    report = {
        "format": "specdraft.eval_report",
        "format_version": 1,
        "target": target.describe(),
        "config": asdict(config),
        "sampling": asdict(sampling),
        "scheduler": asdict(scheduler),
        "drafters": {s.label: {**asdict(s.decode), **_dtype_facts(s, decoders[s.label].proposer)} for s in specs},
        **threads_facts(config.threads, threads),
        "target_forward_path": decoders[AUTOREGRESSIVE].forward_path.to_json(),
        "num_prompts": len(per_prompt),
        "prompts_planned": len(prompts),
        "cut_by_time": cut_by_time,
        "wall_s": time.perf_counter() - started,
        "runs": [asdict(r) for r in records],
        "prompts": per_prompt,
    }
    write_report(report, Path(config.out), plots=config.plots)
    return report
