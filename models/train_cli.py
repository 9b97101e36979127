"""The command line of models/train.py: one subcommand a step (tokenizer, lm, average, distil, bleu), the `lm`
flags in groups (model shape, schedule and data, starting point and teacher, the run itself), and every `lm`
flag's default (what a run started before the flag existed trained with).
"""
from __future__ import annotations

import argparse


def add_tokenizer_args(sub) -> None:
    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    t.add_argument("--data", required=True, help="folder with train.tsv")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--vocab", type=int, default=8192, help="vocabulary size")


def add_lm_args(sub) -> None:
    m = sub.add_parser("lm", help="train (or resume) a model (decoder-only, or --arch m2m100 encoder-decoder); KD "
                                  "and top-K alignment when --teacher is given")
    m.add_argument("--data", required=True, help="folder with train.tsv and valid.tsv (+ .source files for --mix)")
    m.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    m.add_argument("--ckpt", required=True, help="run folder: checkpoints, snapshots; resumed when it has last.pt")
    add_shape_args(m)
    add_schedule_args(m)
    add_start_args(m)
    add_run_args(m)


def add_shape_args(m) -> None:
    """The architecture and its size."""
    m.add_argument("--arch", choices=("llama", "m2m100"), default="llama",
                   help="llama: decoder-only (the prompt format's source and translation in one sequence); m2m100: "
                        "encoder-decoder (NLLB's architecture: pre-norm, --layers encoder and --layers decoder "
                        "layers, FFN 4 x hidden, one embedding for encoder, decoder and head)")
    m.add_argument("--layers", type=int, default=6, help="decoder layers (m2m100: per stack)")
    m.add_argument("--hidden", type=int, default=256, help="hidden size")
    m.add_argument("--heads", type=int, default=4, help="attention heads")
    m.add_argument("--kv_heads", type=int, default=2, help="key/value heads (GQA; llama)")


def add_schedule_args(m) -> None:
    """How long, how fast, on which rows: the token budget, the learning-rate schedule, the batches, the data mix."""
    m.add_argument("--tokens", default="5e6", help="stop after this many tokens (cosine: the schedule's length); "
                   "counted as steps of batch x seq_len tokens")
    m.add_argument("--minutes", type=float, default=0, help="stop this invocation after N minutes (0: no cap); "
                   "the schedule does not depend on it")
    m.add_argument("--schedule", choices=("invsqrt", "cosine"), default="cosine",
                   help="after warm-up: inverse square root (open-ended) or cosine to 10 %% over --tokens")
    m.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    m.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    m.add_argument("--batch", type=int, default=8, help="rows per step (m2m100: batch x seq_len is the token budget "
                   "of a padded batch, source + target)")
    m.add_argument("--seq_len", type=int, default=256, help="tokens per row (pairs longer than this are dropped)")
    m.add_argument("--max_ratio", type=float, default=2.5, help="drop pairs whose sides differ more in length")
    m.add_argument("--mix", default="", help="source repeats per epoch, e.g. libreoffice=3,gimp=2 (others: 1)")
    m.add_argument("--label_smoothing", type=float, default=0.0, help="label smoothing of the CE loss")


def add_start_args(m) -> None:
    """Where the weights start (--init, a cut of it) and the --teacher's loss terms."""
    m.add_argument("--init", default=None, help="start from this HF model folder")
    m.add_argument("--init_layers", default="", help="with --init: keep only these decoder layers, e.g. 0,4,5 (a "
                   "draft cut from the target; the embedding, final norm and head are kept; m2m100: the whole "
                   "encoder too)")
    m.add_argument("--freeze_encoder", action="store_true", help="m2m100 with --init: keep the --init model's "
                   "encoder, embedding (so also the head) and the kept layers' cross K/V projections as they are, "
                   "so the draft can use the target's encoder output at run time (no encoder pass of its own)")
    m.add_argument("--teacher", default=None, help="HF model folder: add KL to its logits (and --align_topk)")
    m.add_argument("--kd_weight", type=float, default=1.0, help="weight of the KL term (with --teacher)")
    m.add_argument("--align_topk", type=int, default=0, help="top-K alignment term with the teacher's top K (0: off)")
    m.add_argument("--align_weight", type=float, default=0.5, help="weight of the alignment term")
    m.add_argument("--align_margin", type=float, default=1.0, help="nats each teacher top-K token should lead by")


