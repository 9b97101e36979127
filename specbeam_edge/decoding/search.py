"""Per-request searches (DESIGN section 6): exact (speculative) beam search and (speculative) beam sampling.

Each search is a coroutine with the same phases per target pass: grow a draft tree -> score (one target pass
over every unscored node) -> replay/verify -> commit. It never runs a model itself: it yields a `ScoreCall`
for every pass it needs and receives the pass's output, a `BeamStep` for every exact beam step (taken with
the other requests' steps), and a `Progress` after every target pass (the messages and their order:
protocol.py). The scheduler (scheduler.py) packs the calls of many requests into one batched pass per model; a
request alone is the batch of one, so there is one code path.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from .beam import BeamRows, BeamSearch
from .cache import TreeCache
from .constraints import ConstrainedBeamSearch, Constraints
from .protocol import BeamStep, PassContext, Progress, ScoreCall
from ..results import Stats, peak_rss_mb
from .sampling import SampleState, choose_width, draw, verify_level
from .tree import TokenTree


def _unread(tree: TokenTree, new: list[int], chain_len: int) -> int:
    """How many leading nodes of a pass are prompt tokens before the last: no search reads their rows (the row of a
    node at depth d predicts the token at d + 1)."""
    n = 0
    while n < len(new) and tree.depths[new[n]] < chain_len - 1:
        n += 1
    return n


def _finish(*caches) -> float:
    """A finished request's KV peak (MB); its caches then let go of their KV: with batch rows a cache is a view of
    its batch's arrays, and finished requests stay referenced until the whole job ends (300 lines at K=4 peaked
    at 7.4 GB instead of 1.8 GB)."""
    caches = [c for c in caches if c is not None]
    for c in caches:
        c.release()
    return sum(c.peak_bytes for c in caches) / 2**20


@dataclass(frozen=True)
class HeadTree:
    """What exact search takes from a target's lookahead head (export/ahead.py) in place of a drafter: below each
    beam, the first guess and the chain below it to `depth` levels in all, then the other first-level guesses up
    to `guesses`; `chain_at`: the chain's first column of `ahead_ids` (the head's own number of guesses);
    `min_log_prob`: a guess joins the tree only while the head's log-probability of its path from the beam stays
    at least this (SpeculativeConfig.min_log_prob)."""
    guesses: int
    depth: int = 1
    chain_at: int = 0
    min_log_prob: float = float("-inf")

    @classmethod
    def of(cls, head: dict, spec) -> "HeadTree":
        """From the target's config entry (`ahead`) and the request's SpeculativeConfig: max_branch_width first
        guesses and max_depth levels, at most the head's own."""
        return cls(guesses=min(spec.max_branch_width, int(head["guesses"])),
                   depth=min(spec.max_depth, int(head.get("depth", 1))), chain_at=int(head["guesses"]),
                   min_log_prob=spec.min_log_prob)


@dataclass(frozen=True)
class BeamSettings:
    """What beam search takes from a request (BeamSearch's settings): its GenerationConfig's, with the new
    tokens that fit the context and the EOS ids in force."""
    num_beams: int
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, gen, max_new_tokens: int, eos) -> "BeamSettings":
        return cls(gen.num_beams, max_new_tokens, tuple(int(e) for e in eos), gen.length_penalty,
                   gen.early_stopping, gen.min_new_tokens, gen.no_repeat_ngram_size, gen.repetition_penalty)


@dataclass(frozen=True)
class Speculation:
    """How exact search drafts: a drafter (`grow`, draft.Drafter) or the target's lookahead head (`ahead`);
    `budget_for(load)`: the draft nodes the request may add to a pass shared by `load` requests; `chooser`:
    ChoosersByLoad, whose PassChooser for the pass's load decides whether drafting pays (None: always)."""
    budget_for: Callable[[int], int] | None
    grow: object = None
    ahead: HeadTree | None = None
    chooser: object = None


