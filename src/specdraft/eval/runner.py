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
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.decode.config import DecodeConfig, SamplingConfig, SchedulerConfig
from specdraft.errors import SpecdraftError, setting
from specdraft.eval.config import EvalConfig
from specdraft.eval.report import EVAL_DIR
from specdraft.eval.suites import EvalPrompt, bucket_label, load_prompts
from specdraft.targets.base import Target
from specdraft.tuning.settings import Choice
from specdraft.utils.lengths import length_bucket
from specdraft.utils.lock import claims_output

if TYPE_CHECKING:
    from specdraft.decode.runtime import SpeculativeDecoder

log = logging.getLogger(__name__)

AUTOREGRESSIVE = "autoregressive"


@dataclass(frozen=True)
class DrafterSpec:
    label: str  # how the drafter is named in tables and plots
    decode: DecodeConfig
    verify_policy: str | None = None  # None: the run's --verify-policy (trained drafters) or 'full'

    @property
    def identity(self) -> tuple[str, str, str | None]:
        """What makes two items the same drafter: proposer (hybrid included), resolved checkpoint and verify policy."""
        return self.decode.drafter, str(Path(self.decode.drafter_path).resolve()) if self.decode.drafter_path else "", self.verify_policy


def drafter_label(decode: DecodeConfig, policy: str | None, depth: int = 1) -> str:
    """'METHOD[+HYBRID]:DIR[@POLICY]' for a checkpoint, DIR its last ``depth`` path components; lookup drafters by name."""
    if decode.drafter_path:
        parts = Path(os.path.abspath(decode.drafter_path)).parts
        name = f"{decode.drafter}:{Path(*parts[-depth:]).as_posix()}"
    else:
        name = AUTOREGRESSIVE if decode.drafter == "none" else decode.drafter
    return name + (f"@{policy}" if policy else "")


def resolve_drafter(
    text: str,
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    seed: int,
    target: str = "",
    draft_dtype: str = "auto",
    forward_path: str = "auto",
    lookup_corpus: str = "",
) -> DrafterSpec:
    """'ngram' / 'suffix' / 'none', 'reference' (the drafter shipped for the embedded ``target``), or a checkpoint
    directory whose config.json names its method, optionally followed by '+ngram' or '+suffix' (the hybrid of
    that drafter with prompt lookup, or with suffix drafting from ``lookup_corpus``) and by '@POLICY' to pick
    that drafter's verify policy (e.g. 'runs/x/final+ngram@scheduled')."""
    from specdraft.decode.proposers import PROPOSERS
    from specdraft.decode.proposers.hybrid import HYBRID_KINDS
    from specdraft.decode.scheduler import VERIFY_POLICIES
    from specdraft.reference import reference_drafter

    common: dict[str, Any] = {
        "num_draft_tokens": num_draft_tokens,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "draft_dtype": draft_dtype,
        "forward_path": forward_path,
        "lookup_corpus": lookup_corpus,
    }
    name, _, policy = text.partition("@")
    if policy:
        VERIFY_POLICIES.get(policy)
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
    elif hybrid:
        raise SpecdraftError(f"drafter {text!r}: '{hybrid}' follows a checkpoint directory or 'reference', and {name!r} is neither")
    elif name in ("ngram", "suffix", "none"):
        decode = DecodeConfig(drafter=name, **common)
    else:
        raise SpecdraftError(f"drafter {name!r} is neither 'ngram', 'suffix', 'reference' nor a checkpoint directory")
    return DrafterSpec(drafter_label(decode, policy or None), decode, policy or None)


def split_label(item: str) -> tuple[str, str]:
    """'LABEL=DRAFTER' -> (LABEL, DRAFTER); ('', item) without a label. A label holds no '/', so a path with '=' in a
    directory name (runs/lr=3e-4/final) is no label; write ./lr=3e-4/final where the first name holds one."""
    label, sep, text = item.partition("=")
    if not sep or "/" in label:
        return "", item
    if not label or not text:
        raise SpecdraftError(
            f"{setting('drafters')} item {item!r}: a labelled drafter is LABEL=DRAFTER, both non-empty (e.g. a=runs/a/final)"
        )
    return label, text


