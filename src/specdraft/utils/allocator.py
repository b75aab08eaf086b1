"""glibc malloc settings for long CPU jobs (training, evaluation), applied by the CLI at start-up.

With glibc's defaults a long PyTorch CPU process slows down as it runs: freed tensor buffers above the
dynamic mmap threshold go back to the kernel and every new one is faulted in again, and the heap top is
trimmed and regrown. ``benchmarks/train_drift.py`` measures it (100 DSpark steps, recipe settings, 2 threads):
anchors/s fell from 136 in the first quarter to 96 in the last with the defaults, and stayed 130-161 with these
settings (397 vs 304 s in all). Set ``SPECDRAFT_MALLOC_TUNING=0`` to keep the defaults.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value on 64-bit: buffers below it are reused from the heap
TRIM_THRESHOLD_BYTES = 2**31 - 1  # never give the heap top back mid-run


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds; False where there is no glibc or the user opted out."""
    if os.environ.get("SPECDRAFT_MALLOC_TUNING", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
