"""Train a small model (target or draft: decoder-only Llama, or an M2M100 encoder-decoder) on the en->de pairs,
resumably.

A run lives in a checkpoint folder (--ckpt): `last.pt` holds the model, the optimizer, the schedule step and
the data position, written atomically every --ckpt_minutes and on SIGTERM / Ctrl-C, so a stopped run
continues where it stopped when the same command is run again (after a crash: from the last checkpoint).
`snap/` keeps the last --keep_snapshots weight snapshots (every --snapshot_every steps) for checkpoint
averaging (`average`), which writes the Hugging Face model folder (config.json, model.safetensors,
generation_config.json, tokenizer files, train_log.json) that `python -m export` and `models/ship.py` read.
PyTorch, CPU, fp32 (--bf16: forward passes, the teacher's included, under bfloat16 autocast); reproducible given
the seed, the data and the flags: the schedule is by steps, never by wall-clock time.

    python models/train.py tokenizer --data $DATA/ende/corpus --out $DATA/ende/tok
    python models/train.py lm --data $DATA/ende/corpus --tokenizer $DATA/ende/tok --ckpt $DATA/ende/run_target \
        --layers 8 --hidden 384 --heads 6 --kv_heads 2 --schedule invsqrt --tokens 1e9
    python models/train.py average --ckpt $DATA/ende/run_target --last 5 --out $DATA/ende/target
    python models/train.py distil --teacher models/ende/target --data $DATA/ende/corpus --out $DATA/ende/kd
    python models/train.py lm --data $DATA/ende/kd --tokenizer ... --ckpt $DATA/ende/run_draft \
        --layers 1 --hidden 128 --heads 2 --kv_heads 1 --teacher $DATA/ende/target --align_topk 4

What the first runs' logs showed and what changed (models/ende/README.md has the numbers):
- random 256-token windows started mid-pair and the loss covered the English side too; now whole pairs are
  packed into windows and only the German side (and its closing end-of-text) is scored;
- 72 k short UI labels (`mo`) outnumbered the 27 k help paragraphs the test set is drawn from: --mix weights
  the sources;
- misaligned pairs (one side three times the other) and over-long pairs are dropped (length filtering);
- no label smoothing: --label_smoothing 0.1, the usual setting for translation;
- a cosine schedule tied to a wall-clock cap cannot continue for days: --schedule invsqrt has no horizon,
  and `average` (mean of the last snapshots) stands in for the final decay.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
SEP = "<|de|>"
IGNORE = -100                                         # label value torch's cross_entropy skips


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


# ---------------------------------------------------------------------------------------------------- data

def encode_units(data: Path, tok_dir: Path, split: str, *, max_tokens: int, max_ratio: float):
    """The split as training units: a list of (ids, scored) int arrays and each unit's source name.

    Pairs: ids = [EOS, *en, SEP, *de]; scored marks the tokens that are loss targets (the German side, and the
    unit's leading EOS, which closes the previous unit's German side). Text documents: [EOS, *doc], all
    scored. Pairs longer than max_tokens, or whose sides differ more than max_ratio times in length (both
    sides >= 5 tokens: misaligned blocks), are dropped."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos, sep = tok.token_to_id(EOS), tok.token_to_id(SEP)
    units, sources, dropped = [], [], 0
    if (data / f"{split}.txt").exists():             # text corpus: whole documents, cut later by the packer
        docs = [json.loads(l) for l in open(data / f"{split}.txt", encoding="utf-8")]
        for enc in tok.encode_batch(docs, add_special_tokens=False):
            ids = np.asarray([eos, *enc.ids], np.int64)
            units.append((ids, np.ones(len(ids), bool)))
        return units, ["text"] * len(units)
    pairs = [line.rstrip("\n").split("\t") for line in open(data / f"{split}.tsv", encoding="utf-8")]
    src_file = data / f"{split}.source"
    names = src_file.read_text(encoding="utf-8").split() if src_file.exists() else ["all"] * len(pairs)
    if len(names) != len(pairs):
        raise SystemExit(f"{src_file} has {len(names)} lines but {split}.tsv has {len(pairs)}: rebuild the corpus")
    en = tok.encode_batch([p[0] for p in pairs], add_special_tokens=False)
    de = tok.encode_batch([p[1] for p in pairs], add_special_tokens=False)
    for a, b, name in zip(en, de, names):
        la, lb = len(a.ids), len(b.ids)
        if la + lb + 3 > max_tokens or (min(la, lb) >= 5 and max(la, lb) > max_ratio * min(la, lb)):
            dropped += 1
            continue
        ids = np.asarray([eos, *a.ids, sep, *b.ids], np.int64)
        scored = np.zeros(len(ids), bool)
        scored[0] = True
        scored[la + 2:] = True
        units.append((ids, scored))
        sources.append(name)
    print(f"{split}: {len(units)} pairs ({dropped} dropped by the length filters)", file=sys.stderr)
    return units, sources


