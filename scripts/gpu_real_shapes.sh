#!/usr/bin/env bash
# The published presets at their shapes, end to end on the GPU host (one H200, SGLang 0.5.17 staged
# by ../shared/gpu's stage_site.sh), for benchmarks/results/real_shapes_h200.json. About 25 minutes,
# so it runs in the background and outlives the device call that starts it:
#
#   source scripts/gpu_host_sglang.sh
#   dspine_bg real "bash scripts/gpu_real_shapes.sh /tmp/real-out TOKENIZER_DIR PROMPTS_DIR"
#   dspine_wait real 560        # in each following call, back to back, until it reports finished
#
#   TOKENIZER_DIR  tokenizer files for the dummy-weight targets and the small hybrid (any tokenizer
#                  whose ids fit the vocabularies, e.g. SmolLM2-135M-Instruct's: `load_tokenizer(None)`
#                  then `save_pretrained(DIR)` on your machine, 3.5 MB, 0.45 MB as an xz tar; no model
#                  weights are needed on the host)
#   PROMPTS_DIR    exported evaluation prompts (dspine.data.prompt_sources.export_prompts)
#
# DSPINE_REAL_PRESETS="P27 P8" (default) picks the presets: P8 alone fits an 80-GB H100;
# the 27B preset needs an H200; "none" runs only the speculation switch on the small hybrid.
# DSPINE_REAL_ROUNDS=0 goes straight to the soaks and skips the AR servers; DSPINE_REAL_SWITCH_SECONDS
# bounds the switch benchmark (default 540; 0 skips it). DSPINE_REAL_SOAK_MINUTES=0 skips the soaks (a
# rounds-only rerun: the report then keeps the preset's earlier soak, `report_real_shapes.py --preset
# NAME=-,LOG`).
#
# 1. Serving folders of both shapes (scripts/make_real_shape_dirs.py) and a small random hybrid
#    Qwen3-Next target with a random DSpine drafter (dspine.bench.hybrid_pair).
# 2. `dspine serve --preset qwen3-8b` (0.2 of the free memory: ~28 GB static), then `--preset
#    qwen3.8-27b` at its own 0.75 of what is left, dummy weights, triton attention, step profiles on.
#    The 27B server gets --max-mamba-cache-size 96 (3 mamba slots a request x 32 running): at its
#    default pool size SGLang would run fewer requests than the preset's --max-running-requests,
#    which the worker refuses.
# 3. DSPINE rounds (scripts/bench_round_cost.py) at c=1/8/32, greedy and T=1 in one run per server
#    (a second run would read phases the first one's throughput levels filled), one server at a time.
# 4. 10-minute soaks of both presets at once (scripts/soak.py, 32 clients); meanwhile the speculation
#    switch on the small hybrid (scripts/bench_dynamic.py: AR, DSPINE-static, DSPINE-plain,
#    DSPINE-dynamic with --alternating-switch, one server at a time, --disable-radix-cache; AR's top-2
#    logprob gaps judge each departure from AR, --parity-gaps: in bf16 a 16-token verify forward and
#    one-token decodes of this random hybrid pick differently at near-ties, on every speculative
#    server, hybrid_parity_diagnosis_h200.json; DSPINE-static shows the same without the switch).
# 5. AR servers of both shapes with the presets' memory and batch flags: their steps at the same levels.
#
# OUT holds real_shapes_rounds.json, soak_P27.json, soak_P8.json, hybrid_switch/dynamic_h200.json,
# logs/ (every server) and progress.txt. Then, on your machine:
#   python scripts/report_real_shapes.py --rounds OUT/real_shapes_rounds.json \
#     --preset qwen3.8-27b=OUT/soak_P27.json,OUT/logs/P27.log --preset qwen3-8b=OUT/soak_P8.json,OUT/logs/P8.log \
#     --hybrid-switch OUT/hybrid_switch/dynamic_h200.json
set -u
cd "$(dirname "$0")/.."
OUT=${1:?OUT folder}; TOKENIZER=${2:?TOKENIZER_DIR}; PROMPTS=${3:?PROMPTS_DIR}
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh || exit 1
LOGS=$OUT/logs SHAPES=/tmp/real-shapes HYBRID=/tmp/real-hybrid PROF=/tmp/real-prof
mkdir -p "$LOGS" "$PROF"
PROFILE=(DSPINE_STEP_PROFILE_PHASES=6 DSPINE_STEP_PROFILE_WINDOWS=30,230,260)   # 2 x 3 levels, short phases
DUMMY=(--load-format dummy --attention-backend triton)

