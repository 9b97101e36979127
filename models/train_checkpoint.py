"""The `lm` command's run folder (--ckpt): `last.pt` (model, optimizer, schedule step, data position) written through
a rename and read back on resume, where the run's defining flags must match; the weight snapshots under `snap/`;
and `average`, which turns the last snapshots into a Hugging Face model folder.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from models.train_cli import lm_defaults
from models.train_data import SEP


def atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)                            # a crash mid-write leaves the previous file intact


SHAPE_FLAGS = ("arch", "layers", "hidden", "heads", "kv_heads", "seq_len", "batch", "lr", "warmup", "schedule", "mix",
               "label_smoothing", "seed", "teacher", "align_topk", "align_weight", "kd_weight", "init", "init_layers",
               "freeze_encoder")


def load_resumable(ckpt: Path, args):
    """The run's `last.pt` state (None for a new run); refused when a defining flag differs from the saved run's."""
    import torch

    state = torch.load(ckpt / "last.pt", weights_only=False) if (ckpt / "last.pt").exists() else None
    if state is not None:                            # resuming: the run's defining flags must not change
        defining = SHAPE_FLAGS + (("tokens",) if args.schedule == "cosine" else ())   # cosine: its length
        saved = {**lm_defaults(), **state["args"]}   # a flag added after the run started: its default
        diff = {k: (saved.get(k), getattr(args, k)) for k in defining if saved.get(k) != getattr(args, k)}
        if diff:
            raise SystemExit(f"{ckpt} was started with other settings {diff} (saved, given): rerun with the saved "
                             f"settings to resume, or pass another --ckpt folder to start a new run")
    return state


def restore(state: dict, model, opt, batches, ckpt: Path) -> tuple:
    """Put a saved state back (weights, optimizer, data position, torch's random state); returns (step, tokens
    seen, log, minutes trained before)."""
    import torch

    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step, seen, log, minutes_before = state["step"], state["seen"], state["log"], state["minutes"]
    batches.epoch, batches.row = state["epoch"], state["row"]
    torch.set_rng_state(state["torch_rng"])
    print(f"resumed {ckpt} at step {step} ({seen/1e6:.2f} M tokens, epoch {batches.epoch})", file=sys.stderr)
    return step, seen, log, minutes_before


def prepare_folder(model, ckpt: Path, tok_dir: Path) -> None:
    """The run folder's snapshot folder, the model's config and the tokenizer files (what `average` copies)."""
    (ckpt / "snap").mkdir(exist_ok=True)
    model.config.save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).write_bytes((tok_dir / f).read_bytes())


def write_snapshot(model, ckpt: Path, step: int, keep: int) -> None:
    """The weights as snap/stepNNNNNNNN.pt; only the last `keep` snapshots are kept."""
    atomic_save(model.state_dict(), ckpt / "snap" / f"step{step:08d}.pt")
    for old in sorted((ckpt / "snap").glob("step*.pt"))[:-keep]:
        old.unlink()


def average(args) -> None:
    """Average the last N weight snapshots of a run into a Hugging Face model folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, GenerationConfig

    ckpt, out = Path(args.ckpt), Path(args.out)
    snaps = sorted((ckpt / "snap").glob("step*.pt"))[-args.last:]
    if not snaps:
        raise SystemExit(f"{ckpt}/snap holds no snapshots: train with `lm --ckpt {ckpt}` first")
    mean = None
    for p in snaps:
        sd = torch.load(p, weights_only=True)
        mean = sd if mean is None else {k: mean[k] + sd[k] for k in mean}
    mean = {k: v / len(snaps) for k, v in mean.items()}
    cfg = AutoConfig.from_pretrained(ckpt)
    model = (AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM).from_config(cfg)
    model.load_state_dict(mean)
    model.config.use_cache = True
    model.save_pretrained(out)
    extra = {"decoder_start_token_id": cfg.decoder_start_token_id} if cfg.is_encoder_decoder else {}
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=cfg.pad_token_id, num_beams=4,
                     max_new_tokens=128, **extra).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((ckpt / f).read_bytes())
    if cfg.is_encoder_decoder:      # the source alone goes to the encoder (the runtime appends EOS), no markers
        tcfg = json.loads((out / "tokenizer_config.json").read_text())
        tcfg.pop("prompt_format", None)
        tcfg["pad_token"] = SEP                      # the encoder-decoder's pad (build_model)
        (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    state = torch.load(ckpt / "last.pt", weights_only=False)
    vals = [m["val_loss"] for m in state["log"] if "val_loss" in m]
    summary = {"params": state["params"], "tokens": state["seen"], "steps": state["step"],
               "minutes": round(state["minutes"], 1), "val_loss": vals[-1] if vals else None,
               "averaged": [p.stem for p in snaps], "args": state["args"], "torch": torch.__version__}
    (out / "train_log.json").write_text(json.dumps({"summary": summary, "log": state["log"]}, indent=1))
    print(f"averaged {len(snaps)} snapshots ({snaps[0].stem} .. {snaps[-1].stem}) -> {out}", file=sys.stderr)
