#!/usr/bin/env bash
# Rebuild a shipped pair from Debian packages: corpus, tokenizer, target, draft, export.
#   bash models/build_pair.sh ende   # en->de pair: about 5.5 hours on 2 CPU cores (target 4 h, draft 80 min); every stage resumes
#   bash models/build_pair.sh text   # English prose + code pair (Python docs), about 35 minutes
# Every training stage keeps its run folder (checkpoints) under $DATA/<kind>/run_*: rerunning the script after
# a stop continues each stage where it stopped; finished stages return at once. DATA defaults to ./data.
# Needs: pip install torch==2.13.0 && pip install -e ".[export,dev]"
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-ende}
D=${DATA:-data}/$KIND
TRAIN="python models/train.py"
case "$KIND" in
  ende)
    python models/build_corpus.py --out "$D/corpus"
    [ -f "$D/tok/tokenizer.json" ] || $TRAIN tokenizer --data "$D/corpus" --out "$D/tok"
    # target: Llama 6x256 (the first shipped run: 4.2 M tokens in 50 minutes), then continued from it with label
    # smoothing and the help corpora upweighted on a 24 M-token cosine schedule (resumed from its checkpoints
    # across sessions); the shipped target averages its last 3 snapshots (models/ende/README.md)
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_target0" \
        --layers 6 --hidden 256 --heads 4 --kv_heads 2 --schedule cosine --lr 3e-3 --warmup 30 --tokens 8e6 \
        --minutes 50
    $TRAIN average --ckpt "$D/run_target0" --last 1 --out "$D/target0"
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_target" --init "$D/target0" \
        --schedule cosine --lr 1e-3 --warmup 50 --tokens "${TARGET_TOKENS:-2.4e7}" --mix libreoffice=2,gimp=2 \
        --label_smoothing 0.1 --snapshot_every 400 --keep_snapshots 6
    $TRAIN average --ckpt "$D/run_target" --last 3 --out "$D/target"
    # draft: a 2-layer cut of the target (its layers 0 and 5 with its embedding, final norm and head), trained
    # with token-level KL to the target plus the top-4 alignment hinge (AtSpeed-S) on the corpus, then on the
    # target's own beam-4 translations of the help corpora, all 4 final beams per source (sequence-level KD)
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_draft_cut" --init "$D/target" --init_layers 0,5 \
        --teacher "$D/target" --align_topk 4 --tokens 3e6 --lr 7e-4 --warmup 10 --mix libreoffice=2,gimp=2
    $TRAIN average --ckpt "$D/run_draft_cut" --last 1 --out "$D/draft_cut"
    [ -f "$D/target_onnx/specbeam_config.json" ] || python -m export -i "$D/target" -o "$D/target_onnx" -p fp16 -q
    $TRAIN distil --teacher "$D/target_onnx" --data "$D/corpus" --out "$D/kd" --sources libreoffice,gimp \
        --num_beams 4 --return_beams 4 --chunk 64
    $TRAIN lm --data "$D/kd" --tokenizer "$D/tok" --ckpt "$D/run_draft_kd" --init "$D/draft_cut" \
        --teacher "$D/target" --align_topk 4 --tokens 7e6 --lr 7e-4 --warmup 10 --snapshot_every 400
    $TRAIN average --ckpt "$D/run_draft_kd" --last 1 --out "$D/draft_kd"
    $TRAIN lm --data "$D/kd" --tokenizer "$D/tok" --ckpt "$D/run_draft" --init "$D/draft_kd" \
        --teacher "$D/target" --align_topk 4 --tokens 5e6 --lr 4e-4 --warmup 10 --snapshot_every 400 --seed 1
    $TRAIN average --ckpt "$D/run_draft" --last 1 --out "$D/draft"
    ;;
  text)
    python models/build_corpus.py --text --out "$D/corpus"
    [ -f "$D/tok/tokenizer.json" ] || $TRAIN tokenizer --data "$D/corpus" --out "$D/tok"
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_target" \
        --layers 6 --hidden 256 --heads 4 --kv_heads 2 --tokens 4e6
    $TRAIN average --ckpt "$D/run_target" --last 1 --out "$D/target"
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_draft_ce" \
        --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens 3e6
    $TRAIN average --ckpt "$D/run_draft_ce" --last 1 --out "$D/draft_ce"
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_draft" --init "$D/draft_ce" \
        --teacher "$D/target" --tokens 4e5 --lr 1e-3 --warmup 10
    $TRAIN average --ckpt "$D/run_draft" --last 1 --out "$D/draft"
    ;;
  *) echo "usage: $0 ende|text" >&2; exit 2 ;;
esac
python models/ship.py --kind "$KIND" --data "$D" --out "models/$KIND"
