"""Replace assistant replies by the target's own answers (self-distillation data for drafters).

Why: a drafter is scored on how often the *target* agrees with it, so it should learn the target's
distribution, not the human/ChatGPT replies in the source data.

Prompts are sorted by length and cut into batches of ``batch_size``; each finished batch is
written atomically as ``<work>/batch-NNNNNN.json`` and reused on a rerun, so a killed job resumes
where it stopped. The work directory is keyed by everything that determines the output (target,
prompts, decoding settings, engine), so a changed setting never reuses stale batches. Sampling
(temperature > 0) seeds batch i with ``seed + i``, so a resumed run produces the same tokens as an
uninterrupted one.

Engines (:data:`REGENERATION_ENGINES`, ``--engine``) run the pending batches: ``hf`` is one
left-padded ``generate`` per batch in this process; ``vllm`` keeps ``batch_size`` requests in
flight on a private vLLM server (continuous batching, ``integrations/vllm/generate.py``, which
registers it here with its :class:`ServerEngine` when the integrations load) and is started only
when some batch is pending. HF generates on ``--forward-path`` (``auto``: the path on which a short generate of the
probe prompts ran fastest here, measured once per machine and cached, ``tuning/forward_path.py``; figures in
``docs/results/machine_tuning.md``). Paths are exact up to float reassociation, so the work directory's key leaves the path out
and a rerun on another path reuses the finished batches.

``--engine auto`` (:func:`resolve_engine`) picks the engine that regenerates more of the data
within the budget on this machine: it times one batch of real prompts with HF and, where a vLLM
environment exists, with a vLLM server, whose start-up is timed too (it can take minutes, so with
a small budget HF can win although vLLM generates faster). Each engine generates 1 and then
``PROBE_TOKENS`` new tokens per prompt, which separates its first token (the prefill) from its later
ones, so its rate is predicted at ``--max-new-tokens`` rather than read off a probe that the prefill
dominates. Tuning decides (``tuning/engines.py``): it caches the figures per machine and settings and remakes the
decision from them for each budget and answer length. A server the probe started is kept for the regeneration when
vLLM wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError
from specdraft.registry import Registry
from specdraft.targets.base import Target
from specdraft.tuning.engines import PROBE_TOKENS, decide_engine, first_and_step
from specdraft.tuning.settings import Choice, MachineSettings, TimedWork, resolve_choices
from specdraft.utils.io import atomic_write_json

log = logging.getLogger(__name__)

#: (batch index, prompt ids of its rows); an engine answers (batch index, completion ids per row).
Batch = tuple[int, list[list[int]]]


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int
    temperature: float  # 0 = greedy
    batch_size: int
    seed: int
    engine: str = "hf"


@dataclass(frozen=True)
class EngineRequest:
    """Everything an engine needs besides the batches."""

    target: Target  # hf runs its model; vllm serves its directory
    pad_id: int
    eos_ids: frozenset[int]
    settings: GenerationSettings
    vllm_python: str | None = None
    vllm_args: str = ""
    server: Any = None  # a vLLM server the engine probe started and left running for the vllm engine (the caller stops it)
    forward_path: str = "auto"  # how hf runs the target's forwards (``tuning/forward_path.py``; auto: timed on a generate here)


@dataclass
class GenerationStats:
    generated_tokens: int = 0  # produced in this run (reused batches excluded)
    seconds: float = 0.0  # generating, engine start-up excluded
    engine_start_seconds: float = 0.0
    reused_batches: int = 0
    generated_batches: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


#: ``--engine`` name -> fn(request, pending batches) -> context manager yielding an iterator of
#: (batch index, completions) in the order batches finish; each completion is cut after its first
#: token in ``request.eos_ids``. Entering the context starts the engine.
EngineRun = Callable[[EngineRequest, list[Batch]], AbstractContextManager[Iterator[Batch]]]
REGENERATION_ENGINES: Registry[EngineRun] = Registry("regeneration engine")


@dataclass(frozen=True)
class ServerEngine:
    """What ``--engine auto`` needs of an engine that runs as a server in an environment of its own: it times one."""

    locate: Callable[[str | None], Any]  # the environment's interpreter (the explicit one or the default); SpecdraftError where none
    version: Callable[[Any], str]  # the engine's version in that environment (keys the cached figures)
    start: Callable[..., Any]  # (request, batches, *, startup_timeout) -> a started server (``.stop()``), sized for the batches
    probe: Callable[[Any, EngineRequest, list[list[int]]], list[list[int]]]  # (server, request, prompts) -> one batch's completions


#: engine name -> its :class:`ServerEngine`; ``vllm`` is registered by ``integrations/vllm/generate.py``.
SERVER_ENGINES: Registry[ServerEngine] = Registry("server engine")


def work_key(target_fingerprint: str, prompts: list[tuple[str, list[int]]], settings: GenerationSettings) -> str:
    keyed = dict(settings.__dict__)
    if keyed["engine"] == "hf":  # hf keys predate --engine: work directories of earlier runs stay resumable
        del keyed["engine"]
    h = hashlib.sha256(json.dumps([target_fingerprint, keyed], sort_keys=True).encode())
    for sample_id, ids in prompts:
        h.update(sample_id.encode() + b"\0" + json.dumps(ids).encode() + b"\n")
    return h.hexdigest()[:16]


def cut_at_eos(tokens: list[int], eos_ids: set[int] | frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-turn token."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    return tokens[:cut]


def generate_batch(
    model: Any, prompts: list[list[int]], *, pad_id: int, eos_ids: set[int], settings: GenerationSettings, seed: int
) -> list[list[int]]:
    """Completions (each cut after its first end-of-turn token) for left-padded prompts."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    sampling = settings.temperature > 0
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens,
        do_sample=sampling,
        temperature=settings.temperature if sampling else None,
        top_k=0 if sampling else None,
        top_p=1.0 if sampling else None,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids),
    )
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device), generation_config=config)
    return [cut_at_eos(row, eos_ids) for row in out[:, width:].tolist()]


