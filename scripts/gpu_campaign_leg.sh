#!/usr/bin/env bash
# One leg of #21's SmolLM2 campaign on the GPU host, after the SGLang bundle is staged and the
# SmolLM2 target built ($SMOLLM2; docs/sglang.md, "GPU host"): the campaign's records (the ranges
# scripts/gpu_campaign_data.sh wrote, as pieces or as folders) become one data file, the DSpine drafter
# and its ablation train at once for SECONDS with the campaign's settings (scripts/gpu_train_pair.sh),
# bench-accept measures both, and OUT/back holds what the next leg and the results need.
#
#   bash scripts/gpu_campaign_leg.sh OUT RECORDS SECONDS [RESUME]
#   DSPINE_CAMPAIGN_STEPS=N    the schedule's length in steps (default 800; see CAMPAIGN_STEPS)
#   DSPINE_CAMPAIGN_SET='k=v ...'  the trainer settings of a new campaign (default: CAMPAIGN_SET below)
#
#   RECORDS         one or more record folders, ':'-separated, in a fixed order: each either the pieces
#                   of records.tar.xz (with records.tar.xz.pieces.json, as dspine_collect sends them back)
#                   or a records folder itself (greedy.jsonl, sampled.jsonl: gpu_campaign_data.sh's
#                   OUT/records on the same host). The data file is their greedy and sampled files
#                   concatenated in that order, byte for byte the same on every leg that names the same
#                   folders; a leg that adds a folder resumes with DSPINE_NEW_DATA=1.
#   SECONDS         training time of both runs (they stop with state saved and the weights so far)
#   RESUME          folder with the previous leg's back/ files (state_*.pt, run_key_*.json); none on the
#                   first leg. DSPINE_NEW_DATA=1 when the data grew since that leg.
#
# bench-accept reads the evaluation prompts' export .gpu-dspine/prompts (carry it); DSPINE_ACCEPT=0
# skips it. DSPINE_RUNS=dspine trains the DSpine drafter alone, DSPINE_RUNS=ablation the ablation alone
# (gpu_train_pair.sh): OUT/back then holds that run's files only.
#
# OUT/back: state_{dspine,ablation}.pt (travel states), run_key_{dspine,ablation}.json,
# train_log_{dspine,ablation}.json, learning_curves_campaign.json/.png, acceptance_smollm2.json, acc/,
# ckpt_dspine and ckpt_ablation; it comes back with `dspine_collect OUT/back` (xz pieces of 15 MiB, about
# 200 MB: a call returns at most ~64 MiB, so four calls).
set -eo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT directory}; RECORDS=${2:?record folders (a:b:...)}; SECONDS_TRAIN=${3:?training seconds}
RESUME=${4:-}
# The campaign's settings: a leg resumes only with the same ones (they are part of the run key).
# The cosine schedule's length: 800 steps end within one ~10-minute leg of both runs on one GPU, so every
# leg leaves a finished drafter; a later leg lengthens it (DSPINE_CAMPAIGN_STEPS=1600 ...: steps are not
# part of the run key, the schedule then rises again and decays toward the new end).
CAMPAIGN_STEPS=${DSPINE_CAMPAIGN_STEPS:-800}
# DSPINE_CAMPAIGN_SET replaces them for a new campaign (e.g. blocks_per_seq=32: more optimizer updates per
# label; the first leg's 800 updates of 4,096 blocks fell short of the shipped run's 2,000 of 512).
CAMPAIGN_SET=${DSPINE_CAMPAIGN_SET:-'max_len=4096 blocks_per_seq=128 cudnn_attention=true layer_loss_fraction=0.25 length_group_batches=16'}
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh
mkdir -p "$OUT"
: > "$OUT/campaign.jsonl"
IFS=: read -ra FOLDERS <<< "$RECORDS"
for i in "${!FOLDERS[@]}"; do
  dir=${FOLDERS[i]}
  if [ -s "$dir/records.tar.xz.pieces.json" ]; then  # pieces: rebuilt and unpacked (the tar holds records/)
    mkdir -p "$OUT/range$i"
    python3 -m dspine.utils.pieces join "$dir" "$OUT/range$i/records.tar.xz" --name records.tar.xz
    tar -C "$OUT/range$i" -xJf "$OUT/range$i/records.tar.xz"
    dir=$OUT/range$i/records
  fi
  [ -s "$dir/greedy.jsonl" ] || { echo "[gpu_campaign_leg] $dir: no greedy.jsonl (pieces or a records folder?)" >&2; exit 1; }
  cat "$dir/greedy.jsonl" "$dir/sampled.jsonl" >> "$OUT/campaign.jsonl"
done
echo "[gpu_campaign_leg] data: $(wc -l < "$OUT/campaign.jsonl") sequences"

DSPINE_DATA="$OUT/campaign.jsonl" DSPINE_TARGET="$SMOLLM2" DSPINE_TRAIN_SECONDS="$SECONDS_TRAIN" \
  DSPINE_TRAIN_SET="$CAMPAIGN_SET" DSPINE_RESUME="$RESUME" \
  bash scripts/gpu_train_pair.sh "$OUT/pair" 0 "$CAMPAIGN_STEPS"

mkdir -p "$OUT/back"
cp "$OUT"/pair/state_*.pt "$OUT"/pair/run_key_*.json "$OUT"/pair/train_log_*.json "$OUT/back/"
cp -r "$OUT"/pair/ckpt_* "$OUT/back/"   # both when both trained: the served comparison needs the pair
# DSPINE_ACCEPT=0 (a leg whose minutes all go to training: its curve is the train logs' held-out tau)
[ "${DSPINE_ACCEPT:-1}" = 0 ] || cp -r "$OUT/pair/acceptance_smollm2.json" "$OUT/pair/acc" "$OUT/back/"
CURVES=()
for run in dspine ablation; do
  [ ! -f "$OUT/back/train_log_$run.json" ] || CURVES+=(--run "$run=$OUT/back/train_log_$run.json")
done
python3 -m dspine.bench.learning_curves "${CURVES[@]}" --out-dir "$OUT/back" --name learning_curves_campaign ||
  echo "[gpu_campaign_leg] no learning curves (see above); the train logs are in OUT/back"
echo "[gpu_campaign_leg] done; collect with: dspine_collect $OUT/back"
