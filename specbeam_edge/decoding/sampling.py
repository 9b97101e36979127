"""Beam sampling and its speculative version with dynamic width (DSBD; DESIGN section 8).

Beam sampling (the reference): live beams b with scores s(b) (sum of the target's log-probs along the path).
Each step forms the joint distribution over (beam, token): softmax((s(b) + log p(y|b)) / T) over the flattened
[beams x V] row, with top-k / top-p applied to that joint, and draws K pairs **independently (with
replacement)**. A drawn EOS finishes a hypothesis; the others are the next live beams (score s(b) + log p(y|b)).
The answer is the hypothesis (finished, or alive at max length) with the best score / generated length
(EOS counted).

Why with replacement: the multi-draft rejection rule (accept x ~ q with min(1, p/q), residual
norm(max(p - q, 0)), reset to p after an acceptance) makes each accepted sample an independent draw from p.
It therefore reproduces i.i.d. draws exactly, not draws without replacement; the reference is defined to
match, so the speculative output distribution is *equal* to it.
"""
from __future__ import annotations

import numpy as np


def joint_probs(scores: np.ndarray, logp: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0) -> np.ndarray:
    """[n, V] -> flattened probabilities over (beam, token) of softmax((score + logp) / T), top-k/top-p."""
    z = (scores[:, None].astype(np.float64) + logp.astype(np.float64)).ravel() / temperature
    keep = np.isfinite(z)
    if top_k and top_k < keep.sum():
        kth = np.partition(z[keep], -top_k)[-top_k]
        keep &= z >= kth
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        cut = int(np.searchsorted(csum, top_p)) + 1     # smallest prefix with mass >= top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[:cut]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def draw(p: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """n independent draws (indices) from the probability vector p."""
    c = np.cumsum(p)
    return np.minimum(np.searchsorted(c, rng.random(n) * c[-1], side="right"), len(p) - 1)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p


def acceptance_count_dist(p: np.ndarray, q: np.ndarray, m: int) -> np.ndarray:
    """P(A = a) for a = 0..m: A = acceptances among m i.i.d. drafts from q walked with the multi-draft rule.

    The chance that a try is accepted depends only on r, the rejections since the last acceptance:
    alpha_r = sum min(p_r, q) with p_0 = p, p_{r+1} = residual(p_r, q). DP over (accepted, streak)."""
    alphas, cur = [], p
    for _ in range(m):
        alphas.append(float(np.minimum(cur, q).sum()))
        cur = residual(cur, q)
    state = {(0, 0): 1.0}
    for _ in range(m):
        nxt: dict = {}
        for (a, r), pr in state.items():
            al = alphas[r]
            nxt[(a + 1, 0)] = nxt.get((a + 1, 0), 0.0) + pr * al
            nxt[(a, r + 1)] = nxt.get((a, r + 1), 0.0) + pr * (1 - al)
        state = nxt
    out = np.zeros(m + 1)
    for (a, _), pr in state.items():
        out[a] += pr
    return out


def choose_width(p: np.ndarray, q: np.ndarray, m: int, threshold: float, floor: int, cap: int) -> int:
    """Largest k with P(A >= k) >= threshold, clipped to [floor, cap]; threshold 0 keeps the width at cap."""
    if threshold <= 0:
        return cap
    tail = np.cumsum(acceptance_count_dist(p, q, m)[::-1])[::-1]   # tail[k] = P(A >= k)
    ks = [k for k in range(m + 1) if tail[k] >= threshold]
    return int(min(cap, max(floor, max(ks) if ks else 0)))


