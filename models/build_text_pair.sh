#!/usr/bin/env bash
# Rebuild the shipped text pair (English prose + code from the Python 3.11 docs): about 35 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${DATA:-data}
python models/build_corpus.py --text --out "$D/text"
python models/train.py tokenizer --data "$D/text" --out "$D/tok_text"
python models/train.py lm --data "$D/text" --tokenizer "$D/tok_text" --out "$D/text_target" \
    --layers 6 --hidden 256 --heads 4 --kv_heads 2 --tokens 4e6 --minutes 22
python models/train.py lm --data "$D/text" --tokenizer "$D/tok_text" --out "$D/text_draft_ce" \
    --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens 3e6 --minutes 6
python models/train.py lm --data "$D/text" --tokenizer "$D/tok_text" --out "$D/text_draft" \
    --init "$D/text_draft_ce" --teacher "$D/text_target" --tokens 4e5 --lr 1e-3 --warmup 10 --minutes 3
mkdir -p "$D/textpair" && ln -sfn "$(cd "$D" && pwd)/text_target" "$D/textpair/target" \
    && ln -sfn "$(cd "$D" && pwd)/text_draft" "$D/textpair/draft" && ln -sfn "$(cd "$D" && pwd)/text" "$D/textpair/text"
python models/ship.py --kind text --data "$D/textpair" --out models/text
