"""The figures of ``specdraft bench-serve`` and the files a person reads: pure functions over request records.

A request record is what the streaming client saw of one completion: its start, first-token and end times
(``time.perf_counter`` seconds) and the token ids it streamed. Per concurrency level:

* tokens/s per user: the mean over requests of tokens / (end - start), what one client experiences;
* throughput: all tokens of the level / its wall time, the time some request was in flight (``busy_time``);
* mean in flight: the sum of request latencies / wall time, so throughput = mean in flight x
  (tokens / summed latency) holds exactly; it reaches the concurrency only while the level keeps every
  client busy (more requests than clients, no stragglers);
* TTFT: first streamed token - start; TPOT: (end - first token) / (tokens - 1), per request;
* tau and acceptance per draft position from vLLM's counters, read before and after the level
  (``metrics.SpecDecodeCounters``): tau = 1 + accepted / drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.integrations.vllm.metrics import SpecDecodeCounters
from specdraft.utils.vllm_options import OPEN_END, format_draft_schedule

#: Relative logit gap (|logit(plain token) - logit(served token)| / max |logit|) under which a divergence is a near-tie of
#: the serving dtype: fp32 kernels that batch or order sums differently move logits by ~1e-6 relative; bf16 carries 8
#: significant bits (2^-8 relative per rounding) and its errors add up over the layers.
NEAR_TIE = {"float32": 1e-4, "float16": 2.0**-9, "bfloat16": 2.0**-6}


@dataclass(frozen=True)
class RequestRecord:
    """One streamed completion as the client saw it."""

    index: int  # the prompt's position in the suite
    domain: str
    started: float
    first_token: float | None
    ended: float
    tokens: tuple[int, ...]
    counters: SpecDecodeCounters | None = None  # this request's own counter delta, when it ran alone

    @property
    def latency(self) -> float:
        return self.ended - self.started

    @property
    def ttft(self) -> float:
        return (self.first_token if self.first_token is not None else self.ended) - self.started

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None for replies of one token)."""
        return (self.ended - self.first_token) / (len(self.tokens) - 1) if self.first_token is not None and len(self.tokens) > 1 else None

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.latency if self.latency > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(seconds: list[float]) -> dict[str, float]:
    """Mean, median, p90 and p99 of ``seconds``, in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {"mean": sum(ms) / len(ms) if ms else math.nan, **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def spec_figures(counters: SpecDecodeCounters) -> dict[str, Any] | None:
    """tau, acceptance and acceptance per draft position of a counter delta; None where nothing was drafted."""
    drafts = counters.num_drafts
    if not drafts:
        return None
    return {
        "drafts": int(drafts),
        "draft_tokens": int(counters.num_draft_tokens),
        "accepted": int(counters.num_accepted_tokens),
        "tau": counters.mean_accepted_length,
        "acceptance_rate": counters.acceptance_rate,
        "position_acceptance": [a / drafts for a in counters.accepted_per_position],
    }


def summed(deltas: list[SpecDecodeCounters]) -> SpecDecodeCounters:
    """The counts of several workloads together (their counter deltas added)."""
    width = max(len(d.accepted_per_position) for d in deltas)

    def padded(d: SpecDecodeCounters) -> tuple[float, ...]:
        return d.accepted_per_position + (0.0,) * (width - len(d.accepted_per_position))

    return SpecDecodeCounters(
        sum(d.num_drafts for d in deltas),
        sum(d.num_draft_tokens for d in deltas),
        sum(d.num_accepted_tokens for d in deltas),
        tuple(map(sum, zip(*map(padded, deltas)))),
    )


def busy_time(records: list[RequestRecord]) -> float:
    """Seconds during which at least one request was in flight (the union of their intervals): the level's wall time
    without the pauses between back-to-back requests in which the client reads the server's counters."""
    total, reach = 0.0, -math.inf
    for r in sorted(records, key=lambda r: r.started):
        total += max(0.0, r.ended - max(r.started, reach))
        reach = max(reach, r.ended)
    return total


