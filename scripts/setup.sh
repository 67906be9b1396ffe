#!/usr/bin/env bash
# Installs topomesh and everything its tests need on a fresh machine.
# torch first and pinned: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[dev,ray,plot,gpu]"
