"""The SmolLM2-135M-Instruct lookahead head, trained here (export/ahead.py; DESIGN "Lookahead head").

The head guesses the token after the target's own next token from the target's final hidden state and that
next token's embedding. It trains on the target's greedy answers (models/smollm2/draft.py `prompts` and
`answers`, run first with the same --work), so on these sequences the token after row t is the target's own
choice at t and the label is its choice at t + 1. Each step is resumable:

    python models/smollm2/ahead.py features --work $W      # the fetched int8 target's final_h and top-8 per answer row
    python models/smollm2/ahead.py train    --work $W      # the head (checkpointed: work/ahead_ckpt.pt)
    python models/smollm2/ahead.py save     --work $W      # models/smollm2/ahead/ (shipped; fetch attaches it)

Objective: cross-entropy on the target's next-next token plus KL to the target's top-8 at that row (renormalised
over the head's tokens), AdamW with a cosine schedule; with --depth D the graph's chain is trained unrolled (level
k from level k - 1's own predicted hidden state, the loss of level k weighted level_decay ** (k - 1)). The output rows are the target's tied embedding for the
`--head` most frequent answer tokens, frozen: the head only learns to move h_t towards the next row's hidden
state.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from models.smollm2 import recipe  # noqa: E402
from models.smollm2.answers import _sequences, head_tokens, target_folder  # noqa: E402

OUT = ROOT / "models" / "smollm2" / "ahead"


def _target_session(threads: int):
    """The fetched target's graph with final_h as an extra output; its embedding table; its rms epsilon."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper as onh

    from export import ahead
    from specbeam_edge.execution.sessions import session_options

    folder = target_folder()
    model = onnx.load(str(folder / "model.onnx"))
    ahead.strip_head(model)          # a head already attached (fetch attaches the shipped one): the target alone
    table = ahead._embedding_table(model.graph)
    E = next(onh.to_array(t) for t in model.graph.initializer if t.name == table).astype(np.float32)
    eps = ahead._rms_eps(model)
    sess = ort.InferenceSession(ahead.with_hidden_output(model).SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"])
    return sess, E, eps


def _feed(ids, layers: int):
    import numpy as np

    T = len(ids)
    mask = np.where(np.tril(np.ones((T, T), bool)), np.float32(0), np.float32(-3.4028234663852886e38))
    f = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(T)[None],
         "attention_mask": mask[None, None].astype(np.float32), "topk": np.array([8], np.int64)}
    z = np.zeros((1, 3, 0, 64), np.float32)
    for i in range(layers):
        f[f"past_key_values.{i}.key"] = f[f"past_key_values.{i}.value"] = z
    return f


def features(args) -> None:
    """Per greedy answer: final_h (fp16) at the rows that predict answer tokens 1..n-1, the token after each (the
    answer's own), the label two ahead, and the target's top-8 at the label's row; work/ahead_feats/*.npz."""
    import numpy as np

    work = Path(args.work)
    out = work / "ahead_feats"
    out.mkdir(exist_ok=True)
    sess, _, _ = _target_session(args.threads)
    layers = sum(1 for i in sess.get_inputs() if i.name.endswith(".key"))
    kv_shape = next(i.shape for i in sess.get_inputs() if i.name.endswith(".key"))
    if kv_shape[1] != 3 or kv_shape[3] != 64:
        raise SystemExit(f"unexpected KV shape {kv_shape}: this recipe is for SmolLM2-135M")
    n, t0 = 0, time.time()
    for rid, kind, prompt, answer in _sequences(work):
        path = out / f"{rid}_{kind}.npz"
        if kind != "greedy" or path.exists() or len(answer) < 3:
            continue
        ids = prompt + answer
        lp, top, h = sess.run(["topk_logprobs", "topk_ids", "final_h"], _feed(ids, layers))
        P = len(prompt)
        rows = np.arange(P - 1, len(ids) - 2)        # row t: predicts ids[t+1]; the head's label is ids[t+2]
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, h=h[0, rows].astype(np.float16), next=np.asarray(ids)[rows + 1].astype(np.int32),
                 label=np.asarray(ids)[rows + 2].astype(np.int32), top_ids=top[0, rows + 1].astype(np.int32),
                 top_lp=lp[0, rows + 1].astype(np.float16))
        os.replace(tmp, path)
        n += 1
        if n % 100 == 0:
            print(f"{n} sequences, {time.time() - t0:.0f} s", flush=True)
    print(f"{n} sequences; {len(list(out.glob('*.npz')))} in {out}")


