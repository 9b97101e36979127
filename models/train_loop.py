"""The `lm` command's training run: the learning-rate schedule, the loss (cross-entropy on the scored tokens; with
a --teacher, KL to its logits and the top-K alignment term), and one invocation of a run in phases: set-up (data,
model, resume), one optimizer step, the log line with its validation loss, checkpoints and snapshots, the end.
"""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

from models.train_checkpoint import atomic_save, load_resumable, prepare_folder, restore, write_snapshot
from models.train_data import IGNORE, load_data
from models.train_model import encdec_logits, make_optimizer, scored_logits, setup_model


def lr_at(step: int, args) -> float:
    """Warm-up, then inverse square root (no horizon: runs for days) or cosine to 10 % over --tokens."""
    w = max(1, args.warmup)
    if step < w:
        return args.lr * (step + 1) / w
    if args.schedule == "invsqrt":
        return args.lr * math.sqrt(w / (step + 1))
    total = max(w + 1, int(float(args.tokens)) // (args.seq_len * args.batch))
    frac = min(1.0, (step - w) / (total - w))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def align_loss(logits, t_logits, k: int, margin: float):
    """Top-K alignment (AtSpeed-S): each of the teacher's top-k tokens should outrank, by `margin` nats, every
    token outside that set in the draft's logits, so the draft's top-k is the target's top-k. Hinge on the
    gap to the best outsider; logits [N, V] (positions already selected)."""
    import torch

    top = t_logits.topk(k, -1).indices                             # [N, k]
    inside = logits.gather(-1, top)                                # [N, k]
    outside = logits.scatter(-1, top, float("-inf")).max(-1, keepdim=True).values
    return torch.relu(margin - (inside - outside)).mean()


class LmRun:
    """One invocation of a run: set up from the flags (resumed from the run folder's `last.pt` when it has one),
    then `run` trains until the token budget, the --minutes cap or a SIGTERM / Ctrl-C, and saves."""

    def __init__(self, args):
        import torch

        torch.manual_seed(args.seed)
        torch.set_num_threads(args.threads)
        self.args = args
        self.tok_dir, data, self.ckpt = Path(args.tokenizer), Path(args.data), Path(args.ckpt)
        if args.arch == "m2m100" and (data / "train.txt").exists():
            raise SystemExit(f"--arch m2m100 needs translation pairs: {data} holds a text corpus (train.txt)")
        self.ckpt.mkdir(parents=True, exist_ok=True)
        state = load_resumable(self.ckpt, args)
        self.batches, self.v_batches, vocab_size, sep = load_data(args, data, self.tok_dir)
        self.encdec = args.arch == "m2m100"
        self.model, self.teacher = setup_model(args, vocab_size, sep)
        self.opt = make_optimizer(self.model, args)
        self.step, self.seen, self.log, self.minutes_before = 0, 0, [], 0.0
        if state is not None:
            self.step, self.seen, self.log, self.minutes_before = restore(state, self.model, self.opt, self.batches,
                                                                          self.ckpt)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        print(f"params {self.n_params/1e6:.2f} M; scored+context tokens per epoch "
              f"{self.batches.tokens_per_epoch()/1e6:.2f} M", file=sys.stderr)
        prepare_folder(self.model, self.ckpt, self.tok_dir)
        self.total_steps = max(1, int(float(args.tokens)) // (args.seq_len * args.batch))

    def logits_of(self, m, batch, keep, bf16=False):
        """Logits [N scored, V] fp32; bf16: the forward pass under bfloat16 autocast (training steps only)."""
        import torch

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if self.encdec:
                src, mask, dec, _ = (torch.from_numpy(a) for a in batch)
                out = encdec_logits(m, src, mask, dec, keep)
            else:
                out = scored_logits(m, torch.from_numpy(batch[0]), keep)
        return out.float()

    def evaluate(self) -> float:
        """Mean CE (no smoothing) of the German side of the validation pairs (and its closing EOS)."""
        import torch

        self.model.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for batch in self.v_batches:
                y = torch.from_numpy(batch[-1]).flatten()
                keep = y != IGNORE
                tot += torch.nn.functional.cross_entropy(self.logits_of(self.model, batch, keep), y[keep],
                                                         reduction="sum").item()
                n += int(keep.sum())
        self.model.train()
        return tot / n

    def save(self) -> None:
        import torch

        minutes = self.minutes_before + (time.time() - self.t0) / 60
        atomic_save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                     "seen": self.seen, "epoch": self.batches.epoch, "row": self.batches.row, "log": self.log,
                     "minutes": minutes, "torch_rng": torch.get_rng_state(), "args": vars(self.args),
                     "params": self.n_params}, self.ckpt / "last.pt")
        print(f"checkpoint at step {self.step} -> {self.ckpt}", file=sys.stderr, flush=True)

    def snapshot(self) -> None:
        write_snapshot(self.model, self.ckpt, self.step, self.args.keep_snapshots)

    def loss(self, batch, y, keep):
        """The step's loss and its parts: CE on the scored tokens; with a teacher, + token-level KD and top-K
        alignment."""
        import torch

        args = self.args
        s_flat = self.logits_of(self.model, batch, keep, args.bf16)           # [N scored, V]
        loss = torch.nn.functional.cross_entropy(s_flat, y[keep], label_smoothing=args.label_smoothing)
        parts = {"ce": round(loss.item(), 4)}
        if self.teacher is not None:                                     # token-level KD and top-K alignment
            with torch.no_grad():
                t_flat = self.logits_of(self.teacher, batch, keep, args.bf16)
            kd = torch.nn.functional.kl_div(torch.log_softmax(s_flat, -1), torch.log_softmax(t_flat, -1),
                                            log_target=True, reduction="batchmean")
            loss = loss + args.kd_weight * kd
            parts["kd"] = round(kd.item(), 4)
            if args.align_topk:
                al = align_loss(s_flat, t_flat, args.align_topk, args.align_margin)
                loss = loss + args.align_weight * al
                parts["align"] = round(al.item(), 4)
        return loss, parts

    def train_step(self):
        """One optimizer step on the next batch; returns the loss and its parts."""
        import torch

        args = self.args
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, args)
        batch = self.batches.next()
        y = torch.from_numpy(batch[-1]).flatten()
        keep = y != IGNORE
        loss, parts = self.loss(batch, y, keep)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        # m2m100: padded source + decoder input
        self.seen += batch[0].size + batch[2].size if self.encdec else args.seq_len * args.batch
        return loss, parts

    def log_step(self, loss, parts) -> None:
        """A log line (every --log_every steps), with the validation loss every --eval_every lines."""
        args, step = self.args, self.step
        wall = time.time() - self.t0
        msg = {"step": step, "tokens": self.seen, "loss": round(loss.item(), 4), **parts,
               "lr": round(lr_at(step, args), 6), "epoch": self.batches.epoch,
               "tok_s": round((self.seen - self.first_seen) / wall),
               "cpu_util": round((time.process_time() - self.cpu0) / wall, 2),
               "minutes": round(self.minutes_before + wall / 60, 2)}
        if step % (args.log_every * args.eval_every) == 0:
            msg["val_loss"] = round(self.evaluate(), 4)
        self.log.append(msg)
        print(json.dumps(msg), file=sys.stderr, flush=True)

    def run(self) -> None:
        """Train to the end of the budget (or the --minutes cap, or a signal), then a last validation loss, a
        checkpoint and a snapshot."""
        args = self.args
        stop = []
        for sig in (signal.SIGTERM, signal.SIGINT):       # finish the step, save, exit
            signal.signal(sig, lambda num, _: stop.append(signal.Signals(num).name))
        self.model.train()
        self.t0 = last_save = time.time()
        self.cpu0 = time.process_time()
        self.first_seen = self.seen
        while self.step < self.total_steps and not stop:
            if args.minutes and time.time() - self.t0 > args.minutes * 60:
                print(f"stopping at the --minutes cap after {self.seen/1e6:.2f} M tokens", file=sys.stderr)
                break
            loss, parts = self.train_step()
            if self.step % args.log_every == 0:
                self.log_step(loss, parts)
            if self.step % args.snapshot_every == 0:
                self.snapshot()
            if time.time() - last_save > args.ckpt_minutes * 60:
                self.save()
                last_save = time.time()
        if stop:
            print(f"{stop[0]}: saving and exiting", file=sys.stderr)
        self.log.append({"step": self.step, "tokens": self.seen, "val_loss": round(self.evaluate(), 4)})
        self.save()
        self.snapshot()
        print(json.dumps(self.log[-1]), file=sys.stderr)


def train_lm(args) -> None:
    LmRun(args).run()
