"""Reference beam-search step with the exact semantics of transformers' `generate(num_beams=K)` (DESIGN s. 7).

The state holds node ids of a TokenTree instead of token tensors; the arithmetic mirrors transformers'
`_beam_search` in float32, including its -1e9 sentinels, so scores and choices match it. K = 1 is greedy
decoding (transformers' greedy path: argmax, stop at EOS).
"""
from __future__ import annotations

import numpy as np

from .tree import TokenTree

NEG = np.float32(-1.0e9)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _top(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, sorted descending, ties by lower index (deterministic).

    Over a beam x vocabulary row (32k values at K=4), argpartition cost 0.5 ms a step; instead the k-th largest
    of a strided sample bounds the k-th largest overall from below, so one comparison leaves a few candidates."""
    n = len(values)
    if k >= n:
        part = np.arange(n)
    else:
        sample = values[::16] if n >= 64 * k else values
        thresh = np.partition(sample, len(sample) - k)[len(sample) - k]
        part = np.flatnonzero(values >= thresh)
    return part[np.lexsort((part, -values[part]))][:k]


class BeamSearch:
    """One request's beam-search state; `step` consumes the processed log-probs of the running beams."""

    def __init__(self, tree: TokenTree, start_node: int, *, num_beams: int, prompt_len: int, max_new_tokens: int,
                 eos_token_ids, length_penalty: float = 1.0, early_stopping=False, min_new_tokens: int = 0):
        self.tree, self.K, self.P = tree, num_beams, prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.eos = np.array(sorted(set(int(e) for e in eos_token_ids)), dtype=np.int64)
        self.lp, self.early, self.min_new = float(length_penalty), early_stopping, min_new_tokens
        self.M = max(2, 1 + len(self.eos)) * num_beams
        self.cur_len = tree.depth(start_node) + 1   # > prompt_len when forced tokens (a language code) count as generated
        self.running = [start_node] * num_beams
        self.scores = np.full(num_beams, NEG, np.float32)
        self.scores[0] = 0
        self.fin_scores = np.full(num_beams, NEG, np.float32)
        self.fin_nodes = [-1] * num_beams
        self.fin_done = np.zeros(num_beams, bool)
        self.improvable = True
        self.done = False

    def process(self, logp: np.ndarray) -> np.ndarray:
        """Logits processors on log-probs [K, V] (min_new_tokens masks EOS)."""
        if self.cur_len - self.P < self.min_new and len(self.eos):
            logp = logp.copy()
            logp[:, self.eos] = -np.inf
        return logp

    def step(self, logp: np.ndarray) -> list[int]:
        """Advance one token; logp: fp32 log_softmax of the running beams' logits [K, V]. Returns the new
        running nodes (registered in the tree; they may not be scored yet)."""
        if self.done:
            raise RuntimeError("beam search already finished")
        logp = self.process(logp)
        if self.K == 1:
            return self._greedy_step(logp[0])
        K, V = logp.shape
        acc = (self.scores[:, None] + logp).reshape(-1)
        idx = _top(acc, self.M)
        topv = acc[idx]
        beam, tok = idx // V, idx % V
        hit = (tok[:, None] == self.eos).any(axis=1) | (self.cur_len + 1 >= self.max_length)   # np.isin sorts: 0.5 ms
        # running beams for the next step: the best K candidates that did not stop
        run_scores = topv + hit.astype(np.float32) * NEG
        nxt = _top(run_scores, K)
        # finished hypotheses: only candidates ranked < K that stopped, normalised by generated length ** lp
        cand = topv / np.float32((self.cur_len + 1 - self.P) ** self.lp)
        full = bool(self.fin_done.all()) and self.early is True
        cand = cand + np.float32(full) * NEG + np.float32(not self.improvable) * NEG
        just = hit & (np.arange(len(idx)) < K)
        cand = cand + (~just).astype(np.float32) * NEG
        merged = np.concatenate([self.fin_scores, cand.astype(np.float32)])
        keep = _top(merged, K)
        cand_nodes = [None] * len(idx)
        for j in np.flatnonzero(just):
            cand_nodes[j] = self.tree.add(self.running[beam[j]], tok[j])
        nodes = self.fin_nodes + cand_nodes
        done_flags = np.concatenate([self.fin_done, just])
        self.fin_scores, self.fin_done = merged[keep], done_flags[keep]
        self.fin_nodes = [nodes[i] if nodes[i] is not None else -1 for i in keep]
        self.running = [self.tree.add(self.running[beam[j]], tok[j]) for j in nxt]
        self.scores = run_scores[nxt].astype(np.float32)
        self.cur_len += 1
        # early-stop heuristic (sticky)
        if self.early == "never" and self.lp > 0.0:
            L = self.max_length - self.P
        else:
            L = self.cur_len - self.P
        best = self.scores[0] / np.float32(L ** self.lp)
        worst = np.where(self.fin_done, self.fin_scores.min(), NEG)
        self.improvable = self.improvable and bool((best > worst).any())
        open_beam = not (bool(self.fin_done.all()) and self.early is True)
        self.done = not (self.improvable and open_beam and not bool(hit.all()))
        return self.running

    def _greedy_step(self, row: np.ndarray) -> list[int]:
        tok = int(np.argmax(row))
        node = self.tree.add(self.running[0], tok)
        self.scores[0] += row[tok]
        self.cur_len += 1
        if tok in self.eos or self.cur_len >= self.max_length:
            self.fin_nodes[0] = node
            self.fin_scores[0] = self.scores[0] / np.float32((self.cur_len - self.P) ** self.lp)
            self.fin_done[0] = True
            self.done = True
        self.running = [node]
        return self.running

    def hypotheses(self, n: int) -> list[tuple[list[int], float]]:
        """The best n finished hypotheses: (generated tokens incl. EOS, normalised score), best first."""
        out = []
        for node, score, ok in zip(self.fin_nodes, self.fin_scores, self.fin_done):
            if node >= 0:
                out.append((self.tree.path(node)[self.P:], float(score)))
        if not out:  # cannot happen with max_new_tokens >= 1, kept for safety
            out = [(self.tree.path(self.running[0])[self.P:], float(self.scores[0]))]
        return out[:n]

    def stable_prefix(self) -> list[int]:
        """Generated tokens that every running beam and every finished hypothesis share: final for sure."""
        nodes = list(self.running) + [n for n, ok in zip(self.fin_nodes, self.fin_done) if ok]
        paths = [self.tree.path(n)[self.P:] for n in set(nodes)]
        if not paths:
            return []
        n = min(len(p) for p in paths)
        for i in range(n):
            t = paths[0][i]
            if any(p[i] != t for p in paths[1:]):
                return paths[0][:i]
        return paths[0][:n]