@dataclass(frozen=True)
class EncoderDecoder:
    """An encoder-decoder request: `ids` is the decoder's start (decoder start token, maybe a forced BOS) of which
    the first `prompt_len` tokens are the prompt (the rest count as generated, with log-prob 0, as transformers'
    forced-BOS processor makes them); `static(with_draft)` returns the target's and the draft's static inputs
    (cross K/V, source mask; the draft's None unless asked), called when the request starts; `process(logp,
    cur_len)` applies extra logits processors (banned pad, forced EOS) to the log-probs."""
    prompt_len: int
    static: Callable | None = None
    process: Callable | None = None


class ExactSearch:
    """Exact beam search (K >= 1), speculative when `grow` is given: output identical to plain beam search.

    target/draft: TreeCaches over one TokenTree (draft None without speculation; a cache without a model for
    prompt lookup). beam: the beam-search settings; speculation: how it drafts (None: plain search); topk: the
    k a top-k head returns per node (None: full rows); encdec: an encoder-decoder request's parts. constraints
    (terminology, constraints.Constraints): the search is a ConstrainedBeamSearch, grown, scored and replayed
    the same way, and ends once `min_finished` hypotheses meet them."""

    def __init__(self, ids: list[int], target_lm, draft_lm, beam: BeamSettings, *,
                 speculation: Speculation | None = None, topk: int | None = None,
                 encdec: EncoderDecoder | None = None, constraints: Constraints | None = None,
                 min_finished: int = 1):
        self.tree = TokenTree()
        self.chain_len = len(ids)
        kind, extra = (BeamSearch, {}) if constraints is None else \
            (ConstrainedBeamSearch, {"constraints": constraints, "min_finished": min_finished})
        prompt_len = self.chain_len if encdec is None else encdec.prompt_len
        self.bs = kind(self.tree, self.tree.add_chain(ids)[-1], prompt_len=prompt_len, **asdict(beam), **extra)
        spec = speculation or Speculation(budget_for=None)
        self.grow, self.chooser, self.budget_for = spec.grow, spec.chooser, spec.budget_for
        # ahead: the tree of the target's own lookahead head (export/ahead.py), instead of a drafter
        self.ahead = spec.ahead
        self.speculative = self.grow is not None or self.ahead is not None
        self.target = TreeCache(target_lm, self.tree)
        self.draft = TreeCache(draft_lm, self.tree) if self.grow is not None else None
        self.topk = topk
        self.static, self.process = (None, None) if encdec is None else (encdec.static, encdec.process)
        self.rows: dict[int, tuple[object, int]] = {}     # scored node -> (pass output, row)
        self.stats = Stats(prompt_tokens=self.chain_len)

    @property
    def state(self) -> BeamSearch:
        return self.bs

    def release(self) -> None:
        """A request stopped before its end (cancelled): its caches let go of their KV."""
        _finish(self.target, self.draft)

    def _start(self) -> None:
        """An encoder-decoder request's caches take its static inputs (encoder outputs) when it starts: the
        encoders run for the requests about to start, not for a whole job at once."""
        if self.static is None:
            return
        with_draft = self.draft is not None and self.draft.model is not None
        target_static, draft_static = self.static(with_draft)
        self.target = TreeCache(self.target.model, self.tree, target_static)
        if with_draft:
            self.draft = TreeCache(self.draft.model, self.tree, draft_static)

    def run(self, ctx: PassContext = PassContext()):
        """The search, pass by pass: grow, score, replay, commit; yields ScoreCalls (receiving their outputs) and
        a Progress after every target pass (receiving the next pass's PassContext)."""
        stats, bs = self.stats, self.bs
        t0 = time.perf_counter()
        self._start()
        while not bs.done:
            tp = time.perf_counter()
            chooser = self.chooser.at(ctx.load) if self.chooser is not None else None
            if chooser is not None and stats.target_passes == 1:   # the pass after the prompt's: new text, on
                chooser.new_request()     # which the choice that lost may win (probed once per request)
            # adaptive speculation drafts no tree in the prompt's pass: its first text then waits for the target's
            # prefill alone, not for the draft's prompt pass and levels too (time to first token); the draft
            # catches up over the prompt in its next pass
            first = chooser is not None and stats.target_passes == 0
            speculate = self.speculative and not first and (chooser is None or chooser.choose(ctx.pass_id))
            steps0, depth0 = stats.beam_steps, self.tree.depths[self.bs.running[0]]
            drafted = (yield from self._grow(self.budget_for(ctx.load))) if speculate else []
            # a lookahead head's guesses feed the next pass: computed when that one may speculate
            yield from self._score(drafted, ahead=self.ahead is not None and (chooser is None or chooser.peek()))
            stats.plain_passes += self.speculative and not speculate
            yield from self._replay(set(drafted))
            self._commit(speculate)
            if chooser is not None and stats.target_passes > 1:   # the first pass carries the prefill
                levels = max((self.tree.depths[n] - depth0 for n in drafted), default=0)
                chooser.update(speculate, time.perf_counter() - tp, stats.beam_steps - steps0,
                               max_steps=1 + levels if speculate and levels else None)
            if stats.time_to_first_token is None:
                stats.time_to_first_token = time.perf_counter() - t0
            stats.seconds = time.perf_counter() - t0
            ctx = yield Progress(bs, stats)
            stats.batch_sizes.append(ctx.load)          # the size of the pass just run
        stats.generated_tokens = bs.cur_len - self.chain_len
        stats.peak_memory_mb = peak_rss_mb()
        stats.kv_cache_peak_mb = _finish(self.target, self.draft)
        store = getattr(getattr(self.target.model, "runner", None), "store", None)
        if store is not None and store.streamed:
            stats.offload = {**store.stats.per_pass(), "placement": list(store.placement.places)}
        stats.seconds = time.perf_counter() - t0

    # 1. grow a draft tree below every running beam
    def _grow(self, budget: int):
        if self.ahead is not None:
            drafted = self._guesses(budget)
            self.stats.draft_tokens_proposed += len(drafted)
            return drafted
        stats, td, d0 = self.stats, time.perf_counter(), self.draft.passes
        drafted = yield from self.grow(self.draft, self.bs.running, list(self.bs.scores), budget)
        own = self.bs.proposals()                  # constraint phrases (none for plain beam search)
        if own:
            drafted = list(dict.fromkeys(drafted + own))
        stats.draft_passes += self.draft.passes - d0
        stats.draft_tokens_proposed += len(drafted)
        stats.draft_seconds += time.perf_counter() - td
        return drafted

    def _guesses(self, budget: int) -> list[int]:
        """The lookahead head's tree (HeadTree), at most `budget` nodes: below each running beam that is its scored
        parent's best next token, the head's guesses from the parent's row; first guess, chain, then the other
        first-level guesses (in the order of their measured worth on SmolLM2: a level-2 guess is taken more often
        than a second first-level one; DESIGN "Lookahead head"), each while its path clears min_log_prob (tree
        rows are not free: unlikely guesses do not pay for theirs). A beam that is not its parent's best token
        gets none: the head guessed for the best one."""
        h, out = self.ahead, []
        for n in dict.fromkeys(self.bs.running):
            row = self.rows.get(self.tree.parents[n])
            if row is None:
                continue
            head, j = row
            if head.ahead_ids is None or int(head.ids[j, 0]) != self.tree.tokens[n]:
                continue
            ids, lps = head.ahead_ids[j].tolist(), head.ahead_logprobs[j].tolist()
            chain = slice(h.chain_at, h.chain_at + h.depth - 1)
            at, path = n, 0.0
            for t, lp in zip(ids[:1] + ids[chain], lps[:1] + lps[chain]):
                path += lp
                if len(out) >= budget or path < h.min_log_prob:
                    break
                at = self.tree.add(at, int(t))
                out.append(at)
            for t, lp in zip(ids[1:h.guesses], lps[1:h.guesses]):
                if len(out) >= budget or lp < h.min_log_prob:
                    break
                out.append(self.tree.add(n, int(t)))
        return out       # no node twice: distinct beams, distinct guesses below each

    # 2. one target pass over every node that is not scored yet (pending beams and the tree)
    def _score(self, drafted: list[int], ahead: bool = False):
        new = self.target.missing_ancestors(list(self.bs.running) + drafted)
        out = yield ScoreCall(self.target, new, self.topk, replayed=True, ahead=ahead,
                              head_from=_unread(self.tree, new, self.chain_len))
        for j, n in enumerate(new):
            if self.tree.depths[n] >= self.chain_len - 1:
                self.rows[n] = (out, j)
        self.stats.target_passes += 1
        self.stats.target_tokens_scored += len(new)

    # 3. replay beam search while every kept beam is a scored node (each step taken with the other requests')
    def _replay(self, in_tree: set[int]):
        bs, stats, first = self.bs, self.stats, True
        while not bs.done and all(n in self.rows for n in bs.running):
            yield BeamStep(bs, self._beam_logprobs(bs.running))
            stats.beam_steps += 1
            stats.from_draft.append(not first)
            first = False
            stats.draft_tokens_accepted += sum(n in in_tree for n in set(bs.running))

    def _beam_logprobs(self, running) -> BeamRows:
        """The running beams' log-probs (dense [beams, V], or a top-k head's entries: beam.BeamRows)."""
        pairs = [self.rows[n] for n in running]
        rows = pairs[0][0].beam_rows(pairs, self.target.model.cfg.vocab_size, logits=self.bs.reads_logits)
        return rows if self.process is None else self.process(rows, self.bs.cur_len)

    # 4. commit: keep only the running beams' paths (lazily), in both caches
    def _commit(self, speculated: bool):
        if self.target.compact(self.bs.running):
            self.rows = {n: r for n, r in self.rows.items() if n in self.target}
        if self.draft is None or self.draft.model is None:
            return
        if speculated:   # a draft that sat a pass out catches up when next used
            self.draft.compact(self.bs.running)
        else:
            self.draft.drop_padding()     # sitting out: hold its own slots, not the rows of a batch that moved on


