"""Turning an eval report into files a person reads: JSON, a Markdown table, PNG plots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdraft.eval.suites import bucket_label
from specdraft.tracking import TrackedRun, local_files, open_trackers, record_metrics
from specdraft.utils.io import DirKind, atomic_dir, atomic_path, atomic_write_bytes, atomic_write_json, json_field_is
from specdraft.utils.lengths import length_bucket
from specdraft.utils.provenance import PROVENANCE_FILE

# Both are replaced whole (``atomic_dir``): a rerun with fewer drafters or without plots leaves no stale file of the last
# one. ``.*.tmp`` are the partial files an older release, which wrote into the directory, left when it was killed.
#: What `specdraft eval` writes: its reports, plots and provenance (``utils/provenance.py``).
EVAL_DIR = DirKind(
    "specdraft eval run",
    "report.json",
    json_field_is("format", "specdraft.eval_report"),
    frozenset({"report.json", "report.md", PROVENANCE_FILE}),
    patterns=("*.png", ".*.tmp", *local_files()),
)
#: What `specdraft eval --parity` writes: its comparison, its provenance and one eval run per side and drafter.
PARITY_DIR = DirKind(
    "specdraft eval --parity run",
    "parity.json",
    json_field_is("format", "specdraft.parity_report"),
    frozenset({"parity.json", "parity.md", PROVENANCE_FILE}),
    patterns=("builtin-*", "served-*", ".*.tmp"),
)


def verify_length_histogram(metrics: dict[str, Any]) -> list[int]:
    """Rounds that verified exactly l drafts, for l = 0..K, from the per-position verified counts
    (``position_drafted[j]`` counts rounds that verified draft j+1, i.e. rounds with l > j)."""
    verified = list(metrics["position_drafted"])
    at_least = [metrics["rounds"], *verified, 0]
    return [at_least[l] - at_least[l + 1] for l in range(len(verified) + 1)]


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (drafter, concurrency) with the figures users compare."""
    rows = []
    for run in report["runs"]:
        m = run["overall"]
        rows.append(
            {
                "drafter": run["drafter"],
                "concurrency": run["concurrency"],
                "tau": m["tau"],
                "accept_rate": m["acceptance_rate"],
                "verify_len": m["drafted"] / m["rounds"] if m["rounds"] else 0.0,
                "drafting": m.get("drafting_fraction"),
                "tok_per_s": m["tokens_per_s"],
                "speedup": run["speedup"],
                "ttft_ms": m["mean_ttft_s"] * 1000,
                "tpot_ms": (run.get("median_tpot_s") or m["time_per_output_token_s"]) * 1000,  # median over batches when recorded
                "tpot_vs_ar": run.get("tpot_vs_autoregressive"),
                "identical": run["identical_to_autoregressive"],
            }
        )
    return rows


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def render_tables(report: dict[str, Any]) -> str:
    """Markdown: the overall table, then, at the first concurrency level, the per-domain and per-bucket tables, tau per
    request and the verify lengths chosen."""
    first = report["config"]["concurrency"][0]
    runs = [r for r in report["runs"] if r["concurrency"] == first]
    lines = [
        *_summary_table(report),
        *gate_floor_lines(report),
        "",
        compute_line(report),
        *_grouped_tables(runs, first),
        *_distribution_table(runs, first),
        *_verify_length_lines(runs, first),
    ]
    return "\n".join(lines) + "\n"


