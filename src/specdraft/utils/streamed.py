"""specdraft's streamed linear: a few rows times a weight, at a GEMV's memory traffic (``native/streamed_linear.cpp``).

Why: a decode step multiplies 1-9 rows by every weight matrix, so it is bound by reading the weights. On a
2-core AVX-512 VM, the part's probe (``forward_path.stream_rows``, which logs and caches its figures) timed a
pass over the embedded target's linears at 28.0 ms through oneDNN with prepacked weights and 20.8 ms through
this kernel at one row, 30.8 vs 19.2 ms at two; from 5 rows on oneDNN was faster. The forward path part
``streamed`` (``utils/forward_path.py``) uses it below the row count measured to pay on the machine at hand.

Built once per machine by the machine's own C++ compiler through torch's extension loader (its cache,
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, keyed by the source, torch and this module's
tag holding the CPU's feature flags, since the build targets the CPU it runs on). Where no compiler is found
or the build fails, :func:`streamed_ops` returns None, the reason is logged and kept in
:func:`build_failure`, and the path part does not apply.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "streamed_linear.cpp"
#: -ffp-contract=off and no fast-math keep each row's sum in one fixed order (see the source).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_failure: list[str] = []


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


@functools.lru_cache(maxsize=None)
def kernel_version() -> str:
    """The kernel's source and build flags, hashed: measurements taken with another kernel are not reused."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def streamed_ops() -> Any | None:
    """The built extension (``streamed_linear(x, weight, bias)``), or None where it cannot be built here."""
    from specdraft.utils.measured import machine_identity

    if _compiler() is None:
        return _failed("no C++ compiler found (set CXX, or install g++)")
    try:
        import ninja  # the build tool torch's loader drives; the wheel's binary may be off PATH outside an activated venv

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    from torch.utils.cpp_extension import load

    tag = hashlib.sha256(f"{machine_identity()['cpu_flags']}|{' '.join(CFLAGS)}".encode()).hexdigest()[:10]
    try:
        return load(name=f"specdraft_streamed_{tag}", sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # a compiler error, a missing tool: the path does not apply, other paths still run
        return _failed(f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}")


def _failed(reason: str) -> None:
    _failure.append(reason)
    log.warning("forward path part 'streamed' is unavailable: %s", reason)
    return None


def build_failure() -> str | None:
    """Why :func:`streamed_ops` returned None, if it did."""
    return _failure[-1] if _failure else None


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous, weight [N, K] contiguous -> [M, N] (no autograd: inference only)."""
    return streamed_ops().streamed_linear(x, weight, bias)