def resolve_drafters(items: list[str], **options: Any) -> list[DrafterSpec]:
    """``--drafters`` items (``resolve_drafter``, each optionally ``LABEL=DRAFTER``) with distinct labels.

    Two items that are the same drafter (``DrafterSpec.identity``) are refused: a label does not make another.
    Unlabelled checkpoints whose labels would be equal (runs/a/final, runs/b/final) are named by the shortest
    path suffix that tells them apart (dspark:a/final, dspark:b/final). A given label must be unique and
    not 'autoregressive', the baseline every drafter is compared with.
    """
    labelled = [split_label(item) for item in items]
    given = [label for label, _ in labelled]
    specs = [resolve_drafter(text, **options) for _, text in labelled]
    first: dict[tuple, str] = {}
    for item, spec in zip(items, specs):
        if spec.identity in first:
            raise SpecdraftError(f"{setting('drafters')} names the same drafter twice ({first[spec.identity]!r} and {item!r}); drop one")
        first[spec.identity] = item

    def deeper(i: int) -> bool:  # a checkpoint's label can name one more directory
        path = specs[i].decode.drafter_path
        return bool(path) and depth[i] < len(Path(os.path.abspath(path)).parts)

    depth = [1] * len(specs)
    while True:
        labels = [label or drafter_label(spec.decode, spec.verify_policy, d) for label, spec, d in zip(given, specs, depth)]
        alike = [i for i, label in enumerate(labels) if not given[i] and labels.count(label) > 1 and deeper(i)]
        if not alike:
            break
        for i in alike:
            depth[i] += 1
    for i, label in enumerate(labels):
        if label == AUTOREGRESSIVE or labels.index(label) != i:
            other = "the baseline (autoregressive decoding)" if label == AUTOREGRESSIVE else repr(items[labels.index(label)])
            raise SpecdraftError(
                f"{setting('drafters')}: {items[i]!r} is labelled {label!r}, as is {other}; give it another label (LABEL=DRAFTER)"
            )
    return [dataclasses.replace(spec, label=label) for spec, label in zip(specs, labels)]


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
    from specdraft.eval.report import write_report
    from specdraft.utils.provenance import write_provenance

    setup_started = time.perf_counter()  # the thread probe, decoder builds and warm-ups count against --max-time too
    setup = _set_up(config, sampling, scheduler, target)
    budget = _Budget.after_setup(config.max_time, setup_started)
    sweep = _decode(config, setup, budget, greedy=sampling.greedy, progress=progress)
    per_prompt = _per_prompt(setup, sweep, config.concurrency)
    if budget.cut:
        log.warning("--max-time %.0f s: evaluated %d of %d prompts", config.max_time, len(per_prompt), len(setup.prompts))
    report = _report(config, sampling, scheduler, setup, sweep, budget, per_prompt)
    write_report(report, Path(config.out), plots=config.plots)
    write_provenance(
        config.out,
        config={"eval": config, "sampling": sampling, "scheduler": scheduler},
        target=report["target"],
        inputs=[config.prompts, config.lookup_corpus, *(s.decode.drafter_path for s in setup.specs)],
        measured=report,
    )
    return report


@dataclass
class _Setup:
    """What every decoder shares: the prompts (and their token ids, domain and length bucket), the target, the
    thread count and the decoders, autoregressive decoding first."""

    prompts: list[EvalPrompt]
    target: Target
    threads: Choice  # the thread count and why (``resolve_decode_threads``)
    specs: list[DrafterSpec]
    decoders: dict[str, SpeculativeDecoder]
    token_ids: list[list[int]]
    groups: list[tuple[str, int]]  # (domain, length bucket) per prompt