@REGENERATION_ENGINES.register("hf")
@contextlib.contextmanager
def _hf_engine(request: EngineRequest, batches: list[Batch]) -> Iterator[Iterator[Batch]]:
    s = request.settings
    yield (
        (
            index,
            generate_batch(
                request.target.model, prompts, pad_id=request.pad_id, eos_ids=set(request.eos_ids), settings=s, seed=s.seed + index
            ),
        )
        for index, prompts in batches
    )


#: The generate that the forward-path and thread-count probes of HF regeneration time: each probe prompt cut to its
#: last ``STEP_PROBE_PROMPT_TOKENS`` tokens, then ``STEP_PROBE_TOKENS`` new ones. Decoding steps, what regeneration
#: spends its time on, weigh most, and short prompts keep the probe of every path a small share of a quickstart's
#: data budget, where whole prompts (a prefill-bound probe) cost several times more (``docs/results/machine_tuning.md``).
STEP_PROBE_PROMPT_TOKENS = 64
STEP_PROBE_TOKENS = 8


@dataclass
class EngineChoice:
    engine: str
    server: Any = None  # the probe's vLLM server when vllm won (the caller stops it)
    facts: dict[str, Any] = field(default_factory=dict)  # what decided it, for the prepared dataset's summary

    def settings(self) -> MachineSettings:
        """The regeneration's machine settings (``tuning/settings.py``): the engine and, where HF generates here, its
        forward path and thread count; ``prepare`` logs them in one block."""
        return MachineSettings(
            "prepare",
            forward_path=Choice.from_facts(self.facts, "forward_path"),
            threads=Choice.from_facts(self.facts, "threads"),
            engine=Choice(self.engine, str(self.facts.get("engine_source"))),
        )