def parse_mix(spec: str) -> dict[str, int]:
    """'libreoffice=3,gimp=2' -> {'libreoffice': 3, 'gimp': 2}; unnamed sources count once."""
    mix = {}
    for part in filter(None, spec.split(",")):
        name, _, w = part.partition("=")
        if not w.isdigit():
            raise SystemExit(f"--mix {spec!r}: each part is NAME=INTEGER (repeats per epoch), e.g. libreoffice=3")
        mix[name] = int(w)
    return mix


def pack(units, order, T: int, eos: int):
    """Pack whole units, in `order`, into rows of T+1 tokens. Returns ids [N, T+1] and labels [N, T]
    (IGNORE where a token is not scored). A row ends with an EOS that closes its last unit; the rest is
    padding. Units longer than a row (text documents) are cut into row-sized pieces."""
    rows, labels = [], []
    ids, scored = [], []

    def flush():
        if not ids:
            return
        row = np.full(T + 1, eos, np.int64)
        sc = np.zeros(T + 1, bool)
        n = len(ids)
        row[:n], sc[:n] = ids, scored
        sc[n] = n < T + 1 and bool(scored[-1])       # the closing EOS ends the last unit's German side
        lab = np.where(sc[1:], row[1:], IGNORE)
        rows.append(row)
        labels.append(lab)
        ids.clear()
        scored.clear()

    for i in order:
        u_ids, u_sc = units[i]
        for s in range(0, len(u_ids), T):
            piece_ids, piece_sc = u_ids[s:s + T], u_sc[s:s + T]
            if len(ids) + len(piece_ids) > T:        # keep one slot for the closing EOS
                flush()
            ids.extend(piece_ids.tolist())
            scored.extend(piece_sc.tolist())
    flush()
    return np.stack(rows), np.stack(labels)


class Batches:
    """Deterministic epochs of packed rows: epoch e shuffles the (mix-weighted) units with seed + e, so a
    run resumed at (epoch, row) sees exactly the rows it would have seen."""

    def __init__(self, units, sources, mix: dict[str, int], T: int, B: int, eos: int, seed: int):
        self.units, self.T, self.B, self.eos, self.seed = units, T, B, eos, seed
        self.index = np.asarray([i for i, s in enumerate(sources) for _ in range(mix.get(s, 1))], np.int64)
        self.epoch, self.row = 0, 0
        self._packed = None

    def _epoch_rows(self):
        if self._packed is None or self._packed[0] != self.epoch:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.index)
            self._packed = (self.epoch, *pack(self.units, order, self.T, self.eos))
        return self._packed[1], self._packed[2]

    def tokens_per_epoch(self) -> int:
        return int(sum(len(self.units[i][0]) for i in self.index))

    def next(self):
        ids, labels = self._epoch_rows()
        if self.row + self.B > len(ids):
            self.epoch, self.row = self.epoch + 1, 0
            ids, labels = self._epoch_rows()
        sl = slice(self.row, self.row + self.B)
        self.row += self.B
        return ids[sl, :-1], labels[sl]


