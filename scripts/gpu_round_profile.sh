#!/usr/bin/env bash
# Where a round's host time goes at Qwen3-8B shapes and many requests (#23's c=32 cell), on the GPU
# host after the SGLang bundle is staged (../shared/gpu's stage_site.sh). Needs no checkpoint: the
# target and the drafter are dummy weights of the published shapes (scripts/make_real_shape_dirs.py).
#
#   source scripts/gpu_host_sglang.sh
#   dspine_bg prof "bash scripts/gpu_round_profile.sh OUT TOKENIZER_DIR PY_SPY_WHEEL [C] [PROMPT_TOKENS]"
#   dspine_wait prof 540
#
#   TOKENIZER_DIR  tokenizer files for the dummy targets (e.g. SmolLM2-135M-Instruct's)
#   PY_SPY_WHEEL   a py-spy manylinux wheel (the host has no network)
#   C              concurrency levels (default 32; e.g. 1,8,32); PROMPT_TOKENS: synthetic prompt length
#                  (default 2000)
#   CONFIGS        (environment) the configs, in order (default "DSPINE AR"; DFLASH: SGLang's DFLASH
#                  with a dummy 5-layer block-16 drafter of the same shapes)
#   SHAPE          (environment) qwen3-8b (default) or smollm2-135m: the staged SmolLM2-135M-Instruct
#                  (the bundle built --with-model smollm2, $SMOLLM2) with the shipped drafter, the five
#                  dev sets mixed as prompts (PROMPT_TOKENS ignored; DSPINE_PROMPTS_DIR, which
#                  gpu_host_sglang.sh sets), 256-token answers; configs DSPINE, DSPINE-copy (the shipped
#                  drafter with copy candidates), AR and NGRAM; C e.g. 1,16. The checkpoint is copied only
#                  for DSPINE configs, so AR and NGRAM can run in a call that does not carry it
#   WORKLOADS      (environment, smollm2-135m) the workloads each server is measured on, in turn
#                  (default "mix"; e.g. "mix trace:/tmp/agentic/agentic_coding.jsonl" adds the
#                  coding-agent sessions of `python -m dspine.data.agentic`, 2k-6k-token contexts)
#
# For DSPINE (the qwen3-8b preset; triton attention, as FA3 is not in the bundle), AR (plain SGLang,
# same target and memory flags) and DFLASH, one server at a time: start it with the step profiler on
# (one phase per level, decode steps 30-630 each), drive each level with scripts/bench_round_cost.py,
# and with a single level, record the scheduler process with py-spy for 12 s at 200 Hz while the
# phase runs (raw collapsed stacks).
# OUT: rounds.json (ms per step, host ms and the profiler's ms per scheduler method), pyspy_<CONFIG>.txt
# (collapsed stacks), pyspy_<CONFIG>_top.txt (inclusive shares of the 40 heaviest frames),
# profiles/<CONFIG>/<pid>-phase<i>.txt (the step profiler's cProfile top functions, decode steps 630-1230 of
# each level: where the scheduler's host time goes, function by function), logs/.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${1:?OUT folder}; TOKENIZER=${2:?TOKENIZER_DIR}; WHEEL=${3:?PY_SPY_WHEEL}; C=${4:-32}; TOKENS=${5:-2000}
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh || exit 1
LOGS=$OUT/logs SHAPES=/tmp/prof-shapes PROF=/tmp/prof-steps PYSPY=/tmp/py-spy
mkdir -p "$LOGS" "$PROF"
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/progress.txt"; }

python3 -m zipfile -e "$WHEEL" "$PYSPY" && SPY=$(find "$PYSPY" -name py-spy -type f | head -n 1) && chmod +x "$SPY" \
  || { log "no py-spy binary in $WHEEL"; exit 1; }
SHAPE=${SHAPE:-qwen3-8b}
case $SHAPE in
  qwen3-8b)
    python3 scripts/make_real_shape_dirs.py "$TOKENIZER" "$SHAPES" --shapes qwen3-8b >> "$OUT/progress.txt" 2>&1 || exit 1
    TARGET=$SHAPES/qwen3-8b/target
    COMMON=(--model-path "$TARGET" --load-format dummy --attention-backend triton --mem-fraction-static 0.6
            --max-running-requests 48 --cuda-graph-max-bs-decode 48)
    WORKLOADS="synthetic:$TOKENS" WORKLOAD=(--max-tokens 48) ;;
  smollm2-135m)
    TARGET=${SMOLLM2:?no SMOLLM2: stage the bundle built --with-model smollm2}
    [ -f "$TARGET/config.json" ] || { log "no SmolLM2 at $TARGET: stage the bundle built --with-model smollm2"; exit 1; }
    DRAFT=$SHAPES/dspine COPY_DRAFT=$SHAPES/dspine-copy   # copies: later calls may carry no checkpoint
    if [[ " ${CONFIGS:-DSPINE AR} " == *" DSPINE"* ]]; then   # AR and NGRAM alone need no checkpoint
      rm -rf "$DRAFT" && mkdir -p "$SHAPES" && cp -r dspine/checkpoints/dspine-smollm2-135m-instruct "$DRAFT" || exit 1
      python3 -c "import sys; from pathlib import Path; from dspine.bench.copy_candidates import make_variant
make_variant(Path(sys.argv[1]), Path(sys.argv[2]), {})" \
        "$DRAFT" "$COPY_DRAFT" >> "$OUT/progress.txt" 2>&1 || exit 1
    fi
    COMMON=(--model-path "$TARGET" --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.3
            --cuda-graph-max-bs-decode 64)
    WORKLOAD=(--prompts-dir "${DSPINE_PROMPTS_DIR:?DSPINE_PROMPTS_DIR: exported evaluation prompts}" --max-tokens 256
              --repeats 2) ;;
  *) log "unknown SHAPE $SHAPE (qwen3-8b or smollm2-135m)"; exit 2 ;;
