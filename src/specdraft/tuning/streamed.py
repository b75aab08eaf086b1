"""specdraft's streamed linear: a few rows times a weight, at a GEMV's memory traffic (``native/streamed_linear.cpp``).

Why: a decode step multiplies 1-9 rows by every weight matrix, so it is bound by reading the weights, and oneDNN's
kernels for a few rows read them below the machine's bandwidth; from some row count on oneDNN is faster again. The
forward path part ``streamed`` (``tuning/forward_path.py``) uses this kernel below the row count its probe
(``forward_path.stream_rows``, which logs and caches its figures) measured to pay on the machine at hand; the
figures of one machine are in ``docs/results/machine_tuning.md``.

Built once per machine by the machine's own C++ compiler through torch's extension loader (its cache,
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, keyed by the source, torch and this module's
tag holding the CPU's feature flags, since the build targets the CPU it runs on). Where no compiler is found
or the build fails, :func:`streamed_ops` returns None, the reason is logged and kept in
:func:`build_failure`, and the path part does not apply: ``auto`` picks among the other forward paths.

A build is never waited on without bound. Torch's loader guards a build with a ``lock`` file that a killed
build leaves behind, and a later loader then waits for it forever; so a process builds only while holding
its own lock beside it (``utils/cache.build_lock``, which the kernel drops when the holder dies): a torch
``lock`` found while holding it has no live builder and is removed, with a WARNING. A process that cannot
take that lock within ``BUILD_WAIT_S`` runs without the kernel. And the library is loaded only where it
matches the sha256 its build stamp recorded (``utils/cache.py``); a library that does not (damaged, or built
before stamps) is rebuilt from scratch rather than imported.
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

from specdraft.errors import SpecdraftError
from specdraft.utils.cache import build_lock, holder_of, read_entry, write_entry
from specdraft.utils.io import sha256_file

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "streamed_linear.cpp"
#: -ffp-contract=off and no fast-math keep each row's sum in one fixed order (see the source).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
#: How long a process waits for another one building the kernel before it runs without it (a build compiles one file).
BUILD_WAIT_S = 300.0
BUILD_LOCK = "specdraft_build.lock"  # ours, in the build directory
TORCH_LOCK = "lock"  # torch's FileBaton, in the build directory
STAMP_FILE = "specdraft_build.json"
STAMP_FORMAT = "specdraft-kernel-stamp-v1"
_failure: list[str] = []


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


@functools.cache
def kernel_version() -> str:
    """The kernel's source and build flags, hashed: measurements taken with another kernel are not reused."""
    return hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:12]


@functools.cache
def extension_name() -> str:
    """The extension's name, which names its build directory: tagged with the CPU's feature flags and the build flags."""
    from specdraft.tuning.measured import machine_identity

    tag = hashlib.sha256(f"{machine_identity()['cpu_flags']}|{' '.join(CFLAGS)}".encode()).hexdigest()[:10]
    return f"specdraft_streamed_{tag}"


@functools.cache
def streamed_ops() -> Any | None:
    """The built extension (``streamed_linear(x, weight, bias)``), or None where it cannot be built here."""
    if _compiler() is None:
        _failed("no C++ compiler found (set CXX, or install g++)")
        return None
    try:
        import ninja  # the build tool torch's loader drives; the wheel's binary may be off PATH outside an activated venv

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass
    from torch.utils import cpp_extension

    name = extension_name()
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))  # torch's choice, $TORCH_EXTENSIONS_DIR first
        with build_lock(build_dir / BUILD_LOCK, timeout=BUILD_WAIT_S, what="the build of specdraft's streamed kernel") as held:
            if not held:
                _failed(f"process {holder_of(build_dir / BUILD_LOCK)} has been building it in {build_dir} for over {BUILD_WAIT_S:g} s")
                return None
            _take_over_stale_lock(build_dir)
            if not _stamped_build(build_dir, name):
                log.info("building specdraft's streamed kernel in %s (once per machine and CPU)", build_dir)
            ops = cpp_extension.load(
                name=name,
                sources=[str(SOURCE)],
                build_directory=str(build_dir),
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            write_entry(
                build_dir / STAMP_FILE,
                {"library": Path(ops.__file__).name, "sha256": sha256_file(ops.__file__)},
                format=STAMP_FORMAT,
                key=_stamp_key(name),
                what="streamed kernel build stamp",
            )
            return ops
    except Exception as exc:  # noqa: BLE001 - a compiler error, a missing tool: the path does not apply, other paths still run
        _failed(f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}")
        return None


def _take_over_stale_lock(build_dir: Path) -> None:
    """Remove torch's build ``lock`` that a killed build left (called holding ``BUILD_LOCK``, so no live build owns it)."""
    baton = build_dir / TORCH_LOCK
    if baton.exists():
        log.warning(
            "taking over the stale build lock %s: the build that made it is gone (no live process holds %s)", baton, build_dir / BUILD_LOCK
        )
        baton.unlink()


def _stamp_key(name: str) -> dict[str, str]:
    return {"extension": name, "kernel": kernel_version(), "torch": torch.__version__}


def _stamped_build(build_dir: Path, name: str) -> bool:
    """Whether ``build_dir`` holds a library that matches its build stamp. One that does not is removed with the rest
    of the build (all but our lock), so torch builds afresh instead of importing a damaged library (which can crash
    the process) or one of unknown provenance."""
    from torch.utils.cpp_extension import LIB_EXT

    library = build_dir / f"{name}{LIB_EXT}"
    if not library.exists():
        return False  # nothing built yet, or a build cut short that ninja finishes
    stamp = read_entry(build_dir / STAMP_FILE, format=STAMP_FORMAT, key=_stamp_key(name), what="streamed kernel build stamp")
    if stamp is not None and stamp.get("library") == library.name and stamp.get("sha256") == sha256_file(library):
        return True
    why = (
        "no build stamp that verifies (built by an earlier specdraft, or its build was cut short)"
        if stamp is None
        else "another sha256 than its build stamp records (damaged)"
    )
    log.warning("rebuilding specdraft's streamed kernel: %s has %s", library, why)
    for entry in build_dir.iterdir():
        if entry.name == BUILD_LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return False


def _failed(reason: str) -> None:
    _failure.append(reason)
    log.warning("forward path part 'streamed' is unavailable: %s", reason)


def build_failure() -> str | None:
    """Why :func:`streamed_ops` returned None, if it did."""
    return _failure[-1] if _failure else None


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous, weight [N, K] contiguous -> [M, N] (no autograd: inference only)."""
    ops = streamed_ops()
    if ops is None:
        raise SpecdraftError(f"the streamed kernel is unavailable here: {build_failure()}")
    return ops.streamed_linear(x, weight, bias)