def split_unit(ids: np.ndarray, scored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A pair unit [EOS, *en, SEP, *de] (scored from the German side on) -> (en, de)."""
    if not scored[1:].any():
        raise SystemExit("an encoder-decoder trains on translation pairs (train.tsv): this unit has no German side")
    k = 1 + int(np.argmax(scored[1:]))               # first German token
    return ids[1:k - 1], ids[k:]


class PairBatches:
    """Deterministic epochs of padded (source, target) batches for an encoder-decoder: epoch e shuffles the
    (mix-weighted) pairs with seed + e, sorts each window of 64 batches' worth of pairs by length (little
    padding), and cuts batches of at most `budget` padded tokens (source + target, the decoder-only rows'
    B x T). Resumes at (epoch, row) like Batches; row counts batches."""

    def __init__(self, units, sources, mix: dict[str, int], budget: int, eos: int, start: int, pad: int, seed: int):
        self.pairs = [split_unit(*u) for u in units]
        self.budget, self.eos, self.start, self.pad, self.seed = budget, eos, start, pad, seed
        self.index = np.asarray([i for i, s in enumerate(sources) for _ in range(mix.get(s, 1))], np.int64)
        self.epoch, self.row = 0, 0
        self._plan = None

    def tokens_per_epoch(self) -> int:
        return int(sum(len(self.pairs[i][0]) + len(self.pairs[i][1]) + 2 for i in self.index))

    def _size(self, i: int) -> tuple[int, int]:
        en, de = self.pairs[i]
        return len(en) + 1, len(de) + 1              # + EOS on the source; + start / EOS on the decoder side

    def _epoch_plan(self) -> list[np.ndarray]:
        if self._plan is None or self._plan[0] != self.epoch:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.index)
            plan, window = [], 64 * max(1, self.budget // 64)
            for s in range(0, len(order), window):
                chunk = sorted(order[s:s + window].tolist(), key=lambda i: self._size(i))
                cur, S, L = [], 0, 0
                for i in chunk:
                    a, b = self._size(i)
                    if cur and (len(cur) + 1) * (max(S, a) + max(L, b)) > self.budget:
                        plan.append(np.asarray(cur))
                        cur, S, L = [], 0, 0
                    cur.append(i)
                    S, L = max(S, a), max(L, b)
                if cur:
                    plan.append(np.asarray(cur))
            self._plan = (self.epoch, np.random.default_rng(self.seed + self.epoch).permutation(len(plan)), plan)
        return [self._plan[2][j] for j in self._plan[1]]

    def batch(self, idx) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """source ids [n, S] (pad), source mask [n, S], decoder input [n, L] (start, *de), labels [n, L]
        (*de, EOS; IGNORE on padding)."""
        S = max(self._size(i)[0] for i in idx)
        L = max(self._size(i)[1] for i in idx)
        src = np.full((len(idx), S), self.pad, np.int64)
        dec = np.full((len(idx), L), self.pad, np.int64)
        lab = np.full((len(idx), L), IGNORE, np.int64)
        for r, i in enumerate(idx):
            en, de = self.pairs[i]
            src[r, :len(en) + 1] = [*en, self.eos]
            dec[r, :len(de) + 1] = [self.start, *de]
            lab[r, :len(de) + 1] = [*de, self.eos]
        return src, (src != self.pad).astype(np.int64), dec, lab

    def next(self):
        plan = self._epoch_plan()
        if self.row >= len(plan):
            self.epoch, self.row = self.epoch + 1, 0
            plan = self._epoch_plan()
        idx = plan[self.row]
        self.row += 1
        return self.batch(idx)


# ---------------------------------------------------------------------------------------------- training

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


def scored_logits(model, x, keep):
    """Logits of the scored positions only: the LM head and the loss skip the English side (about half the
    tokens), which is most of a small model's head and softmax cost. x [B, T]; keep bool [B*T] -> [N, V]."""
    hidden = model.model(input_ids=x).last_hidden_state            # [B, T, H], after the final norm
    return model.lm_head(hidden.flatten(0, 1)[keep])


def encdec_logits(model, src, src_mask, dec, keep):
    """Logits of the scored decoder positions of an encoder-decoder: src/src_mask [B, S], dec [B, L], keep bool
    [B*L] -> [N, V]."""
    hidden = model.model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).last_hidden_state
    return model.lm_head(hidden.flatten(0, 1)[keep])