def verify_level(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, k: int,
                 rng: np.random.Generator) -> tuple[list[int], int]:
    """Walk the drafts (indices into the shared (node, token) space, i.i.d. from q) with the multi-draft rule
    until k are accepted. Returns (k samples distributed i.i.d. as p, how many were accepted drafts).
    A short level completes with one draw from the residual and fresh draws from p."""
    if q is None:
        raise ValueError("speculative sampling needs the draft's sampling distribution q: drafts from beam "
                         "search or best-first growth are not samples and cannot be verified with p/q")
    out, cur = [], p
    for x in drafts:
        if len(out) >= k:
            break
        ratio = cur[x] / q[x] if q[x] > 0 else 0.0
        if rng.random() < min(1.0, ratio):
            out.append(int(x))
            cur = p
        else:
            cur = residual(cur, q)
    accepted = len(out)
    if accepted == k:
        return out, accepted
    out.append(int(draw(cur, 1, rng)[0]))
    if len(out) < k:
        out.extend(int(i) for i in draw(p, k - len(out), rng))
    return out, accepted


class SampleState:
    """Live beams (a multiset of tree nodes), their scores, finished hypotheses; one level per `advance`."""

    def __init__(self, tree, start: int, *, prompt_len: int, max_new_tokens: int, eos, min_new_tokens: int,
                 temperature: float, top_k: int, top_p: float):
        self.tree, self.prompt_len = tree, prompt_len
        self.max_len = prompt_len + max_new_tokens
        self.eos = np.array(sorted(set(int(e) for e in eos)), dtype=np.int64)
        self.min_new, self.T, self.top_k, self.top_p = min_new_tokens, temperature, top_k, top_p
        self.live = [start]
        self.score = {start: 0.0}
        self.finished: list[int] = []
        self.cur_len = tree.depths[start] + 1   # > prompt_len when forced tokens count as generated
        self.widths: list[int] = []

    @property
    def done(self) -> bool:
        return not self.live or self.cur_len >= self.max_len

    def process(self, logp: np.ndarray, cur_len: int) -> np.ndarray:
        if cur_len - self.prompt_len < self.min_new and len(self.eos):
            logp = logp.copy()
            logp[..., self.eos] = -np.inf
        return logp

    def joint(self, space: list[int], nodes: list[int], logp_of, scores: dict, cur_len: int) -> np.ndarray:
        """Probabilities over (node in `space`, token), flattened; zero for space nodes not in `nodes`.
        Multiplicity of a node among `nodes` multiplies its mass (beams are a multiset)."""
        uniq, mult = np.unique(np.array(nodes), return_counts=True)
        rows = self.process(np.stack([logp_of(int(n)) for n in uniq]), cur_len)
        V = rows.shape[1]
        z = (np.array([scores[int(n)] for n in uniq])[:, None] + rows) / self.T + np.log(mult)[:, None]
        p_small = joint_probs(np.zeros(len(uniq)), z, 1.0, self.top_k, self.top_p).reshape(len(uniq), V)
        if list(uniq) == list(space):
            return p_small.ravel()
        p = np.zeros((len(space), V))
        where = {n: i for i, n in enumerate(space)}
        for j, n in enumerate(uniq):
            p[where[int(n)]] = p_small[j]
        return p.ravel()

    def advance(self, picks, space: list[int], V: int, target_logp_of) -> list[int]:
        """Apply one level of sampled (node, token) picks; returns the new live beams."""
        live = []
        for idx in picks:
            parent, tok = space[idx // V], idx % V
            node = self.tree.add(parent, tok)
            self.score[node] = self.score[parent] + float(target_logp_of(parent)[tok])
            (self.finished if tok in self.eos else live).append(node)
        self.live = live
        self.cur_len += 1
        self.widths.append(len(picks))
        return live

    def hypotheses(self, n: int) -> list[tuple[list[int], float]]:
        cands = set(self.finished) | (set(self.live) if self.cur_len >= self.max_len else set())
        ranked = sorted(cands, key=lambda c: -self.score[c] / (self.tree.depths[c] + 1 - self.prompt_len))
        return [(self.tree.path(c)[self.prompt_len:], self.score[c] / (self.tree.depths[c] + 1 - self.prompt_len))
                for c in ranked[:n]]

    def stable_prefix(self) -> list[int]:
        paths = [self.tree.path(n)[self.prompt_len:] for n in set(self.live) | set(self.finished)]
        if not paths:
            return []
        out = []
        for toks in zip(*paths):
            if any(t != toks[0] for t in toks):
                break
            out.append(toks[0])
        return out
