#!/usr/bin/env bash
# #3 end to end on the GPU host, after the SGLang bundle is staged (docs/sglang.md, "GPU host"):
# target-regenerated data, the DSpine drafter and its ablation trained at once on it (same data,
# steps, seed), then `bench-accept` of both. One H200: data 7.2 min (server start included), training
# ~9-10 min (both sharing the GPU), bench-accept ~3 min.
#
#   bash scripts/gpu_train_pair.sh OUT [SAMPLED_PROMPTS] [STEPS] [VARIANT 'KEY=JSON ...']
#
#   OUT              results: data.jsonl.gz, train_log_*.json, acc/*.json, ckpt_* (checkpoints)
#   SAMPLED_PROMPTS  how many training prompts also get one sampled answer (T=1, top-p 0.95,
#                    top-k 20: the evaluation's T=1) beside every prompt's greedy answer (default 6000)
#   STEPS            training steps of both drafters (default 2000)
#   VARIANT          a DSpine variant name and its drafter overrides, trained instead of the
#                    configured DSpine drafter, e.g. top16 injection_top_k=16 (several: 'KEY=JSON KEY=JSON')
#
# Prompts come from exports (`dspine.data.prompt_sources.export_prompts`; the host has no data
# packages): step 1 reads all training prompts from .gpu-dspine/prompts-full (or
# $DSPINE_PROMPTS_FULL), step 3 the evaluation sets from .gpu-dspine/prompts (or $DSPINE_EVAL_PROMPTS).
# 1. an AR server of the target; gen-data greedy (every prompt) and sampled (the first SAMPLED_PROMPTS)
#    as two clients at once; the server stops; the two files join into OUT/data.jsonl. With
#    DSPINE_DATA=FILE (.jsonl or .jsonl.gz, e.g. an earlier run's OUT/data.jsonl.gz) that file is the
#    data instead: no server, no generation (~7 minutes less). DSPINE_TRAIN_SET='KEY=VALUE ...' sets
#    top-level training fields of both runs alike (a campaign's data: 'max_len=8192 blocks_per_seq=64').
#    DSPINE_TARGET=DIR trains and measures against that target folder (the one gen-data's records
#    name, e.g. $SMOLLM2) instead of the bundle's GGUF environment.
#    A campaign leg: DSPINE_TRAIN_SECONDS=S stops both runs after S seconds (state saved, weights so far
#    exported; run again on the same --work to resume), STEPS is then the campaign's whole length, and
#    OUT/state_{dspine,ablation}.pt are travel states (`python -m dspine.train.resume travel`) to carry,
#    with OUT/run_key_{dspine,ablation}.json. DSPINE_RESUME=DIR holding an earlier leg's four files
#    puts them in place first, so the runs continue where that leg stopped; with DSPINE_NEW_DATA=1 (the
#    data grew) they go on with everything but the data, with DSPINE_WARM_START=1 (other settings)
#    from those weights with a new optimizer and schedule.
#    DSPINE_ACCEPT=0 skips step 3. DSPINE_RUNS picks the runs (default 'dspine ablation'): 'dspine'
#    trains and measures the DSpine drafter alone (the GPU to itself, about twice its labels in the same
#    minutes), and a later 'ablation' run with the same data, steps and seed catches up: once both have
#    finished the schedule, the ratio compares equal budgets.
# 2. scripts/train_pair.py: the DSpine drafter (or VARIANT) and the ablation, one process each, sharing the GPU.
# 3. bench-accept, one process per drafter (32 prompts per set, 160 new tokens, T=0 and T=1; greedy
#    parity checked for DSpine), merged into OUT/acceptance_smollm2.json; a third process measures the
#    DSpine drafter with argmax selection (injection alone: OUT/acc/dspine_argmax.json).
set -eo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT directory}; SAMPLED=${2:-6000}; STEPS=${3:-2000}; VARIANT=${4:-}; VARIANT_SET=${5:-}
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh
TRAIN_PROMPTS=${DSPINE_PROMPTS_FULL:-$PWD/.gpu-dspine/prompts-full}
EVAL_PROMPTS=${DSPINE_EVAL_PROMPTS:-$PWD/.gpu-dspine/prompts}
mkdir -p "$OUT/acc"
T0=$SECONDS
say() { echo "[gpu_train_pair +$((SECONDS - T0))s] $*"; }

if [ -n "${DSPINE_DATA:-}" ]; then
  case $DSPINE_DATA in *.gz) gzip -dc "$DSPINE_DATA" > "$OUT/data.jsonl" ;; *) cp "$DSPINE_DATA" "$OUT/data.jsonl" ;; esac
  say "data: $(wc -l < "$OUT/data.jsonl") sequences from $DSPINE_DATA"
else
  dspine_server ar 30000 --cuda-graph-bs-decode 8 16 32 64 128 192 256 384 512 --max-running-requests 512 \
    --mem-fraction-static 0.5
  trap 'dspine_server_stop 30000' EXIT
  say "server up"
  GEN=(python3 -m dspine.cli gen-data --server http://127.0.0.1:30000 --target "$SMOLLM2" --batch-size 8
       --concurrency 32 --prompts-dir "$TRAIN_PROMPTS" -q)
  "${GEN[@]}" --out "$OUT/greedy.jsonl" &
  greedy=$!
  "${GEN[@]}" --out "$OUT/sampled.jsonl" --num-prompts "$SAMPLED" --temperature 1 --top-p 0.95 --top-k 20
  wait $greedy
  dspine_server_stop 30000
  trap - EXIT
  cat "$OUT/greedy.jsonl" "$OUT/sampled.jsonl" > "$OUT/data.jsonl"
  gzip -k "$OUT/data.jsonl"
  say "data: $(wc -l < "$OUT/greedy.jsonl") greedy + $(wc -l < "$OUT/sampled.jsonl") sampled sequences"