def load_pretrained(folder, arch: str):
    """An HF folder of this architecture (llama: decoder-only, m2m100: encoder-decoder), fp32."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM, M2M100ForConditionalGeneration

    kind = AutoConfig.from_pretrained(folder).model_type
    want = {"llama": "llama", "m2m100": "m2m_100"}[arch]
    if kind != want:
        raise SystemExit(f"{folder} holds a {kind} model; --arch {arch} needs a {want} folder")
    cls = M2M100ForConditionalGeneration if arch == "m2m100" else LlamaForCausalLM
    return cls.from_pretrained(folder, torch_dtype=torch.float32)


def load_init(args):
    """The --init model; with --init_layers, a draft cut from it: its embedding, these (decoder) layers, final
    norm and head (an encoder-decoder keeps its whole encoder: it runs once per request)."""
    arch = getattr(args, "arch", "llama")
    model = load_pretrained(args.init, arch)
    if not args.init_layers:
        return model
    stack = model.model.decoder if arch == "m2m100" else model.model
    n = len(stack.layers)
    keep = layer_list(args.init_layers)
    if not keep or any(not 0 <= i < n for i in keep) or len(set(keep)) != len(keep):
        raise SystemExit(f"--init_layers {args.init_layers}: distinct layer numbers separated by commas; "
                         f"{args.init} has {'decoder ' if arch == 'm2m100' else ''}layers 0..{n - 1}")
    return cut_layers(model, keep, arch)


def cut_layers(model, keep: list[int], arch: str = "llama"):
    """The model with only the (decoder) layers `keep`, renumbered, its config saying so (a draft cut from a
    target)."""
    import torch

    stack = model.model.decoder if arch == "m2m100" else model.model
    stack.layers = torch.nn.ModuleList(stack.layers[i] for i in keep)
    for j, layer in enumerate(stack.layers):
        layer.self_attn.layer_idx = j
        if arch == "m2m100":
            layer.encoder_attn.layer_idx = j
    if arch == "m2m100":
        model.config.decoder_layers = len(keep)
    else:
        model.config.num_hidden_layers = len(keep)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def layer_list(spec: str) -> list[int]:
    """--init_layers as numbers ([] when it is not a comma-separated list of integers)."""
    try:
        return [int(i) for i in spec.split(",")]
    except ValueError:
        return []


def share_target_encoder(model, args) -> None:
    """--freeze_encoder: a draft that shares its target's encoder output. The encoder, the shared embedding (tied
    to the head) and each kept decoder layer's cross-attention K/V projections stay the --init model's, and the
    config records which target layer each decoder layer came from (export: `target_cross_layers`; composed
    when --init is itself such a draft). Without it, an --init draft that shared its target's encoder trains an
    encoder of its own from now on, so it must not declare the target's (the export would drop it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from export.encdec import TARGET_CROSS_KEY

    prev = getattr(model.config, TARGET_CROSS_KEY, None)
    if not args.freeze_encoder:
        if prev is not None:
            delattr(model.config, TARGET_CROSS_KEY)
            print(f"note: the --init model shared its target's encoder ({TARGET_CROSS_KEY}); without "
                  f"--freeze_encoder this run trains its own", file=sys.stderr)
        return
    if args.arch != "m2m100" or not args.init:
        raise SystemExit("--freeze_encoder keeps an encoder-decoder's encoder from its --init model: pass --arch "
                         "m2m100 and --init")
    for p in [*model.model.shared.parameters(), *model.model.encoder.parameters()]:
        p.requires_grad_(False)
    for layer in model.model.decoder.layers:
        for p in [*layer.encoder_attn.k_proj.parameters(), *layer.encoder_attn.v_proj.parameters()]:
            p.requires_grad_(False)
    keep = layer_list(args.init_layers) if args.init_layers else list(range(len(model.model.decoder.layers)))
    setattr(model.config, TARGET_CROSS_KEY, keep if prev is None else [prev[i] for i in keep])


