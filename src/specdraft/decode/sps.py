"""SPS(B): target forward steps per second when one forward carries B tokens.

The DSpark scheduler trades expected committed tokens against the cost of a wider verify
forward, so it needs the target's real speed curve on this device. It is measured once (a few
seconds) and cached as JSON per target fingerprint + device + dtype under
``<cache>/sps/`` (``$SPECDRAFT_CACHE`` or ``~/.cache/specdraft``), and per forward path
(``tuning/forward_path.py``): the scheduler must price verify widths on the path that runs them.
The cache goes through ``utils/cache.py``: a damaged profile is measured again, and one that cannot be
written (a read-only cache) is used from memory, both with a WARNING.

A profile taken while other jobs share the CPU can be wildly wrong, and a cached wrong profile
misleads every later run, so each point keeps the *fastest* of its repeats (interference only
ever adds time), forwards are timed the way the runtime calls the target (with an attention
mask), and step time is made non-decreasing in B: a wider forward is never reported cheaper.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdraft.errors import SpecdraftError

log = logging.getLogger(__name__)

SPS_FORMAT = "specdraft-sps-v3"  # v1 used medians without monotonicity, v2 had no checksum: re-measure


@dataclass(frozen=True)
class SpsTable:
    """Measured points (tokens[i], steps_per_second[i]); lookups interpolate the step *time* linearly.

    Beyond the largest measured B the time is extrapolated with the last segment's slope (never
    decreasing), so a scheduler is not told that wider forwards become free.
    """

    tokens: tuple[int, ...]
    steps_per_second: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.steps_per_second):
            raise SpecdraftError("an SPS table needs one steps/s value per measured token count, and at least one point")
        if list(self.tokens) != sorted(set(self.tokens)) or self.tokens[0] < 1:
            raise SpecdraftError(f"SPS token counts must be increasing and >= 1, got {list(self.tokens)}")
        if any(not s > 0 for s in self.steps_per_second):
            raise SpecdraftError(f"SPS values must be > 0, got {list(self.steps_per_second)}")

    def __call__(self, num_tokens: int) -> float:
        xs, times = self.tokens, [1.0 / s for s in self.steps_per_second]
        if num_tokens <= xs[0] or len(xs) == 1:
            return self.steps_per_second[0]
        i = bisect.bisect_left(xs, num_tokens)
        if i < len(xs) and xs[i] == num_tokens:
            return self.steps_per_second[i]
        lo, hi = (i - 1, i) if i < len(xs) else (len(xs) - 2, len(xs) - 1)
        slope = (times[hi] - times[lo]) / (xs[hi] - xs[lo])
        if i == len(xs):
            slope = max(slope, 0.0)
        return 1.0 / (times[lo] + slope * (num_tokens - xs[lo]))

    def to_json(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "steps_per_second": list(self.steps_per_second)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SpsTable:
        return cls(tuple(int(t) for t in obj["tokens"]), tuple(float(s) for s in obj["steps_per_second"]))


def default_token_counts(max_tokens: int) -> list[int]:
    """Every B up to 16 (where small-batch kernels change speed in steps), then powers of two."""
    counts = list(range(1, min(max_tokens, 16) + 1))
    b = 32
    while b <= max_tokens:
        counts.append(b)
        b *= 2
    if counts[-1] != max_tokens:
        counts.append(max_tokens)
    return counts


def sps_cache_path(
    cache_dir: Path, *, fingerprint: str, device: torch.device, dtype: torch.dtype, context_tokens: int, max_tokens: int, forward_path: str
) -> Path:
    """Keyed by the path's version (``forward_path.path_version``): a profile of an earlier kernel is not reused."""
    from specdraft.tuning.forward_path import path_version

    dtype_name = str(dtype).removeprefix("torch.")
    return (
        cache_dir / "sps" / f"{fingerprint}-{device.type}-{dtype_name}-{path_version(forward_path)}-ctx{context_tokens}-b{max_tokens}.json"
    )


