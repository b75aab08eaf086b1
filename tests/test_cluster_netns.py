"""``scripts/cluster.sh``: the seed's cluster on this machine, one network namespace per host.

Runs ``steady`` and ``producer-killed`` (a Mooncake master + memory holder, two producer hosts,
two trainer hosts running one torchrun job as two gloo ranks) and checks what the summary claims:
every planned sample delivered exactly once and in plan order on each rank, the store empty, the
final weights of the faulted run equal to the fault-free one, nothing of the run listening in the
root namespace, every namespace removed. Needs root and ``ip netns``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~3 min: five hosts load torch
REPO = Path(__file__).resolve().parents[1]


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "needs iproute2 (`ip`, `ss`)"
    probe = f"sdprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "`ip netns add` is not permitted here (no CAP_SYS_ADMIN?)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def test_cluster_steady_and_producer_killed(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cluster"
    done = subprocess.run(
        [
            "bash",
            str(REPO / "scripts/cluster.sh"),
            "--scenario",
            "steady,producer-killed",
            "--out",
            str(out),
            "--samples",
            "24",
            "--timeout",
            "420",
        ],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())

    assert {h["role"].split()[0] for h in summary["hosts"]} == {"mooncake", "producer", "trainer"}
    addresses = [h["address"] for h in summary["hosts"]]
    assert len(set(addresses)) == 5 and all(a.startswith("10.213.") for a in addresses)
    assert all("default" not in route for route in summary["routes"].values())  # nothing can route out
    for name in ("steady", "producer-killed"):
        s = summary["scenarios"][name]
        assert s["completed"], s
        assert s["delivered"] == s["samples_expected"] > 0 and s["duplicated"] == 0 and s["lost"] == 0, s
        assert s["each_rank_in_plan_order"] == [True, True], s
        assert s["store_keys_left"] == 0, s
    killed = summary["scenarios"]["producer-killed"]
    assert killed["faults"] and killed["faults"][0].startswith("FAULT: SIGKILL")
    assert killed["final_weights_max_abs_diff_vs_steady"] == 0.0  # same samples, same order, same hidden states
    listening = summary["listening"]
    assert listening["root_namespace_samples"] > 0 and listening["root_namespace_listeners_of_this_run"] == []
    assert any(a.startswith("10.213.") for a in listening["inside_namespaces"]["master"])
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h["ns"] in left for h in summary["hosts"])


def test_cluster_fsdp_job_killed_on_one_host_resumes_exactly(tmp_path):
    """FSDP2 across the two trainer hosts (the drafter sharded, not replicated): every process of trainer-1 is
    killed after the first checkpoint, the same two commands resume it, and the epoch ends with every sample
    delivered once and the final weights bit-identical to the fault-free FSDP run."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cluster"
    argv = ["bash", str(REPO / "scripts/cluster.sh"), "--scenario", "steady,trainer-killed", "--parallel", "fsdp"]
    done = subprocess.run(
        [*argv, "--out", str(out), "--samples", "48", "--timeout", "420"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    scenarios = json.loads((out / "summary.json").read_text())["scenarios"]
    for s in scenarios.values():
        assert s["completed"] and s["delivered"] == s["samples_expected"] > 0, s
        assert s["duplicated"] == 0 and s["lost"] == 0 and s["each_rank_in_plan_order"] == [True, True], s
        assert s["store_keys_left"] == 0, s
    killed = scenarios["trainer-killed"]
    assert killed["faults"][0].startswith("FAULT: SIGKILL") and killed["resumed_from_step"] >= 2, killed
    assert killed["return_codes"][-1] == [0, 0] and killed["final_weights_max_abs_diff_vs_steady"] == 0.0, killed


def test_cluster_sequence_parallel_across_two_hosts_equals_one_process_and_resumes_exactly(tmp_path):
    """``train --sequence-parallel 2`` as one job over the two trainer hosts (each sample split in two, one half per
    host) trains as one process does, to float32 rounding, and a run killed on one host resumes bit for bit."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "cluster"
    done = subprocess.run(
        ["bash", str(REPO / "scripts/cluster.sh"), "--scenario", "sequence-parallel", "--out", str(out), "--samples", "48"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    sp = json.loads((out / "summary.json").read_text())["sequence_parallel"]
    assert sp["completed"] and sp["return_codes"]["two_hosts"] == [0, 0] and sp["return_codes"]["resumed"] == [0, 0], sp
    assert sp["steps"][0] == sp["steps"][1] > 2, sp
    assert sp["loss_max_abs_diff_vs_one_process"] < 1e-4 and sp["final_weights_max_abs_diff_vs_one_process"] < 1e-5, sp
    assert sp["faults"] and sp["resumed_from_step"] >= 2 and sp["resumed_final_weights_max_abs_diff_vs_uninterrupted"] == 0.0, sp
