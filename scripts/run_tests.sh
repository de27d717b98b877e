#!/usr/bin/env bash
# The test command of README.md and CI, on a CPU machine:
#   1. .venv: DSpine (editable) + PyTorch CPU + the default target/data packages; every CPU test
#      (Triton kernels in TRITON_INTERPRET=1 mode; GPU-only tests are skipped: run them on a GPU
#      host with -m gpu). Arguments go to this pytest run: `bash scripts/run_tests.sh -k drafter`.
#   2. the wheel test (scripts/check_wheel.sh): the built wheel in a fresh venv, non-editable;
#   3. .venv-sglang: SGLang 0.5.22 (the published pin, CPU import only) + DSpine; the plugin tests.
# Each pytest run must collect tests: exit status 5 (none collected, e.g. a selection that matches
# nothing) fails like a failing test. The closing lines of both runs are repeated at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
SUMMARY=()

# run_pytest LABEL PYTHON ARGS...: pytest -q with its output shown; keeps its closing line.
run_pytest() {
  local label=$1 python=$2 log rc=0 closing
  shift 2
  log="$(mktemp)"
  "$python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log" || rc=$?
  closing="$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -n 1)"
  rm -f "$log"
  case $rc in
    0) SUMMARY+=("$label: $closing") ;;
    5) echo "run_tests: $label: pytest collected no tests (exit status 5): ${closing:-no closing line}" >&2
       exit 5 ;;
    *) echo "run_tests: $label: FAILED (pytest exit status $rc): ${closing:-no closing line}" >&2
       exit "$rc" ;;
  esac
}

[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
bash scripts/install_cpu.sh
run_pytest "CPU tests (.venv)" python -m "not gpu" "$@"
deactivate

bash scripts/check_wheel.sh
SUMMARY=("wheel test (scripts/check_wheel.sh): passed" "${SUMMARY[@]}")

bash scripts/install_sglang_cpu.sh
run_pytest "SGLang tests (.venv-sglang)" .venv-sglang/bin/python tests/sglang

echo
echo "run_tests: all passed"
printf '  %s\n' "${SUMMARY[@]}"
