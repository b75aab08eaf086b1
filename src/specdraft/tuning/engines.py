"""The regeneration engine (``prepare --engine auto``): the one that regenerates more of the data within the budget here.

Which engine wins depends on the machine (HF's tokens/s in this process against a vLLM server's, and the minutes the
server takes to start), on the budget and on the answer length, so it is measured, never fixed: the data layer
(``data/regenerate.py``) times one batch of real prompts on each engine, 1 and then ``PROBE_TOKENS`` new tokens per
prompt (:func:`first_and_step` separates the first token, with the prefill, from the later ones), and this module
caches those figures per machine and settings (``tuning/measured.py``), predicts each engine's rate at
``--max-new-tokens`` (:func:`generation_rate`; a probe read as one rate is prefill-bound) and decides for the budget
left (:func:`choose_engine`). The decision is remade from the cached figures for each budget and answer length.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdraft.tuning.measured import measured_figures

log = logging.getLogger(__name__)

#: New tokens per reply in the engine probe's longer generate (its shorter one makes 1): enough steps to time the
#: step beside the prefill, few enough to stay cheap. A 16-token probe read as one rate is prefill-bound, well below
#: the rate a whole regeneration reaches (``docs/results/machine_tuning.md``).
PROBE_TOKENS = 16
#: The engines timed, with the figures the probe records for each: ``NAME_first_s``, ``NAME_step_s``.
ENGINES = ("hf", "vllm")


def generation_rate(first_s: float, step_s: float, *, rows: int, tokens: int) -> float:
    """Tokens/s of ``rows`` replies of ``tokens`` tokens generated together, where the first token of all costs
    ``first_s`` (with the prefill) and each later one ``step_s``: the probe's two generates fitted."""
    return rows * tokens / max(first_s + step_s * (tokens - 1), 1e-9)


def first_and_step(seconds: Callable[[int], float], *, caches_prefixes: bool = False) -> tuple[float, float]:
    """(seconds of a 1-token generate, seconds per further token) from ``seconds(1)`` and ``seconds(PROBE_TOKENS)``.
    An engine that ``caches_prefixes`` (a vLLM server) serves the second generate of the same prompts without their
    prefill, so the step is taken between two generates that both found them cached (a third, 1-token one): taken
    against the first, uncached one it reads several times too fast (``docs/results/machine_tuning.md``)."""
    first = seconds(1)
    longer = seconds(PROBE_TOKENS)
    shorter = seconds(1) if caches_prefixes else first
    return first, max(0.0, (longer - shorter) / (PROBE_TOKENS - 1))


def engine_plan(figures: dict[str, float], *, work_tokens: int, budget_s: float | None, server_running: bool) -> dict[str, dict]:
    """Per engine: the start-up still to pay, the seconds it would take for all ``work_tokens`` and the tokens it
    would generate within ``budget_s`` (None: no limit, all of them)."""
    plan = {}
    for name, start in (("hf", 0.0), ("vllm", 0.0 if server_running else figures["vllm_start_s"])):
        rate = max(figures[f"{name}_tokens_per_s"], 1e-9)
        tokens = work_tokens if budget_s is None else min(work_tokens, max(0.0, budget_s - start) * rate)
        plan[name] = {"start_s": round(start, 1), "seconds": round(start + work_tokens / rate, 1), "tokens": int(tokens)}
    return plan


def choose_engine(
    figures: dict[str, float], *, work_tokens: int, budget_s: float | None, server_running: bool, margin: float = 0.1
) -> tuple[str, dict[str, dict]]:
    """``(engine, plan)``: hf (in this process, nothing to start) unless vLLM regenerates clearly more of the data
    within the budget or, where both would finish it, finishes clearly sooner."""
    plan = engine_plan(figures, work_tokens=work_tokens, budget_s=budget_s, server_running=server_running)
    hf, vllm = plan["hf"], plan["vllm"]
    more = vllm["tokens"] > (1 + margin) * hf["tokens"]
    sooner = vllm["tokens"] >= hf["tokens"] and vllm["seconds"] < (1 - margin) * hf["seconds"]
    return ("vllm" if more or sooner else "hf"), plan


@dataclass(frozen=True)
class EngineDecision:
    """The engine chosen, the figures behind it (the probe's seconds and the predicted rates) and its plan."""

    engine: str
    figures: dict[str, float]
    plan: dict[str, dict]
    cached: bool
    path: Path


def decide_engine(
    context: dict[str, Any],
    measure: Callable[[], dict[str, float]],
    *,
    rows: int,
    max_new_tokens: int,
    prompts: int,
    budget_left: Callable[[], float | None],
    server_running: Callable[[], bool],
    device: Any = "cpu",
    cache_dir: Path | None = None,
) -> EngineDecision:
    """The engine that regenerates ``prompts`` replies of ``max_new_tokens`` more fully within ``budget_left()`` (seconds
    after the probe; None: no limit), from ``measure()``'s figures for one batch of ``rows`` prompts (``NAME_first_s``,
    ``NAME_step_s`` per engine and ``vllm_start_s``), taken once per machine and ``context``, then cached.
    ``server_running()``: whether the probe left a server started (its start is paid). ``measure`` may raise: nothing
    is cached then."""
    figures, cached, path = measured_figures("regen-engine", context, measure, device=device, cache_dir=cache_dir)
    rates = {
        f"{name}_tokens_per_s": generation_rate(figures[f"{name}_first_s"], figures[f"{name}_step_s"], rows=rows, tokens=max_new_tokens)
        for name in ENGINES
    }
    rates["vllm_start_s"] = figures["vllm_start_s"]
    work = prompts * max_new_tokens
    budget = budget_left()
    engine, plan = choose_engine(rates, work_tokens=work, budget_s=budget, server_running=server_running())
    log.info(
        "--engine auto: %s (%s; tokens/s at %d new tokens a reply: hf %.1f, vllm %.1f, vLLM start %.0f s; for %d tokens%s: %s; figures %s)",
        engine,
        "cached" if cached else "measured",
        max_new_tokens,
        rates["hf_tokens_per_s"],
        rates["vllm_tokens_per_s"],
        rates["vllm_start_s"],
        work,
        "" if budget is None else f" in {budget:.0f} s",
        plan,
        path,
    )
    return EngineDecision(engine, {**figures, **rates}, plan, cached, path)