fi

TARGET_ARGS=()
if [ -n "${DSPINE_TARGET:-}" ]; then TARGET_ARGS=(--target "$DSPINE_TARGET")
else dspine_train_env; fi   # from here on: the host's torch/transformers, the GGUF target (the server is gone)
DSPINE_RUN=(train-dspine)
NAME=dspine
if [ -n "$VARIANT" ]; then
  DSPINE_RUN+=(--variant "$VARIANT")
  for kv in $VARIANT_SET; do DSPINE_RUN+=(--drafter-set "$kv"); done
  NAME=dspine-$VARIANT
fi
COMMON=(--steps "$STEPS" --data "$OUT/data.jsonl" --work /tmp/dspine-run --out-dir "$OUT")
RUNS=()
for run in ${DSPINE_RUNS:-dspine ablation}; do
  case $run in dspine) RUNS+=("$NAME") ;; ablation) RUNS+=(ablation) ;;
    *) echo "[gpu_train_pair] DSPINE_RUNS: '$run' is neither dspine nor ablation" >&2; exit 1 ;; esac
done
has_run() { [[ " ${RUNS[*]} " == *" $1 "* ]]; }
if [ -n "${DSPINE_RESUME:-}" ]; then
  for run in "${RUNS[@]}"; do
    mkdir -p "/tmp/dspine-run/$run"
    cp "$DSPINE_RESUME/state_$run.pt" "/tmp/dspine-run/$run/state.pt"
    cp "$DSPINE_RESUME/run_key_$run.json" "/tmp/dspine-run/$run/run_key.json"
  done
  say "resuming ${RUNS[*]} from $DSPINE_RESUME"
fi
for kv in ${DSPINE_TRAIN_SET:-}; do COMMON+=(--set "$kv"); done
[ -z "${DSPINE_TARGET:-}" ] || COMMON+=(--set "target=$DSPINE_TARGET")
[ -z "${DSPINE_TRAIN_SECONDS:-}" ] || COMMON+=(--time-limit "$DSPINE_TRAIN_SECONDS")
[ "${DSPINE_WARM_START:-0}" = 0 ] || COMMON+=(--warm-start)
[ "${DSPINE_NEW_DATA:-0}" = 0 ] || COMMON+=(--new-data)
pids=()
if has_run "$NAME"; then python3 scripts/train_pair.py "${DSPINE_RUN[@]}" "${COMMON[@]}" > "$OUT/train-dspine.log" 2>&1 &
  pids+=($!); fi
if has_run ablation; then python3 scripts/train_pair.py train-ablation "${COMMON[@]}" > "$OUT/train-ablation.log" 2>&1 &
  pids+=($!); fi
for pid in "${pids[@]}"; do wait "$pid"; done
say "trained ${RUNS[*]} ($STEPS steps each, or until ${DSPINE_TRAIN_SECONDS:-no} s)"
if [ -n "${DSPINE_TRAIN_SECONDS:-}" ]; then
  for run in "${RUNS[@]}"; do
    python3 -m dspine.train.resume travel "/tmp/dspine-run/$run/state.pt" "$OUT/state_$run.pt"
    cp "/tmp/dspine-run/$run/run_key.json" "$OUT/run_key_$run.json"
  done
fi

[ "${DSPINE_ACCEPT:-1}" != 0 ] || { say "done (no bench-accept: DSPINE_ACCEPT=0)"; exit 0; }
ACC=(python3 -m dspine.cli bench-accept --num-prompts 32 --max-new-tokens 160 --batch-size 32 --device cuda
     --prompts-dir "$EVAL_PROMPTS"
     "${TARGET_ARGS[@]}")
pids=() MEASURED=()
if has_run "$NAME"; then
  "${ACC[@]}" --drafter "dspine=$OUT/ckpt_$NAME" --check-parity --out "$OUT/acc/dspine.json" > "$OUT/acc/dspine.log" 2>&1 &
  pids+=($!)
  "${ACC[@]}" --drafter "dspine-argmax=$OUT/ckpt_$NAME" --selection argmax --out "$OUT/acc/dspine_argmax.json" \
    > "$OUT/acc/dspine_argmax.log" 2>&1 &
  pids+=($!) MEASURED+=("$OUT/acc/dspine.json")
fi
if has_run ablation; then
  "${ACC[@]}" --drafter "ablation=$OUT/ckpt_ablation" --out "$OUT/acc/ablation.json" > "$OUT/acc/ablation.log" 2>&1 &
  pids+=($!) MEASURED+=("$OUT/acc/ablation.json")
fi
for pid in "${pids[@]}"; do wait "$pid"; done
python3 -m dspine.cli bench-accept --merge "${MEASURED[@]}" --out "$OUT/acceptance_smollm2.json"
say "done"