log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$OUT/progress.txt"; }

launch() {  # NAME PORT VAR=VALUE... -- COMMAND...: a server in its own process group, not waited for
  local name=$1 port=$2; shift 2
  local vars=(); while [ "$1" != -- ]; do vars+=("$1"); shift; done; shift
  setsid env "${vars[@]}" "$@" --host 127.0.0.1 --port "$port" > "$LOGS/$name.log" 2>&1 < /dev/null &
  echo "$!" > "$PROF/$name.pid"; echo "$port" > "$PROF/$name.port"
  log "$name started on port $port: ${vars[*]} $*"
}
alive() { kill -0 "$(cat "$PROF/$1.pid")" 2>/dev/null; }
url() { echo "http://127.0.0.1:$(cat "$PROF/$1.port")"; }
wait_log() {  # NAME PATTERN SECONDS: until the server's log has the line
  local t0=$SECONDS
  until grep -q "$2" "$LOGS/$1.log" 2>/dev/null; do
    alive "$1" || { log "$1 exited before '$2'"; tail -n 30 "$LOGS/$1.log" >> "$OUT/progress.txt"; return 1; }
    (( SECONDS - t0 > $3 )) && { log "$1: no '$2' after $3 s"; return 2; }
    sleep 2
  done
}
wait_ready() {  # NAME SECONDS: until /health answers 200
  local t0=$SECONDS
  until curl -sf -o /dev/null -m 5 "$(url "$1")/health"; do
    alive "$1" || { log "$1 exited during start-up"; tail -n 40 "$LOGS/$1.log" >> "$OUT/progress.txt"; return 1; }
    (( SECONDS - t0 > $2 )) && { log "$1 not ready after $2 s"; return 2; }
    sleep 2
  done
  log "$1 ready"
}
stop() {  # NAME: the server's whole process group
  local pid; pid=$(cat "$PROF/$1.pid" 2>/dev/null) || return 0
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  log "$1 stopped"
}
rounds() {  # NAME CONFIG SHAPE: greedy and T=1 in one run (step-profile phases 1-3, then 4-6)
  timeout 800 python3 scripts/bench_round_cost.py --url "$2=$(url "$1")" --profile-dir "$2=$PROF/$1" \
    --shape "$3" --concurrency 1,8,32 --prompts 32 --max-tokens 32 --temperature 0,1 \
    --profile-timeout 90 --prompts-dir "$PROMPTS" --out-dir "$OUT" --results-name real_shapes_rounds \
    > "$LOGS/rounds_$1.txt" 2>&1
  log "rounds $1: exit $?"
}

log "start"
# Which presets (DSPINE_REAL_PRESETS, default both: "P27 P8"). Both share the card, and the 27B target
# alone is 50 GB of weights: it needs an H200 (~139 GiB); the 8B preset alone fits an 80-GB H100.
PRESETS=" ${DSPINE_REAL_PRESETS:-P27 P8} "
SOAK_MINUTES=${DSPINE_REAL_SOAK_MINUTES:-10}
want() { [[ $PRESETS == *" $1 "* ]]; }
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if want P27 && [ "${total_mib:-0}" -lt 120000 ]; then
  log "this GPU has ${total_mib} MiB; the 27B preset needs an H200 (~139 GiB): ask the device for one (needs_h200), or run DSPINE_REAL_PRESETS=P8"
  exit 2
fi
# The 8B servers' static memory: a fifth of an H200 beside the 27B preset, two fifths of an H100 alone
FRACTION_8B=0.2; [ "${total_mib:-0}" -lt 120000 ] && FRACTION_8B=0.4
python3 scripts/make_real_shape_dirs.py "$TOKENIZER" "$SHAPES" >> "$OUT/progress.txt" 2>&1 || exit 1
if [ "${DSPINE_REAL_SWITCH_SECONDS:-540}" != 0 ]; then
  python3 -m dspine.bench.hybrid_pair "$TOKENIZER" "$HYBRID" >> "$OUT/progress.txt" 2>&1 || exit 1
fi

if want P8; then
  launch P8 30040 DSPINE_STEP_PROFILE="$PROF/P8" "${PROFILE[@]}" -- python3 -m dspine.cli serve --preset qwen3-8b \
    --model-path "$SHAPES/qwen3-8b/target" "${DUMMY[@]}" --speculative-draft-model-path "$SHAPES/qwen3-8b/dspine" \
    --speculative-draft-load-format dummy --speculative-draft-attention-backend triton --mem-fraction-static "$FRACTION_8B"
  wait_log P8 "KV Cache is allocated" 300 || exit 1
