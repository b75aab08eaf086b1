"""The torch CPU thread count: the user's, or for ``0`` (auto) the count whose real work ran fastest here.

torch's default (every core) is not always the fastest: on a busy shared CPU fewer threads than cores
can run faster (``docs/results/machine_tuning.md``), while an idle machine wants them all; small matmuls stop
scaling long before large ones do. So each command that computes on the CPU times a short piece of its own
work (a training step, a few decoding steps, a short generate) at each candidate count once per
machine and work (``tuning/measured.py``: the cache is keyed by the cores available, not the
current count), logs the figures and sets the fastest. Candidates are 1, 2, 4, ... and the number of
cores available; all cores is preferred unless another count is clearly faster. An explicit count
always wins and is never measured; GPU work keeps torch's default (its CPU threads barely matter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdraft.tuning.measured import Measurement, available_cores, fastest_time, machine_identity, measured_choice
from specdraft.utils.lengths import power_of_two_at_least

log = logging.getLogger(__name__)


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... below ``cores``, then ``cores`` itself: a few probes even on a 128-core machine."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [max(cores, 1)]


def set_threads(count: int) -> None:
    """``torch.set_num_threads(count)`` for a user's explicit count, refused with a ``SpecdraftError`` when it is
    negative or absurd (torch raises a bare RuntimeError below 1 and overflows on a huge one)."""
    import torch

    from specdraft.errors import SpecdraftError, setting

    most = 4 * max(available_cores(), 1)
    if not 1 <= count <= most:
        raise SpecdraftError(
            f"thread count {count} ({setting('threads', 'num_threads')}) must be 0 (auto) or 1..{most} "
            f"(4x the {available_cores()} "
            "cores available here)"
        )
    torch.set_num_threads(count)


def default_threads_for_probes(requested: int) -> None:
    """With ``requested`` 0 (auto), set the default count (every core this process may use, what
    :func:`resolve_threads` prefers) for the probes that run before the thread-count probe (a forward path, a dtype).
    They are timed, and their caches keyed, at the count they run at; otherwise that is whatever an earlier stage of
    the same process left, and every later stage measured them again."""
    if not requested:
        set_threads(available_cores())


def resolve_threads(
    requested: int,
    name: str,
    context: dict[str, Any],
    work: Callable[[], Any],
    *,
    device: Any = "cpu",
    repeats: int = 1,
    cache_dir: Path | None = None,
) -> Measurement | None:
    """Set torch's thread count: ``requested`` when > 0, else the candidate whose ``work()`` was fastest
    (measured once per machine and ``context``); returns the measurement (None when nothing was measured)."""
    import torch

    if requested:
        set_threads(requested)
        return None
    if torch.device(device).type != "cpu":
        return None
    cores = available_cores()
    warm: list[Any] = []

    def timer(count: int) -> Callable[[], float]:
        def run() -> float:
            torch.set_num_threads(count)
            if not warm:  # one warm-up call in all, at the first (cheapest) count: on a crowded CPU a call at the
                warm.append(work())  # wrong count can take 15x longer, so no candidate pays for one twice
            return fastest_time(work, repeats=repeats, warmup=False)

        return run

    timers = {str(n): timer(n) for n in thread_candidates(cores)}
    measurement = measured_choice(
        name,
        context,
        timers,
        preferred=str(cores),
        device=device,
        machine={**machine_identity(device, threads=False), "cores": cores},
        cache_dir=cache_dir,
    )
    torch.set_num_threads(int(measurement.choice))
    return measurement


def threads_facts(requested: int, measurement: Measurement | None) -> dict[str, Any]:
    """What reports and summaries record: the count used and why (flag, measured, cached, or torch's
    default where nothing was measured)."""
    import torch

    if measurement is None:
        return {"threads": torch.get_num_threads(), "threads_source": "flag" if requested else "default"}
    return {
        "threads": int(measurement.choice),
        "threads_source": "cached" if measurement.cached else "measured",
        "threads_seconds": measurement.seconds,
    }


def resolve_forward_threads(requested: int, model: Any, *, fingerprint: str, rows: int, tokens: int) -> Measurement | None:
    """:func:`resolve_threads` for work that is forward passes of ``model`` (hidden-state extraction and
    serving): timed on one no-grad forward of ``rows`` x ``tokens`` (rounded up to a power of two) random ids."""
    import torch

    param = next(model.parameters())
    tokens = power_of_two_at_least(tokens)
    ids: list[torch.Tensor] = []  # drawn on the first timed forward: a fixed --threads N never pays for (or overflows on) the probe's batch

    def forward() -> None:
        if not ids:
            generator = torch.Generator().manual_seed(0)
            ids.append(torch.randint(0, int(model.config.vocab_size), (rows, tokens), generator=generator).to(param.device))
        with torch.no_grad():
            model(input_ids=ids[0])

    context = {"work": "forward", "target": fingerprint, "dtype": str(param.dtype), "rows": rows, "tokens": tokens}
    return resolve_threads(requested, "forward-threads", context, forward, device=param.device)
