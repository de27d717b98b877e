#!/usr/bin/env bash
# The speculation-switch benchmark (#5) end to end on the GPU host, after the SGLang bundle is staged
# (docs/sglang.md, "GPU host"). One H200, one server measuring at a time:
#
#   bash scripts/gpu_bench_dynamic.sh OUT DRAFT HELDOUT [K]
#
#   OUT      results directory (plain/, draft/, bench/)
#   DRAFT    the DSpine checkpoint directory
#   HELDOUT  held-out chat requests (python -m dspine.data.traces heldout benchmarks/traces/*.jsonl --count 206
#            --out FILE, written on a machine with the ShareGPT package); never tuned on
#   K        target tokens per plain step (default 8)
#
# 1. Plain-step table: a DSPINE server whose every decode step is a K-token plain step (a forced
#    switch file, OUT/plain-forced.json: {"force": "plain", "plain_tokens": K}), with
#    SGLANG_RECORD_STEP_TIME=1 (the worker's step clock: decode periods, prefills excluded) ->
#    tune-sps --verify-tokens 1 on the dev traces' tune split. The server stays up for step 3.
# 2. Drafting table, calibration, prior and switch.json: a static DSPINE server with confidence
#    records -> tune-sps --plain-table --plain-tokens K. Stopped afterwards.
# 3. scripts/bench_dynamic.py --repeats 3: AR, DSPINE-static, DSPINE-dynamic started one at a time,
#    DSPINE-plain on the step-1 server.
# Every server gets the same CUDA-graph batch sizes (fewer than SGLang's default 35: a DSPINE server
# captures three graph sets, and this keeps its start near one minute).
set -eo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT directory}; DRAFT=${2:?DRAFT checkpoint}; HELDOUT=${3:?HELDOUT requests}; K=${4:-8}
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh
mkdir -p "$OUT"
LEVELS=1,4,16,64,128
GRAPHS="--cuda-graph-bs-decode 1 2 3 4 6 8 12 16 24 32 48 64 96 128 --max-running-requests 128"
SPEC="--speculative-algorithm DSPINE --speculative-num-draft-tokens 16 --speculative-draft-attention-backend triton
      --speculative-draft-model-path $DRAFT"
TRACES=(benchmarks/traces/*.jsonl)
FORCED="$(cd "$OUT" && pwd)/plain-forced.json"

python3 -c 'import sys; from dspine.dynamic.switch import write_forced_switch
write_forced_switch(sys.argv[1], "plain", plain_tokens=int(sys.argv[2]))' "$FORCED" "$K"
# shellcheck disable=SC2086
SGLANG_RECORD_STEP_TIME=1 DSPINE_DYNAMIC="$FORCED" \
  dspine_server plain 30001 $GRAPHS $SPEC --mem-fraction-static 0.2
trap 'dspine_server_stop 30001; dspine_server_stop 30002' EXIT
python3 scripts/tune_sps.py --url http://127.0.0.1:30001 --traces "${TRACES[@]}" --out "$OUT/plain" -q \
  --verify-tokens 1 --acceptance-requests 0 --concurrencies $LEVELS --gpu "NVIDIA H200"

# shellcheck disable=SC2086
SGLANG_RECORD_STEP_TIME=1 DSPINE_RECORD_CONFIDENCE=1 \
  dspine_server draft 30002 $GRAPHS $SPEC --mem-fraction-static 0.4
python3 scripts/tune_sps.py --url http://127.0.0.1:30002 --traces "${TRACES[@]}" --out "$OUT/draft" -q \
  --concurrencies $LEVELS --gpu "NVIDIA H200" --plain-table "$OUT/plain/sps_table.json" --plain-tokens "$K"
dspine_server_stop 30002

python3 scripts/bench_dynamic.py --requests "$HELDOUT" --concurrency $LEVELS --min-requests 48 --repeats 3 \
  --draft "$DRAFT" --model-path "$SMOLLM2" --extra-flags "$GRAPHS --mem-fraction-static 0.6" \
  --configs AR,DSPINE-static,DSPINE-dynamic,DSPINE-plain --url DSPINE-plain=http://127.0.0.1:30001 \
  --plain-tokens "$K" --switch "$OUT/draft/switch.json" --out-dir "$OUT/bench"
