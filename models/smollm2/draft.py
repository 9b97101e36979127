"""The SmolLM2-135M-Instruct draft, trained here: prompts, the target's own answers, distillation, export.

Each step is resumable (its output is appended or checkpointed; running the same command again continues):

    python models/smollm2/draft.py prompts  --work $W             # instruction prompts from English corpora here
    python models/smollm2/draft.py answers  --work $W             # the target's greedy (and K=4 beam) answers
    python models/smollm2/draft.py teacher  --work $W             # the target's top-k log-probs at every answer token
    python models/smollm2/draft.py train    --work $W             # distil the draft (checkpointed)
    python models/smollm2/draft.py save     --work $W --out models/smollm2/draft   # the shipped weights

Prompts (no model or dataset hub: packages only): the English questions of `chatterbot-corpus` (BSD; the first
turn of each conversation), and tasks over the Python 3.11 documentation's reST sources (`python3.11-doc`, PSF
licence): explain a glossary term, summarise a paragraph, say what a code example does, rewrite a sentence simply;
and everyday requests over common nouns of WordNet 3.0 (`wordnet-base`; general_prompts). The 24 prompts of bench/llamacpp.py are held out (none is in the set; checked). The target is the fetched int8
export (`specbeam fetch smollm2`): the answers and the teacher's top-k come from the graph the draft will serve,
so the draft learns what this target says, rounding included.

The draft (docs/HISTORY.md "A draft for a real model"): 2 decoder layers initialised from the target's layers 0 and 1,
the target's final norm, the target's embedding shared and frozen, and a head over the FREQ most frequent answer
tokens (rows of the tied embedding to start with); trained with cross-entropy on the target's answers plus the
top-K alignment term of the shipped pair (models/train_loop.py `align_loss`) against the target's top-k.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# each step lives in its own module; the names tests use stay importable from here
from models.smollm2 import recipe  # noqa: E402
from models.smollm2.answers import answers, teacher  # noqa: E402
from models.smollm2.draft_model import Draft, _saved_draft, save, write_weights  # noqa: E402
from models.smollm2.draft_train import train  # noqa: E402
from models.smollm2.prompts import build_prompts, general_prompts  # noqa: E402

__all__ = ["Draft", "_saved_draft", "answers", "build_parser", "build_prompts", "general_prompts", "main", "save",
           "teacher", "train", "write_weights"]


def build_parser() -> argparse.ArgumentParser:
    ap, sub = recipe.parser(__doc__)
    recipe.subcommand(sub, "prompts")
    a = recipe.subcommand(sub, "answers", threads=1)
    a.add_argument("--batch", type=int, default=16)
    a.add_argument("--max_new", type=int, default=160)
    a.add_argument("--beam_every", type=int, default=4, help="every N-th prompt also gets a K=4 beam answer")
    a.add_argument("--limit", type=int, default=None)
    t = recipe.subcommand(sub, "teacher", threads=1)
    t.add_argument("--topk", type=int, default=8)
    r = recipe.subcommand(sub, "train", threads=2)
    r.add_argument("--layers", default="0,1", help="target layers the draft starts from")
    r.add_argument("--init", default=None, help="start from a saved draft folder (its layers, head and head tokens) "
                   "instead of the target's layers, e.g. models/smollm2/draft")
    r.add_argument("--head", type=int, default=8192, help="tokens in the draft's output head")
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--batch_tokens", type=int, default=4096)
    r.add_argument("--lr", type=float, default=5e-4)
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--topk", type=int, default=8)
    r.add_argument("--margin", type=float, default=1.0)
    r.add_argument("--kd_weight", type=float, default=1.0)
    r.add_argument("--align_weight", type=float, default=0.5)
    r.add_argument("--ckpt_minutes", type=float, default=5)
    v = recipe.subcommand(sub, "save")
    v.add_argument("--out", default=str(ROOT / "models" / "smollm2" / "draft"))
    return ap


def main(argv=None) -> int:
    return recipe.run(build_parser(), {"prompts": build_prompts, "answers": answers, "teacher": teacher,
                                       "train": train, "save": save}, argv)


if __name__ == "__main__":
    sys.exit(main())
