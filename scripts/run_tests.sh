#!/usr/bin/env bash
# The test command of README.md and CI, on a CPU machine:
#   1. .venv: DSpine + PyTorch CPU + the default target/data packages; every CPU test (Triton kernels
#      in TRITON_INTERPRET=1 mode; GPU-only tests are skipped — run them on a GPU host with -m gpu);
#   2. .venv-sglang: SGLang 0.5.22 (the published pin, CPU import only) + DSpine; the plugin tests.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/install_cpu.sh
python -m pytest -q -m "not gpu" -p no:cacheprovider "$@"
deactivate
bash scripts/install_sglang_cpu.sh
.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/sglang
