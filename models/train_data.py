"""The `lm` command's data: the byte-level BPE tokenizer (`tokenizer`), the corpus split encoded as training units
(whole pairs or text documents, length-filtered), and the deterministic, resumable epochs built from them: packed
rows for a decoder-only model (`Batches`), padded (source, target) batches for an encoder-decoder (`PairBatches`).
"""
from __future__ import annotations

import json
import math
import sys
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


def load_data(args, data: Path, tok_dir: Path):
    """The run's training batches, its validation batches (a fixed list), the model's vocabulary size (the
    tokenizer's, rounded up to a multiple of 64) and the pad id of an encoder-decoder (the separator; 1 otherwise)."""
    T, B = args.seq_len, args.batch
    filt = dict(max_tokens=T, max_ratio=args.max_ratio)
    units, sources = encode_units(data, tok_dir, "train", **filt)
    valid_units, _ = encode_units(data, tok_dir, "valid", **filt)
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())
    known = vocab["model"]["vocab"]
    vocab_size = len(known) + sum(1 for t in vocab["added_tokens"] if t["content"] not in known)
    vocab_size = int(math.ceil(vocab_size / 64) * 64)
    if args.arch == "m2m100":
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
    return batches, v_batches, vocab_size, sep
