"""Reference beam-search step with the exact semantics of transformers' `generate(num_beams=K)` (DESIGN s. 7).

The state holds node ids of a TokenTree instead of token tensors; the arithmetic mirrors transformers'
`_beam_search` in float32, including its -1e9 sentinels, so scores and choices match it. K = 1 is greedy
decoding (transformers' greedy path: argmax, stop at EOS).
"""
from __future__ import annotations

from dataclasses import dataclass

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


def _order(values: np.ndarray, k: int) -> np.ndarray:
    """Per row of [R, n], the indices of its k largest values, sorted descending, ties by lower index: what
    `_top` gives each row (a stable sort of the negated values orders equal values by index)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


def repeated_ngram_ends(seq: list[int], n: int) -> np.ndarray:
    """The tokens that would complete an n-gram already in `seq` (transformers' _get_generated_ngrams over the
    whole sequence, prompt included): the token after each earlier occurrence of seq's last n - 1 tokens."""
    if len(seq) + 1 < n:
        return np.zeros(0, np.int64)
    tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return np.array([seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == tail], np.int64)


class BeamRows:
    """The log-probs of the running beams for one step: dense [K, V], or a beam head's best k entries per beam
    (`ids` [K, k]; every other token -inf), which beam search reads without touching the vocabulary.

    Exact either way: the global top M of K x V candidates lies in the union of each beam's top M, so a beam head
    with k >= M entries per row gives the same candidates, and `top` orders them as the dense path does (value,
    then flat index beam * V + token; -inf candidates the dense path would reach are the lowest flat indices)."""

    def __init__(self, logprobs: np.ndarray, ids: np.ndarray | None = None, vocab: int | None = None,
                 logits: np.ndarray | None = None):
        """logits: a dense head's raw rows, kept beside their log-probs for processors that act on logits
        (transformers' greedy decoding applies repetition_penalty there)."""
        self.logprobs, self.ids = logprobs.astype(np.float32, copy=False), ids
        self.vocab = logprobs.shape[1] if ids is None else int(vocab)
        self.logits = logits

    def ban(self, tokens: np.ndarray) -> "BeamRows":
        """Tokens set to -inf (min_new_tokens' EOS, an encoder-decoder's pad)."""
        logp = self.logprobs.copy()
        if self.ids is None:
            logp[:, tokens] = -np.inf
            logits = None if self.logits is None else self.logits.copy()
            if logits is not None:
                logits[:, tokens] = -np.inf
            return BeamRows(logp, logits=logits)
        logp[np.isin(self.ids, tokens)] = -np.inf
        return BeamRows(logp, self.ids, self.vocab)

    def penalize(self, seqs: list, penalty: float, on_logits: bool) -> "BeamRows":
        """transformers' repetition_penalty: per beam, each token of its sequence scores x * penalty where x < 0,
        else x / penalty; on the logits (greedy decoding, then renormalised) or on the log-probs (beam search)."""
        def apply(x, b, toks):
            v = x[b, toks]
            x[b, toks] = np.where(v < 0, v * np.float32(penalty), v / np.float32(penalty))

        if on_logits:
            if self.logits is None:
                raise ValueError("greedy repetition_penalty acts on the logits: build the rows with them")
            x = self.logits.copy()
            for b, toks in enumerate(seqs):
                apply(x, b, toks)
            return BeamRows(log_softmax(x), logits=x)
        logp = self.logprobs.copy()
        for b, toks in enumerate(seqs):
            if self.ids is None:
                apply(logp, b, toks)
            else:
                hit = np.flatnonzero(np.isin(self.ids[b], toks))
                apply(logp, b, hit)
        return BeamRows(logp, self.ids, self.vocab, self.logits)

    def ban_per_beam(self, banned: list) -> "BeamRows":
        """Per beam, its own tokens set to -inf (no_repeat_ngram_size)."""
        logp = self.logprobs.copy()
        for b, toks in enumerate(banned):
            if len(toks):
                if self.ids is None:
                    logp[b, toks] = -np.inf
                else:
                    logp[b, np.isin(self.ids[b], toks)] = -np.inf
        return BeamRows(logp, self.ids, self.vocab)

    def force(self, token: int) -> "BeamRows":
        """Only `token` survives, with log-prob 0 (a forced EOS)."""
        K = len(self.logprobs)
        if self.ids is None:
            logp = np.full_like(self.logprobs, -np.inf)
            logp[:, token] = 0
            return BeamRows(logp, logits=None if self.logits is None else logp.copy())
        return BeamRows(np.zeros((K, 1), np.float32), np.full((K, 1), token, np.int64), self.vocab)

    def dense(self) -> np.ndarray:
        if self.ids is None:
            return self.logprobs
        out = np.full((len(self.logprobs), self.vocab), -np.inf, np.float32)
        np.put_along_axis(out, self.ids, self.logprobs, axis=1)
        return out

    def best(self) -> tuple[int, float]:
        """Beam 0's most probable token (lowest id on a tie, as argmax) and its log-prob."""
        if self.ids is None:
            tok = int(np.argmax(self.logprobs[0]))
            return tok, self.logprobs[0, tok]
        logp, ids = self.logprobs[0], self.ids[0]
        finite = np.isfinite(logp)
        if not finite.any():                 # every entry -inf: argmax of the dense row is token 0
            return 0, np.float32(-np.inf)
        j = np.lexsort((ids[finite], -logp[finite]))[0]
        return int(ids[finite][j]), logp[finite][j]

    def top(self, scores: np.ndarray, M: int) -> tuple[np.ndarray, np.ndarray]:
        """The M best candidates scores[beam] + logprob[beam, token]: (values [M], flat indices beam * V + token)."""
        acc = scores[:, None].astype(np.float32) + self.logprobs
        if self.ids is None:
            flat = acc.reshape(-1)
            idx = _top(flat, M)
            return flat[idx], idx
        V = self.vocab
        flat = (np.arange(len(acc))[:, None] * V + self.ids).reshape(-1)
        vals = acc.reshape(-1)
        finite = np.isfinite(vals)
        flat, vals = flat[finite], vals[finite]
        order = np.lexsort((flat, -vals))[:M]
        flat, vals = flat[order], vals[order]
        if len(flat) < M:                    # the dense path goes on with -inf candidates, lowest index first
            fill = np.setdiff1d(np.arange(M + len(flat)), flat)[:M - len(flat)]
            flat = np.concatenate([flat, fill])
            vals = np.concatenate([vals, np.full(len(fill), -np.inf, np.float32)])
        return vals, flat


