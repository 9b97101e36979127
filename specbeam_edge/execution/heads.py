"""What a model pass returns for the nodes it scored: one type per head kind (DESIGN section 11).

`DenseOutput` holds a logit row per node (the usual head); `TopKOutput` holds a top-k head's sorted log-probs and token
ids per node (export --output_kind topk: no full-vocabulary row leaves the graph). Both answer the two
questions the runtime asks, so no consumer branches on the kind:

- `beam_rows(pairs, vocab, logits)`: the log-probs of rows picked from one or more pass outputs as a
  `beam.BeamRows` (beam search replays over rows of different passes): dense [R, V] rows (with their logits when
  asked), or a top-k head's k entries only, never a vocabulary-sized row;
- `top(rows, width)`: each row's `width` most probable tokens and their log-probs (the drafters).
"""
from __future__ import annotations

import numpy as np

from ..decoding.beam import BeamRows, log_softmax


class DenseOutput:
    """Logits [Q, V] fp32 of Q scored nodes."""

    def __init__(self, logits: np.ndarray):
        self.logits = logits

    def take(self, rows) -> "DenseOutput":
        return DenseOutput(self.logits[rows])

    def limit(self, k: int | None) -> "DenseOutput":
        return self

    def log_probs(self) -> np.ndarray:
        """[Q, V] log-softmax of every row."""
        return log_softmax(self.logits)

    @staticmethod
    def beam_rows(pairs: list[tuple["DenseOutput", int]], vocab: int, logits: bool = False) -> BeamRows:
        """logits: keep the raw rows beside the log-probs (a processor acts on them: greedy repetition_penalty);
        off, no ban or force copies them."""
        x = np.stack([h.logits[j] for h, j in pairs]).astype(np.float32, copy=False)
        return BeamRows(log_softmax(x), logits=x if logits else None)

    def top(self, rows, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [R, w], log-probs [R, w]) of each row's w best tokens (unordered within a row)."""
        logp = log_softmax(self.logits[rows])
        w = min(width, logp.shape[1])
        if w < logp.shape[1]:
            ids = _top_ids(logp, w)
        else:
            ids = np.tile(np.arange(logp.shape[1]), (len(logp), 1))
        return ids, np.take_along_axis(logp, ids, axis=1)

    @staticmethod
    def join(parts: list) -> "DenseOutput":
        return parts[0] if len(parts) == 1 else DenseOutput(_rows(parts, lambda p: p.logits))


def _top_ids(x: np.ndarray, w: int) -> np.ndarray:
    """Indices [R, w] of each row's w largest values (unordered). argpartition over whole 8,192-token rows cost
    0.36 ms a draft pass (a fifth of a K=1 speculative run, cProfile); instead the w-th largest of a strided
    sample bounds each row's w-th largest from below, one comparison leaves a few dozen candidates, and only
    those are partitioned (beam._top does the same for beam steps)."""
    R, V = x.shape
    if V < 64 * w:
        return np.argpartition(-x, w - 1, axis=1)[:, :w]
    sample = x[:, ::16]
    thresh = np.partition(sample, sample.shape[1] - w, axis=1)[:, sample.shape[1] - w]
    out = np.empty((R, w), np.int64)
    for r in range(R):
        cand = np.flatnonzero(x[r] >= thresh[r])
        out[r] = cand if len(cand) == w else cand[np.argpartition(-x[r, cand], w - 1)[:w]]
    return out


