"""One launcher for the tests that run the real trainer in several gloo processes: ``torchrun`` on a test file whose
``__main__`` is the per-rank entry, one thread per process (the ranks share a few cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: int = 600) -> None:
    """Run ``script args...`` as ``nproc`` processes of one standalone ``torchrun``; fail with the ranks' errors."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args],
        cwd=TESTS,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 0, "\n".join(errors[:40]) + "\n" + proc.stderr[-4000:]
