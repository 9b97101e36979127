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
top-K alignment term of the shipped pair (models/train.py `align_loss`) against the target's top-k.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from models.smollm2 import recipe  # noqa: E402

SYSTEM_PACKAGES = {"python3.11-doc": "deb", "wordnet-base": "deb"}
TASKS_DOC = ["Summarize the following paragraph in one or two sentences.\n\n{p}",
             "Explain the following text in simple words.\n\n{p}",
             "What is the main idea of this paragraph?\n\n{p}"]
TASKS_TERM = ["What is {t} in Python?", "Explain {t} in Python with a short example.",
              "Define the term \"{t}\"."]
TASKS_CODE = ["What does this Python code do?\n\n{c}", "Explain this code line by line.\n\n{c}"]
TASKS_SENT = ["Rewrite this sentence in simpler words: \"{s}\"", "Make this sentence more formal: \"{s}\""]
# everyday chat over common English nouns (WordNet 3.0, by lexicographer file); {a} is "a"/"an" + the noun
TASKS_ANY = ["Tell me three interesting facts about {x}.", "Explain {x} in simple terms.",
             "Write a short paragraph about {x}.", "Write a four-line poem about {x}.",
             "What are the pros and cons of {x}?", "Give a one-sentence definition of {x}.",
             "How would you explain {x} to a child?", "Write a tweet about {x}.",
             "Write a very short story that involves {a}.", "Why is {x} important?"]
TASKS_BY_KIND = {
    "food": ["What can I cook with {x}?", "Is {x} good for you? Answer briefly.", "Suggest a dish that uses {x}.",
             "How should {x} be stored?"],
    "animal": ["Where does {a} live and what does it eat?", "Write a short children's story about {a}.",
               "What makes {a} a good or bad pet?"],
    "artifact": ["What is {a} used for?", "How does {a} work?", "Write a short product description for {a}.",
                 "How do I clean {a}?"],
    "person": ["What does {a} do at work?", "Write a job advertisement for {a}.", "What skills does {a} need?"],
    "act": ["How do people get better at {x}?", "Give me advice about {x}.", "What is the history of {x}?"],
    "location": ["Describe {a} in a few sentences.", "What would I find in {a}?"],
    "plant": ["How do I take care of {a}?", "Where does {a} grow best?"],
    "feeling": ["How can someone deal with {x}?", "Write a short message to a friend who feels {x}."],
    "state": ["How can someone deal with {x}?", "What causes {x}?"],
    "phenomenon": ["What causes {x}?", "Explain {x} to a high-school student."],
    "substance": ["What is {x} made of?", "Where is {x} used in everyday life?"],
    "object": ["Describe {x} to someone who cannot see.", "What would happen without {x}?"],
    "possession": ["How can I save money on {x}?", "Explain {x} in one paragraph."],
}
LEX_KINDS = {4: "act", 5: "animal", 6: "artifact", 9: "cognition", 10: "communication", 12: "feeling", 13: "food",
             15: "location", 17: "object", 18: "person", 19: "phenomenon", 20: "plant", 21: "possession",
             26: "state", 27: "substance"}
TASKS_PAIR = ["Compare {x} and {y}.", "What is the difference between {x} and {y}?",
              "Write an email to a colleague about {x} and {y}."]
CODE_TASKS = ["reverse a string", "count the vowels in a sentence", "check whether a word is a palindrome",
              "compute the factorial of a number", "return the n-th Fibonacci number", "remove duplicates from a list",
              "sort a list of words by length", "find the second largest number in a list",
              "count how often each word occurs in a text", "check whether a number is prime",
              "convert Celsius to Fahrenheit", "merge two sorted lists", "flatten a nested list",
              "read a text file and print its lines", "sum the digits of an integer", "find common items of two lists",
              "capitalize every word in a sentence", "compute the average of a list of numbers",
              "check whether two words are anagrams", "split a list into chunks of size n"]
TASKS_CODE_GEN = ["Write a Python function to {t}.", "Show me how to {t} in Python.", "How can I {t} in Python?"]
ITEMS = ["notebooks", "apples", "tickets", "pencils", "shirts", "cups of coffee", "books", "plants"]