def _set_up(config: EvalConfig, sampling: SamplingConfig, scheduler: SchedulerConfig, target: Target | None) -> _Setup:
    """Load the prompts and the target, resolve the threads, then build and warm up every decoder."""
    from specdraft.decode.runtime import decoder_for_target, decoding_settings, drafter_settings, resolve_decode_threads
    from specdraft.targets import load_target

    prompts = load_prompts(None if config.prompts else config.suite, config.prompts or None, config.limit_per_domain or None)
    if target is None:
        target = load_target(config.target, dtype=config.dtype, device=config.device)
    # before any decoder is built: the SPS profile and the draft-dtype probe are measured at the count used
    threads = resolve_decode_threads(target, config.threads)
    specs = [
        resolve_drafter(
            "none", num_draft_tokens=0, max_new_tokens=config.max_new_tokens, seed=config.seed, forward_path=config.forward_path
        )
    ]  # one target: every decoder runs it on the same path
    specs += resolve_drafters(
        config.drafters,
        num_draft_tokens=config.num_draft_tokens,
        max_new_tokens=config.max_new_tokens,
        seed=config.seed,
        target=config.target,
        draft_dtype=config.draft_dtype,
        forward_path=config.forward_path,
        lookup_corpus=config.lookup_corpus,
    )
    decoders = {
        s.label: decoder_for_target(target, config=s.decode, sampling=sampling, scheduler=_scheduler_for(s, scheduler)) for s in specs
    }
    drafters = {label: drafter_settings(label, d.proposer) for label, d in decoders.items() if label != AUTOREGRESSIVE}
    dataclasses.replace(decoding_settings("eval", decoders[AUTOREGRESSIVE], threads), drafters=drafters).log()
    token_ids = [p.token_ids(target.tokenizer) for p in prompts]
    groups = [(p.domain, length_bucket(len(ids))) for p, ids in zip(prompts, token_ids)]
    warmup = token_ids[0][-16:]
    for decoder in decoders.values():  # first calls pay one-off costs (allocator, lazy init)
        decoder.generate([warmup])
    return _Setup(prompts, target, threads, specs, decoders, token_ids, groups)


@dataclass
class _Budget:
    """``--max-time`` over the decoding (what setup took is already spent): a batch starts only while one more
    batch of the average time so far fits."""

    started: float
    max_time: float  # 0: no limit
    done: int = 0  # batches started
    cut: bool = False  # a batch was left out for time

    @classmethod
    def after_setup(cls, max_time: float, setup_started: float) -> _Budget:
        started = time.perf_counter()
        return cls(started, max(max_time - (started - setup_started), 1e-9) if max_time else 0.0)

    def next_batch_fits(self) -> bool:
        elapsed = time.perf_counter() - self.started
        if self.max_time and self.done and elapsed + elapsed / self.done > self.max_time:
            self.cut = True
            return False
        self.done += 1
        return True


@dataclass
class _Level:
    """One concurrency level's metrics per decoder label, merged over its batches, and each batch's TPOT."""

    merged: dict[str, Any]
    by_domain: dict[str, dict[str, Any]]
    by_bucket: dict[str, dict[int, Any]]
    tpots: dict[str, list[float]]

    @classmethod
    def empty(cls, labels: list[str]) -> _Level:
        return cls(
            dict.fromkeys(labels),
            {label: {} for label in labels},
            {label: {} for label in labels},
            {label: [] for label in labels},
        )

    def add(self, label: str, domain: str, bucket: int, metrics: Any) -> None:
        self.tpots[label].append(metrics.time_per_output_token_s)
        self.merged[label] = metrics if self.merged[label] is None else self.merged[label].merge(metrics)
        groups: tuple[tuple[dict[str, dict[Any, Any]], str | int], ...] = ((self.by_domain, domain), (self.by_bucket, bucket))
        for grouped, key in groups:
            previous = grouped[label].get(key)
            grouped[label][key] = metrics if previous is None else previous.merge(metrics)


@dataclass
class _Sweep:
    """What decoding produced: ``outputs[concurrency][label][prompt index]`` and one record per (drafter, concurrency)."""

    outputs: dict[int, dict[str, dict[int, dict[str, Any]]]]
    records: list[RunRecord] = field(default_factory=list)


def _decode(config: EvalConfig, setup: _Setup, budget: _Budget, *, greedy: bool, progress: bool) -> _Sweep:
    """Every concurrency level in turn, until the time budget cuts one short before its autoregressive baseline ran."""
    from tqdm import tqdm

    sweep = _Sweep({c: {label: {} for label in setup.decoders} for c in config.concurrency})
    total = sum(len(_batches(setup.groups, c)) for c in config.concurrency) * len(setup.decoders)
    bar = tqdm(total=total, desc="eval", unit="batch", disable=not progress)
    for concurrency in config.concurrency:
        level = _decode_level(setup, concurrency, budget, sweep.outputs[concurrency], bar)
        if level.merged[AUTOREGRESSIVE] is None:  # the time limit came before this concurrency level started
            break
        sweep.records += _level_records(level, concurrency, sweep.outputs[concurrency], greedy=greedy)
    bar.close()
    return sweep


