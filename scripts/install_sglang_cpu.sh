#!/usr/bin/env bash
# Install SGLang into a separate venv for the CPU-only SGLang adapter tests (tests/sglang/).
#
#   bash scripts/install_sglang_cpu.sh                     # SGLang 0.5.22 -> .venv-sglang (git-ignored)
#   SGLANG_VERSION=0.5.23 DSPINE_SGLANG_VENV=.venv-sglang-0523 bash scripts/install_sglang_cpu.sh
#   SGLANG_VERSION=0.5.17 DSPINE_SGLANG_VENV=.venv-sglang-0517 bash scripts/install_sglang_cpu.sh
#   .venv-sglang/bin/python -m pytest tests/sglang
#
# Why not `pip install sglang==X`: its requirements include `cuda-tile` (an NVIDIA-hosted stub that
# cannot be fetched here) and ~10 GPU kernel packages. Importing SGLang's plugin, server-args and
# speculative modules on CPU needs none of them: the wheel goes in with --no-deps, then torch,
# torchvision, triton (`import sglang` imports triton) and the pure-Python packages SGLang imports at
# module level, at SGLang's own pins where it has one. 0.5.17 pins torch 2.11 (not installable here);
# its CPU tests run on torch 2.14.1, which is enough for everything that runs on CPU.
#
# Idempotent: a venv that already has this exact set (stamp = hash of this script + version) returns
# at once; otherwise pip re-runs and skips what is installed. Fresh: ~2.5 min, ~6 GB (torch 2.14.1 is
# the CUDA build with its nvidia-* wheels; nothing CUDA is used, but SGLang's config package imports
# torchvision, and PyPI's torchvision needs CUDA torch's libraries). pip's download cache stays off:
# it would hold a second copy of those wheels, and a CI machine's disk can be small.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSPINE_SGLANG_VENV:-$ROOT/.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.22}"
STAMP="$VENV/.dspine-sglang-install"
WANT="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)-$SGLANG_VERSION"

case "$SGLANG_VERSION" in
  # Pins read from each wheel's own METADATA (`pip download --no-deps sglang==X`, Requires-Dist).
  0.5.23) PINNED=("transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
                  "openai==2.8.0" "apache-tvm-ffi==0.1.11") ;;  # 0.5.23 imports tvm_ffi at module level
  0.5.22) PINNED=("transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
                  "openai==2.6.1") ;;
  0.5.17) PINNED=("transformers==5.12.1" "xgrammar==0.2.1" sentencepiece compressed-tensors "openai==2.6.1") ;;
  *) echo "install_sglang_cpu: SGLANG_VERSION must be 0.5.23, 0.5.22 or 0.5.17 (the versions DSpine's CPU tests" \
          "cover)" >&2
     exit 2 ;;
esac

CHECK="import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'
assert any(e.value == 'dspine.sglang.plugin:register' for e in m.entry_points(group='sglang.srt.plugins'))"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
   && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "install_sglang_cpu: $VENV is up to date (sglang $SGLANG_VERSION, dspine editable)"
  exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  # A fresh venv needs ~6.5 GB: say so now rather than with pip's OSError halfway through.
  mkdir -p "$(dirname "$VENV")"
  free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
  if (( free_kb < 7 * 1024 * 1024 )); then
    echo "install_sglang_cpu: $VENV needs ~7 GB of free disk (torch's CUDA build, which SGLang's" \
         "torchvision import requires); $(( free_kb / 1024 )) MB are free there. Free some space, or set" \
         "DSPINE_SGLANG_VENV to a folder on a larger disk." >&2
    exit 3
  fi
  "$PYTHON" -m venv "$VENV"
fi
# pip, minus the noise we expect: the resolver lists every sglang requirement skipped on purpose
# (and this machine's pip config warns about local index folders). Real errors still show.
PIP_NOISE="^sglang [0-9.]+ requires |^ERROR: pip's dependency resolver does not currently take"
PIP_NOISE+="|is ignored: it is neither a file nor a directory"
pip_install() {
  "$VENV/bin/python" -m pip install --no-cache-dir --quiet --progress-bar off "$@" \
    2> >(grep -v -E "$PIP_NOISE" >&2)
}

# 1. SGLang itself, without its (GPU) requirements.
pip_install --no-deps "sglang==$SGLANG_VERSION"

# 2. torch + what SGLang imports at module level on the plugin / server-args / speculative paths.
#    `cuda-tile`, sglang-kernel, flashinfer, flash-attn, ... are deliberately absent.
pip_install \
  "torch==2.14.1" "torchvision==0.29.1" triton "${PINNED[@]}" \
  numpy msgspec requests psutil pydantic packaging orjson setproctitle pyzmq einops regex tqdm xxhash \
  pybase64 zstandard pillow starlette IPython aiohttp dill gguf partial_json_parser \
  uvicorn fastapi python-multipart pyyaml safetensors pytest

# 3. DSpine itself, editable and without its own dependencies (torch/transformers are above), so the
#    `sglang.srt.plugins` entry point `dspine = dspine.sglang.plugin:register` is visible to SGLang.
pip_install --no-deps -e "$ROOT"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
eps = [e for e in m.entry_points(group="sglang.srt.plugins") if e.name == "dspine"]
assert eps, "dspine's sglang.srt.plugins entry point is not installed (pyproject.toml?)"
import sglang.srt.server_args  # noqa: F401  (imports torch/triton and most of SGLang's config layer)
import sglang.srt.speculative.spec_info  # noqa: F401
print(f"install_sglang_cpu: sglang {m.version('sglang')}, torch {m.version('torch')}, entry point {eps[0].value}")
EOF

echo "$WANT" > "$STAMP"
echo "install_sglang_cpu: done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