def _load(work: Path):
    import numpy as np

    train, val = [], []
    for path in sorted((work / "ahead_feats").glob("*.npz")):
        rid = int(path.stem.split("_")[0])
        d = dict(np.load(path))
        d["left"] = np.arange(len(d["label"]))[::-1].astype(np.int32)   # rows after this one in its sequence
        (val if rid % 20 == 0 else train).append(d)
    cat = lambda ds: {k: np.concatenate([d[k] for d in ds]) for k in ds[0]}   # noqa: E731
    return cat(train), cat(val)


class Head:
    """The head in torch, as export/ahead.py builds it in the graph."""

    def __init__(self, E, token_ids, eps: float):
        import torch

        H = E.shape[1]
        self.E = torch.from_numpy(E)                                   # frozen: the target's embedding
        self.out = torch.from_numpy(E[token_ids]).T.contiguous()       # [H, S], frozen tied rows
        self.eps = eps
        g = torch.Generator().manual_seed(0)
        self.w1 = (torch.randn(2 * H, H, generator=g) * (1 / math.sqrt(2 * H))).requires_grad_()
        self.b1 = torch.zeros(H, requires_grad=True)
        self.w2 = torch.zeros(H, H, requires_grad=True)                # starts as "the next row is this row"
        self.b2 = torch.zeros(H, requires_grad=True)
        self.norm = torch.ones(H, requires_grad=True)

    def params(self):
        return [self.w1, self.b1, self.w2, self.b2, self.norm]

    def state(self) -> dict:
        return {k: getattr(self, k).detach().clone() for k in ("w1", "b1", "w2", "b2", "norm")}

    def load(self, state: dict):
        import torch

        with torch.no_grad():
            for k, v in state.items():
                getattr(self, k).copy_(v)

    def step(self, h, nxt):
        """One level: (its guess of the next row's final hidden state, its logits over the head's tokens)."""
        import torch

        u = torch.nn.functional.silu(torch.cat([h, self.E[nxt]], -1) @ self.w1 + self.b1)
        y = h + u @ self.w2 + self.b2
        y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + self.eps) * self.norm
        return y, y @ self.out

    def logits(self, h, nxt):
        return self.step(h, nxt)[1]


def _tensor(a, dt=None):
    """A numpy array (cast to `dt` if given) as a torch tensor."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(a) if dt is None else np.asarray(a, dt))


def _level_tensors(d, rows, k, index):
    """Level k (0-based) of the chains starting at `rows`: its input token, label, top-8, and which rows
    have a level k inside their sequence. `index`: a token's row in the head (-1: not in it)."""
    import numpy as np

    ok = d["left"][rows] >= k
    r = np.minimum(rows + k, len(d["label"]) - 1)
    lab = np.where(ok, index[d["label"][r]], -1)
    tid = index[d["top_ids"][r]]
    tlp = np.where((tid >= 0) & ok[:, None], d["top_lp"][r].astype(np.float32), -np.inf)
    return _tensor(d["next"][r].astype(np.int64)), _tensor(lab), _tensor(np.maximum(tid, 0)), _tensor(tlp)