def _summary_table(report: dict[str, Any]) -> list[str]:
    """The title line and one row per (drafter, concurrency) of ``summary_rows``."""
    n = report["num_prompts"]
    planned = report.get("prompts_planned", n)
    prompts = f"{n} of {planned} prompts (--max-time reached)" if report.get("cut_by_time") else f"{n} prompts"
    lines = [
        f"# specdraft eval — target {report['target']['name']}, {prompts}, "
        f"max {report['config']['max_new_tokens']} new tokens, temperature {report['sampling']['temperature']}",
        "",
        "| drafter | concurrency | tau | acceptance | mean verify len | drafting | tok/s | speed-up | TTFT ms "
        "| TPOT ms (median) | TPOT vs AR | identical to AR |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary_rows(report):
        identical = "-" if r["identical"] is None else f"{r['identical']}/{n}"
        lines.append(
            f"| {r['drafter']} | {r['concurrency']} | {_fmt(r['tau'])} | {_fmt(r['accept_rate'])} | {_fmt(r['verify_len'])} "
            f"| {_fmt(r['drafting'])} | {_fmt(r['tok_per_s'])} | {_fmt(r['speedup'])}x | {_fmt(r['ttft_ms'], '.0f')} "
            f"| {_fmt(r['tpot_ms'], '.1f')} | {_fmt(r['tpot_vs_ar'], '.3f')} | {identical} |"
        )
    return lines


def _grouped_tables(runs: list[dict[str, Any]], first: int) -> list[str]:
    """Tau, speed-up and mean verify length per domain, then tau and speed-up per prompt-length bucket, one column per
    group; a table whose groups no run recorded is left out."""
    plain: dict[str, Any] = next((r for r in runs if r["drafter"] == "autoregressive"), {})

    def drafted(r: dict, group: str, key: str) -> dict:
        return m if (m := r.get(group, {}).get(key, {})).get("rounds") else {}

    def speedup(r: dict, group: str, key: str) -> str:
        m, base = r.get(group, {}).get(key, {}), plain.get(group, {}).get(key, {})
        return _fmt(m["tokens_per_s"] / base["tokens_per_s"]) + "x" if m and base.get("tokens_per_s") else "-"

    tables: list[tuple[str, str, Callable[[Any], list], Callable[[dict, str, Any], str]]] = [
        ("tau per domain", "per_domain", sorted, lambda r, g, d: _fmt(drafted(r, g, d).get("tau"))),
        ("speed-up over autoregressive per domain", "per_domain", sorted, speedup),
        (
            "mean verify length per drafting round, per domain",
            "per_domain",
            sorted,
            lambda r, g, d: _fmt(m["drafted"] / m["rounds"]) if (m := drafted(r, g, d)) else "-",
        ),
        # buckets keep the runner's order: by length
        ("tau per prompt-length bucket (tokens)", "per_bucket", list, lambda r, g, b: _fmt(drafted(r, g, b).get("tau"))),
        ("speed-up over autoregressive per prompt-length bucket (tokens)", "per_bucket", list, speedup),
    ]
    lines: list[str] = []
    for title, group, order, cell in tables:
        keys = order(dict.fromkeys(k for r in runs for k in r.get(group, {})))
        if keys:
            lines += [
                "",
                f"{title} (concurrency {first}):",
                "",
                "| drafter | " + " | ".join(keys) + " |",
                "| --- |" + " ---: |" * len(keys),
            ]
            lines += [
                f"| {r['drafter']} | " + " | ".join(cell(r, group, k) for k in keys) + " |"
                for r in runs
                if r["drafter"] != "autoregressive"
            ]
    return lines


def _distribution_table(runs: list[dict[str, Any]], first: int) -> list[str]:
    """Tau per request (``tau_distribution``) of each drafter that recorded it; nothing when none did."""
    distributions = [r for r in runs if r["drafter"] != "autoregressive" and r.get("tau_distribution")]
    if not distributions:
        return []
    lines = [
        "",
        f"tau per request (concurrency {first}; top-10% floor: the lowest tau among the best tenth of requests):",
        "",
        "| drafter | mean tau | macro tau over domains | median | p90 | top-10% floor | requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in distributions:
        d = r["tau_distribution"]
        lines.append(
            f"| {r['drafter']} | {_fmt(r['overall']['tau'])} | {_fmt(r.get('macro_tau'))} | {_fmt(d['median'])} "
            f"| {_fmt(d['p90'])} | {_fmt(d['top10_floor'])} | {d['requests']} |"
        )
    return lines


def _verify_length_lines(runs: list[dict[str, Any]], first: int) -> list[str]:
    """Per drafter, how many rounds verified exactly l drafts, and the steps its draft gate decoded without drafting."""
    lines = ["", f"verify lengths chosen per round (concurrency {first}; rounds that verified exactly l drafts):", ""]
    for r in runs:
        if r["drafter"] != "autoregressive":
            hist = verify_length_histogram(r["overall"])
            skipped = r["overall"].get("plain_steps", 0)
            lines.append(
                f"- {r['drafter']}: "
                + ", ".join(f"l={l}: {n}" for l, n in enumerate(hist) if n)
                + (f"; {skipped} steps decoded without drafting (draft gate)" if skipped else "")
            )
    return lines


def tau_distribution(taus: list[float | None]) -> dict[str, Any]:
    """Per-request tau as the seed's results state it: the median, the 90th percentile (interpolated) and the
    top-10% floor (the lowest tau among the best ceil(n/10) requests: one some request reached). Requests
    that never drafted (None) are left out."""
    import math
    import statistics

    values = sorted((t for t in taus if t is not None), reverse=True)
    if not values:
        return {"requests": 0, "median": None, "p90": None, "top10_floor": None}
    p90 = statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]
    return {
        "requests": len(values),
        "median": statistics.median(values),
        "p90": p90,
        "top10_floor": values[math.ceil(len(values) / 10) - 1],
    }


def macro_tau(per_domain: dict[str, dict[str, Any]]) -> float | None:
    """The mean of the domains' tau, each domain once (the pooled tau weighs domains by their rounds)."""
    taus = [m["tau"] for m in per_domain.values() if m.get("rounds")]
    return sum(taus) / len(taus) if taus else None


#: The most a closed draft gate may add to autoregressive decoding's median time per output token.
GATE_FLOOR = 1.03


def paired_ratios(times: list[float], baseline: list[float]) -> list[float]:
    """times[i] / baseline[i] for measurements of the same batch (or prompt), skipping empty baselines."""
    return [t / a for t, a in zip(times, baseline) if a > 0]


def gate_floor_lines(report: dict[str, Any]) -> list[str]:
    """For drafters whose draft gate decoded most steps plainly: their median time per output token
    against autoregressive decoding's, whether that stays within the floor's 3%, and the middle half of
    the per-batch ratios: on a shared CPU one batch's ratio moves by several percent, so a median of
    ten batches resolves the floor only to about that spread."""
    import statistics

    autoregressive = {r["concurrency"]: r.get("batch_tpot_s") or [] for r in report["runs"] if r["drafter"] == "autoregressive"}
    lines = []
    for run, r in zip(report["runs"], summary_rows(report)):
        if r["drafting"] is not None and r["drafting"] < 0.5 and r["tpot_vs_ar"] is not None:
            within = "within" if r["tpot_vs_ar"] <= GATE_FLOOR else "OVER"
            ratios = paired_ratios(run.get("batch_tpot_s") or [], autoregressive.get(r["concurrency"], []))
            spread = ""
            if len(ratios) >= 4:
                low, _, high = statistics.quantiles(ratios, n=4)
                spread = f"; middle half of {len(ratios)} batches {low - 1:+.1%} to {high - 1:+.1%}"
            lines.append(
                f"- draft gate floor, {r['drafter']} (c={r['concurrency']}): drafted in {r['drafting']:.0%} of steps, median TPOT "
                f"{r['tpot_vs_ar'] - 1:+.1%} vs autoregressive ({within} the {GATE_FLOOR - 1:.0%} floor{spread})"
            )
    return ["", *lines] if lines else []


def compute_line(report: dict[str, Any]) -> str:
    """How the run computed and why: CPU threads, the target's forward path, and each trained drafter's resolved
    forward path and draft dtype."""

    def why(source: str, seconds: dict | None, unit: float, suffix: str) -> str:
        figures = ", ".join(f"{k} {v * unit:.1f} {suffix}" for k, v in (seconds or {}).items())
        return f"{source}: {figures}" if figures else source

    parts = []
    if "threads" in report:
        parts.append(
            f"{report['threads']} CPU threads ({why(report.get('threads_source', '?'), report.get('threads_seconds'), 1e3, 'ms')})"
        )
    target_path = report.get("target_forward_path")
    if target_path:
        step_unit = "ms per plain + verify step, short and long context"
        parts.append(
            f"target forward {target_path['forward_path']} "
            f"({why(target_path['forward_path_source'], target_path.get('forward_path_seconds'), 1e3, step_unit)})"
        )
    for label, drafter in report.get("drafters", {}).items():
        if drafter.get("draft_dtype"):
            path = (
                f"; forward path {drafter['draft_forward_path']} "
                f"({why(drafter['draft_forward_path_source'], drafter.get('draft_forward_path_seconds'), 1e3, 'ms/round')})"
                if drafter.get("draft_forward_path")
                else ""
            )
            parts.append(
                f"{label} drafts in {drafter['draft_dtype']} "
                f"({why(drafter.get('draft_dtype_source', '?'), drafter.get('draft_dtype_seconds'), 1e3, 'ms/round')}{path})"
            )
    return "compute: " + ("; ".join(parts) if parts else "-")


def write_report(report: dict[str, Any], out: Path, *, plots: bool = True) -> list[Path]:
    """Write report.json, report.md and (optionally) plots into a fresh directory that then replaces ``out`` whole
    (``EVAL_DIR``), print the tables and mirror the summary to the ``--report-to`` trackers. Returns the paths written."""
    tables = render_tables(report)
    with atomic_dir(out, EVAL_DIR) as tmp:
        atomic_write_json(tmp / "report.json", report)
        atomic_write_bytes(tmp / "report.md", tables.encode())
        written = [tmp / "report.json", tmp / "report.md", *(write_plots(report, tmp) if plots else [])]
    print(tables)
    mirror_summary(report, out)
    return [out / path.name for path in written]


def summary_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The summary table as the numbers a tracker plots: ``eval/DRAFTER/cN/NAME`` per row (tau, accept_rate,
    tok_per_s, speedup, ...), and the prompts and wall time of the run."""
    rows = {
        f"{row['drafter']}/c{row['concurrency']}": {k: v for k, v in row.items() if k not in ("drafter", "concurrency")}
        for row in summary_rows(report)
    }
    return record_metrics({"split": "eval", **rows, "num_prompts": report["num_prompts"], "wall_s": report["wall_s"]})


def mirror_summary(report: dict[str, Any], out: Path) -> None:
    """Mirror the summary, once, to the trackers the run's ``--report-to`` names; their local files go into ``out``
    after it is swapped in (``EVAL_DIR`` knows them), and a rerun replaces them with the report."""
    names = report["config"].get("report_to") or []
    if names:
        config = {**report["config"], **{key: report[key] for key in ("sampling", "scheduler") if key in report}}
        with open_trackers(names, TrackedRun(out, job="eval", config=config)) as trackers:
            trackers.log(summary_metrics(report), step=0)


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    """tau per domain per drafter; per-position acceptance; throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    first = report["config"]["concurrency"][0]
    runs = [r for r in report["runs"] if r["concurrency"] == first and r["drafter"] != "autoregressive"]
    domains = sorted({d for r in runs for d in r["per_domain"]})

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(domains) + 2), 4))
    width = 0.8 / max(len(runs), 1)
    for j, r in enumerate(runs):
        xs = [i + j * width for i in range(len(domains))]
        ax.bar(xs, [r["per_domain"].get(d, {}).get("tau", 0.0) for d in domains], width, label=r["drafter"])
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(domains))], domains, rotation=30, ha="right")
    ax.set_ylabel("acceptance length tau (bonus incl.)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend()
    ax.set_title("tau per domain")
    paths.append(_save(fig, out / "tau_per_domain.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        acc = r["overall"]["position_acceptance"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["drafter"])
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | verified)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("per-position acceptance")
    paths.append(_save(fig, out / "position_acceptance.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["drafter"] for r in report["runs"]):
        points = sorted((r["concurrency"], r["overall"]["tokens_per_s"]) for r in report["runs"] if r["drafter"] == label)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.set_title("throughput vs concurrency")
    paths.append(_save(fig, out / "throughput_vs_concurrency.png"))
    if len({p["prompt_tokens"] for p in report["prompts"]}) > 1:
        paths.append(_tau_vs_context(report, first, out / "tau_vs_context.png"))
    return paths


def _tau_vs_context(report: dict[str, Any], concurrency: int, path: Path) -> Path:
    """Each request's tau against its prompt length (points) and each bucket's tau at its median length (line), per drafter."""
    import statistics

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for j, r in enumerate(r for r in report["runs"] if r["concurrency"] == concurrency and r["drafter"] != "autoregressive"):
        color = f"C{j}"
        points = [
            (p["prompt_tokens"], out["tau"])
            for p in report["prompts"]
            if (out := p["outputs"].get(r["drafter"], {}).get(str(concurrency))) and out.get("tau") is not None
        ]
        ax.scatter([x for x, _ in points], [y for _, y in points], s=12, alpha=0.4, color=color)
        lengths: dict[str, list[int]] = {}  # bucket -> its requests' prompt lengths
        for x, _ in points:
            lengths.setdefault(bucket_label(length_bucket(x)), []).append(x)
        line = sorted(
            (statistics.median(xs), r["per_bucket"][b]["tau"])
            for b, xs in lengths.items()
            if r.get("per_bucket", {}).get(b, {}).get("rounds")
        )
        ax.plot([x for x, _ in line], [y for _, y in line], marker="o", color=color, label=r["drafter"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("acceptance length tau (bonus incl.)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend()
    ax.set_title("tau vs context length (points: requests; line: per length bucket)")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