def add_run_args(m) -> None:
    """The invocation: checkpoints, snapshots, threads, bf16, the seed, logging."""
    m.add_argument("--ckpt_minutes", type=float, default=5, help="write a checkpoint this often")
    m.add_argument("--snapshot_every", type=int, default=500, help="keep a weight snapshot every N steps (and at "
                   "the end of each invocation) for `average`")
    m.add_argument("--keep_snapshots", type=int, default=8, help="weight snapshots kept for averaging")
    m.add_argument("--threads", type=int, default=2, help="torch threads")
    m.add_argument("--bf16", action="store_true", help="forward passes (the --teacher's too) under bfloat16 "
                   "autocast; weights, optimizer and validation stay fp32. On a CPU with AVX512-BF16: 1.1-1.25x "
                   "the tokens per second of fp32 in train.py runs (6+6 x 384 encoder-decoder, 2 threads; 1.57x "
                   "for fixed-shape batches); slower without it. A run may switch it when resumed")
    m.add_argument("--seed", type=int, default=0, help="random seed")
    m.add_argument("--log_every", type=int, default=20, help="log every N steps")
    m.add_argument("--eval_every", type=int, default=10, help="validation loss every N log lines")


def add_average_args(sub) -> None:
    a = sub.add_parser("average", help="average a run's last snapshots into an HF model folder")
    a.add_argument("--ckpt", required=True, help="run folder written by `lm`")
    a.add_argument("--last", type=int, default=5, help="average the last N snapshots")
    a.add_argument("--out", required=True, help="output HF model folder")


def add_distil_args(sub) -> None:
    d = sub.add_parser("distil", help="sequence-level KD data: the teacher's beam-search translations")
    d.add_argument("--teacher", required=True, help="specbeam model folder of the target (exported)")
    d.add_argument("--data", required=True, help="corpus folder with train.tsv")
    d.add_argument("--out", required=True, help="output corpus folder")
    d.add_argument("--num_beams", type=int, default=4, help="teacher beam width")
    d.add_argument("--return_beams", type=int, default=1, help="final beams written per source (<= num_beams)")
    d.add_argument("--max_new_tokens", type=int, default=160, help="generation limit")
    d.add_argument("--sources", default="", help="comma-separated corpus sources to translate (train.source "
                   "names, e.g. libreoffice,gimp; default all)")
    d.add_argument("--chunk", type=int, default=32, help="sources per generate call (and per resume point)")
    d.add_argument("--limit", type=int, default=0, help="only the first N sources (0: all)")


def add_bleu_args(sub) -> None:
    b = sub.add_parser("bleu", help="BLEU / chrF of a trained HF folder on held-out pairs (PyTorch generate)")
    b.add_argument("--model", required=True, help="HF model folder written by `average`")
    b.add_argument("--test", required=True, help="held-out pairs (english<TAB>german)")
    b.add_argument("--lines", type=int, default=300, help="the first N pairs")
    b.add_argument("--num_beams", type=int, default=4, help="beam width (1: greedy)")
    b.add_argument("--max_new_tokens", type=int, default=160, help="generation limit")
    b.add_argument("--threads", type=int, default=2, help="torch threads")


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; `description`: the help text above them (models/train.py's docstring)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_tokenizer_args(sub)
    add_lm_args(sub)
    add_average_args(sub)
    add_distil_args(sub)
    add_bleu_args(sub)
    return ap


def lm_defaults() -> dict:
    """Every `lm` flag's default: what a run started before the flag existed trained with."""
    return vars(build_parser().parse_args(["lm", "--data", "", "--tokenizer", "", "--ckpt", ""]))

