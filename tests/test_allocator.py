"""The CLI's glibc malloc settings (specdraft/utils/allocator.py), applied in a subprocess so the test
process keeps its own allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = "from specdraft.utils.allocator import tune_malloc; print(tune_malloc())"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_malloc_settings_apply_on_glibc_and_can_be_turned_off():
    env = {k: v for k, v in os.environ.items() if k != "SPECDRAFT_MALLOC_TUNING"}
    on = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run(
        [sys.executable, "-c", CHECK], env={**env, "SPECDRAFT_MALLOC_TUNING": "0"}, capture_output=True, text=True, check=True
    )
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")
