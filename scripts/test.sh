#!/usr/bin/env bash
# Runs the whole test suite (fast unit tests and the slow integration tests on the real target).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/bootstrap.sh
# Lint, format and type-check before the tests (settings: pyproject.toml [tool.ruff], [tool.mypy]); any failure fails the run.
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
.venv/bin/mypy
# The docs site (mkdocs.yml): broken links, missing pages or bad includes fail the build.
.venv/bin/mkdocs build --strict --quiet
exec .venv/bin/python -m pytest "$@"
