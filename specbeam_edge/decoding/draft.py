"""Drafters: grow a token tree below the live beams with the draft model (DESIGN section 6, step 1).

A drafter is one protocol: a generator function `(dcache, roots, root_scores, budget)` that yields a
`ScoreCall` for every draft pass it needs (receiving each pass's output) and returns the new tree nodes (parents
before children, at most `budget` of them). The scheduler serves the draft levels of many requests with one
batched pass. A drafter without a model (prompt lookup) yields nothing. The draft keeps its own TreeCache over the
same TokenTree, so it only ever computes KV for nodes it has not seen. `custom_drafter` adapts a user's function.
"""
from __future__ import annotations

import inspect
import math
from typing import Generator, Protocol

import numpy as np

from .protocol import ScoreCall
from .cache import TreeCache
from ..config import SpeculativeConfig, head_width


class Drafter(Protocol):
    def __call__(self, dcache: TreeCache, roots: list[int], root_scores: list[float],
                 budget: int) -> Generator[ScoreCall, object, list[int]]: ...


def custom_drafter(fn) -> Drafter:
    """A user's tree-growth function in the drafter protocol: `fn(dcache, roots, root_scores)` returns the new
    nodes, or is a generator function that yields ScoreCalls and returns them (it is given no budget)."""
    call = getattr(fn, "__call__", fn)
    if inspect.isgeneratorfunction(fn) or inspect.isgeneratorfunction(call):
        def grow(dcache, roots, root_scores, budget):
            return (yield from fn(dcache, roots, root_scores))
    else:
        def grow(dcache, roots, root_scores, budget):
            yield from ()
            return fn(dcache, roots, root_scores)
    return grow


class _Expansions:
    """The draft's top-`width` children (tokens, log-probs) of every node it has scored, kept while the node is
    in the draft cache. A beam the draft scored in an earlier pass (the target then accepted fewer levels than
    the tree had) is expanded from here: a drafter that skipped it lost a level on every such pass (measured
    with draft == target: 3.2 instead of 5 steps per pass at K=2, depth 4)."""

    def __init__(self, width: int):
        self.width = width
        self.memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def prune(self, dcache: TreeCache) -> None:
        self.memo = {n: v for n, v in self.memo.items() if n in dcache}

    def __call__(self, dcache: TreeCache, frontier: list[int]):
        """One draft pass over the frontier's unscored nodes (and missing ancestors), as a ScoreCall; returns
        (expandable frontier nodes, their top tokens [F, width], those tokens' draft log-probs [F, width])."""
        frontier = list(dict.fromkeys(frontier))
        need = dcache.missing_ancestors(frontier)
        if need:
            index = {n: j for j, n in enumerate(need)}
            fresh = [f for f in frontier if f in index]
            rows = [index[f] for f in fresh]
            # never more children than the head scores: a top-k head's TopK refuses a k beyond them
            width = min(self.width, head_width(dcache.model.cfg))
            out = yield ScoreCall(dcache, need, topk=width, head_from=min(rows))
            top, lps = out.top(rows, width)
            self.memo.update((f, (t, v)) for f, t, v in zip(fresh, top, lps))
        nodes = [f for f in frontier if f in self.memo]
        if not nodes:
            return [], np.zeros((0, self.width), np.int64), np.zeros((0, self.width), np.float32)
        return nodes, np.stack([self.memo[n][0] for n in nodes]), np.stack([self.memo[n][1] for n in nodes])