def probe_prompts(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """One batch of prompts spread over the length range (batches are cut by length, so the first is the shortest)."""
    ordered = sorted(prompts, key=len)
    return ordered[:: max(1, len(ordered) // batch_size)][:batch_size]


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _hf_generate(request: EngineRequest, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    settings = dataclasses.replace(request.settings, max_new_tokens=tokens)
    return generate_batch(
        request.target.model, prompts, pad_id=request.pad_id, eos_ids=set(request.eos_ids), settings=settings, seed=settings.seed
    )


def _place_hf(request: EngineRequest, probe: list[list[int]], *, threads: int, cache_dir: Path | None) -> tuple[dict[str, Any], str]:
    """Put HF generation on its forward path (``request.forward_path``; ``auto``: the fastest decoding steps of the probe
    prompts here, cached) and then its thread count (``threads``; 0: measured the same way, on that path). Returns the
    facts for the summary and the path's version (the engine probe's HF figures are taken on it)."""
    from specdraft.tuning.forward_path import PathChoice, path_version

    short = [p[-STEP_PROBE_PROMPT_TOKENS:] for p in probe]
    context = {
        "work": "hf-generate",
        "target": request.target.fingerprint,
        "rows": len(short),
        "prompt_tokens": max(map(len, short)),
        "tokens": STEP_PROBE_TOKENS,
    }

    def steps() -> float:  # seconds per generated token
        started = time.perf_counter()
        out = _hf_generate(request, short, STEP_PROBE_TOKENS)
        return (time.perf_counter() - started) / max(1, sum(map(len, out)))

    warm: list[float] = []

    def path_seconds(_dtype: str) -> float:
        if not warm:  # the process's first generate pays one-off set-up: not on the first path's account
            warm.append(steps())
        return steps()

    work = TimedWork(
        "regenerate",
        context,
        seconds_in=path_seconds,
        run=lambda _dtype: steps(),
        model=request.target.model,
        device=next(request.target.model.parameters()).device,
    )
    choices = resolve_choices("prepare", work, forward_path=request.forward_path, threads=threads, cache_dir=cache_dir)
    path = choices.chosen("forward_path")
    facts = {**PathChoice(path.value, path.source, dict(path.seconds)).to_json(), **choices.chosen("threads").facts("threads")}
    return facts, path_version(path.value)


def resolve_engine(
    request: EngineRequest, prompts: list[list[int]], *, requested: str, threads: int, deadline: float | None, cache_dir: Path | None = None
) -> EngineChoice:
    """The engine of ``--engine`` (``auto``: measured, see the module docstring) and, where HF generates in this
    process, its forward path and CPU thread count (``_place_hf``; the model is left on that path)."""
    probe = probe_prompts(prompts, request.settings.batch_size)
    facts, hf_path = _place_hf(request, probe, threads=threads, cache_dir=cache_dir) if requested in ("hf", "auto") else ({}, "")
    if requested != "auto":
        return EngineChoice(requested, facts={**facts, "engine_source": "flag"})
    found = _vllm_environment(request)
    if isinstance(found, str):
        return EngineChoice("hf", facts={**facts, "engine_source": found})
    vllm, python = found
    return _race_engines(request, prompts, probe, vllm, python, facts=facts, hf_path=hf_path, deadline=deadline, cache_dir=cache_dir)


def _vllm_environment(request: EngineRequest) -> tuple[ServerEngine, Any] | str:
    """The vLLM engine and its environment's interpreter, or why ``auto`` has only HF here. An explicit
    ``--vllm-python`` that is not a vLLM environment is an error, not a quiet fall-back."""
    if "vllm" not in SERVER_ENGINES:
        return "no vLLM integration loaded: hf, the only engine here"
    vllm = SERVER_ENGINES.get("vllm")
    try:
        return vllm, vllm.locate(request.vllm_python)
    except SpecdraftError:
        if request.vllm_python:
            raise
        return "no vLLM environment found: hf, the only engine here"


def _race_engines(
    request: EngineRequest,
    prompts: list[list[int]],
    probe: list[list[int]],
    vllm: ServerEngine,
    python: Any,
    *,
    facts: dict[str, Any],
    hf_path: str,
    deadline: float | None,
    cache_dir: Path | None,
) -> EngineChoice:
    """``auto`` where vLLM is installed: the engine that regenerates more within the budget (``decide_engine``: cached,
    or measured on ``probe``); a vLLM server the measurement started is kept only where vLLM won."""
    settings = request.settings
    started: list[Any] = []
    context = {
        "target": request.target.fingerprint,
        "rows": len(probe),
        "tokens": [1, PROBE_TOKENS],
        "temperature": settings.temperature,
        "vllm": vllm.version(python),
        "vllm_args": request.vllm_args,
        "hf_forward_path": hf_path,
    }
    try:
        decision = decide_engine(
            context,
            _engine_timings(request, prompts, probe, vllm, deadline=deadline, started=started),
            rows=len(probe),
            max_new_tokens=settings.max_new_tokens,
            prompts=len(prompts),
            budget_left=lambda: None if deadline is None else max(0.0, deadline - time.monotonic()),
            server_running=lambda: bool(started),
            device=next(request.target.model.parameters()).device,
            cache_dir=cache_dir,
        )
    except BaseException as exc:
        for server in started:  # a probe that failed (or was interrupted) after the start leaves no server behind
            server.stop()
        if not isinstance(exc, _NoVllm):
            raise
        # not cached: a later run with more budget (or a fixed environment) measures again
        log.warning("--engine auto: regenerating with hf, vLLM could not be measured: %s", exc)
        return EngineChoice("hf", facts={**facts, "engine_source": f"hf: vLLM not measured ({exc})"})
    server = started[0] if started and decision.engine == "vllm" else None
    if started and server is None:
        started[0].stop()
    return EngineChoice(
        decision.engine,
        server,
        {
            **facts,
            "engine_source": "cached" if decision.cached else "measured",
            "engine_figures": decision.figures,
            "engine_plan": decision.plan,
        },
    )


def _engine_timings(
    request: EngineRequest, prompts: list[list[int]], probe: list[list[int]], vllm: ServerEngine, *, deadline: float | None, started: list
) -> Callable[[], dict[str, float]]:
    """What ``decide_engine`` calls when nothing is cached: HF's and vLLM's first-token and per-token times on
    ``probe``, and the vLLM server's start (the server is appended to ``started``); ``_NoVllm`` where vLLM cannot be
    timed (no budget left for a start, or a server that fails)."""
    settings = request.settings

    def on_vllm(tokens: int) -> float:
        return _timed(
            lambda: vllm.probe(
                started[0], dataclasses.replace(request, settings=dataclasses.replace(settings, max_new_tokens=tokens)), probe
            )
        )

    def measure() -> dict[str, float]:
        hf_first, hf_step = first_and_step(lambda tokens: _timed(lambda: _hf_generate(request, probe, tokens)))
        t0 = time.perf_counter()
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise _NoVllm("the budget ran out before a vLLM server could be started")
        try:
            started.append(vllm.start(request, [(0, prompts)], startup_timeout=left or 600.0))
            start_s = time.perf_counter() - t0
            vllm_first, vllm_step = first_and_step(on_vllm, caches_prefixes=True)
        except SpecdraftError as exc:  # vLLM is broken here: HF regenerates
            raise _NoVllm(str(exc).splitlines()[0]) from None
        return {"hf_first_s": hf_first, "hf_step_s": hf_step, "vllm_first_s": vllm_first, "vllm_step_s": vllm_step, "vllm_start_s": start_s}

    return measure


class _NoVllm(Exception):
    """vLLM could not be timed here (no time left, or its server failed to start)."""


def regenerate(
    request: EngineRequest,
    prompts: list[tuple[str, list[int]]],
    *,
    work_dir: Path,
    progress: bool = True,
    deadline: float | None = None,
) -> tuple[dict[str, list[int]], GenerationStats]:
    """``{sample_id: completion ids}`` for ``(sample_id, prompt ids)`` pairs, resuming from ``work_dir``.

    With a ``deadline`` (``time.monotonic()`` value) no batch is started after it: samples of the
    batches left out are missing from the result (finished batches are kept, so a rerun resumes).
    """
    from tqdm.auto import tqdm

    settings = request.settings
    open_engine = REGENERATION_ENGINES.get(settings.engine)
    work_dir.mkdir(parents=True, exist_ok=True)
    prompts = sorted(prompts, key=lambda p: len(p[1]))  # similar lengths share a batch: less padding
    batches = [prompts[start : start + settings.batch_size] for start in range(0, len(prompts), settings.batch_size)]
    stats = GenerationStats()
    results: dict[str, list[int]] = {}
    pending: list[Batch] = []
    for index, batch in enumerate(batches):
        completions = _load_batch(_batch_path(work_dir, index), [sample_id for sample_id, _ in batch], int(request.target.vocab_size))
        if completions is None:
            pending.append((index, [ids for _, ids in batch]))
        else:
            stats.reused_batches += 1
            results.update(zip((sample_id for sample_id, _ in batch), completions))
    if not pending or (deadline is not None and time.monotonic() >= deadline):
        return results, stats

    bar = tqdm(total=len(prompts), initial=len(results), unit="sample", desc=f"regenerate ({settings.engine})", disable=not progress)
    t0 = time.perf_counter()
    with open_engine(request, pending) as finished:
        stats.engine_start_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        for index, completions in finished:
            ids = [sample_id for sample_id, _ in batches[index]]
            atomic_write_json(_batch_path(work_dir, index), {"sample_ids": ids, "completions": completions})
            results.update(zip(ids, completions))
            stats.seconds = time.perf_counter() - t0
            stats.generated_tokens += sum(len(c) for c in completions)
            stats.generated_batches += 1
            bar.update(len(ids))
            bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", reused=stats.reused_batches)
            if deadline is not None and time.monotonic() >= deadline:
                break
    bar.close()
    return results, stats


def _batch_path(work_dir: Path, index: int) -> Path:
    return work_dir / f"batch-{index:06d}.json"


def _load_batch(path: Path, sample_ids: list[str], vocab_size: int) -> list[list[int]] | None:
    """A finished batch, or None when it is absent, for other samples or damaged, and is to be generated again.

    A batch is reused only when it is what ``regenerate`` writes: a JSON object with these sample ids and one list of
    token ids of this vocabulary per sample. A truncated, edited or foreign file would otherwise fail the rerun with a
    traceback, or with ids out of range on every rerun, since the same file would be read again; it costs a batch
    instead, with a WARNING naming the file.
    """
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or bytes that are not UTF-8
        _damaged(path, f"it cannot be read ({exc})")
        return None
    if not isinstance(saved, dict):
        _damaged(path, f"it holds a JSON {type(saved).__name__}, not an object")
        return None
    if saved.get("sample_ids") != sample_ids:
        return None  # another batching of the prompts (a changed --batch-size): not this batch's work
    completions = saved.get("completions")
    if not isinstance(completions, list) or len(completions) != len(sample_ids):
        _damaged(path, f"it does not hold one completion per sample ({len(sample_ids)})")
        return None
    for reply in completions:
        if not isinstance(reply, list) or not all(type(t) is int and 0 <= t < vocab_size for t in reply):
            _damaged(path, f"a completion is not a list of token ids below the vocabulary size {vocab_size}")
            return None
    return completions


def _damaged(path: Path, why: str) -> None:
    log.warning("regeneration work %s is damaged: %s; generating that batch again", path, why)