fi
if want P27; then
  launch P27 30041 DSPINE_STEP_PROFILE="$PROF/P27" "${PROFILE[@]}" -- python3 -m dspine.cli serve --preset qwen3.8-27b \
    --model-path "$SHAPES/qwen3.8-27b/target" "${DUMMY[@]}" --speculative-draft-model-path "$SHAPES/qwen3.8-27b/dspine" \
    --speculative-draft-load-format dummy --speculative-draft-attention-backend triton --max-mamba-cache-size 96
  wait_ready P27 900 || exit 1
  grep -h "ReplaySSM verify scratch" "$LOGS/P27.log" >> "$OUT/progress.txt"
fi
if want P8; then wait_ready P8 900 || exit 1; fi
if [ "${DSPINE_REAL_ROUNDS:-1}" != 0 ]; then   # DSPINE_REAL_ROUNDS=0: straight to the soaks (and no AR servers)
  want P27 && rounds P27 DSPINE qwen3.8-27b
  want P8 && rounds P8 DSPINE qwen3-8b
fi

soaks=()
for name in P27 P8; do
  want $name && [ "$SOAK_MINUTES" != 0 ] || continue
  python3 scripts/soak.py --url "$(url $name)" --minutes "$SOAK_MINUTES" --clients 32 --out "$OUT" --config "$name" \
    --prompts "$PROMPTS/eval-sharegpt-heldout.jsonl" --server-pid "$(cat "$PROF/$name.pid")" > "$LOGS/soak_$name.txt" 2>&1 &
  soaks+=("$!")
done
SWITCH_SECONDS=${DSPINE_REAL_SWITCH_SECONDS:-540}
if [ "$SWITCH_SECONDS" = 0 ]; then log "hybrid switch: skipped (DSPINE_REAL_SWITCH_SECONDS=0)"; else
timeout "$SWITCH_SECONDS" python3 scripts/bench_dynamic.py --configs AR,DSPINE-static,DSPINE-plain,DSPINE-dynamic \
  --alternating-switch --parity-gaps \
  --plain-tokens 4 --model-path "$HYBRID/target" --draft "$HYBRID/drafter" --port 30050 \
  --extra-flags "--mem-fraction-static 0.3 --mamba-ssm-dtype float32 --disable-radix-cache --cuda-graph-max-bs-decode 16" \
  --spec-flags "--enable-linear-replayssm-spec --linear-replayssm-cache-len 32" \
  --requests "$PROMPTS/eval-sharegpt-heldout.jsonl" --concurrency 1,8 --repeats 1 --min-requests 16 --max-tokens 96 \
  --out-dir "$OUT/hybrid_switch" > "$LOGS/hybrid_switch.txt" 2>&1
log "hybrid switch: exit $? ($(tail -n 4 "$LOGS/hybrid_switch.txt" | tr '\n' ' '))"
fi
(( ${#soaks[@]} )) && wait "${soaks[@]}"   # a bare `wait` would wait for the servers too
for name in P27 P8; do
  want $name || continue
  if [ "$SOAK_MINUTES" != 0 ]; then log "soak $name: $(tail -n 2 "$LOGS/soak_$name.txt" | tr '\n' ' ')"; fi
  stop $name
done

[ "${DSPINE_REAL_ROUNDS:-1}" = 0 ] && { log "done (no rounds)"; exit 0; }
if want P8; then
  launch AR8 30060 DSPINE_STEP_PROFILE="$PROF/AR8" "${PROFILE[@]}" -- python3 -m sglang.launch_server \
    --model-path "$SHAPES/qwen3-8b/target" "${DUMMY[@]}" --dtype bfloat16 --mem-fraction-static "$FRACTION_8B" --max-running-requests 48
  wait_log AR8 "KV Cache is allocated" 300 || exit 1
fi
if want P27; then
  launch AR27 30061 DSPINE_STEP_PROFILE="$PROF/AR27" "${PROFILE[@]}" -- python3 -m sglang.launch_server \
    --model-path "$SHAPES/qwen3.8-27b/target" "${DUMMY[@]}" --dtype bfloat16 --linear-attn-backend triton \
    --mamba-ssm-dtype float32 --max-running-requests 32 --mem-fraction-static 0.75 --max-mamba-cache-size 96
  wait_ready AR27 900 || exit 1
  rounds AR27 AR qwen3.8-27b
  stop AR27
fi
if want P8; then wait_ready AR8 900 && rounds AR8 AR qwen3-8b; stop AR8; fi
log "done"