@dataclass(frozen=True)
class RankedStep:
    """One beam step of one search, ranked (BeamSearch.step, or step_many over many searches): candidates
    `beam`/`tok` [M], those that stopped (`just`), the finished hypotheses to keep (`keep` into `merged`, the old
    finished and the candidates' scores, with `done_flags`), the next running candidates `nxt` and their
    `scores`, and the early-stop state after the step."""
    beam: np.ndarray
    tok: np.ndarray
    just: np.ndarray
    keep: np.ndarray
    merged: np.ndarray
    done_flags: np.ndarray
    nxt: np.ndarray
    scores: np.ndarray
    improvable: bool
    done: bool


class BeamSearch:
    """One request's beam-search state; `step` consumes the processed log-probs of the running beams."""

    def __init__(self, tree: TokenTree, start_node: int, *, num_beams: int, prompt_len: int, max_new_tokens: int,
                 eos_token_ids, length_penalty: float = 1.0, early_stopping=False, min_new_tokens: int = 0,
                 no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0):
        self.tree, self.num_beams, self.prompt_len = tree, num_beams, prompt_len
        self.ngram, self.penalty = no_repeat_ngram_size, float(repetition_penalty)
        self.max_length = prompt_len + max_new_tokens
        self.eos = np.array(sorted(set(int(e) for e in eos_token_ids)), dtype=np.int64)
        self.length_penalty, self.early, self.min_new = float(length_penalty), early_stopping, min_new_tokens
        self.n_candidates = max(2, 1 + len(self.eos)) * num_beams
        self.cur_len = tree.depths[start_node] + 1   # > prompt_len when forced tokens (a language code) count as generated
        self.running = [start_node] * num_beams
        self.scores = np.full(num_beams, NEG, np.float32)
        self.scores[0] = 0
        self.fin_scores = np.full(num_beams, NEG, np.float32)
        self.fin_nodes = [-1] * num_beams
        self.fin_done = np.zeros(num_beams, bool)
        self.improvable = True
        self.done = False

    @property
    def reads_logits(self) -> bool:
        """Whether a step needs the raw logits beside the log-probs (greedy repetition_penalty, as transformers)."""
        return self.num_beams == 1 and self.penalty != 1.0

    def process(self, rows: BeamRows) -> BeamRows:
        """Logits processors on the beams' log-probs, in transformers' order: min_new_tokens masks EOS,
        repetition_penalty (transformers: on the logits at K = 1, on the log-probs at K > 1), no_repeat_ngram_size
        bans each beam's tokens that would repeat one of its n-grams."""
        if self.cur_len - self.prompt_len < self.min_new and len(self.eos):
            rows = rows.ban(self.eos)
        if self.penalty != 1.0:
            seqs = [np.unique(self.tree.path(n)) for n in self.running]
            rows = rows.penalize(seqs, self.penalty, on_logits=self.reads_logits)
        if self.ngram:
            rows = rows.ban_per_beam([repeated_ngram_ends(self.tree.path(n), self.ngram) for n in self.running])
        return rows

    def step(self, rows: BeamRows | np.ndarray) -> list[int]:
        """Advance one token; rows: the running beams' fp32 log-probs (BeamRows, or a dense [K, V] array).
        Returns the new running nodes (registered in the tree; they may not be scored yet)."""
        if self.done:
            raise RuntimeError("beam search already finished")
        rows = self.process(rows if isinstance(rows, BeamRows) else BeamRows(rows))
        if self.num_beams == 1:
            return self._greedy_step(*rows.best())
        K, V = self.num_beams, rows.vocab
        topv, idx = rows.top(self.scores, self.n_candidates)
        beam, tok = idx // V, idx % V
        hit = (tok[:, None] == self.eos).any(axis=1) | (self.cur_len + 1 >= self.max_length)   # np.isin sorts: 0.5 ms
        # running beams for the next step: the best K candidates that did not stop
        run_scores = topv + hit.astype(np.float32) * NEG
        nxt = _top(run_scores, K)
        # finished hypotheses: only candidates ranked < K that stopped, normalised by generated length ** length_penalty
        cand = topv / np.float32((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = bool(self.fin_done.all()) and self.early is True
        cand = cand + np.float32(full) * NEG + np.float32(not self.improvable) * NEG
        just = hit & (np.arange(len(idx)) < K)
        cand = cand + (~just).astype(np.float32) * NEG
        merged = np.concatenate([self.fin_scores, cand.astype(np.float32)])
        keep = _top(merged, K)
        done_flags = np.concatenate([self.fin_done, just])
        scores = run_scores[nxt].astype(np.float32)
        fin_scores, fin_done = merged[keep], done_flags[keep]
        # early-stop heuristic (sticky)
        if self.early == "never" and self.length_penalty > 0.0:
            L = self.max_length - self.prompt_len
        else:
            L = self.cur_len + 1 - self.prompt_len
        best = scores[0] / np.float32(L ** self.length_penalty)
        worst = np.where(fin_done, fin_scores.min(), NEG)
        improvable = self.improvable and bool((best > worst).any())
        open_beam = not (bool(fin_done.all()) and self.early is True)
        done = not (improvable and open_beam and not bool(hit.all()))
        return self.commit_step(RankedStep(beam, tok, just, keep, merged, done_flags, nxt, scores, improvable,
                                           done))

    def commit_step(self, step: "RankedStep") -> list[int]:
        """Take a ranked step (computed by `step`, or for many searches at once by `step_many`): the tree's new
        finished hypotheses and running beams, the scores and the stopping state. Returns the running nodes."""
        cand_nodes = [None] * len(step.tok)
        for j in np.flatnonzero(step.just):
            cand_nodes[j] = self.tree.add(self.running[step.beam[j]], step.tok[j])
        nodes = self.fin_nodes + cand_nodes
        self.fin_scores, self.fin_done = step.merged[step.keep], step.done_flags[step.keep]
        self.fin_nodes = [nodes[i] if nodes[i] is not None else -1 for i in step.keep]
        self.running = [self.tree.add(self.running[step.beam[j]], step.tok[j]) for j in step.nxt]
        self.scores = step.scores.astype(np.float32)
        self.cur_len += 1
        self.improvable, self.done = bool(step.improvable), bool(step.done)
        return self.running

    def proposals(self) -> list[int]:
        """Tree nodes the search itself expects to need (added to a speculative pass's tree beside the drafter's):
        none for plain beam search (ConstrainedBeamSearch proposes its constraint phrases)."""
        return []

    def _greedy_step(self, tok: int, logprob) -> list[int]:
        node = self.tree.add(self.running[0], tok)
        self.scores[0] += logprob
        self.cur_len += 1
        if tok in self.eos or self.cur_len >= self.max_length:
            self.fin_nodes[0] = node
            self.fin_scores[0] = self.scores[0] / np.float32((self.cur_len - self.prompt_len) ** self.length_penalty)
            self.fin_done[0] = True
            self.done = True
        self.running = [node]
        return self.running

    def hypotheses(self, n: int) -> list[tuple[list[int], float]]:
        """The best n finished hypotheses: (generated tokens incl. EOS, normalised score), best first."""
        out = []
        for node, score, ok in zip(self.fin_nodes, self.fin_scores, self.fin_done):
            if node >= 0:
                out.append((self.tree.path(node)[self.prompt_len:], float(score)))
        if not out:  # cannot happen with max_new_tokens >= 1, kept for safety
            out = [(self.tree.path(self.running[0])[self.prompt_len:], float(self.scores[0]))]
        return out[:n]

    def stable_prefix(self) -> list[int]:
        """Generated tokens that every running beam and every finished hypothesis share: final for sure."""
        nodes = list(self.running) + [n for n, ok in zip(self.fin_nodes, self.fin_done) if ok]
        paths = [self.tree.path(n)[self.prompt_len:] for n in set(nodes)]
        if not paths:
            return []
        n = min(len(p) for p in paths)
        for i in range(n):
            t = paths[0][i]
            if any(p[i] != t for p in paths[1:]):
                return paths[0][:i]
        return paths[0][:n]


def steppable_together(bs: BeamSearch) -> bool:
    """Whether `step_many` takes this search's step into its array computation (plain beam search, K > 1);
    others (greedy, constrained search) take their own step there."""
    return type(bs) is BeamSearch and bs.num_beams > 1 and not bs.done


def step_many(states: list[BeamSearch], rows: list[BeamRows | np.ndarray]) -> None:
    """One beam step of each of several searches (the requests of one batched pass, docs/DESIGN.md "Beam steps
    over a batched pass"): the same as `[bs.step(r) for bs, r in zip(states, rows)]`, bit for bit.

    Each search processes its rows and ranks its candidates itself (per-request arrays stay in cache: one
    log-softmax or ranking over every request's rows at once measured slower), then the bookkeeping over the
    ranked candidates (what stopped, the next beams, the finished hypotheses, the early-stop rule), about twenty
    small array operations a step, runs once over an [R, candidates] array for all searches with the same
    num_beams and n_candidates; only the tree's new nodes are added per search."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, bs in enumerate(states):
        if steppable_together(bs):
            groups.setdefault((bs.num_beams, bs.n_candidates), []).append(i)
        else:
            bs.step(rows[i])
    for (K, M), members in groups.items():
        if len(members) == 1:                       # alone, the scalar step is the faster (see _step_group)
            states[members[0]].step(rows[members[0]])
            continue
        group = [states[i] for i in members]
        for bs, ranked in zip(group, _step_group(group, [rows[i] for i in members], K, M)):
            bs.commit_step(ranked)


def _step_group(states: list[BeamSearch], rows: list, K: int, M: int) -> list[RankedStep]:
    """BeamSearch.step's ranking over R searches at once (same K and M), one RankedStep per search (each search
    commits its own); every line mirrors one of step's (tests/
    test_step_many.py holds the two equal). step stays the scalar form: a group of one measured 1.15-1.8x slower
    per step than step itself (beam-head rows, K = 4; two alternated micro-runs, noisy machine), and a request
    alone is the laptop's common case."""
    R = len(states)
    topv = np.empty((R, M), np.float32)
    idx = np.empty((R, M), np.int64)
    vocab = np.empty((R, 1), np.int64)
    for r, (bs, x) in enumerate(zip(states, rows)):         # none is done: steppable_together
        x = bs.process(x if isinstance(x, BeamRows) else BeamRows(x))
        topv[r], idx[r] = x.top(bs.scores, M)
        vocab[r] = x.vocab
    beam, tok = idx // vocab, idx % vocab
    n_eos = max(len(bs.eos) for bs in states)
    eos = np.full((R, max(n_eos, 1)), -1, np.int64)
    for r, bs in enumerate(states):
        eos[r, :len(bs.eos)] = bs.eos
    cur = np.array([bs.cur_len for bs in states], np.int64)
    ends = (cur + 1 >= np.array([bs.max_length for bs in states], np.int64))[:, None]
    hit = (tok[:, :, None] == eos[:, None, :]).any(axis=2) | ends
    run_scores = topv + hit.astype(np.float32) * NEG
    nxt = _order(run_scores, K)
    norm = np.array([[(bs.cur_len + 1 - bs.prompt_len) ** bs.length_penalty] for bs in states], np.float32)
    cand = topv / norm
    fin_scores = np.stack([bs.fin_scores for bs in states])
    fin_done = np.stack([bs.fin_done for bs in states])
    early_true = np.array([bs.early is True for bs in states])
    full = fin_done.all(axis=1) & early_true
    stuck = np.array([not bs.improvable for bs in states])
    cand = cand + (full.astype(np.float32) * NEG)[:, None] + (stuck.astype(np.float32) * NEG)[:, None]
    just = hit & (np.arange(M) < K)
    cand = cand + (~just).astype(np.float32) * NEG
    merged = np.concatenate([fin_scores, cand.astype(np.float32)], axis=1)
    keep = _order(merged, K)
    done_flags = np.concatenate([fin_done, just], axis=1)
    rows_r = np.arange(R)[:, None]
    scores = run_scores[rows_r, nxt]
    new_fin_scores, new_fin_done = merged[rows_r, keep], done_flags[rows_r, keep]
    # early-stop heuristic (sticky), as in step
    denom = np.array([((bs.max_length - bs.prompt_len) if bs.early == "never" and bs.length_penalty > 0.0
                       else (bs.cur_len + 1 - bs.prompt_len)) ** bs.length_penalty for bs in states], np.float32)
    best = scores[:, 0] / denom
    worst = np.where(new_fin_done, new_fin_scores.min(axis=1, keepdims=True), NEG)
    improvable = ~stuck & (best[:, None] > worst).any(axis=1)
    open_beam = ~(new_fin_done.all(axis=1) & early_true)
    done = ~(improvable & open_beam & ~hit.all(axis=1))
    return [RankedStep(beam[r], tok[r], just[r], keep[r], merged[r], done_flags[r], nxt[r], scores[r],
                       bool(improvable[r]), bool(done[r])) for r in range(R)]