class SamplingSearch:
    """Beam sampling (spec None) or speculative beam sampling with dynamic width (DSBD, DESIGN section 8).
    The request's own seeded generator makes its output independent of the requests it shares passes with.
    gen: the request's GenerationConfig (beams, temperature, top_k, top_p, seed). Encoder-decoder requests:
    `encdec` as in ExactSearch; its `process` applies to the target's and the draft's log-probs as they are
    stored, so scores, p and q all see the banned pad and forced EOS."""

    def __init__(self, ids: list[int], target_lm, draft_lm, gen, *, max_new_tokens: int, eos, spec=None,
                 encdec: EncoderDecoder | None = None):
        self.tree = tree = TokenTree()
        self.chain_len = len(ids)
        num_beams = gen.num_beams
        self.st = SampleState(tree, tree.add_chain(ids)[-1], max_new_tokens=max_new_tokens,
                              prompt_len=self.chain_len if encdec is None else encdec.prompt_len,
                              eos=eos, min_new_tokens=gen.min_new_tokens, temperature=gen.temperature,
                              top_k=gen.top_k, top_p=gen.top_p)
        self.static, self.process = (None, None) if encdec is None else (encdec.static, encdec.process)
        self.target = TreeCache(target_lm, tree)
        self.draft = TreeCache(draft_lm, tree) if spec else None
        self.spec, self.num_beams = spec, num_beams
        self.width = (spec.draft_width or max(num_beams, spec.max_branch_width)) if spec else num_beams
        self.rng = np.random.default_rng(gen.seed)
        self.t_rows: dict[int, np.ndarray] = {}
        self.d_rows: dict[int, np.ndarray] = {}
        self.stats = Stats(prompt_tokens=self.chain_len)

    @property
    def state(self) -> SampleState:
        return self.st

    def release(self) -> None:
        """As ExactSearch.release."""
        _finish(self.target, self.draft)

    def _scored(self, cache: TreeCache, rows: dict, nodes):
        """Log-probs of `nodes` (and any missing ancestors) in `rows`, by one pass; returns how many were new."""
        new = cache.missing_ancestors(nodes)
        if new:
            skip = _unread(self.tree, new, self.chain_len)
            # the rows read only: a long prompt's others would be [prompt tokens, vocabulary] log-probs
            logp = (yield ScoreCall(cache, new, head_from=skip)).take(slice(skip, None)).log_probs()
            for j, n in enumerate(new[skip:]):
                d = self.tree.depths[n]
                if d >= self.chain_len - 1:     # the row of a node at depth d predicts the token at length d + 1
                    rows[n] = logp[j] if self.process is None else self.process(logp[j:j + 1], d + 1)[0]
        return len(new)

    def run(self, ctx: PassContext = PassContext()):
        """As ExactSearch.run (sampling has no adaptive choice: of the context it records the batch sizes)."""
        st, stats, spec = self.st, self.stats, self.spec
        t0 = time.perf_counter()
        if self.static is not None:       # as ExactSearch._start
            target_static, draft_static = self.static(self.draft is not None)
            self.target = TreeCache(self.target.model, self.tree, target_static)
            if self.draft is not None:
                self.draft = TreeCache(self.draft.model, self.tree, draft_static)
        while not st.done:
            levels = yield from self._grow()
            # 2. one target pass over the pending beams and every drafted node
            drafted = [self.tree.add(sp[i // (len(q) // len(sp))], i % (len(q) // len(sp)))
                       for sp, q, picks in levels for i in picks]
            stats.target_tokens_scored += yield from self._scored(self.target, self.t_rows, list(st.live) + drafted)
            stats.target_passes += 1
            self._verify(levels)
            if spec and spec.single_sequence and st.live:
                st.live = st.live[:1]          # memory-saving mode: one sequence between passes
            self._commit()
            if stats.time_to_first_token is None:
                stats.time_to_first_token = time.perf_counter() - t0
            stats.seconds = time.perf_counter() - t0
            ctx = yield Progress(st, stats)
            stats.batch_sizes.append(ctx.load)
        stats.widths = st.widths
        stats.generated_tokens = st.cur_len - self.chain_len
        stats.peak_memory_mb = peak_rss_mb()
        stats.kv_cache_peak_mb = _finish(self.target, self.draft)
        stats.seconds = time.perf_counter() - t0

    # 1. the draft samples gamma levels of beam sampling (i.i.d. draws, q recorded per level)
    def _grow(self):
        st, stats, tree = self.st, self.stats, self.tree
        levels, parents, dscore = [], list(st.live), dict(st.score)
        td = time.perf_counter()
        for j in range(self.spec.max_depth if self.spec else 0):
            if st.cur_len + j >= st.max_len or not parents:
                break
            yield from self._scored(self.draft, self.d_rows, parents)
            stats.draft_passes += 1
            space = sorted(set(parents))
            q = st.joint(space, parents, self.d_rows.__getitem__, dscore, st.cur_len + j)
            V = len(q) // len(space)
            picks = draw(q, self.width, self.rng)
            kids = [tree.add(space[i // V], i % V) for i in picks]
            for i, c in zip(picks, kids):
                dscore[c] = dscore[space[i // V]] + float(self.d_rows[space[i // V]][i % V])
            levels.append((space, q, picks))
            parents = [c for c in kids if tree.tokens[c] not in st.eos]
            stats.draft_tokens_proposed += len(set(kids))
        stats.draft_seconds += time.perf_counter() - td
        return levels

    # 3. verify level by level; a short level is completed from the residual and ends the pass
    def _verify(self, levels):
        st, stats, rng, spec = self.st, self.stats, self.rng, self.spec
        full = True
        for space, q, picks in levels:
            p = st.joint(space, st.live, self.t_rows.__getitem__, st.score, st.cur_len)
            k = choose_width(p, q, self.width, spec.width_threshold, spec.min_num_beams, self.num_beams)
            out, accepted = verify_level(p, q, picks, k, rng)
            full = accepted == k
            st.advance(out, space, len(q) // len(space), self.t_rows.__getitem__)
            stats.beam_steps += 1
            stats.from_draft.append(full)
            stats.draft_tokens_accepted += accepted
            if not full or st.done:
                break
        if full and not st.done and all(n in self.t_rows for n in st.live):
            space = sorted(set(st.live))
            p = st.joint(space, st.live, self.t_rows.__getitem__, st.score, st.cur_len)
            st.advance(draw(p, self.num_beams, rng), space, len(p) // len(space), self.t_rows.__getitem__)
            stats.beam_steps += 1
            stats.from_draft.append(False)

    # 4. commit
    def _commit(self):
        keep = list(self.st.live)
        if self.target.compact(keep):
            self.t_rows = {n: r for n, r in self.t_rows.items() if n in self.target}
        if self.draft is not None and self.draft.compact(keep):
            self.d_rows = {n: r for n, r in self.d_rows.items() if n in self.draft}
