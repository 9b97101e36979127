#!/usr/bin/env bash
# Rebuild a shipped pair from Debian packages: corpus, tokenizer, target, draft, export.
#   bash models/build_pair.sh ende   # en->de pair: days on 2 CPU cores (the target); every stage resumes
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
    # target 8x384: chosen from measured throughput (models/ende/README.md); open-ended schedule, averaged
    $TRAIN lm --data "$D/corpus" --tokenizer "$D/tok" --ckpt "$D/run_target_8x384" \
        --layers 8 --hidden 384 --heads 6 --kv_heads 2 --schedule invsqrt --lr 2e-3 --warmup 400 \
        --tokens "${TARGET_TOKENS:-6e7}" --mix libreoffice=2,gimp=2 --label_smoothing 0.1
    $TRAIN average --ckpt "$D/run_target_8x384" --last 5 --out "$D/target"
    python -m export -i "$D/target" -o "$D/target_onnx" --precision fp32 --overwrite --quiet
    # sequence-level KD: the target's 4 final beams per training source (the draft learns its top-K)
    $TRAIN distil --teacher "$D/target_onnx" --data "$D/corpus" --out "$D/kd" --num_beams 4 --return_beams 4
    $TRAIN lm --data "$D/kd" --tokenizer "$D/tok" --ckpt "$D/run_draft_ce" \
        --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens 2e7 --mix libreoffice=2,gimp=2
    $TRAIN average --ckpt "$D/run_draft_ce" --last 1 --out "$D/draft_ce"
    # token-level KL to the target plus the top-K alignment hinge (AtSpeed-S)
    $TRAIN lm --data "$D/kd" --tokenizer "$D/tok" --ckpt "$D/run_draft" --init "$D/draft_ce" \
        --teacher "$D/target" --align_topk 4 --tokens 4e6 --lr 1e-3 --warmup 10 --mix libreoffice=2,gimp=2
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