def build_model(args, vocab_size: int, sep: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.init_layers and not args.init:
        raise SystemExit("--init_layers cuts layers out of the --init model: pass --init too")
    if args.init:
        return load_init(args)
    if getattr(args, "arch", "llama") == "m2m100":
        from transformers import M2M100Config, M2M100ForConditionalGeneration

        # pad: the separator token, which an encoder-decoder never sees (EOS doubles as the decoder-only models'
        # pad, but an encoder masks its padding and M2M100's positions skip pad tokens: the pad id must be a row
        # of its position table, so a small id); the decoder starts from EOS, as fairseq's models do
        cfg = M2M100Config(vocab_size=vocab_size, d_model=args.hidden, encoder_layers=args.layers,
                           decoder_layers=args.layers, encoder_attention_heads=args.heads,
                           decoder_attention_heads=args.heads, encoder_ffn_dim=4 * args.hidden,
                           decoder_ffn_dim=4 * args.hidden, max_position_embeddings=512, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                           decoder_layerdrop=0.0, activation_function="relu", scale_embedding=True,
                           pad_token_id=sep, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
                           tie_word_embeddings=True)
        return M2M100ForConditionalGeneration(cfg)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=int(math.ceil(8 * args.hidden / 3 / 16) * 16),
                      max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)                            # a crash mid-write leaves the previous file intact


SHAPE_FLAGS = ("arch", "layers", "hidden", "heads", "kv_heads", "seq_len", "batch", "lr", "warmup", "schedule", "mix",
               "label_smoothing", "seed", "teacher", "align_topk", "align_weight", "kd_weight", "init", "init_layers",
               "freeze_encoder")


