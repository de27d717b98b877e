#!/usr/bin/env bash
# The test command of README.md and CI: a fresh venv (.venv), everything installed, all CPU tests.
# Triton kernels run in TRITON_INTERPRET=1 mode; GPU-only tests are skipped (run them on a GPU
# host with `pytest -m gpu`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/install_cpu.sh
python -m pytest -q -m "not gpu" -p no:cacheprovider "$@"
