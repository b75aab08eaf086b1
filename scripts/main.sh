#!/usr/bin/env bash
# The main job on the embedded default target (SmolLM2-135M-Instruct): `specdraft quickstart`
# (prepare + regenerate, extract, train a DSpark drafter within the budget, calibrate, evaluate
# against autoregressive decoding and ngram). Extra arguments go to the quickstart, e.g. --budget 30.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
exec .venv/bin/specdraft quickstart "$@"
