"""The SmolLM2 draft recipe's target side: the fetched target's own answers to the prompts (`answers`), its top-k
log-probs at every answer token (`teacher`), the answers read back as sequences, and the most frequent answer tokens
(the rows of a head over a subset of the vocabulary). The lookahead head's recipe (ahead.py) reads them too.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path


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

    from specbeam_edge.execution.model import OnnxCausalLM

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
