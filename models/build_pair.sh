#!/usr/bin/env bash
# Rebuild the shipped en->de pair from Debian packages: corpus, tokenizer, target, draft (CE then KD), export.
# Takes about 75 minutes on 2 CPU cores. Needs: pip install torch==2.13.0 && pip install -e ".[export,dev]"
set -euo pipefail
cd "$(dirname "$0")/.."
D=${DATA:-data}
python models/build_corpus.py --out "$D/ende"
python models/train.py tokenizer --data "$D/ende" --out "$D/tok"
python models/train.py lm --data "$D/ende" --tokenizer "$D/tok" --out "$D/target" \
    --layers 6 --hidden 256 --heads 4 --kv_heads 2 --tokens 8e6 --minutes 50
python models/train.py lm --data "$D/ende" --tokenizer "$D/tok" --out "$D/draft_ce" \
    --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens 4e6 --minutes 10
python models/train.py lm --data "$D/ende" --tokenizer "$D/tok" --out "$D/draft" \
    --init "$D/draft_ce" --teacher "$D/target" --tokens 6e5 --lr 1e-3 --warmup 10 --minutes 6
python models/ship.py --data "$D" --out models/ende