def _download(work: Path) -> tuple[Path, Path, Path]:
    """The three source packages, downloaded once into work/src (pip and apt, the user's own settings)."""
    src = work / "src"
    src.mkdir(parents=True, exist_ok=True)
    wheels = list(src.glob("chatterbot_corpus-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "chatterbot-corpus==1.3.3",
                        "-d", str(src)], check=True)
        wheels = list(src.glob("chatterbot_corpus-*.whl"))
    docs = src / "pydoc"
    if not docs.exists():
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=src, check=True)
        [deb] = src.glob("python3.11-doc_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(docs)], check=True)
    wordnet = src / "wordnet"
    if not wordnet.exists():
        subprocess.run(["apt-get", "download", "wordnet-base"], cwd=src, check=True)
        [deb] = src.glob("wordnet-base_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(wordnet)], check=True)
    return wheels[0], docs, wordnet


def chatterbot_questions(wheel: Path) -> list[str]:
    """The first turn of every English conversation (a question or a remark a user would type)."""
    import yaml

    out = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if "/english/" in name and name.endswith(".yml"):
                data = yaml.safe_load(z.read(name).decode("utf-8"))
                for conv in data.get("conversations") or []:
                    if conv and isinstance(conv[0], str) and 3 <= len(conv[0].split()) <= 30:
                        out.append(conv[0].strip())
    return out


def _clean(text: str) -> str:
    text = re.sub(r":[a-z:]+:`~?([^`<]+?)(?: <[^>]+>)?`", r"\1", text)    # :role:`target` -> target
    text = re.sub(r"``([^`]+)``", r"\1", text)
    text = re.sub(r"`([^`<]+?)(?: <[^>]+>)?`_?", r"\1", text)
    return " ".join(text.split())


def doc_prompts(docs: Path, rng: random.Random) -> list[str]:
    """Tasks over the Python documentation: glossary terms, prose paragraphs, code examples, sentences."""
    root = next(docs.rglob("_sources"))
    terms, paras, codes, sents = [], [], [], []
    gloss = root / "glossary.rst.txt"
    if gloss.exists():
        terms = [m.group(1).strip() for m in re.finditer(r"^   ([^\s].{1,40})\n      \S", gloss.read_text("utf-8"), re.M)]
    for f in sorted(root.rglob("*.rst.txt")):
        text = f.read_text("utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            lines = block.split("\n")
            if block.startswith(">>> ") and 2 <= len(lines) <= 12:
                codes.append(block.strip())
            elif all(l and not l.startswith((" ", ".", "=", "-", "*", "#", "+", "|", ">")) for l in lines):
                p = _clean(block)
                n = len(p.split())
                if 25 <= n <= 90 and p[-1] in ".!?" and "`" not in p and "::" not in p:
                    paras.append(p)
                    sents += [s for s in re.split(r"(?<=[.!?]) ", p) if 10 <= len(s.split()) <= 30]
    out = [rng.choice(TASKS_TERM).format(t=t) for t in terms]
    out += [rng.choice(TASKS_DOC).format(p=p) for p in rng.sample(paras, min(1200, len(paras)))]
    out += [rng.choice(TASKS_CODE).format(c=c) for c in rng.sample(codes, min(500, len(codes)))]
    out += [rng.choice(TASKS_SENT).format(s=s) for s in rng.sample(sents, min(500, len(sents)))]
    return out


def _article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def general_prompts(wordnet: Path, rng: random.Random, per_kind: int = 220) -> list[str]:
    """Everyday chat requests: templates over common nouns of WordNet 3.0 (a sense tagged at least 3 times in its
    semantic concordance, cntlist.rev; once for food, animals and plants), pairs of them, small coding tasks and
    word problems. None is one of the held-out benchmark prompts (checked in build_prompts)."""
    by_kind: dict[str, set] = {}
    lines = next(wordnet.rglob("cntlist.rev")).read_text("utf-8").splitlines()
    for line in lines:
        key, _, count = line.split()
        lemma, sense = key.split("%")
        ss, lex = sense.split(":")[:2]
        kind = LEX_KINDS.get(int(lex))
        word = lemma.replace("_", " ")
        if (ss == "1" and kind and word.replace(" ", "").isalpha() and word == word.lower()
                and int(count) >= (1 if kind in ("food", "animal", "plant") else 3)):
            by_kind.setdefault(kind, set()).add(word)
    out = []
    for kind in sorted(by_kind):
        words = sorted(by_kind[kind])
        for x in rng.sample(words, min(per_kind, len(words))):
            tasks = TASKS_ANY + TASKS_BY_KIND.get(kind, []) * 2      # kind-specific requests twice as often
            out.append(rng.choice(tasks).format(x=x, a=_article(x)))
        for _ in range(per_kind // 6):
            x, y = rng.sample(words, 2)
            out.append(rng.choice(TASKS_PAIR).format(x=x, y=y))
    out += [t.format(t=c) for c in CODE_TASKS for t in TASKS_CODE_GEN]
    for _ in range(150):
        n, k, p = rng.randint(2, 12), rng.randint(3, 40), rng.randint(2, 30)
        item = rng.choice(ITEMS)
        out.append(rng.choice([f"One of the {item} costs {p} dollars. How much do {k} of them cost?",
                               f"I have {k} {item} and give away {min(n, k)}. How many are left? Explain.",
                               f"If {n} people share {k * n} {item} equally, how many does each get?"]))
    return out


def build_prompts(args) -> None:
    # the benchmark's prompts stay out of the training text (a data file: the recipe imports no benchmark code)
    held_out = Path(__file__).resolve().parents[2] / "bench" / "data" / "chat_prompts.json"
    HELD_OUT = json.loads(held_out.read_text(encoding="utf-8"))

    work = Path(args.work)
    wheel, docs, wordnet = _download(work)
    rng = random.Random(0)
    prompts = chatterbot_questions(wheel) + doc_prompts(docs, rng) + general_prompts(wordnet, rng)
    held = {p.lower() for p in HELD_OUT}
    seen, out = set(), []
    for p in prompts:
        if p.lower() not in held and p not in seen:
            seen.add(p)
            out.append(p)
    rng.shuffle(out)
    with open(work / "prompts.jsonl", "w", encoding="utf-8") as f:
        for i, p in enumerate(out):
            f.write(json.dumps({"id": i, "prompt": p}) + "\n")
    print(f"{len(out)} prompts -> {work / 'prompts.jsonl'}")


def _done_ids(path: Path) -> set:
    if not path.exists():
        return set()
    ids = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                ids.add(json.loads(line)["id"])
            except (ValueError, KeyError):
                break                                   # a torn last line: the rest is written again
    return ids


def target_folder() -> Path:
    from specbeam_edge import fetch

    return fetch.model_path("smollm2")


def answers(args) -> None:
    """The target's own answers (greedy; every --beam_every-th prompt also K=4 beam search), appended to
    answers.jsonl in batches, so a stopped run continues with the prompts not yet answered."""
    from specbeam_edge import Engine

    work = Path(args.work)
    out = work / "answers.jsonl"
    done = _done_ids(out)
    prompts = [json.loads(l) for l in open(work / "prompts.jsonl", encoding="utf-8")][:args.limit]
    # shortest first, so a batch holds prompts of similar length: a batched pass pads every request's cache to
    # the longest one's (a batch of 32 with a few long doc paragraphs ran at 42-67 tok/s, about one request's rate)
    todo = sorted((p for p in prompts if p["id"] not in done), key=lambda p: (len(p["prompt"]), p["id"]))
    engine = Engine(target_folder(), threads=args.threads)
    t0, n_tok = time.time(), 0
    with open(out, "a", encoding="utf-8") as f:
        for s in range(0, len(todo), args.batch):
            chunk = todo[s:s + args.batch]
            ids = [engine.tokenizer.encode_prompt(engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": p["prompt"]}])) for p in chunk]
            greedy = engine.generate(ids, num_beams=1, do_sample=False, max_new_tokens=args.max_new,
                                     max_batch_size=args.batch)
            beam_rows = [j for j, p in enumerate(chunk) if p["id"] % args.beam_every == 0]
            beams = engine.generate([ids[j] for j in beam_rows], num_beams=4, do_sample=False,
                                    max_new_tokens=args.max_new, max_batch_size=args.batch) if beam_rows else []
            beam_of = dict(zip(beam_rows, beams))
            for j, p in enumerate(chunk):
                rec = {"id": p["id"], "prompt_ids": ids[j], "greedy": greedy[j].hypotheses[0].tokens}
                if j in beam_of:
                    rec["beam"] = beam_of[j].hypotheses[0].tokens
                n_tok += len(rec["greedy"]) + len(rec.get("beam", []))
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            print(f"{len(done) + s + len(chunk)}/{len(prompts)} prompts, {n_tok / (time.time() - t0):.0f} tok/s",
                  flush=True)


def _sequences(work: Path):
    """(record id, kind, prompt ids, answer ids) of every answer written so far."""
    with open(work / "answers.jsonl", encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                break
            for kind in ("greedy", "beam"):
                if rec.get(kind):
                    yield rec["id"], kind, rec["prompt_ids"], rec[kind]


def teacher(args) -> None:
    """The target's top-TOPK log-probs at every answer position (the row that predicts each answer token), one
    causal pass over prompt + answer per sequence, in the int8 export the draft will serve; work/teacher/*.npz,
    existing files skipped."""
    import numpy as np

    from specbeam_edge.model import OnnxCausalLM

    work = Path(args.work)
    out = work / "teacher"
    out.mkdir(exist_ok=True)
    model = OnnxCausalLM(target_folder(), threads=args.threads)
    n = 0
    for rid, kind, prompt, answer in _sequences(work):
        path = out / f"{rid}_{kind}.npz"
        if path.exists():
            continue
        ids = np.array([prompt + answer], np.int64)
        T = ids.shape[1]
        mask = np.tril(np.ones((T, T), bool))[None, None]
        (lp, top), _ = model.forward(ids, np.arange(T)[None], mask, model.empty_past(1), topk=args.topk)
        rows = slice(len(prompt) - 1, T - 1)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, logprobs=lp[0, rows].astype(np.float16), ids=top[0, rows].astype(np.int32))
        os.replace(tmp, path)
        n += 1
        if n % 100 == 0:
            print(f"{n} sequences scored", flush=True)
    print(f"{n} sequences scored; {len(list(out.glob('*.npz')))} in {out}")


def head_tokens(work: Path, size: int, always=(), min_count: int = 1) -> list[int]:
    """The `size` most frequent tokens of the target's answers (ties by id; those seen at least `min_count`
    times), the end-of-turn ids always among them, in ascending id order."""
    from collections import Counter

    counts = Counter()
    for _, _, _, answer in _sequences(work):
        counts.update(answer)
    keep = set(always)
    for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size or c < min_count:
            break
        keep.add(t)
    return sorted(keep)


class Draft:
    """The draft in torch: the target's embedding (frozen), `layers` of its decoder layers, its final norm, and a
    head over `token_ids` (rows of the tied embedding to start with)."""

    def __init__(self, target, layers: list[int], token_ids: list[int]):
        import torch

        from models.train import cut_layers

        model = cut_layers(target, layers)
        model.model.embed_tokens.weight.requires_grad_(False)
        self.model = model
        self.token_ids = torch.tensor(token_ids, dtype=torch.long)
        self.head = torch.nn.Linear(model.config.hidden_size, len(token_ids), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(model.model.embed_tokens.weight[self.token_ids])
        self.index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        self.index[self.token_ids] = torch.arange(len(token_ids))

    def parameters(self):
        return [p for p in list(self.model.model.parameters()) + list(self.head.parameters()) if p.requires_grad]

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "head": self.head.state_dict()}

    def load(self, state: dict, head_tokens: list[int] | None = None) -> None:
        """Weights from a checkpoint's or a saved draft's state; `head_tokens`: the tokens of its head rows when
        they are a subset of this head's (the other rows keep their embedding rows)."""
        import torch

        missing = set(self.model.load_state_dict(state["model"], strict=False).missing_keys)
        if missing - {"model.embed_tokens.weight", "lm_head.weight"}:     # a saved draft has no embedding
            raise KeyError(f"draft weights missing: {sorted(missing)}")
        if head_tokens is None or list(head_tokens) == self.token_ids.tolist():
            self.head.load_state_dict(state["head"])
            return
        rows = self.index[torch.tensor(head_tokens)]
        if (rows < 0).any():
            raise KeyError("the saved head has tokens this head lacks")
        with torch.no_grad():
            self.head.weight[rows] = state["head"]["weight"].to(self.head.weight.dtype)

    def logits(self, x, attention_mask, rows):
        """Head logits [N, S] of the selected flat positions `rows`."""
        hidden = self.model.model(input_ids=x, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden.flatten(0, 1)[rows])


def _saved_draft(folder: Path) -> dict:
    """A draft written by `save` (e.g. the shipped one) as a starting point: its layers, final norm, head and head
    token ids; the embedding is the target's (frozen, not stored), taken from the target as always."""
    from safetensors.torch import load_file

    w = load_file(str(folder / "draft.safetensors"))
    log = json.loads((folder / "train_log.json").read_text())
    token_ids = w.pop("lm_head.token_ids").tolist()
    head = {"weight": w.pop("lm_head.weight").float()}
    model = {k: v.float() for k, v in w.items()}
    return {"draft": {"model": model, "head": head}, "token_ids": token_ids,
            "layers": ",".join(str(i) for i in log["layers_from_target"])}


def _batches(items, budget: int, rng: random.Random):
    """Lists of sequences of about `budget` tokens (padded), similar lengths together, in random order."""
    items = sorted(items, key=lambda it: len(it[0]))
    out, cur = [], []
    for it in items:
        if cur and (len(cur) + 1) * len(it[0]) > budget:
            out.append(cur)
            cur = []
        cur.append(it)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _tensors(batch, index, topk: int):
    """Padded inputs, the flat rows scored, labels in head space (-100: outside the head) and the teacher's
    top-k in head space (-1 outside) with its log-probs."""
    import numpy as np
    import torch

    T = max(len(seq) for seq, _, _, _ in batch)
    x = torch.zeros((len(batch), T), dtype=torch.long)
    am = torch.zeros((len(batch), T), dtype=torch.long)
    rows, labels, tids, tlp = [], [], [], []
    for b, (seq, start, t_ids, t_lp) in enumerate(batch):
        x[b, :len(seq)] = torch.tensor(seq)
        am[b, :len(seq)] = 1
        n = len(seq) - start
        rows.append(torch.arange(start - 1, len(seq) - 1) + b * T)
        labels.append(torch.tensor(seq[start:]))
        tids.append(torch.from_numpy(t_ids[:n, :topk].astype(np.int64)))
        tlp.append(torch.from_numpy(t_lp[:n, :topk].astype(np.float32)))
    labels = index[torch.cat(labels)]
    labels[labels < 0] = -100
    return x, am, torch.cat(rows), labels, index[torch.cat(tids)], torch.cat(tlp)


def _losses(logits, labels, tids, tlp, margin: float):
    """(cross-entropy on the target's answer tokens, KL to the target's top-k (renormalised, inside the head),
    top-k alignment: each of the target's top-k in the head should lead the best token outside it by `margin`)."""
    import torch
    import torch.nn.functional as F

    ce = F.cross_entropy(logits, labels, ignore_index=-100)
    valid = tids >= 0
    safe = tids.clamp(min=0)
    lp = F.log_softmax(logits, -1).gather(-1, safe)
    p_t = torch.where(valid, tlp.exp(), torch.zeros_like(tlp))
    p_t = p_t / p_t.sum(-1, keepdim=True).clamp(min=1e-9)
    kd = -(p_t * torch.where(valid, lp, torch.zeros_like(lp))).sum(-1).mean()
    inside = logits.gather(-1, safe)
    outside = logits.scatter(-1, safe, float("-inf")).max(-1, keepdim=True).values
    hinge = torch.relu(margin - (inside - outside)) * valid
    align = hinge.sum() / valid.sum().clamp(min=1)
    return ce, kd, align


def _load_items(work: Path, held: set):
    import numpy as np

    train, val = [], []
    for rid, kind, prompt, answer in _sequences(work):
        path = work / "teacher" / f"{rid}_{kind}.npz"
        if not path.exists():
            continue
        d = np.load(path)
        item = (prompt + answer, len(prompt), d["ids"], d["logprobs"])
        (val if rid in held else train).append(item)
    return train, val


def train(args) -> None:
    """Distil the draft: cross-entropy on the target's answers + KL to its top-k + top-k alignment, AdamW with a
    cosine schedule over --epochs, checkpointed (work/ckpt.pt) every --ckpt_minutes and at the end; a rerun
    continues from the checkpoint."""
    import torch

    from export.gguf_input import _load
    from specbeam_edge import fetch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    target, tok = _load(fetch.gguf_path("smollm2"), quiet=True)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ckpt = work / "ckpt.pt"
    state = torch.load(ckpt, weights_only=False) if ckpt.exists() else None
    init = _saved_draft(Path(args.init)) if args.init and not state else None
    if state:
        token_ids = state["token_ids"]
    elif init:        # the saved head's tokens, plus the answers' tokens it lacks (their rows from the embedding)
        token_ids = sorted(set(init["token_ids"]) | set(head_tokens(work, args.head, eos, min_count=2)))
    else:
        token_ids = head_tokens(work, args.head, eos)
    layers = [int(i) for i in (state or init or {}).get("layers", args.layers).split(",")]
    draft = Draft(target, layers, token_ids)
    if init:
        draft.load(init["draft"], head_tokens=init["token_ids"])
    held = {i for i in range(0, 100000, 20)}                   # every 20th prompt: validation
    items, val = _load_items(work, held)
    batches = [_batches(items, args.batch_tokens, random.Random(e)) for e in range(args.epochs)]
    total = sum(len(b) for b in batches)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step = 0
    if state:
        draft.load(state["draft"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    print(f"{len(items)} train / {len(val)} validation sequences, head {len(token_ids)} tokens, {total} steps; "
          f"from step {step}", flush=True)

    def save():
        recipe.save_checkpoint({"draft": draft.state(), "opt": opt.state_dict(), "step": step,
                                "token_ids": token_ids, "layers": ",".join(map(str, layers))}, ckpt)

    def evaluate() -> dict:
        top1 = n = over = 0
        with torch.no_grad():
            for batch in _batches(val, args.batch_tokens, random.Random(0)):
                x, am, rows, labels, tids, tlp = _tensors(batch, draft.index, 4)
                lg = draft.logits(x, am, rows)
                pred = lg.argmax(-1)
                top1 += int((pred == labels).sum())
                mine = lg.topk(4, -1).indices
                over += int((mine[:, :, None] == tids[:, None, :]).any(-1).sum())
                n += len(labels)
        return {"top1": round(top1 / max(n, 1), 4), "top4_overlap": round(over / max(4 * n, 1), 4)}

    flat = [b for e in batches for b in e]
    last, t0 = time.time(), time.time()
    log = open(work / "train_log.jsonl", "a")
    if step == 0:
        print(json.dumps({"step": 0, **evaluate()}), file=log, flush=True)
    while step < total:
        lr = recipe.cosine_lr(opt, args.lr, step, args.warmup, total)
        x, am, rows, labels, tids, tlp = _tensors(flat[step], draft.index, args.topk)
        ce, kd, al = _losses(draft.logits(x, am, rows), labels, tids, tlp, args.margin)
        loss = ce + args.kd_weight * kd + args.align_weight * al
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == total:
            rec = {"step": step, "ce": round(ce.item(), 4), "kd": round(kd.item(), 4), "align": round(al.item(), 4),
                   "lr": round(lr, 6), "s_per_step": round((time.time() - t0) / 50, 2)}
            t0 = time.time()
            if step % 500 == 0 or step == total:
                rec.update(evaluate())
            print(json.dumps(rec), file=log, flush=True)
            print(json.dumps(rec), flush=True)
        if time.time() - last > args.ckpt_minutes * 60 or step == total:
            save()
            last = time.time()
    print(f"done: {ckpt}")


def write_weights(state: dict, out: Path) -> dict:
    """out/draft.safetensors from a checkpoint's state (fp16; no embedding); returns the arrays written."""
    import numpy as np
    import torch

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16).numpy() for k, v in state["draft"]["model"].items()
               if k != "model.embed_tokens.weight" and v.is_floating_point()}
    weights["lm_head.weight"] = state["draft"]["head"]["weight"].to(torch.float16).numpy()
    weights["lm_head.token_ids"] = np.asarray(state["token_ids"], np.int64)
    recipe.save_weights(weights, out / "draft.safetensors")
    return weights


def save(args) -> None:
    """The shipped draft from the checkpoint: config.json (a 2-layer Llama of the target's shape) and
    draft.safetensors (fp16: its layers, final norm, the subset head and its token ids; NOT the embedding, which is
    the target's and is taken from the fetched target when `specbeam fetch smollm2` builds the draft)."""
    import torch

    work, out = Path(args.work), Path(args.out)
    state = torch.load(work / "ckpt.pt", weights_only=False)
    weights = write_weights(state, out)
    from export.gguf_input import _load
    from specbeam_edge import fetch

    target, _ = _load(fetch.gguf_path("smollm2"), quiet=True)
    cfg = target.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):     # the latter: where the GGUF was, on this machine
        cfg.pop(key, None)
    layers = [int(i) for i in state["layers"].split(",")]
    cfg.update(num_hidden_layers=len(layers), tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if cfg.get("layer_types"):
        cfg["layer_types"] = [cfg["layer_types"][i] for i in layers]
    recipe.write_json(out / "config.json", cfg, default=str)
    log = recipe.read_log(work / "train_log.jsonl")
    recipe.write_json(out / "train_log.json", {"layers_from_target": layers, "head_tokens": len(state["token_ids"]),
                                               "steps": state["step"], "log": log})
    print(f"{out}: {sum(v.nbytes for v in weights.values()) / 1e6:.1f} MB of weights")


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
