"""What the two SmolLM2 training recipes (draft.py, ahead.py) share: their command line (one subcommand a step,
each with --work and, where it runs a model, --threads), the learning-rate schedule, the checkpoint written
through a rename, the training log read back, and the shipped files (fp16 safetensors without the target's
embedding, JSON cards)."""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

NO_EMBEDDING = {"embedding": "the target's (not stored)"}      # safetensors metadata of a shipped file


def parser(doc: str) -> tuple:
    """The recipe's parser (described by its docstring's first line) and its required subcommands."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    return ap, ap.add_subparsers(dest="cmd", required=True)


def subcommand(sub, name: str, threads: int | None = None) -> argparse.ArgumentParser:
    """One step's subcommand: --work (required) and, with a default thread count, --threads."""
    p = sub.add_parser(name)
    p.add_argument("--work", required=True)
    if threads is not None:
        p.add_argument("--threads", type=int, default=threads)
    return p


def run(ap: argparse.ArgumentParser, steps: dict, argv=None) -> int:
    """Parse `argv` and run the step named (steps: subcommand -> function of the parsed arguments)."""
    args = ap.parse_args(argv)
    steps[args.cmd](args)
    return 0


def cosine_lr(opt, lr: float, step: int, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then a cosine down to 0 at `total`; set on every parameter group of
    `opt`, and returned."""
    lr = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def save_checkpoint(state: dict, path: Path) -> None:
    """torch.save to a temporary file, then renamed over `path`: a run stopped while writing keeps the last one."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def read_log(path: Path) -> list[dict]:
    """A training log (JSON lines) as a list."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def write_json(path: Path, obj, **kw) -> None:
    """A card or config file: indented by one, a newline at the end."""
    path.write_text(json.dumps(obj, indent=1, **kw) + "\n")


def save_weights(weights: dict, path: Path) -> None:
    """A shipped safetensors file (fp16 arrays; the target's embedding is never in it: fetch takes it from the
    fetched target)."""
    from safetensors.numpy import save_file

    save_file(weights, str(path), metadata=NO_EMBEDDING)
