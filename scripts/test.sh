#!/usr/bin/env bash
# The whole test suite on a fresh machine (this is what .ci/run calls).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m ruff check src tests benchmarks examples
python3 -m pytest -q "$@"
