"""The SmolLM2 draft recipe's `train` step: distil the draft on the target's answers (cross-entropy, KL to the
target's top-k, top-k alignment) in token-budget batches, with a cosine schedule, checkpointed and resumable. Its
phases: the draft to start from, the data, the optimizer steps, the validation scores.
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

from models.smollm2 import recipe
from models.smollm2.answers import _sequences, head_tokens
from models.smollm2.draft_model import Draft, _saved_draft


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



def _start(args, ckpt: Path):
    """The draft to train and the checkpoint's state (None before the first one): the checkpoint's head tokens and
    layers, or a saved draft's (--init: its head grown by the answers' tokens it lacks), or the target's --layers
    with a head over the --head most frequent answer tokens. Returns (draft, head token ids, layers, state)."""
    import torch

    from export.gguf_input import _load
    from specbeam_edge import fetch

    work = ckpt.parent
    target, tok = _load(fetch.gguf_path("smollm2"), quiet=True)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
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
    return draft, token_ids, layers, state


def evaluate(draft, val, batch_tokens: int) -> dict:
    """Top-1 agreement with the target's answers and the overlap of the draft's top-4 with the target's, held out."""
    import torch

    top1 = n = over = 0
    with torch.no_grad():
        for batch in _batches(val, batch_tokens, random.Random(0)):
            x, am, rows, labels, tids, tlp = _tensors(batch, draft.index, 4)
            lg = draft.logits(x, am, rows)
            pred = lg.argmax(-1)
            top1 += int((pred == labels).sum())
            mine = lg.topk(4, -1).indices
            over += int((mine[:, :, None] == tids[:, None, :]).any(-1).sum())
            n += len(labels)
    return {"top1": round(top1 / max(n, 1), 4), "top4_overlap": round(over / max(4 * n, 1), 4)}


def train(args) -> None:
    """Distil the draft: cross-entropy on the target's answers + KL to its top-k + top-k alignment, AdamW with a
    cosine schedule over --epochs, checkpointed (work/ckpt.pt) every --ckpt_minutes and at the end; a rerun
    continues from the checkpoint."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(args.work)
    ckpt = work / "ckpt.pt"
    draft, token_ids, layers, state = _start(args, ckpt)
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

    def save(step: int) -> None:
        recipe.save_checkpoint({"draft": draft.state(), "opt": opt.state_dict(), "step": step,
                                "token_ids": token_ids, "layers": ",".join(map(str, layers))}, ckpt)

    flat = [b for e in batches for b in e]
    _fit(args, draft, opt, flat, step, total, lambda: evaluate(draft, val, args.batch_tokens), save,
         work / "train_log.jsonl")
    print(f"done: {ckpt}")


def _fit(args, draft, opt, flat, step: int, total: int, scores, save, log_path: Path) -> None:
    """Optimizer steps `step`..`total` over the batches `flat`: a line in `log_path` every 50 steps (with the
    validation `scores` every 500, and before the first step), a checkpoint (`save`) every --ckpt_minutes and at
    the end."""
    import torch

    last, t0 = time.time(), time.time()
    log = open(log_path, "a")
    if step == 0:
        print(json.dumps({"step": 0, **scores()}), file=log, flush=True)
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
                rec.update(scores())
            print(json.dumps(rec), file=log, flush=True)
            print(json.dumps(rec), flush=True)
        if time.time() - last > args.ckpt_minutes * 60 or step == total:
            save(step)
            last = time.time()
