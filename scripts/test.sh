#!/usr/bin/env bash
# Runs the whole test suite (fast unit tests and the slow integration tests on the real target).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest "$@"
