"""Speed-dependent defaults measured on the machine at hand, not fixed in code or recipes.

Whether bf16 pays depends on the machine: CPUs without native bf16 arithmetic (AVX2-only) run a bf16 matmul
at a drafter's shapes many times slower than fp32, while AVX-512-BF16/AMX CPUs and GPUs run it faster
(``docs/results/machine_tuning.md``). So ``auto`` settings time the real work in each candidate once
and pick the fastest; the figures are cached as JSON under ``<cache>/measured/`` (``cache_root``,
through ``utils/cache.py``: verified on read, measured again where an entry is damaged, kept in memory
where the cache cannot be written), keyed by the machine and software (device, CPU model and flags,
torch version, threads) and by what was timed (e.g. the drafter's config and pack size), and logged
with the choice. An explicit setting always wins: callers measure only for ``auto``.

A candidate other than the preferred one (the exact one, fp32) must be faster by more than
``margin`` to be chosen, so timing noise on a shared machine does not flip a near tie. Each
figure is the fastest of a few repeats (interference only adds time); a decision measured under
heavy load still persists, so the log names the cache file: delete it to measure again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MEASURED_FORMAT = "specdraft-measured-v2"  # v1 had no checksum


@dataclass(frozen=True)
class Measurement:
    """Seconds per unit of work of each candidate, the choice made from them, and where they came from."""

    name: str
    seconds: dict[str, float]
    choice: str
    cached: bool = False
    path: str | None = None

    def describe(self) -> str:
        figures = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.seconds.items())
        return f"{self.name}: {self.choice} ({figures}; {'cached' if self.cached else 'measured'}{f' in {self.path}' if self.path else ''})"

    def to_json(self) -> dict[str, Any]:
        return {"choice": self.choice, "seconds": dict(self.seconds), "cached": self.cached}


@functools.cache
def _cpu() -> tuple[str, str]:
    """(CPU model name, hash of its feature flags) from /proc/cpuinfo, else what ``platform`` knows."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return model, hashlib.sha256(flags.encode()).hexdigest()[:16]


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_identity(device: Any = "cpu", *, threads: bool = True) -> dict[str, Any]:
    """What decides relative speeds besides the work itself: device, CPU model and flags, torch, and the
    thread count (``threads=False``: the cores available instead, for the probe that picks the count)."""
    import torch

    device = torch.device(device)
    model, flags = _cpu()
    identity: dict[str, Any] = {"device": device.type, "cpu": model, "cpu_flags": flags, "torch": torch.__version__}
    identity.update({"threads": torch.get_num_threads()} if threads else {"cores": available_cores()})
    if device.type == "cuda":
        identity["gpu"] = torch.cuda.get_device_name(device)
        identity["capability"] = list(torch.cuda.get_device_capability(device))
    return identity


def choose(seconds: dict[str, float], *, preferred: str, margin: float = 0.1) -> str:
    """The fastest candidate; ``preferred`` unless another takes less than (1 - margin) of its time."""
    if not seconds:
        raise ValueError("no candidates were timed")
    fastest = min(seconds, key=seconds.__getitem__)
    if preferred in seconds and seconds[fastest] >= (1.0 - margin) * seconds[preferred]:
        return preferred
    return fastest


def fastest_time(fn: Callable[[], Any], *, repeats: int = 2, sync: Callable[[], None] = lambda: None, warmup: bool = True) -> float:
    """Seconds of the fastest of ``repeats`` calls after one warm-up call (interference only adds time)."""
    if warmup:
        fn()
        sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


class _MeasuringClock:
    """Seconds this process spent inside measurements, outermost ones only (one that runs another counts once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.depth = 0

    def time(self, measure: Callable[[], dict[str, float]]) -> dict[str, float]:
        start = time.perf_counter()
        self.depth += 1
        try:
            return measure()
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.seconds += time.perf_counter() - start


_CLOCK = _MeasuringClock()


def measuring_seconds() -> float:
    """Seconds this process has spent taking measurements that :func:`measured_figures` caches. They are one-off costs:
    a stage timed while they ran was slower than the same stage will be once they are cached, so a rate meant to
    project later work (the quickstart's data split) leaves out the difference of this clock across the timing."""
    return _CLOCK.seconds


def measured_figures(
    name: str,
    context: dict[str, Any],
    measure: Callable[[], dict[str, float]],
    *,
    device: Any = "cpu",
    machine: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
    decide: Callable[[dict[str, float]], Any] | None = None,
) -> tuple[dict[str, float], bool, Path]:
    """``(figures, cached, cache file)``: ``measure()``'s figures, taken once per machine (``machine``,
    default :func:`machine_identity`) and ``context``, then read back from the cache (which also
    records ``decide(figures)``, the choice they gave, for whoever reads the file)."""
    from specdraft.utils.cache import cached
    from specdraft.utils.io import cache_root

    key = {"name": name, "machine": machine or machine_identity(device), "context": context}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = (cache_dir or cache_root()) / "measured" / f"{name}-{digest}.json"

    def build() -> dict[str, Any]:
        figures = {k: float(v) for k, v in _CLOCK.time(measure).items()}
        return {"seconds": figures, **({"choice": decide(figures)} if decide else {})}

    figures, was_cached = cached(path, build, format=MEASURED_FORMAT, key=key, what=f"measurement {name!r}", parse=_figures)
    return figures, was_cached, path


def _figures(value: dict[str, Any]) -> dict[str, float]:
    """A cached entry's figures: seconds, each finite and >= 0 (``ValueError`` otherwise: measured again)."""
    figures = {str(k): float(v) for k, v in value["seconds"].items()}
    if not figures or not all(math.isfinite(v) and v >= 0 for v in figures.values()):
        raise ValueError(f"seconds {figures} are not finite times")
    return figures


def measured_choice(
    name: str,
    context: dict[str, Any],
    timers: dict[str, Callable[[], float]],
    *,
    preferred: str,
    margin: float = 0.1,
    device: Any = "cpu",
    machine: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
) -> Measurement:
    """Time each candidate (``timers[c]()`` returns seconds per unit of work) once per machine and
    ``context``, cache the figures, log them and return the choice."""
    if len(timers) == 1:  # nothing to choose between: nothing to time
        return Measurement(name, {}, next(iter(timers)))
    context = {**context, "candidates": sorted(timers)}
    decide = functools.partial(choose, preferred=preferred, margin=margin)
    seconds, cached, path = measured_figures(
        name,
        context,
        lambda: {c: timer() for c, timer in timers.items()},
        device=device,
        machine=machine,
        cache_dir=cache_dir,
        decide=decide,
    )
    result = Measurement(name, seconds, decide(seconds), cached=cached, path=str(path))
    log.info("%s", result.describe())
    return result