def evaluate(head: Head, va, index, D: int) -> dict:
    """Teacher-forced per level: top-1/2/3 of level 1, and how often levels 1..k are all right (the chain's
    worth); `tokens_a_pass`: 1 + P(one of 3 first guesses right) + the chain's, a K = 1 pass's expectation."""
    import numpy as np
    import torch

    with torch.no_grad():
        n = len(va["label"])
        hits = np.zeros(3)
        chain = np.zeros(D)
        for s0 in range(0, n, 8192):
            rows = np.arange(s0, min(s0 + 8192, n))
            h = _tensor(va["h"][rows], np.float32)
            alive = torch.ones(len(rows), dtype=torch.bool)
            for k in range(D):
                nxt, lab, _, _ = _level_tensors(va, rows, k, index)
                h, logits = head.step(h, nxt)
                top = logits.topk(3, -1).indices
                if k == 0:
                    for m in range(3):
                        hits[m] += int(((top[:, :m + 1] == lab[:, None]).any(-1) & (lab >= 0)).sum())
                alive &= (top[:, 0] == lab) & (lab >= 0)
                chain[k] += int(alive.sum())
    rec = {f"top{m + 1}": round(float(hits[m]) / n, 4) for m in range(3)}
    rec.update({f"chain{k + 1}": round(float(chain[k]) / n, 4) for k in range(1, D)})
    rec["tokens_a_pass"] = round(float(1 + hits[2] / n + chain[1:].sum() / n), 3)
    rec["positions"] = n
    return rec


def _chain_loss(head: Head, tr, rows, index, args):
    """The training loss of the chains starting at `rows`, levels 1..--depth unrolled, and each level's CE."""
    import numpy as np
    import torch

    h = _tensor(tr["h"][rows], np.float32)
    loss, ces = 0.0, []
    for k in range(args.depth):
        nxt, lab, tid, tlp = _level_tensors(tr, rows, k, index)
        h, logits = head.step(h, nxt)
        logp = torch.log_softmax(logits, -1)
        ok = lab >= 0
        ce = -(logp[ok].gather(1, lab[ok, None])).mean()
        # KL to the target's top-8 at the label's row, renormalised over the entries inside the head
        inside = torch.isfinite(tlp)
        has = inside.any(-1)                  # a row none of whose top-8 is in the head has no KD term
        q = torch.softmax(torch.where(has[:, None], tlp, torch.zeros(())), -1) * inside
        kd = -(q * torch.where(inside, logp.gather(1, tid), torch.zeros(()))).sum(-1)[has].mean()
        loss = loss + args.level_decay ** k * (ce + args.kd_weight * kd)
        ces.append(round(float(ce.detach()), 4))
    return loss, ces


def _load_init(head: Head, args, tokens) -> None:
    """--init: the weights of a head trained before (e.g. the shipped one), which must have the same tokens."""
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    w = load_file(str(Path(args.init) / "ahead.safetensors"))
    if not np.array_equal(w.pop("token_ids"), np.asarray(tokens)):
        raise SystemExit(f"{args.init}: its head tokens differ from --head {args.head}'s")
    head.load({k: torch.from_numpy(v.astype(np.float32)) for k, v in w.items()})