def level_picks(is_pred: np.ndarray, top: np.ndarray, cum: np.ndarray, path: np.ndarray, eos: np.ndarray, K: int,
                take: int, min_lp: float) -> tuple[np.ndarray, int] | None:
    """One level of draft beam search over F expandable nodes' `top` children [F, w] (cumulative scores `cum`,
    path log-probs from their beams `path`): flat indices into [F, w] of the children to draft, the first
    `n_pred` of them being the draft's own next beams (the K best non-EOS children of nodes with `is_pred`),
    then the best other non-EOS children whose path log-prob is >= min_lp, `take` in all. None: stop growing
    (min_lp > -inf and no own beam reaches it). Array work only: the list comprehensions it replaced took
    145 us a level over 16 x 16 children (K = 4's default tree) and 614 us over 32 x 32; this 31 and 46 us."""
    w = top.shape[1]
    order = np.argsort(-cum, axis=None, kind="stable")
    order = order[~np.isin(top.ravel()[order], eos)]
    own = is_pred[order // w]
    from_pred = order[own][:min(K, take)]
    paths = path.ravel()
    if min_lp > -math.inf and (len(from_pred) == 0 or paths[from_pred].max() < min_lp):
        return None
    rest = np.ones(len(order), bool)
    rest[np.flatnonzero(own)[:len(from_pred)]] = False
    others = order[rest & (paths[order] >= min_lp)]
    return np.concatenate([from_pred, others[:take - len(from_pred)]]), len(from_pred)


def default_width(num_beams: int, max_branch_width: int, budget: int) -> int:
    """Nodes per level of draft beam search when `draft_width` is not given: max(K, max_branch_width, min(4K,
    budget // 2)). For K > 1 a level is accepted only when it holds all K of the target's next beams, which the
    draft's own top K rarely are, so the budget goes to width (4K, at least two levels) rather than depth; K=1 keeps
    max_branch_width children per level (measured: docs/HISTORY.md "Draft width")."""
    return max(num_beams, max_branch_width, min(4 * num_beams, budget // 2))


class DraftBeamSearch:
    """AtSpeed-style: a draft beam search for up to `max_depth` levels from all live beams. Per level, the K best
    non-EOS children (beam score + draft log-prob) of the draft's own K beams (its prediction of the target's
    next beams: with draft == target every level is accepted), then the best other children up to W in all.
    Each node offers up to max(W, max_branch_width) children: the next K beams may all descend from one beam.
    (A plain width-W beam search does not nest for W > K: other children can push the K beams out.)
    With min_path_prob > 0, a child whose draft path probability from its beam is below it is not drafted
    unless it is one of the draft's own beams, and the levels stop once the best of those is below it too."""

    def __init__(self, spec: SpeculativeConfig, num_beams: int, eos_ids, context_length: int):
        self.num_beams = num_beams
        self.fixed_W, self.branch = spec.draft_width, spec.max_branch_width
        self.depth = spec.max_depth
        self.expand = _Expansions(max(self.width(spec.budget), spec.max_branch_width))
        self.min_lp = spec.min_log_prob
        self.eos = np.array(sorted(set(int(e) for e in eos_ids)), np.int64)
        self.ctx = context_length

    def width(self, budget: int) -> int:
        """Nodes per level at this pass's budget: `draft_width`, else default_width."""
        return self.fixed_W or default_width(self.num_beams, self.branch, budget)

    def __call__(self, dcache, roots, root_scores, budget):
        tree = dcache.tree
        self.expand.prune(dcache)
        W = self.width(budget)
        frontier = list(dict.fromkeys(roots))
        score, rel = {}, {}                  # cumulative score; log-prob of the path from its beam
        for r, s in zip(roots, root_scores):
            score[r] = max(score.get(r, -math.inf), float(s))
            rel[r] = 0.0
        out, seen, pred = [], set(frontier), set(frontier)
        for _ in range(self.depth):
            frontier = [f for f in frontier if tree.depths[f] + 1 < self.ctx]
            if not frontier or len(out) >= budget:
                break
            nodes, top, lps = yield from self.expand(dcache, frontier)
            if not nodes:
                break
            cum = np.array([score[f] for f in nodes])[:, None] + lps                 # [F, width]
            path = np.array([rel[f] for f in nodes])[:, None] + lps
            # the draft's own beams first (its prediction of the target's next K beams), then the best others
            level = level_picks(np.array([f in pred for f in nodes]), top, cum, path, self.eos, self.num_beams,
                                min(W, budget - len(out)), self.min_lp)
            if level is None:
                break                        # the draft is no longer confident about any of its beams
            picks, n_pred = level
            frontier = []
            for f, t, s, r in zip((picks // top.shape[1]).tolist(), top.ravel()[picks].tolist(),
                                  cum.ravel()[picks].tolist(), path.ravel()[picks].tolist()):
                n = tree.add(nodes[f], t)
                if n not in seen:
                    seen.add(n)
                    out.append(n)
                score[n], rel[n] = s, r
                frontier.append(n)
            pred = set(frontier[:n_pred])
        return out


class BestFirstDrafter:
    """SpecExec-style: repeatedly expand the most probable leaves (cumulative draft log-prob plus
    log(decay_factor) per level) until `budget` nodes; each expansion round is one draft pass."""

    def __init__(self, spec: SpeculativeConfig, num_beams: int, eos_ids, context_length: int):
        self.depth, self.num_beams = spec.max_depth, num_beams
        self.expand = _Expansions(spec.max_branch_width)
        self.log_decay = math.log(spec.decay_factor)
        self.min_lp = spec.min_log_prob
        self.eos = set(int(e) for e in eos_ids)
        self.ctx = context_length

    def __call__(self, dcache, roots, root_scores, budget):
        tree = dcache.tree
        self.expand.prune(dcache)
        chunk = max(self.num_beams, math.ceil(budget / self.depth))       # nodes added per expansion round
        roots = list(dict.fromkeys(roots))
        base = {r: tree.depths[r] for r in roots}
        cum = {r: 0.0 for r in roots}
        rel = {r: 0.0 for r in roots}            # undecayed log-prob of the path from its root (min_path_prob)
        root_of = {r: r for r in roots}
        out, seen, pool = [], set(roots), []
        expand = roots
        while expand:
            expand = [e for e in expand if tree.depths[e] + 1 < self.ctx
                      and tree.depths[e] - base[root_of[e]] < self.depth and tree.tokens[e] not in self.eos]
            if not expand:
                break
            nodes, top, lps = yield from self.expand(dcache, expand)
            base_scores = np.array([cum[e] for e in nodes])[:, None] + self.log_decay + lps
            path = np.array([rel[e] for e in nodes])[:, None] + lps
            pool.extend((float(base_scores.flat[i]), nodes[i // top.shape[1]], int(top.flat[i]), float(path.flat[i]))
                        for i in range(base_scores.size) if path.flat[i] >= self.min_lp)
            room = budget - len(out)
            if room <= 0 or not pool:
                break
            pool.sort(key=lambda c: -c[0])
            take, pool = pool[:min(chunk, room)], pool[min(chunk, room):]
            expand = []
            for s, p, t, r in take:
                n = tree.add(p, t)
                if n in seen:
                    continue
                seen.add(n)
                out.append(n)
                cum[n], rel[n], root_of[n] = s, r, root_of[p]
                expand.append(n)
            if len(out) >= budget:
                break
        return out


class PromptLookupDrafter:
    """No draft model: below each beam, propose what followed the latest earlier occurrence of the beam's last
    n tokens (n = 3, 2, 1) in the source (an encoder-decoder's input; none for a decoder-only model, whose prompt
    is in the beam's path) or in the beam itself, up to `max_depth` tokens and `max_branch_width` distinct
    continuations per beam. Costs no model pass, so any covered level is a gain (names, numbers, code and markup
    survive translation unchanged; small models repeat themselves)."""

    def __init__(self, spec: SpeculativeConfig, num_beams: int, eos_ids, context_length: int, max_ngram: int = 3,
                 source=()):
        self.depth, self.width, self.ngram = spec.max_depth, spec.max_branch_width, max_ngram
        self.source, self.ctx = list(source), context_length

    def _continuations(self, path: list[int]) -> list[tuple]:
        hay = np.array(self.source + [-1] + path)      # -1: no n-gram or continuation crosses into the beam
        conts = []
        for n in range(min(self.ngram, len(path) - 1), 0, -1):
            key = hay[-n:]
            hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(hay[:-1], n) == key, axis=1))
            for i in hits[::-1]:                        # latest first
                cont = hay[i + n:i + n + self.depth].tolist()
                cont = tuple(cont[:cont.index(-1)] if -1 in cont else cont)
                if cont and cont not in conts:
                    conts.append(cont)
                if len(conts) >= self.width:
                    return conts
        return conts

    def __call__(self, dcache, roots, root_scores, budget):
        yield from ()                                   # no model pass
        tree = dcache.tree
        out, seen = [], set(roots)
        for root in dict.fromkeys(roots):
            for cont in self._continuations(tree.path(root)):
                node = root
                for t in cont:
                    if len(out) >= budget or tree.depths[node] + 1 >= self.ctx:
                        break
                    node = tree.add(node, t)
                    if node not in seen:
                        seen.add(node)
                        out.append(node)
        return out


class MergedDrafter:
    """One tree from the draft model and prompt lookup together: lookup spans (names, numbers, markup copied from
    the source or repeated from the beam) go in beside the model's tree, sharing one node budget. The split
    follows measured acceptance: each pass, the nodes each source proposed last time that the target kept
    (they are on the new beams' paths) count for it, and lookup gets the share of the budget that its accepted
    nodes per proposed node earn against the model's (within [min_share, 1 - min_share], so the other source
    keeps being measured). Lookup costs no draft pass; the draft model later scores the lookup nodes it grows
    below (its cache catches up on their path)."""

    def __init__(self, model, lookup: PromptLookupDrafter, num_beams: int, min_share: float = 0.125):
        self.model, self.lookup = model, lookup
        self.num_beams, self.min_share = num_beams, min_share
        self.split = (0, 0)                                         # (lookup's, the model's) budget last pass
        self.counts = {"model": [1.0, 2.0], "lookup": [1.0, 2.0]}   # [accepted, proposed], prior 1/2 each
        self.last: dict[int, tuple[str, ...]] = {}                  # node -> the sources that proposed it
        self.floor = 0                                              # depth of the shallowest root last time

    def share(self) -> float:
        """Lookup's share of the budget: its acceptance rate over the sum of both (smoothed counts)."""
        rate = {k: a / p for k, (a, p) in self.counts.items()}
        s = rate["lookup"] / (rate["lookup"] + rate["model"])
        return min(1 - self.min_share, max(self.min_share, s))

    def _learn(self, tree, roots) -> None:
        """Count last time's proposals that lie on the new beams' paths (passes without drafting in between
        only lengthen those paths)."""
        kept = set()
        for n in dict.fromkeys(roots):
            while n >= 0 and tree.depths[n] > self.floor and n not in kept:
                if n in self.last:
                    kept.add(n)
                n = tree.parents[n]
        for n, sources in self.last.items():
            for src in sources:
                self.counts[src][1] += 1
                self.counts[src][0] += n in kept

    def __call__(self, dcache, roots, root_scores, budget):
        self._learn(dcache.tree, roots)
        to_lookup = max(1, round(budget * self.share()))
        self.split = (to_lookup, max(self.num_beams, budget - to_lookup))
        self.floor = min(dcache.tree.depths[r] for r in roots)
        looked = yield from self.lookup(dcache, roots, root_scores, self.split[0])
        drafted = yield from self.model(dcache, roots, root_scores, self.split[1])
        self.last = {}
        for src, nodes in (("lookup", looked), ("model", drafted)):
            for n in nodes:
                self.last[n] = self.last.get(n, ()) + (src,)
        return list(self.last)        # lookup's chains, then the model's: parents before children in each


def make_drafter(spec: SpeculativeConfig, num_beams: int, eos_ids, context_length: int, source=None) -> Drafter:
    """The drafter spec names; `source` (an encoder-decoder request's input ids) feeds prompt lookup;
    spec.with_lookup merges prompt lookup into a model drafter's tree (MergedDrafter)."""
    if spec.drafter == "lookup":
        return PromptLookupDrafter(spec, num_beams, eos_ids, context_length, source=source or ())
    cls = {"beam": DraftBeamSearch, "best_first": BestFirstDrafter}[spec.drafter]
    model = cls(spec, num_beams, eos_ids, context_length)
    if not spec.with_lookup:
        return model
    return MergedDrafter(model, PromptLookupDrafter(spec, num_beams, eos_ids, context_length, source=source or ()),
                         num_beams)