def _decode_level(setup: _Setup, concurrency: int, budget: _Budget, outputs: dict[str, dict[int, dict[str, Any]]], bar: Any) -> _Level:
    """Each batch of ``concurrency`` prompts by every decoder, in an order rotated per batch; fills ``outputs``."""
    order = list(setup.decoders)
    level = _Level.empty(order)
    for batch in _batches(setup.groups, concurrency):
        if not budget.next_batch_fits():
            break
        domain, bucket = setup.groups[batch[0]]
        shift = budget.done % len(order)
        for label in order[shift:] + order[:shift]:
            result = setup.decoders[label].generate([setup.token_ids[i] for i in batch])
            level.add(label, domain, bucket, result.metrics)
            for i, out, tau in zip(batch, result.outputs, result.metrics.request_tau):
                outputs[label][i] = {"tokens": out.tokens, "finish_reason": out.finish_reason, "tau": tau}
            bar.update(1)
            bar.set_postfix(drafter=label, c=concurrency)
    return level


def _level_records(level: _Level, concurrency: int, outputs: dict[str, dict[int, dict[str, Any]]], *, greedy: bool) -> list[RunRecord]:
    """One record per decoder of a level, each against the autoregressive baseline on the same batches."""
    from specdraft.eval.report import macro_tau, paired_ratios, tau_distribution

    baseline = level.merged[AUTOREGRESSIVE]
    records = []
    for label, metrics in level.merged.items():
        ratios = paired_ratios(level.tpots[label], level.tpots[AUTOREGRESSIVE])
        same = None
        if greedy:
            same = sum(out["tokens"] == outputs[AUTOREGRESSIVE][i]["tokens"] for i, out in outputs[label].items())
        per_domain = {d: m.to_json() for d, m in sorted(level.by_domain[label].items())}
        records.append(
            RunRecord(
                drafter=label,
                concurrency=concurrency,
                overall=metrics.to_json(),
                per_domain=per_domain,
                per_bucket={bucket_label(b): m.to_json() for b, m in sorted(level.by_bucket[label].items())},
                tau_distribution=tau_distribution([out["tau"] for out in outputs[label].values()]),
                macro_tau=macro_tau(per_domain),
                speedup=metrics.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None,
                median_tpot_s=statistics.median(level.tpots[label]),
                tpot_vs_autoregressive=statistics.median(ratios) if ratios else None,
                batch_tpot_s=level.tpots[label],
                identical_to_autoregressive=same,
            )
        )
    return records


def _per_prompt(setup: _Setup, sweep: _Sweep, concurrencies: list[int]) -> list[dict[str, Any]]:
    """Each decoded prompt with every decoder's output at every concurrency (prompts the time limit left out are dropped)."""
    per_prompt = []
    for i, prompt in enumerate(setup.prompts):
        entry = {**prompt.to_json(), "prompt_tokens": len(setup.token_ids[i]), "outputs": {}}
        for concurrency in concurrencies:
            for label in setup.decoders:
                out = sweep.outputs[concurrency][label].get(i)
                if out is not None:
                    text = setup.target.tokenizer.decode(out["tokens"], skip_special_tokens=True)
                    entry["outputs"].setdefault(label, {})[str(concurrency)] = {**out, "text": text}
        if entry["outputs"]:
            per_prompt.append(entry)
    return per_prompt


def _report(
    config: EvalConfig,
    sampling: SamplingConfig,
    scheduler: SchedulerConfig,
    setup: _Setup,
    sweep: _Sweep,
    budget: _Budget,
    per_prompt: list[dict[str, Any]],
) -> dict[str, Any]:
    """``report.json``: the settings, each decoder's resolved facts, the records and the per-prompt outputs."""
    return {
        "format": "specdraft.eval_report",
        "format_version": 1,
        "target": setup.target.describe(),
        "config": asdict(config),
        "sampling": asdict(sampling),
        "scheduler": asdict(scheduler),
        "drafters": {s.label: {**asdict(s.decode), **_dtype_facts(s, setup.decoders[s.label].proposer)} for s in setup.specs},
        **setup.threads.facts("threads"),
        "target_forward_path": setup.decoders[AUTOREGRESSIVE].forward_path.to_json(),
        "num_prompts": len(per_prompt),
        "prompts_planned": len(setup.prompts),
        "cut_by_time": budget.cut,
        "wall_s": time.perf_counter() - budget.started,
        "runs": [asdict(r) for r in sweep.records],
        "prompts": per_prompt,
    }