def train(args) -> None:
    """Levels 1..depth unrolled as the graph runs them: level k reads level k - 1's predicted hidden state (not
    the target's) and the embedding of the answer's token there (a chain is only worth anything while its guesses
    are right, and then they are the answer's tokens); each level's loss is weighted level_decay ** (k - 1)."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    tr, va = _load(work)
    _, E, eps = _target_session(1)
    tokens = head_tokens(work, args.head, always=(2,))
    index = np.full(E.shape[0], -1, np.int64)
    index[tokens] = np.arange(len(tokens))
    head = Head(E, np.asarray(tokens), eps)
    if args.init:                  # a head trained before (e.g. the shipped one): its weights, same tokens
        _load_init(head, args, tokens)
    opt = torch.optim.AdamW(head.params(), lr=args.lr, weight_decay=0.0)
    N = len(tr["label"])
    steps_per_epoch = max(1, N // args.batch)
    total = steps_per_epoch * args.epochs
    ckpt = work / "ahead_ckpt.pt"
    step = 0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        head.load(st["head"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
    D = args.depth

    def scores() -> dict:
        return evaluate(head, va, index, D)

    def save(step: int) -> None:
        recipe.save_checkpoint({"head": head.state(), "opt": opt.state_dict(), "step": step, "token_ids": tokens,
                                "eps": eps, "depth": D, "val": scores()}, ckpt)

    print(f"train {N} positions, val {len(va['label'])}, head {len(tokens)} tokens, depth {D} "
          f"(covers {np.mean(index[tr['label']] >= 0):.3f} of labels); start {scores()}", flush=True)
    _fit(args, head, opt, tr, index, step, total, scores, save, work / "ahead_log.jsonl")


def _fit(args, head: Head, opt, tr, index, step: int, total: int, scores, save, log_path: Path) -> None:
    """Optimizer steps `step`..`total` on random rows of `tr` (drawn from a generator seeded with the first step):
    a line in `log_path` every 50 steps (with the validation `scores` every 200), a checkpoint (`save`) every
    --ckpt_minutes and at the end."""
    import numpy as np

    N = len(tr["label"])
    rng = np.random.default_rng(step)
    last = time.time()
    log = open(log_path, "a")
    while step < total:
        rows = rng.integers(0, N, args.batch)
        lr = recipe.cosine_lr(opt, args.lr, step, args.warmup, total)
        loss, ces = _chain_loss(head, tr, rows, index, args)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % 50 == 0 or step == total:
            rec = {"step": step, "loss": round(float(loss.detach()), 4), "ce": ces, "lr": lr}
            if step % 200 == 0 or step == total:
                rec.update(scores())
            print(rec, flush=True)
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if time.time() - last > 60 * args.ckpt_minutes or step == total:
            save(step)
            last = time.time()


def save(args) -> None:
    """models/smollm2/ahead/: ahead.safetensors (fp16 weights and the head's token ids) and card.json."""
    import numpy as np
    import torch

    work, out = Path(args.work), Path(args.out)
    st = torch.load(work / "ahead_ckpt.pt", weights_only=False)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16).numpy() for k, v in st["head"].items()}
    weights["token_ids"] = np.asarray(st["token_ids"], np.int64)
    recipe.save_weights(weights, out / "ahead.safetensors")
    recipe.write_json(out / "card.json", {"guesses": args.guesses, "depth": args.depth or st.get("depth", 1),
                                          "eps": st["eps"], "tokens": len(st["token_ids"]), "steps": st["step"],
                                          "held_out": st["val"], "log": recipe.read_log(work / "ahead_log.jsonl")})
    print(f"{out}: {sum(v.nbytes for v in weights.values()) / 1e6:.1f} MB; held out {st['val']}")


def build_parser() -> argparse.ArgumentParser:
    ap, sub = recipe.parser(__doc__)
    recipe.subcommand(sub, "features", threads=2)
    t = recipe.subcommand(sub, "train", threads=2)
    t.add_argument("--head", type=int, default=8192, help="tokens in the head's output rows")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--batch", type=int, default=1024)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--kd_weight", type=float, default=1.0)
    t.add_argument("--ckpt_minutes", type=float, default=3)
    t.add_argument("--depth", type=int, default=3, help="levels trained (the graph's chain: depth - 1 below the "
                   "first guess)")
    t.add_argument("--level_decay", type=float, default=0.8, help="loss weight of level k: level_decay ** (k - 1)")
    t.add_argument("--init", help="start from a saved head's folder (e.g. models/smollm2/ahead)")
    s = recipe.subcommand(sub, "save")
    s.add_argument("--out", default=str(OUT))
    s.add_argument("--guesses", type=int, default=2)
    s.add_argument("--depth", type=int, help="levels the graph runs (default: the levels trained)")
    return ap


def main(argv=None) -> int:
    return recipe.run(build_parser(), {"features": features, "train": train, "save": save}, argv)


if __name__ == "__main__":
    sys.exit(main())