class TopKOutput:
    """A top-k head's log-probs [Q, k] (sorted, best first) and token ids [Q, k] of Q scored nodes; with a
    lookahead head (export/ahead.py) also each node's guesses of the token after its best next token
    (`ahead_ids`, `ahead_logprobs` [Q, guesses], best first)."""

    def __init__(self, logprobs: np.ndarray, ids: np.ndarray, ahead_logprobs: np.ndarray | None = None,
                 ahead_ids: np.ndarray | None = None):
        self.logprobs, self.ids = logprobs, ids
        self.ahead_logprobs, self.ahead_ids = ahead_logprobs, ahead_ids

    def _ahead(self, rows) -> tuple:
        return (None, None) if self.ahead_ids is None else (self.ahead_logprobs[rows], self.ahead_ids[rows])

    def take(self, rows) -> "TopKOutput":
        return TopKOutput(self.logprobs[rows], self.ids[rows], *self._ahead(rows))

    def limit(self, k: int | None) -> "TopKOutput":
        """The first k entries of each row (a batched pass runs with the largest k its requests asked for)."""
        if k is None:
            return self
        return TopKOutput(self.logprobs[:, :k], self.ids[:, :k], self.ahead_logprobs, self.ahead_ids)

    def log_probs(self) -> np.ndarray:
        raise ValueError("a top-k head has no full distribution (sampling needs a logits head)")

    @staticmethod
    def beam_rows(pairs: list[tuple["TopKOutput", int]], vocab: int, logits: bool = False) -> BeamRows:
        """The beams' k entries as they are: beam search never builds a vocabulary-sized row (beam.BeamRows). A
        top-k head has no logits (the engine refuses the processors that need them)."""
        return BeamRows(np.stack([h.logprobs[j] for h, j in pairs]), np.stack([h.ids[j] for h, j in pairs]), vocab)

    def top(self, rows, width: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[rows, :width], self.logprobs[rows, :width]

    @staticmethod
    def join(parts: list) -> "TopKOutput":
        if len(parts) == 1:
            return parts[0]
        read = [p for p in parts if not isinstance(p, Unread)]
        ahead = (None, None) if any(p.ahead_ids is None for p in read) else \
            (_rows(parts, lambda p: p.ahead_logprobs), _rows(parts, lambda p: p.ahead_ids))
        return TopKOutput(_rows(parts, lambda p: p.logprobs), _rows(parts, lambda p: p.ids), *ahead)


class Unread:
    """The rows of a pass that no caller reads (before a ScoreCall's `head_from`: a long prompt's chunks before its
    last), counted, not kept: a join gives them zero rows."""

    def __init__(self, rows: int):
        self.rows = rows


def join(parts: list, model) -> DenseOutput | TopKOutput:
    """The output of one call's passes, in order (batch.score_batch's chunks); Unread parts read as zeros."""
    read = [p for p in parts if not isinstance(p, Unread)]
    if not read:             # nothing of it is read: zero rows of the model's kind
        read = [empty(model)]
        parts = [read[0]] + parts
    return type(read[0]).join(parts)


def _rows(parts: list, field) -> np.ndarray:
    """The parts' arrays `field(part)` stacked along rows, an Unread part's rows left zero: never written, so a
    long prompt's unread logits take no memory (np.zeros maps a large array's pages on their first write)."""
    like = field(next(p for p in parts if not isinstance(p, Unread)))
    n = [p.rows if isinstance(p, Unread) else len(field(p)) for p in parts]
    out = np.zeros((sum(n),) + like.shape[1:], like.dtype)
    at = 0
    for p, k in zip(parts, n):
        if not isinstance(p, Unread):
            out[at:at + k] = field(p)
        at += k
    return out


def wrap(raw) -> list:
    """A batched OnnxCausalLM.run head output (logits [B, n_new, V], or a top-k head's (logprobs, ids) pair of
    [B, n_new, k], followed by a lookahead head's (logprobs, ids) [B, n_new, guesses]) -> one object per batch
    row."""
    if isinstance(raw, tuple):
        return [TopKOutput(*row) for row in zip(*raw)]
    return [DenseOutput(x) for x in raw]


def empty(model) -> DenseOutput | TopKOutput:
    if model.cfg.output == "topk":
        return TopKOutput(np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int64))
    return DenseOutput(np.zeros((0, model.cfg.vocab_size), np.float32))