def timing_figures(records: list[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Per-user rate, throughput, in-flight mean, TTFT and TPOT of a set of requests run within ``wall_s``."""
    tokens = sum(len(r.tokens) for r in records)
    latency = sum(r.latency for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "per_user_tok_s": sum(r.tokens_per_s for r in records) / len(records) if records else 0.0,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "mean_in_flight": latency / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": distribution_ms([r.ttft for r in records]),
        "tpot_ms": distribution_ms([t for r in records if (t := r.tpot) is not None]),
    }


def level_figures(records: list[RequestRecord], counters: SpecDecodeCounters) -> dict[str, Any]:
    """One server at one concurrency: timing overall and per domain, and the level's counter delta. A domain's tau is
    given where each of its requests carries its own counters (requests run one at a time)."""
    per_domain = {}
    for domain in sorted({r.domain for r in records}):
        mine = [r for r in records if r.domain == domain]
        own = [r.counters for r in mine if r.counters is not None]
        total = summed(own) if own and len(own) == len(mine) else None
        per_domain[domain] = {
            **timing_figures(mine, sum(r.latency for r in mine)),
            "spec": spec_figures(total) if total is not None else None,
        }
    return {**timing_figures(records, busy_time(records)), "spec": spec_figures(counters), "per_domain": per_domain}


def speedups(levels: list[dict[str, Any]], plain: str) -> None:
    """Add, in place, each level's per-user speed-up and throughput ratio over the ``plain`` server at the same
    concurrency, overall and per domain (None where the plain server has no such level)."""
    base = {lv["concurrency"]: lv for lv in levels if lv["server"] == plain}

    def ratio(a: float, b: float | None) -> float | None:
        return a / b if b else None

    for lv in levels:
        ref = base.get(lv["concurrency"])
        lv["speedup"] = ratio(lv["per_user_tok_s"], ref["per_user_tok_s"] if ref else None)
        lv["throughput_ratio"] = ratio(lv["throughput_tok_s"], ref["throughput_tok_s"] if ref else None)
        for domain, figures in lv["per_domain"].items():
            other = (ref or {}).get("per_domain", {}).get(domain)
            figures["speedup"] = ratio(figures["per_user_tok_s"], other and other["per_user_tok_s"])


def best_draft_schedules(variants: list[tuple[str, int, str]], levels: list[dict[str, Any]], plain: str) -> dict[str, str]:
    """Per drafter, the draft tokens per round that gave the most tokens/s per user at each measured concurrency, 0 where
    the ``plain`` server was faster, as a ``--draft-schedule`` (``variants``: drafter, k, server label). A level of c
    clients stands for batch size c (vLLM batches every running request) and covers the sizes up to the next level."""
    rate = {(lv["server"], lv["concurrency"]): lv["per_user_tok_s"] for lv in levels}
    concurrency = sorted({c for _, c in rate})
    schedules = {}
    for drafter in dict.fromkeys(d for d, _, _ in variants):
        options = [(0, plain), *((k, label) for d, k, label in variants if d == drafter)]
        entries: list[tuple[int, int, int]] = []
        for i, c in enumerate(concurrency):
            k = max(options, key=lambda option: rate.get((option[1], c), -math.inf))[0]
            last = concurrency[i + 1] - 1 if i + 1 < len(concurrency) else OPEN_END
            if entries and entries[-1][2] == k:
                entries[-1] = (entries[-1][0], last, k)
            else:
                entries.append((entries[-1][1] + 1 if entries else 1, last, k))
        schedules[drafter] = format_draft_schedule(entries)
    return schedules


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def judge_divergence(logits: list[float], plain_token: int, served_token: int, dtype: str) -> dict[str, Any]:
    """Why two greedy replies part at one position, from the fp32 target's logits after their common prefix.

    A near-tie (the two tokens' logits within ``NEAR_TIE[dtype]`` of the logit scale) is the serving numerics
    deciding a coin flip. Otherwise it is flagged and named: the speculative server kept the fp32 target's choice
    where plain serving left it (plain serving's numerics moved the argmax), or it emitted a token the target ranks
    clearly below plain serving's (the verification, not the numerics, is suspect)."""
    scale = max(abs(x) for x in logits) or 1.0
    ranked = sorted(range(len(logits)), key=logits.__getitem__, reverse=True)
    pair_gap = logits[plain_token] - logits[served_token]
    relative = abs(pair_gap) / scale
    tie = relative <= NEAR_TIE[dtype]
    if tie:
        why = f"near-tie: the two tokens' fp32 logits differ by {abs(pair_gap):.3g} ({relative:.1e} of the logit scale)"
    elif served_token == ranked[0]:
        why = (
            f"plain serving left the fp32 target's argmax here (its token scores {-pair_gap:.3g} lower); "
            f"the speculative server kept the target's choice: {dtype} serving numerics, not the drafter"
        )
    else:
        why = (
            f"the speculative server emitted a token the fp32 target ranks {pair_gap:.3g} below plain serving's "
            f"(rank {ranked.index(served_token) + 1}): not a {dtype} near-tie; check the drafter's verification"
        )
    return {
        "plain_token": plain_token,
        "served_token": served_token,
        "top2_gap": logits[ranked[0]] - logits[ranked[1]],
        "pair_gap": pair_gap,
        "relative_gap": relative,
        "near_tie": tie,
        "flagged": not tie,
        "why": why,
    }


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def render_markdown(report: dict[str, Any]) -> str:
    """The seed's table, one row per server and concurrency, then per-domain figures, acceptance per position and
    every divergence from plain serving with its explanation."""
    engine, setup = report["engine"], report["setup"]
    lines = [
        f"# specdraft bench-serve: target {setup['target']}, {setup['num_prompts']} prompts ({setup['suite']}), "
        f"{setup['max_new_tokens']} greedy tokens each (EOS ignored)",
        "",
        f"- engine: {engine['vllm']} ({'CPU' if engine['cpu_build'] else 'GPU'} build), dtype {setup['dtype']}, "
        f"engine flags `{' '.join(setup['engine_flags']) or '(none)'}`, "
        f"environment `{' '.join(f'{k}={v}' for k, v in engine['env'].items())}`",
        f"- servers: {'; '.join(s['label'] + ': ' + s['what'] for s in report['servers'])}",
        *(
            [f"- draft tokens by batch size (vLLM's num_speculative_tokens_per_batch_size): `{setup['draft_schedule']}`"]
            if setup.get("draft_schedule")
            else []
        ),
        *[f"- not run: {s['label']}: {s['why']}" for s in report["skipped"]],
        "- each level sends every prompt (cycled up to the concurrency) through that many streaming clients, after one "
        "warm-up request per server; speed-up = tokens/s per user over the plain server's at the same concurrency",
        "",
        "| server | concurrency | tokens/s per user | throughput tokens/s | speed-up | throughput vs plain | TTFT ms (p50) "
        "| TPOT ms (p50) | served tau (vLLM's counters) | acceptance | identical to plain |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for lv in report["levels"]:
        spec, agree = lv["spec"] or {}, lv.get("agreement")
        tau = f"{spec['tau']:.2f} ({spec['drafts']} drafts)" if spec else "-"
        same = f"{agree['identical']}/{agree['compared']}" if agree else "-"
        lines.append(
            f"| {lv['server']} | {lv['concurrency']} | {_fmt(lv['per_user_tok_s'], '.1f')} "
            f"| {_fmt(lv['throughput_tok_s'], '.1f')} | {_fmt(lv['speedup'], '.2f', 'x')} "
            f"| {_fmt(lv['throughput_ratio'], '.2f', 'x')} | {_fmt(lv['ttft_ms']['p50'], '.0f')} "
            f"| {_fmt(lv['tpot_ms']['p50'], '.1f')} | {tau} | {_fmt(spec.get('acceptance_rate'))} | {same} |"
        )
    if report.get("best_draft_schedules"):
        lines += [
            "",
            "Measured best draft tokens per round at each concurrency (0: plain serving was faster), as "
            "`specdraft serve --draft-schedule`: "
            + "; ".join(f"{drafter} `{schedule}`" for drafter, schedule in report["best_draft_schedules"].items()),
        ]
    first = min(lv["concurrency"] for lv in report["levels"])
    at_first = [lv for lv in report["levels"] if lv["concurrency"] == first]
    domains = sorted({d for lv in at_first for d in lv["per_domain"]})
    if domains:
        lines += [
            "",
            f"Per domain at concurrency {first}: tokens/s per user (speed-up; served tau where the server drafts):",
            "",
            "| server | " + " | ".join(domains) + " |",
            "| --- |" + " ---: |" * len(domains),
        ]
        for lv in at_first:
            cells = []
            for d in domains:
                f = lv["per_domain"].get(d)
                tau = f" tau {f['spec']['tau']:.2f}" if f and f["spec"] else ""
                cells.append(f"{f['per_user_tok_s']:.1f} ({_fmt(f['speedup'], '.2f', 'x')}){tau}" if f else "-")
            lines.append(f"| {lv['server']} | " + " | ".join(cells) + " |")
    drafting = [lv for lv in report["levels"] if lv["spec"]]
    if drafting:
        lines += ["", "Acceptance per draft position (vLLM's counters, delta over each level):", ""]
        lines += [
            f"- {lv['server']} @ {lv['concurrency']}: " + ", ".join(f"{a:.2f}" for a in lv["spec"]["position_acceptance"])
            for lv in drafting
        ]
    divergences = [(lv, d) for lv in report["levels"] for d in (lv.get("agreement") or {}).get("divergences", [])]
    lines += [
        "",
        f"Agreement with plain serving ({setup['dtype']}): {len(divergences)} divergent replies"
        + (", each at its first differing token, judged with the fp32 target in specdraft's runtime:" if divergences else "."),
        "",
    ]
    for lv, d in divergences:
        mark = "**FLAGGED** " if d["flagged"] else ""
        lines.append(
            f"- {mark}{lv['server']} @ {lv['concurrency']}, prompt {d['prompt_id']}, token {d['position']}: "
            f"plain {d['plain_token']} vs served {d['served_token']}, top-2 gap {d['top2_gap']:.3g}; {d['why']}"
        )
    return "\n".join(lines) + "\n"


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Tokens/s per user and total throughput against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for server in dict.fromkeys(lv["server"] for lv in report["levels"]):
        mine = [lv for lv in report["levels"] if lv["server"] == server]
        levels = [lv["concurrency"] for lv in mine]
        axes[0].plot(levels, [lv["per_user_tok_s"] for lv in mine], marker="o", label=server)
        axes[1].plot(levels, [lv["throughput_tok_s"] for lv in mine], marker="o", label=server)
    for ax, title in zip(axes, ("tokens/s per user", "total throughput, tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    setup = report["setup"]
    fig.suptitle(f"vLLM serving {setup['target']} ({setup['dtype']}, {report['engine']['vllm']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
