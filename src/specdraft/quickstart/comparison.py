"""The final comparison: which decoders it runs (``eval_drafters``) and the reserve of the budget it needs,
measured here before any other stage (``size_eval``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdraft.quickstart.config import EVAL_MARGIN_S, QuickstartConfig
from specdraft.targets.base import Target

if TYPE_CHECKING:
    from specdraft.eval.config import EvalConfig
    from specdraft.tuning.budget_probes import DecoderCost
    from specdraft.tuning.settings import MachineSettings


def size_eval(config: QuickstartConfig, target: Target, train_config: Any, *, final: Path) -> dict:
    """The comparison's reserve, measured here (eval/budget.py, tuning/budget_probes.py): its decoders' worst-case round times (a
    fresh drafter of the recipe stands in for the one not trained yet) times its prompts and tokens,
    plus the margin for what its time limit does not cover."""
    from specdraft.decode.runtime import resolve_decode_threads, resolve_target_path
    from specdraft.decode.sps import load_or_measure_sps
    from specdraft.eval.budget import WARMUP_TOKENS, plain_overhead_seconds
    from specdraft.eval.config import EvalConfig
    from specdraft.eval.report import GATE_FLOOR
    from specdraft.eval.runner import AUTOREGRESSIVE
    from specdraft.eval.suites import load_prompts
    from specdraft.tuning.budget_probes import DecoderCost, estimate_eval_seconds, round_seconds
    from specdraft.tuning.settings import Choice, MachineSettings

    threads = resolve_decode_threads(target, config.threads)  # the count the comparison will decode at (cached)
    defaults = EvalConfig(out="-", drafters=["ngram"])  # the comparison's draft length for ngram, its draft dtype and forward path
    path = resolve_target_path(target, defaults.forward_path)  # the path the comparison will run the target on (cached)
    sps = load_or_measure_sps(target.model, fingerprint=target.fingerprint, forward_path=path.name)
    overhead = plain_overhead_seconds(target, sps)
    gated = round_seconds(sps, overhead_s=overhead, gate_floor=GATE_FLOOR)  # a scheduled drafter's bound does not depend on the drafter
    lookup = round_seconds(sps, overhead_s=overhead, verify_tokens=1 + defaults.num_draft_tokens)
    costs = [
        DecoderCost(AUTOREGRESSIVE, round_seconds(sps, overhead_s=overhead)),
        DecoderCost("ngram", lookup),
        DecoderCost("suffix", lookup),
    ]
    drafter_costs, drafter_choices = _drafter_costs(config, target, train_config, final, sps, defaults, overhead_s=overhead, gated_s=gated)
    costs += drafter_costs
    MachineSettings(
        "quickstart", forward_path=Choice(path.name, path.source, dict(path.seconds)), threads=threads, drafters=drafter_choices
    ).log()
    full = next(c.round_s for c in costs if c.label == "drafter@full")
    costs.append(DecoderCost("drafter+suffix", full))  # the hybrid at worst drafts and verifies a whole block every round
    prompts = load_prompts("quick", None, config.eval_prompts_per_domain)
    estimate = estimate_eval_seconds(
        [len(p.token_ids(target.tokenizer)) for p in prompts], config.eval_max_new_tokens, costs, sps, warmup_tokens=WARMUP_TOKENS
    )
    reserve = estimate["seconds"] + EVAL_MARGIN_S
    print(
        f"[quickstart] comparison reserve {reserve / 60:.1f} min: {len(prompts)} prompts x {config.eval_max_new_tokens} tokens, "
        "worst-case rounds " + ", ".join(f"{c.label} {c.round_s * 1e3:.0f} ms" for c in costs),
        flush=True,
    )
    return {
        "reserve_s": round(reserve, 1),
        "prompts": len(prompts),
        "plain_overhead_ms": round(overhead * 1e3, 2),
        "round_ms": {c.label: round(c.round_s * 1e3, 2) for c in costs},
        **estimate,
    }


def _drafter_costs(
    config: QuickstartConfig,
    target: Target,
    train_config: Any,
    final: Path,
    sps: Any,
    defaults: EvalConfig,
    *,
    overhead_s: float,
    gated_s: float,
) -> tuple[list[DecoderCost], dict[str, MachineSettings]]:
    """``size_eval``'s drafter rounds, each drafter's full block timed here (a fresh drafter of the recipe for the one not
    trained yet; the reference drafter when the comparison has it) and its scheduled rounds at the gate's bound
    (``gated_s``), with the settings each decodes at, for the machine-settings log."""
    from specdraft.decode.config import DecodeConfig
    from specdraft.decode.proposers.drafters import drafter_proposer
    from specdraft.decode.runtime import drafter_settings
    from specdraft.eval.budget import drafter_cost
    from specdraft.models.common.drafter import load_drafter
    from specdraft.reference import reference_drafter
    from specdraft.tuning.budget_probes import DecoderCost

    drafters = {"drafter": fresh_drafter(train_config, target)}
    if "reference@full" in eval_drafters(config, final):
        drafters["reference"] = load_drafter(reference_drafter(config.target), target=target)
    costs: list[DecoderCost] = []
    choices: dict[str, MachineSettings] = {}
    for name, drafter in drafters.items():
        proposer = drafter_proposer(drafter, DecodeConfig(drafter=drafter.method, num_draft_tokens=defaults.num_draft_tokens))
        costs.append(
            drafter_cost(
                f"{name}@full", proposer, sps, overhead_s=overhead_s, draft_dtype=defaults.draft_dtype, forward_path=defaults.forward_path
            )
        )
        costs.append(DecoderCost(f"{name}@scheduled", gated_s))
        choices[name] = drafter_settings(name, proposer)
    return costs, choices


def fresh_drafter(train_config: Any, target: Target) -> Any:
    """An untrained drafter of ``train_config``'s recipe for ``target``: it costs what the trained one will.
    Its draft vocabulary is the first ``draft_vocab_size`` ids (which tokens it holds does not change the cost)."""
    import torch

    from specdraft.models import METHODS
    from specdraft.train.plan import build_method_config

    spec = METHODS.get(train_config.method)
    torch.manual_seed(0)
    counts = torch.arange(target.vocab_size, 0, -1, dtype=torch.int64)
    return spec.build(build_method_config(spec, train_config.model), target, counts=counts)


def eval_drafters(config: QuickstartConfig, final: Path) -> list[str]:
    """ngram, suffix drafting (the run's own answers as its corpus), the freshly trained drafter (full block, scheduled,
    and in its hybrid with suffix drafting, which picks its own verify lengths) and, when specdraft ships one for the
    target, the reference drafter with the scheduler."""
    from specdraft.reference import REFERENCE_DRAFTERS

    drafters = ["ngram", "suffix", str(final), f"{final}@scheduled", f"{final}+suffix"]  # the hybrid picks its own verify lengths
    if config.compare_reference and config.target in REFERENCE_DRAFTERS:
        drafters += ["reference@full", "reference@scheduled"]
    return drafters