@torch.no_grad()
def measure_sps(model: Any, *, token_counts: list[int], context_tokens: int = 256, repeats: int = 5) -> SpsTable:
    """Time one cached forward of B tokens after a ``context_tokens`` prefix, for each B (fastest of
    ``repeats``), with step times made non-decreasing in B."""
    from specdraft.decode.kv_cache import GrowingCache

    if context_tokens < 1 or repeats < 1 or not token_counts:
        raise SpecdraftError("SPS profiling needs context_tokens >= 1, repeats >= 1 and at least one token count")
    device = next(model.parameters()).device
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, context_tokens), generator=gen).to(device)
    # the runtime's cache: full-length attention layers (a sliding layer's cache cannot be cropped past its window), and
    # recurrent layers that record per column as a verify forward does, so the timing includes that cost
    cache = GrowingCache(model.config.get_text_config())
    model(input_ids=context, cache=cache, use_cache=True)
    step_times: list[float] = []
    for b in token_counts:
        block = torch.randint(0, vocab, (1, b), generator=gen).to(device)
        positions = torch.arange(context_tokens, context_tokens + b, device=device)[None]
        mask = torch.ones((1, context_tokens + b), dtype=torch.long, device=device)
        times = []
        for i in range(repeats + 1):  # the first run warms up kernels for this shape
            _sync(device)
            start = time.perf_counter()
            cache.record(b)
            model(input_ids=block, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            _sync(device)
            if i:
                times.append(time.perf_counter() - start)
            cache.rollback(torch.zeros(1, dtype=torch.long, device=device), b)
        step_times.append(max(min(times), step_times[-1] if step_times else 0.0))
    return SpsTable(tuple(token_counts), tuple(1.0 / t for t in step_times))


def load_or_measure_sps(
    model: Any,
    *,
    fingerprint: str,
    cache_dir: Path | None = None,
    max_tokens: int = 64,
    context_tokens: int = 256,
    repeats: int = 5,
    forward_path: str | None = None,
) -> SpsTable:
    """The cached SPS table for this target + device + dtype + forward path (default: the one the model is
    on now), measuring and caching it on first use."""
    from specdraft.tuning.forward_path import current_path, path_version
    from specdraft.utils.cache import cached
    from specdraft.utils.io import cache_root

    param = next(model.parameters())
    forward_path = forward_path or current_path(model)
    path = sps_cache_path(
        cache_dir or cache_root(),
        fingerprint=fingerprint,
        device=param.device,
        dtype=param.dtype,
        context_tokens=context_tokens,
        max_tokens=max_tokens,
        forward_path=forward_path,
    )
    key = {
        "fingerprint": fingerprint,
        "device": param.device.type,
        "dtype": str(param.dtype).removeprefix("torch."),
        "forward_path": path_version(forward_path),
        "context_tokens": context_tokens,
        "max_tokens": max_tokens,
    }

    def measure() -> dict[str, Any]:
        log.info("profiling target steps/s for forwards of 1..%d tokens (once per target and device)", max_tokens)
        table = measure_sps(model, token_counts=default_token_counts(max_tokens), context_tokens=context_tokens, repeats=repeats)
        return {"repeats": repeats, **table.to_json()}

    table, was_cached = cached(path, measure, format=SPS_FORMAT, key=key, what="SPS profile", parse=SpsTable.from_json)
    if was_cached and path not in _CHECKED:
        now = measure_sps(model, token_counts=[table.tokens[0]], context_tokens=context_tokens, repeats=3)
        if stale_profile(table, now):
            log.warning(
                "the cached SPS profile %s was taken on a busier machine: %.1f steps/s at %d token(s) cached, %.1f now; measuring again",
                path,
                table.steps_per_second[0],
                table.tokens[0],
                now.steps_per_second[0],
            )
            path.unlink(missing_ok=True)
            table, _ = cached(path, measure, format=SPS_FORMAT, key=key, what="SPS profile", parse=SpsTable.from_json)
    _CHECKED.add(path)
    return table


#: Profiles this process measured or spot-checked: the machine does not change under one run, so an eval building a
#: decoder per drafter spot-checks its profile once, not once per decoder.
_CHECKED: set[Path] = set()


#: How much slower than a spot check now a cached profile's first point may be before it is measured again.
STALE_FACTOR = 2.0


def stale_profile(cached: SpsTable, now: SpsTable) -> bool:
    """Whether ``cached`` was measured under load: its first point ``STALE_FACTOR`` times slower than a spot check of
    that point now. Interference only adds time, so a profile faster than the spot check stands (the machine is busy
    now, not then); one far slower would price every round of later runs wrong (a quickstart once refused its 20
    minutes on a profile taken under a 14x load)."""
    return cached.steps_per_second[0] * STALE_FACTOR < now.steps_per_second[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
