#!/usr/bin/env bash
# Rebuild a shipped pair from Debian packages: corpus, tokenizer, target, draft (CE then KD), export.
#   bash models/build_pair.sh ende   # en->de translation pair, about 75 minutes on 2 CPU cores
#   bash models/build_pair.sh text   # English prose + code pair (Python docs), about 35 minutes
# Needs: pip install torch==2.13.0 && pip install -e ".[export,dev]"
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${1:-ende}
D=${DATA:-data}/$KIND
case "$KIND" in
  ende) CORPUS=();       T_TOK=8e6; T_MIN=50; D_TOK=4e6; D_MIN=10; KD_TOK=6e5; KD_MIN=6 ;;
  text) CORPUS=(--text); T_TOK=4e6; T_MIN=22; D_TOK=3e6; D_MIN=6;  KD_TOK=4e5; KD_MIN=3 ;;
  *) echo "usage: $0 ende|text" >&2; exit 2 ;;
esac
python models/build_corpus.py "${CORPUS[@]}" --out "$D/corpus"
python models/train.py tokenizer --data "$D/corpus" --out "$D/tok"
python models/train.py lm --data "$D/corpus" --tokenizer "$D/tok" --out "$D/target" \
    --layers 6 --hidden 256 --heads 4 --kv_heads 2 --tokens "$T_TOK" --minutes "$T_MIN"
python models/train.py lm --data "$D/corpus" --tokenizer "$D/tok" --out "$D/draft_ce" \
    --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens "$D_TOK" --minutes "$D_MIN"
python models/train.py lm --data "$D/corpus" --tokenizer "$D/tok" --out "$D/draft" \
    --init "$D/draft_ce" --teacher "$D/target" --tokens "$KD_TOK" --lr 1e-3 --warmup 10 --minutes "$KD_MIN"
python models/ship.py --kind "$KIND" --data "$D" --out "models/$KIND"