def train_lm(args) -> None:
    import torch

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    tok_dir, data, ckpt = Path(args.tokenizer), Path(args.data), Path(args.ckpt)
    if args.arch == "m2m100" and (data / "train.txt").exists():
        raise SystemExit(f"--arch m2m100 needs translation pairs: {data} holds a text corpus (train.txt)")
    ckpt.mkdir(parents=True, exist_ok=True)
    state = torch.load(ckpt / "last.pt", weights_only=False) if (ckpt / "last.pt").exists() else None
    if state is not None:                            # resuming: the run's defining flags must not change
        defining = SHAPE_FLAGS + (("tokens",) if args.schedule == "cosine" else ())   # cosine: its length
        saved = {**lm_defaults(), **state["args"]}   # a flag added after the run started: its default
        diff = {k: (saved.get(k), getattr(args, k)) for k in defining if saved.get(k) != getattr(args, k)}
        if diff:
            raise SystemExit(f"{ckpt} was started with other settings {diff} (saved, given): rerun with the saved "
                             f"settings to resume, or pass another --ckpt folder to start a new run")
    filt = dict(max_tokens=args.seq_len, max_ratio=args.max_ratio)
    units, sources = encode_units(data, tok_dir, "train", **filt)
    valid_units, _ = encode_units(data, tok_dir, "valid", **filt)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    known = vocab["model"]["vocab"]
    vocab_size = len(known) + sum(1 for t in vocab["added_tokens"] if t["content"] not in known)
    vocab_size = int(math.ceil(vocab_size / 64) * 64)
    T, B = args.seq_len, args.batch
    encdec = args.arch == "m2m100"
    if encdec:
        from tokenizers import Tokenizer
        sep = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id(SEP)
        kw = dict(budget=T * B, eos=0, start=0, pad=sep)
        batches = PairBatches(units, sources, parse_mix(args.mix), seed=args.seed, **kw)
        valid = PairBatches(valid_units, ["all"] * len(valid_units), {}, seed=0, **kw)
        v_batches = [valid.batch(idx) for idx in valid._epoch_plan()]
    else:
        sep = 1
        batches = Batches(units, sources, parse_mix(args.mix), T, B, eos=0, seed=args.seed)
        v_ids, v_lab = pack(valid_units, range(len(valid_units)), T, 0)
        v_batches = [(v_ids[s:s + 16, :-1], v_lab[s:s + 16]) for s in range(0, len(v_ids), 16)]

    def logits_of(m, batch, keep, bf16=False):
        """Logits [N scored, V] fp32; bf16: the forward pass under bfloat16 autocast (training steps only)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if encdec:
                src, mask, dec, _ = (torch.from_numpy(a) for a in batch)
                out = encdec_logits(m, src, mask, dec, keep)
            else:
                out = scored_logits(m, torch.from_numpy(batch[0]), keep)
        return out.float()

    model = build_model(args, vocab_size, sep)
    model.config.use_cache = False
    if args.bf16 and not any(getattr(torch.cpu, f, lambda: True)() for f in ("_is_avx512_bf16_supported",
                                                                             "_is_amx_tile_supported")):
        print("warning: --bf16 on a CPU without AVX512-BF16 or AMX runs slower than fp32", file=sys.stderr)
    if args.freeze_encoder or args.arch == "m2m100":
        share_target_encoder(model, args)
    teacher = None
    if args.teacher:
        teacher = load_pretrained(args.teacher, args.arch).eval()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    step, seen, log, minutes_before = 0, 0, [], 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, seen, log, minutes_before = state["step"], state["seen"], state["log"], state["minutes"]
        batches.epoch, batches.row = state["epoch"], state["row"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed {ckpt} at step {step} ({seen/1e6:.2f} M tokens, epoch {batches.epoch})", file=sys.stderr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params/1e6:.2f} M; scored+context tokens per epoch {batches.tokens_per_epoch()/1e6:.2f} M",
          file=sys.stderr)
    (ckpt / "snap").mkdir(exist_ok=True)
    model.config.save_pretrained(ckpt)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).write_bytes((tok_dir / f).read_bytes())
    total_steps = max(1, int(float(args.tokens)) // (T * B))

    def evaluate() -> float:
        """Mean CE (no smoothing) of the German side of the validation pairs (and its closing EOS)."""
        model.eval()
        tot, n = 0.0, 0
        with torch.no_grad():
            for batch in v_batches:
                y = torch.from_numpy(batch[-1]).flatten()
                keep = y != IGNORE
                tot += torch.nn.functional.cross_entropy(logits_of(model, batch, keep), y[keep],
                                                         reduction="sum").item()
                n += int(keep.sum())
        model.train()
        return tot / n

    def save() -> None:
        minutes = minutes_before + (time.time() - t0) / 60
        atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "seen": seen,
                     "epoch": batches.epoch, "row": batches.row, "log": log, "minutes": minutes,
                     "torch_rng": torch.get_rng_state(), "args": vars(args), "params": n_params}, ckpt / "last.pt")
        print(f"checkpoint at step {step} -> {ckpt}", file=sys.stderr, flush=True)

    def snapshot() -> None:
        atomic_save(model.state_dict(), ckpt / "snap" / f"step{step:08d}.pt")
        for old in sorted((ckpt / "snap").glob("step*.pt"))[:-args.keep_snapshots]:
            old.unlink()

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):       # finish the step, save, exit
        signal.signal(sig, lambda num, _: stop.append(signal.Signals(num).name))
    model.train()
    t0 = last_save = time.time()
    cpu0 = time.process_time()
    first_seen = seen
    while step < total_steps and not stop:
        if args.minutes and time.time() - t0 > args.minutes * 60:
            print(f"stopping at the --minutes cap after {seen/1e6:.2f} M tokens", file=sys.stderr)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        batch = batches.next()
        y = torch.from_numpy(batch[-1]).flatten()
        keep = y != IGNORE
        s_flat = logits_of(model, batch, keep, args.bf16)           # [N scored, V]
        loss = torch.nn.functional.cross_entropy(s_flat, y[keep], label_smoothing=args.label_smoothing)
        parts = {"ce": round(loss.item(), 4)}
        if teacher is not None:                                     # token-level KD and top-K alignment
            with torch.no_grad():
                t_flat = logits_of(teacher, batch, keep, args.bf16)
            kd = torch.nn.functional.kl_div(torch.log_softmax(s_flat, -1), torch.log_softmax(t_flat, -1),
                                            log_target=True, reduction="batchmean")
            loss = loss + args.kd_weight * kd
            parts["kd"] = round(kd.item(), 4)
            if args.align_topk:
                al = align_loss(s_flat, t_flat, args.align_topk, args.align_margin)
                loss = loss + args.align_weight * al
                parts["align"] = round(al.item(), 4)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += batch[0].size + batch[2].size if encdec else T * B   # m2m100: padded source + decoder input
        if step % args.log_every == 0:
            wall = time.time() - t0
            msg = {"step": step, "tokens": seen, "loss": round(loss.item(), 4), **parts,
                   "lr": round(lr_at(step, args), 6), "epoch": batches.epoch,
                   "tok_s": round((seen - first_seen) / wall),
                   "cpu_util": round((time.process_time() - cpu0) / wall, 2),
                   "minutes": round(minutes_before + wall / 60, 2)}
            if step % (args.log_every * args.eval_every) == 0:
                msg["val_loss"] = round(evaluate(), 4)
            log.append(msg)
            print(json.dumps(msg), file=sys.stderr, flush=True)
        if step % args.snapshot_every == 0:
            snapshot()
        if time.time() - last_save > args.ckpt_minutes * 60:
            save()
            last_save = time.time()
    if stop:
        print(f"{stop[0]}: saving and exiting", file=sys.stderr)
    log.append({"step": step, "tokens": seen, "val_loss": round(evaluate(), 4)})
    save()
    snapshot()
    print(json.dumps(log[-1]), file=sys.stderr)


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


def distil(args) -> None:
    """Sequence-level KD data: the teacher's own beam-search translations of the training sources, written as a
    corpus folder (train.tsv with the teacher's output as the German side; valid/test copied). With
    --return_beams K, all K final beams are written (the draft learns the target's top-K, as AtSpeed does)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from specbeam_edge import Engine

    data, out = Path(args.data), Path(args.out)
    if (out / "train.tsv").exists():
        print(f"distil: {out / 'train.tsv'} exists (delete it to regenerate)", file=sys.stderr)
        return
    rows = [l.rstrip("\n").split("\t") for l in open(data / "train.tsv", encoding="utf-8")]
    has_names = (data / "train.source").exists()
    names = (data / "train.source").read_text(encoding="utf-8").split() if has_names else ["all"] * len(rows)
    if args.sources:                                  # only these corpora (e.g. the test's domain)
        if not has_names:
            raise SystemExit(f"distil --sources needs {data / 'train.source'} (each pair's corpus name)")
        keep = set(args.sources.split(","))
        unknown = sorted(keep - set(names))
        if unknown:
            raise SystemExit(f"distil --sources {args.sources}: no pairs from {unknown}; "
                             f"{data / 'train.source'} names {sorted(set(names))}")
        rows, names = [r for r, n in zip(rows, names) if n in keep], [n for n in names if n in keep]
    out.mkdir(parents=True, exist_ok=True)
    part = out / "train.partial.tsv"                 # resumable: lines already written are skipped
    done = sum(1 for _ in open(part, encoding="utf-8")) // args.return_beams if part.exists() else 0
    engine = Engine(args.teacher)
    with open(part, "a", encoding="utf-8") as f, open(out / "train.partial.source", "a", encoding="utf-8") as fs:
        end = min(len(rows), args.limit or len(rows))
        for s in range(done, end, args.chunk):
            chunk = rows[s:min(s + args.chunk, end)]
            res = engine.generate([engine.tokenizer.format_prompt(r[0]) for r in chunk], num_beams=args.num_beams,
                                  num_return_sequences=args.return_beams, max_new_tokens=args.max_new_tokens)
            for r, name, hyp in zip(chunk, names[s:s + args.chunk], res):
                for h in hyp.hypotheses[:args.return_beams]:
                    f.write(f"{r[0]}\t{' '.join(h.text.split())}\n")
                    fs.write(f"{name}\n")
            f.flush()
            fs.flush()
            print(f"distil: {s + len(chunk)} of {len(rows)} sources", file=sys.stderr, flush=True)
    os.replace(part, out / "train.tsv")
    os.replace(out / "train.partial.source", out / "train.source")
    for f in ("valid.tsv", "valid.source", "test.tsv", "test.source"):
        if (data / f).exists():
            (out / f).write_bytes((data / f).read_bytes())


def bleu(args) -> None:
    """BLEU / chrF of a trained Hugging Face folder (either architecture) on held-out pairs, with PyTorch's
    generate (the same decoding for both, so architectures compare before any export)."""
    import sacrebleu
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    torch.set_num_threads(args.threads)
    folder = Path(args.model)
    cfg = AutoConfig.from_pretrained(folder)
    model = (AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM).from_pretrained(folder).eval()
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos, sep, n_tok = tok.token_to_id(EOS), tok.token_to_id(SEP), tok.get_vocab_size()
    pairs = [l.rstrip("\n").split("\t") for l in open(args.test, encoding="utf-8")][:args.lines]
    hyps, t0 = [], time.time()
    with torch.no_grad():
        for en, _ in pairs:
            ids = tok.encode(en, add_special_tokens=False).ids
            kw = dict(num_beams=args.num_beams, do_sample=False, max_new_tokens=args.max_new_tokens,
                      eos_token_id=eos, pad_token_id=cfg.pad_token_id)   # the rest from generation_config.json
            if cfg.is_encoder_decoder:
                out = model.generate(input_ids=torch.tensor([[*ids, eos]]),
                                     decoder_start_token_id=cfg.decoder_start_token_id, **kw)[0, 1:]
            else:
                prompt = [eos, *ids, sep]
                out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                     **kw)[0, len(prompt):]
            hyps.append(tok.decode([t for t in out.tolist() if t != eos and t < n_tok]))
    refs = [p[1] for p in pairs]
    report = {"model": folder.name, "arch": cfg.model_type, "lines": len(pairs), "num_beams": args.num_beams,
              "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
              "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(report))


def lm_defaults() -> dict:
    """Every `lm` flag's default: what a run started before the flag existed trained with."""
    return vars(build_parser().parse_args(["lm", "--data", "", "--tokenizer", "", "--ckpt", ""]))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    t.add_argument("--data", required=True, help="folder with train.tsv")
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    m = sub.add_parser("lm", help="train (or resume) a model (decoder-only, or --arch m2m100 encoder-decoder); KD "
                                  "and top-K alignment when --teacher is given")
    m.add_argument("--data", required=True, help="folder with train.tsv and valid.tsv (+ .source files for --mix)")
    m.add_argument("--tokenizer", required=True, help="folder with tokenizer.json and tokenizer_config.json")
    m.add_argument("--ckpt", required=True, help="run folder: checkpoints, snapshots; resumed when it has last.pt")
    m.add_argument("--arch", choices=("llama", "m2m100"), default="llama",
                   help="llama: decoder-only (the prompt format's source and translation in one sequence); m2m100: "
                        "encoder-decoder (NLLB's architecture: pre-norm, --layers encoder and --layers decoder "
                        "layers, FFN 4 x hidden, one embedding for encoder, decoder and head)")
    m.add_argument("--layers", type=int, default=6, help="decoder layers (m2m100: per stack)")
    m.add_argument("--hidden", type=int, default=256, help="hidden size")
    m.add_argument("--heads", type=int, default=4, help="attention heads")
    m.add_argument("--kv_heads", type=int, default=2, help="key/value heads (GQA; llama)")
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
    a = sub.add_parser("average", help="average a run's last snapshots into an HF model folder")
    a.add_argument("--ckpt", required=True, help="run folder written by `lm`")
    a.add_argument("--last", type=int, default=5, help="average the last N snapshots")
    a.add_argument("--out", required=True, help="output HF model folder")
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
    b = sub.add_parser("bleu", help="BLEU / chrF of a trained HF folder on held-out pairs (PyTorch generate)")
    b.add_argument("--model", required=True, help="HF model folder written by `average`")
    b.add_argument("--test", required=True, help="held-out pairs (english<TAB>german)")
    b.add_argument("--lines", type=int, default=300, help="the first N pairs")
    b.add_argument("--num_beams", type=int, default=4, help="beam width (1: greedy)")
    b.add_argument("--max_new_tokens", type=int, default=160, help="generation limit")
    b.add_argument("--threads", type=int, default=2, help="torch threads")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "tokenizer":
        train_tokenizer(Path(args.data), Path(args.out), args.vocab)
    elif args.cmd == "average":
        average(args)
    elif args.cmd == "distil":
        distil(args)
    elif args.cmd == "bleu":
        bleu(args)
    else:
        train_lm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