esac

scheduler_pid() {  # PGID: the SGLang scheduler process of the server leading that process group
  pgrep -g "$1" -f 'sglang::scheduler' | head -n 1
}

profile() {  # CONFIG PORT COMMAND...: start, drive, record, stop
  local name=$1 port=$2 pid spid load
  shift 2
  rm -rf "${PROF:?}/$name"
  DSPINE_STEP_PROFILE=$PROF/$name DSPINE_STEP_PROFILE_PHASES=$PHASES DSPINE_STEP_PROFILE_WINDOWS=30,630,1230 \
    setsid "$@" "${COMMON[@]}" --host 127.0.0.1 --port "$port" > "$LOGS/$name.log" 2>&1 < /dev/null &
  pid=$!
  log "$name started (pid $pid): $*"
  for _ in $(seq 450); do
    curl -sf -o /dev/null -m 5 "http://127.0.0.1:$port/health" && break
    kill -0 "$pid" 2>/dev/null || { log "$name exited during start-up"; tail -n 30 "$LOGS/$name.log" >> "$OUT/progress.txt"; return 1; }
    sleep 2
  done
  log "$name ready"
  (first=1   # each workload reads its own LEVELS phases of the server's profile
   for workload in $WORKLOADS; do
     python3 scripts/bench_round_cost.py --url "$name=http://127.0.0.1:$port" --profile-dir "$name=$PROF/$name" \
       --shape "$SHAPE" --workload "$workload" "${WORKLOAD[@]}" --concurrency "$C" --prompts 32 \
       --profile-from-phase "$first" --profile-timeout 120 --out-dir "$OUT" --results-name rounds || exit $?
     first=$((first + LEVELS))
   done) > "$LOGS/rounds_$name.txt" 2>&1 &
  load=$!
  spid=$(scheduler_pid "$pid")
  sleep 10   # the 8 prompt-length probes and the first wave's prefill; the phase (steps 30-630) runs ~30 s
  if [ "$LEVELS" = 1 ] && [ -n "$spid" ]; then
    "$SPY" record --pid "$spid" --duration 12 --rate 200 --nonblocking --format raw \
      --output "$OUT/pyspy_$name.txt" > "$LOGS/pyspy_$name.log" 2>&1
    python3 - "$OUT/pyspy_$name.txt" > "$OUT/pyspy_${name}_top.txt" <<'PY'
import collections, sys
inclusive, total = collections.Counter(), 0
for line in open(sys.argv[1]):
    stack, _, count = line.rstrip("\n").rpartition(" ")
    total += int(count)
    for frame in set(stack.split(";")):
        inclusive[frame] += int(count)
print(f"{total} samples; inclusive share of the heaviest frames")
for frame, n in inclusive.most_common(40):
    print(f"{100 * n / total:5.1f}%  {frame}")
PY
    log "$name py-spy: $(head -n 1 "$OUT/pyspy_${name}_top.txt")"
  elif [ "$LEVELS" = 1 ]; then
    log "$name: no sglang::scheduler process in group $pid"
  fi
  wait "$load"
  log "$name rounds: exit $? ($(tail -n 3 "$LOGS/rounds_$name.txt" | tr '\n' ' '))"
  mkdir -p "$OUT/profiles/$name" && cp "$PROF/$name"/*.txt "$OUT/profiles/$name/" 2>/dev/null   # cProfile tops
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  log "$name stopped"
}

WORKLOADS=${WORKLOADS:-mix}
LEVELS=$(echo "$C" | tr ',' '\n' | wc -l) PHASES=$(( $(echo "$C" | tr ',' '\n' | wc -l) * $(echo "$WORKLOADS" | wc -w) ))
log "start: $SHAPE, c=$C$([ "$SHAPE" = qwen3-8b ] && echo ", ~$TOKENS-token prompts")"
for config in ${CONFIGS:-DSPINE AR}; do
  case $SHAPE:$config in
    smollm2-135m:DSPINE) profile DSPINE 30071 python3 -m dspine.cli serve --preset smollm2-135m \
              --speculative-draft-model-path "$DRAFT" ;;
    smollm2-135m:DSPINE-copy) profile DSPINE-copy 30073 python3 -m dspine.cli serve --preset smollm2-135m \
              --speculative-draft-model-path "$COPY_DRAFT" ;;
    smollm2-135m:AR) profile AR 30070 python3 -m sglang.launch_server ;;
    smollm2-135m:NGRAM) profile NGRAM 30074 python3 -m sglang.launch_server --speculative-algorithm NGRAM ;;
    smollm2-135m:*) log "unknown config $config for smollm2-135m (DSPINE, DSPINE-copy, AR or NGRAM)"; exit 2 ;;
  esac
  [ "$SHAPE" = qwen3-8b ] || continue
  case $config in
    DSPINE) profile DSPINE 30071 python3 -m dspine.cli serve --preset qwen3-8b \
              --speculative-draft-model-path "$SHAPES/qwen3-8b/dspine" --speculative-draft-load-format dummy \
              --speculative-draft-attention-backend triton ;;
    AR) profile AR 30070 python3 -m sglang.launch_server --dtype bfloat16 ;;
    DFLASH) profile DFLASH 30072 python3 -m sglang.launch_server --dtype bfloat16 --speculative-algorithm DFLASH \
              --speculative-draft-model-path "$SHAPES/qwen3-8b/dflash" --speculative-draft-load-format dummy \
              --speculative-num-draft-tokens 16 --speculative-draft-attention-backend triton ;;
    *) log "unknown config $config (DSPINE, AR or DFLASH)"; exit 2 ;;
  esac
done
log "done"
