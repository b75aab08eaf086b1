"""The machine choices one stage runs with, resolved once at its start, logged in one block and passed down.

:func:`resolve_choices` is the one entry point that decides them: the layer that owns the work (a training step, a
decoding round, a generate) hands it in as :class:`TimedWork`, and the forward path, compute dtype and thread count
come back as a :class:`MachineSettings`. Each choice says where it came from, so a log (and a report) tells a figure
measured now from one read back from the cache (``tuning/measured.py``: delete the file to measure again) or one a
flag or config gave. A stage fills only the fields it uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdraft.errors import SpecdraftError

log = logging.getLogger(__name__)

#: How a choice was made, as the log words it (``flag``: the user's setting, never measured).
SOURCES = {
    "flag": "given",
    "measured": "measured now",
    "cached": "from cache",
    "only": "the only one that applies",
    "default": "default",
    "dry run": "dry run",
    "as given": "as given",
}


@dataclass(frozen=True)
class Choice:
    """One machine choice: its value, how it was made (a key of :data:`SOURCES`) and the seconds each candidate took."""

    value: Any
    source: str
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self, unit: float = 1e3, suffix: str = "ms") -> str:
        figures = ", ".join(f"{k} {v * unit:.1f} {suffix}" for k, v in self.seconds.items())
        return f"{self.value} ({SOURCES.get(self.source, self.source)}{f': {figures}' if figures else ''})"

    @classmethod
    def from_facts(cls, facts: dict[str, Any] | None, name: str) -> Choice | None:
        """A choice from the ``{name, name_source, name_seconds}`` facts reports record (None where ``name`` is absent)."""
        if not facts or facts.get(name) is None:
            return None
        return cls(facts[name], str(facts.get(f"{name}_source", "default")), dict(facts.get(f"{name}_seconds") or {}))

    def facts(self, name: str) -> dict[str, Any]:
        """What reports record (the inverse of :meth:`from_facts`): ``{name, name_source}`` and, where candidates were
        timed, ``name_seconds``."""
        return {name: self.value, f"{name}_source": self.source, **({f"{name}_seconds": dict(self.seconds)} if self.seconds else {})}


@dataclass(frozen=True)
class MachineSettings:
    """What a stage resolved: the target's (or the trained module's) forward path, the CPU thread count, the compute
    dtype, a drafter's own path and dtype (a comparison's several drafters: ``drafters``) and the regeneration engine.
    None: the stage does not use that choice."""

    stage: str
    forward_path: Choice | None = None
    threads: Choice | None = None
    compute_dtype: Choice | None = None
    draft_forward_path: Choice | None = None
    draft_dtype: Choice | None = None
    engine: Choice | None = None  # the regeneration engine (``tuning/engines.py``)
    drafters: dict[str, MachineSettings] = field(default_factory=dict)  # a comparison's drafters' own choices, by label

    def chosen(self, name: str) -> Choice:
        """The choice in field ``name``, which the caller asked ``resolve_choices`` for (so it is set, not None)."""
        choice = getattr(self, name)
        if not isinstance(choice, Choice):
            raise SpecdraftError(f"{self.stage} machine settings hold no {name.replace('_', ' ')}: it was not resolved")
        return choice

    def describe(self) -> str:
        lines = [f"{self.stage} machine settings:", *self._lines("")]
        for label, drafter in self.drafters.items():
            lines += drafter._lines(f"{label} ")
        return "\n".join(lines)

    def _lines(self, prefix: str) -> list[str]:
        return [
            f"  {prefix}{f.name.replace('_', ' ')}: {choice.describe()}"
            for f in fields(self)
            if isinstance(choice := getattr(self, f.name), Choice)
        ]

    def log(self) -> None:
        """The stage's one log block."""
        log.info("%s", self.describe())


@dataclass(frozen=True)
class TimedWork:
    """The work a stage's choices are timed on, handed in by the layer that owns it (this package imports none).

    ``name`` names the probes and their cache files (``forward-path-NAME``, ``NAME-dtype``, ``NAME-threads``) and
    ``context`` keys them with what was timed. ``seconds_in(dtype)``: seconds of one unit of the work in a compute dtype
    (the forward-path probe asks for fp32, on each path of ``model``); ``run(dtype)``: one unit of it, which the
    thread-count probe times itself. A stage that does not resolve a choice need not hand in what times it."""

    name: str
    context: dict[str, Any]
    seconds_in: Callable[[str], float] | None = None
    run: Callable[[str], Any] | None = None
    model: Any = None  # the nn.Module whose forward path is chosen
    device: Any = "cpu"


def resolve_choices(
    stage: str,
    work: TimedWork,
    *,
    forward_path: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
    cache_dir: Path | None = None,
) -> MachineSettings:
    """Resolve, in this order, the choices asked for (None: not this stage's): ``work.model``'s forward path, the
    compute dtype on that path, then the thread count at that dtype. A given value is used as given; ``auto`` (0 for
    threads) is measured on ``work`` once per machine and context, then cached. The model is left on its path and torch
    on its thread count. Each later probe's cache is keyed by the earlier choices (the path's version, the dtype), and the
    probes before the thread-count probe run at the count it prefers (``threads.default_threads_for_probes``)."""
    import torch

    from specdraft.tuning import dtype as dtypes
    from specdraft.tuning import forward_path as paths
    from specdraft.tuning import threads as thread_counts

    if threads is not None and (forward_path is not None or dtype is not None):
        thread_counts.default_threads_for_probes(threads)
    context, device = dict(work.context), torch.device(work.device)
    path_choice = dtype_choice = threads_choice = None
    if forward_path is not None:
        seconds_in = _needs(work.seconds_in, work, "seconds_in", "forward path")
        path = paths.resolve_path(work.model, forward_path, work.name, context, lambda: seconds_in("fp32"))
        path_choice = Choice(path.name, path.source, dict(path.seconds))
        context["forward_path"] = paths.path_version(path.name)
    chosen_dtype = dtype
    if dtype == "auto":
        measurement = dtypes.measure_dtype(
            f"{work.name}-dtype", context, _needs(work.seconds_in, work, "seconds_in", "dtype"), device=device, cache_dir=cache_dir
        )
        chosen_dtype = measurement.choice
        dtype_choice = Choice(measurement.choice, "cached" if measurement.cached else "measured", dict(measurement.seconds))
    elif dtype is not None:
        dtype_choice = Choice(dtype, "flag")
    if threads is not None:
        run = _needs(work.run, work, "run", "thread count")
        measured = thread_counts.resolve_threads(
            threads,
            f"{work.name}-threads",
            {**context, **({"dtype": chosen_dtype} if dtype is not None else {})},
            lambda: run(chosen_dtype or "fp32"),
            device=device,
            cache_dir=cache_dir,
        )
        threads_choice = Choice.from_facts(thread_counts.threads_facts(threads, measured), "threads")
    return MachineSettings(stage, forward_path=path_choice, threads=threads_choice, compute_dtype=dtype_choice)


def _needs(timer: Callable[..., Any] | None, work: TimedWork, field_name: str, choice: str) -> Callable[..., Any]:
    if timer is None:
        raise TypeError(f"TimedWork {work.name!r} has no {field_name}: the {choice} cannot be measured on it")
    return timer
