#!/usr/bin/env bash
# The seed's cluster on one machine, one Linux network namespace per host (needs root and iproute2):
# a Mooncake master + memory holder, producer hosts running `specdraft serve-hidden-states`, and two
# trainer hosts running one `torchrun` job as two ranks. Every host's command line is recorded in
# OUT/summary.json ("commands"): read them as the recipe for a real cluster. Scenarios and what is
# checked: tests/cluster.py (the system test tests/test_cluster_netns.py runs it).
#   bash scripts/cluster.sh --scenario steady,producer-killed --out runs/cluster [--timeout 900]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="sdc$$"
limit=900
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) limit="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
cleanup() {
  # the Python side removes what it made; this catches a run killed before it could
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^${prefix}-" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  for link in $(ip -o link 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^${prefix}" || true); do
    ip link del "$link" 2>/dev/null || true
  done
}
trap cleanup EXIT
py="${PYTHON:-$root/.venv/bin/python}"
PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" timeout --signal=TERM --kill-after=30 "$limit" \
  "$py" "$root/tests/cluster.py" --prefix "$prefix" "${args[@]}"
