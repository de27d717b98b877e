#!/usr/bin/env bash
# One leg of #21's SmolLM2 campaign on the GPU host, after the SGLang bundle is staged and the
# SmolLM2 target built ($SMOLLM2; docs/sglang.md, "GPU host"): the campaign's records (the pieces of
# records.tar.xz that scripts/gpu_campaign_data.sh sent back) become one data file, the DSpine drafter
# and its ablation train at once for SECONDS with the campaign's settings (scripts/gpu_train_pair.sh),
# bench-accept measures both, and OUT/back holds what the next leg and the results need.
#
#   bash scripts/gpu_campaign_leg.sh OUT RECORDS_PIECES SECONDS [RESUME]
#
#   RECORDS_PIECES  folder of records.tar.xz pieces with records.tar.xz.pieces.json (one range's
#                   greedy.jsonl and sampled.jsonl; the data file is their concatenation, byte for byte
#                   the same on every leg)
#   SECONDS         training time of both runs (they stop with state saved and the weights so far)
#   RESUME          folder with the previous leg's back/ files (state_*.pt, run_key_*.json); none on the
#                   first leg. DSPINE_NEW_DATA=1 when the data grew since that leg.
#
# bench-accept reads the evaluation prompts' export .gpu-dspine/prompts (carry it); DSPINE_ACCEPT=0
# skips it.
#
# OUT/back: state_{dspine,ablation}.pt (travel states), run_key_{dspine,ablation}.json,
# train_log_{dspine,ablation}.json, acceptance_smollm2.json, acc/ and ckpt_dspine; it comes back with
# `dspine_collect OUT/back` (xz pieces, about 170 MB: two calls).
set -eo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT directory}; PIECES=${2:?folder of records.tar.xz pieces}; SECONDS_TRAIN=${3:?training seconds}
RESUME=${4:-}
# The campaign's settings: a leg resumes only with the same ones (they are part of the run key).
CAMPAIGN_STEPS=3000   # ~5 legs; lengthen it between legs if they go faster (the schedule follows)
CAMPAIGN_SET='max_len=4096 blocks_per_seq=128 cudnn_attention=true layer_loss_fraction=0.25 length_group_batches=16'
# shellcheck source=/dev/null
source scripts/gpu_host_sglang.sh
mkdir -p "$OUT/records"
python3 -m dspine.utils.pieces join "$PIECES" "$OUT/records.tar.xz" --name records.tar.xz
tar -C "$OUT/records" -xJf "$OUT/records.tar.xz"
cat "$OUT/records/greedy.jsonl" "$OUT/records/sampled.jsonl" > "$OUT/campaign.jsonl"
echo "[gpu_campaign_leg] data: $(wc -l < "$OUT/campaign.jsonl") sequences"

DSPINE_DATA="$OUT/campaign.jsonl" DSPINE_TARGET="$SMOLLM2" DSPINE_TRAIN_SECONDS="$SECONDS_TRAIN" \
  DSPINE_TRAIN_SET="$CAMPAIGN_SET" DSPINE_RESUME="$RESUME" \
  bash scripts/gpu_train_pair.sh "$OUT/pair" 0 "$CAMPAIGN_STEPS"

mkdir -p "$OUT/back"
cp "$OUT"/pair/state_*.pt "$OUT"/pair/run_key_*.json "$OUT"/pair/train_log_*.json "$OUT/back/"
cp -r "$OUT/pair/ckpt_dspine" "$OUT/back/"
# DSPINE_ACCEPT=0 (a leg whose minutes all go to training: its curve is the train logs' held-out tau)
[ "${DSPINE_ACCEPT:-1}" = 0 ] || cp -r "$OUT/pair/acceptance_smollm2.json" "$OUT/pair/acc" "$OUT/back/"
echo "[gpu_campaign_leg] done; collect with: dspine_collect $OUT/back"
