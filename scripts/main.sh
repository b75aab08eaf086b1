#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct): see README.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
out="${1:-runs/main}"
.venv/bin/specdraft prepare --data sharegpt --max-samples 32 --regenerate --max-new-tokens 96 --out "$out/data"
.venv/bin/specdraft extract --dataset "$out/data" --method dspark --out "$out/hidden_states"
