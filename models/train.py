"""Train a small Llama-architecture model (target, draft, or distilled draft) on the en->de pairs.

Writes a Hugging Face model folder (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json) that `python -m export` turns into a specbeam model folder.
PyTorch, CPU, fp32; reproducible given the seed, the data and the flags (the schedule is by tokens;
--minutes only caps a run that is slower than expected, and the log says so).

    python models/train.py tokenizer --data data/ende --out data/tok
    python models/train.py lm --data data/ende --tokenizer data/tok --out data/target \
        --layers 6 --hidden 256 --heads 4 --kv_heads 2 --tokens 7e6
    python models/train.py lm ... --out data/draft --layers 2 --hidden 128 --heads 2 --kv_heads 1 --tokens 4e6
    python models/train.py lm ... --out data/draft_kd --init data/draft --teacher data/target --tokens 6e5 --lr 1e-3
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
SEP = "<|de|>"


def train_tokenizer(data: Path, out: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, SEP],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)

    def lines():
        if (data / "train.txt").exists():            # text corpus: one JSON string (document) per line
            with open(data / "train.txt", encoding="utf-8") as f:
                for line in f:
                    yield from json.loads(line).split("\n\n")
            return
        with open(data / "train.tsv", encoding="utf-8") as f:
            for line in f:
                en, de = line.rstrip("\n").split("\t")
                yield en
                yield de

    tok.train_from_iterator(lines(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    text = (data / "train.txt").exists()
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "model_max_length": 512,
        "prompt_format": "<|endoftext|>{source}" if text else "<|endoftext|>{source}<|de|>",
    }, indent=2))
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {out}", file=sys.stderr)


def encode_corpus(data: Path, tok_dir: Path, split: str) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos, sep = tok.token_to_id(EOS), tok.token_to_id(SEP)
    if (data / f"{split}.txt").exists():            # text corpus: documents separated by EOS
        docs = [json.loads(l) for l in open(data / f"{split}.txt", encoding="utf-8")]
        ids = []
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids += [eos, *enc.ids]
        return np.asarray(ids + [eos], dtype=np.int64)
    pairs = [line.rstrip("\n").split("\t") for line in open(data / f"{split}.tsv", encoding="utf-8")]
    en = tok.encode_batch([p[0] for p in pairs], add_special_tokens=False)
    de = tok.encode_batch([p[1] for p in pairs], add_special_tokens=False)
    ids = []
    for a, b in zip(en, de):
        ids += [eos, *a.ids, sep, *b.ids]
    ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def train_lm(args) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok_dir = Path(args.tokenizer)
    train = encode_corpus(Path(args.data), tok_dir, "train")
    valid = encode_corpus(Path(args.data), tok_dir, "valid")
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab_size = len(vocab["model"]["vocab"]) + sum(1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"])
    vocab_size = int(math.ceil(vocab_size / 64) * 64)
    if args.init:
        model = LlamaForCausalLM.from_pretrained(args.init, torch_dtype=torch.float32)
    else:
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                          intermediate_size=int(math.ceil(8 * args.hidden / 3 / 16) * 16),
                          max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    teacher = None
    if args.teacher:
        teacher = LlamaForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params/1e6:.2f} M; train tokens/epoch {len(train)/1e6:.2f} M", file=sys.stderr)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    T, B = args.seq_len, args.batch
    total_tokens = int(float(args.tokens))
    total_steps = max(1, total_tokens // (T * B))
    rng = np.random.default_rng(args.seed)
    t0, seen, step = time.time(), 0, 0
    log = []

    def lr_at(frac):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def evaluate():
        model.eval()
        losses = []
        with torch.no_grad():
            for s in range(0, min(len(valid) - T - 1, 64 * T), T):
                x = torch.from_numpy(valid[s:s + T + 1][None])
                out = model(input_ids=x[:, :-1])
                losses.append(torch.nn.functional.cross_entropy(out.logits[0], x[0, 1:]).item())
        model.train()
        return float(np.mean(losses))

    model.train()
    while step < total_steps:
        elapsed = time.time() - t0
        if args.minutes and elapsed > args.minutes * 60:
            print(f"stopping at the --minutes cap after {seen/1e6:.2f} M tokens", file=sys.stderr)
            break
        frac = max(step / total_steps, elapsed / (args.minutes * 60) if args.minutes else 0.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(frac)
        starts = rng.integers(0, len(train) - T - 1, size=B)
        x = torch.from_numpy(np.stack([train[s:s + T + 1] for s in starts]))
        out = model(input_ids=x[:, :-1])
        logits = out.logits.float()
        if teacher is not None:
            with torch.no_grad():
                t_logits = teacher(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(t_logits, -1),
                                              log_target=True, reduction="batchmean") / T
        else:
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += T * B
        if step % args.log_every == 0 or step == total_steps:
            rate = seen / (time.time() - t0)
            msg = {"step": step, "tokens": seen, "loss": round(loss.item(), 4), "tok_s": round(rate),
                   "minutes": round((time.time() - t0) / 60, 2)}
            if step % (args.log_every * 10) == 0:
                msg["val_loss"] = round(evaluate(), 4)
            log.append(msg)
            print(json.dumps(msg), file=sys.stderr, flush=True)
    val = evaluate()
    out_dir = Path(args.out)
    model.config.use_cache = True
    model.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0, num_beams=4, max_new_tokens=128).save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out_dir / f).write_bytes((tok_dir / f).read_bytes())
    summary = {"params": n_params, "tokens": seen, "steps": step, "minutes": round((time.time() - t0) / 60, 1),
               "val_loss": round(val, 4), "args": vars(args), "torch": torch.__version__}
    (out_dir / "train_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    print(json.dumps(summary), file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    t.add_argument("--data", required=True, help="folder with train.tsv")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    m = sub.add_parser("lm", help="train a causal LM (CE, or KD when --teacher is given)")
    m.add_argument("--data", required=True, help="folder with train.tsv and valid.tsv")
    m.add_argument("--tokenizer", required=True, help="folder written by the tokenizer command")
    m.add_argument("--out", required=True, help="output HF model folder")
    m.add_argument("--layers", type=int, default=6, help="decoder layers")
    m.add_argument("--hidden", type=int, default=256, help="hidden size")
    m.add_argument("--heads", type=int, default=4, help="attention heads")
    m.add_argument("--kv_heads", type=int, default=2, help="key/value heads (GQA)")
    m.add_argument("--tokens", default="5e6", help="training tokens (sets the schedule)")
    m.add_argument("--minutes", type=float, default=0, help="wall-clock cap in minutes (0: none)")
    m.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    m.add_argument("--warmup", type=int, default=30, help="warm-up steps")
    m.add_argument("--batch", type=int, default=8, help="sequences per step")
    m.add_argument("--seq_len", type=int, default=256, help="tokens per sequence")
    m.add_argument("--init", default=None, help="start from this HF model folder")
    m.add_argument("--teacher", default=None, help="distil on this HF model folder's logits (KL, T=1)")
    m.add_argument("--threads", type=int, default=2, help="torch threads")
    m.add_argument("--seed", type=int, default=0, help="random seed")
    m.add_argument("--log_every", type=int, default=20, help="log every N steps")
    args = ap.parse_args(argv)
    if args.cmd == "tokenizer":
        train_tokenizer(Path(args.data), Path(args.out), args.vocab)
    else:
        train_lm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
