"""The batched pass: one model pass over the new nodes of several requests' tree caches (the messages it answers:
protocol.py; docs/HISTORY.md "The batched pass" and "Batch rows").

Request b's past is left-aligned and zero-padded to the longest past, its new rows follow the padded past;
padding columns are masked out, padding rows see only themselves. A request alone is the batch of one: exactly
the unpadded pass. Each cache takes its part of the pass's presents through `TreeCache`'s public interface
(`pass_inputs`, `adopt_batch_row`, `record_pass`, `append_rows`, `unpad_for_packing`, `drop_padding`); the
batch arrays (`cache.BatchKV`) are written only through their own methods.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from . import heads
from ..decoding.cache import BatchKV, TreeCache
from .pass_input import PassInput
from .runner import host
from ..decoding.protocol import ScoreCall


class StaticStacks:
    """Per model: the requests' static inputs (an encoder's cross K/V) of its last batched pass and their stacked
    arrays. A batch whose requests are the same, in the same order, feeds the same arrays instead of padding and
    copying them anew every pass (docs/HISTORY.md "The batched pass"). The scheduler keeps one for its run."""

    def __init__(self):
        self._last: dict = {}      # model -> (statics, stacked)

    def get(self, model, statics: list[dict]) -> dict[str, np.ndarray]:
        last = self._last.get(model)
        if last is not None and len(last[0]) == len(statics) and all(a is b for a, b in zip(last[0], statics)):
            return last[1]
        out = _stack_static(statics)
        self._last[model] = (statics, out)
        return out


def score_one(cache: TreeCache, nodes: list[int], topk: int | None = None):
    """One model pass over `nodes` of one cache (each node's parent cached or earlier in `nodes`): the batch of
    one. Returns the head output (heads.DenseOutput [Q, V] logits, or heads.TopKOutput [Q, k])."""
    return score_batch([ScoreCall(cache, nodes, topk)])[0]


def score_batch(calls: list[ScoreCall], stacks: StaticStacks | None = None) -> list:
    """One pass of one model over the new nodes of several requests' caches (a batch dimension: request b's
    past is left-aligned and zero-padded to the longest, its new rows follow the padded past; padding columns
    are masked out, padding rows see only themselves). Returns each call's head output (heads.DenseOutput, or
    heads.TopKOutput limited to its own k). Requests whose shapes differ a lot run as separate sub-batches (see
    `_buckets`). A call of more new nodes than the model's `prefill_chunk` (a long prompt, a draft cache
    catching up) runs as passes of at most that many rows, each recording its KV before the next: the pass's
    attention and head buffers stay the chunk's size, so the KV cache is the only thing that grows with a
    prompt (its first pass over 5,600 tokens took 9 GB). stacks: the run's stacked static inputs (None: stacked
    afresh)."""
    model = calls[0].cache.model
    if model.cfg.output == "both":
        # a replayed call reads rows of several passes together, so it gets its top-k in every pass: beside a
        # call that needs full rows (a constrained request, a sampling draft) it runs as a pass of its own (one
        # pass answering both kinds gave it dense rows here and top-k rows after the other left: a mixed join)
        mixed = [i for i, c in enumerate(calls) if c.replayed and c.topk is not None and c.nodes]
        dense = [i for i, c in enumerate(calls) if c.topk is None and c.nodes]
        if mixed and dense:
            alone = set(mixed)
            rest = [i for i in range(len(calls)) if i not in alone]
            out: list = [None] * len(calls)
            for part in (mixed, rest):
                for i, o in zip(part, score_batch([calls[i] for i in part], stacks)):
                    out[i] = o
            return out
    limit = min(model.cfg.context_length, model.prefill_chunk)      # (the rotary tables hold context_length rows)
    outs: list[list] = [[] for _ in calls]
    if getattr(model, "prompt_attention", False):    # (test doubles have no such branch)
        calls = [_prompt_alone(model, c, limit, outs[i], stacks) for i, c in enumerate(calls)]
    todo = [(i, list(c.nodes)) for i, c in enumerate(calls) if c.nodes]
    # a 'both' head answers with its top-k when every call of the pass takes one (a sampling draft beside exact
    # ones gets full rows, which answer top() as well) and the pass has two rows or more (over one row Python's
    # top-k of the logits is the cheaper) or a call's rows are replayed (DESIGN section 11, "Head outputs")
    use_topk = model.cfg.output != "both" or (all(calls[i].topk is not None for i, _ in todo) and (
        sum(len(n) for _, n in todo) >= 2 or any(calls[i].replayed for i, _ in todo)))
    start = 0                  # the first node of this round's chunks in every call's nodes
    while todo:
        chunk = [(i, nodes[:limit]) for i, nodes in todo]
        groups = _buckets([(len(calls[i].cache), len(part)) for i, part in chunk])
        for group in _within(groups, [len(p) for _, p in chunk], [calls[i].head_from > start for i, _ in chunk],
                             limit):
            sub = [chunk[g] for g in group]
            k = (max((calls[i].topk or 0) for i, _ in sub) or None) if use_topk else None
            ahead = k is not None and any(calls[i].ahead for i, _ in sub)
            # rows no caller of the sub-batch reads (the leading rows of a prompt) skip the head where it can
            skip = min(max(calls[i].head_from - start, 0) for i, _ in sub)
            for (i, part), out in zip(sub, _one_pass(model, [(calls[i].cache, part) for i, part in sub], k, ahead,
                                                           stacks, skip)):
                # a chunk nobody reads (a long prompt's before its last) is not kept: its logits would add up
                read = start + len(part) > calls[i].head_from
                outs[i].append(out.limit(calls[i].topk) if read else heads.Unread(len(part)))
        todo = [(i, nodes[limit:]) for i, nodes in todo if len(nodes) > limit]
        start += limit
    return [heads.join(o, c.cache.model) if o else heads.empty(c.cache.model) for o, c in zip(outs, calls)]


def _prompt_alone(model, call: ScoreCall, limit: int, out: list, stacks) -> ScoreCall:
    """A call's unread rows (a prompt's before its last), when there are PROMPT_ROWS of them or more, scored first
    in passes of their own of at most `limit` rows with the graph's attention in fp32 (PROMPT_ATTENTION: 2.7x faster
    than double over 5,600 tokens). fp32 attention is not layout-exact, so those rows are laid out alike whatever
    the mode: alone, in the same chunks, before any drafted node; the rest of the call (the prompt's last token, a
    tree) is scored as before. Their outputs (unread) go into `out`; returns the rest of the call."""
    n = call.head_from
    if n < PROMPT_ROWS:
        return call
    for start in range(0, n, limit):
        part = call.nodes[start:min(start + limit, n)]
        _one_pass(model, [(call.cache, part)], call.topk, False, stacks, len(part), prompt=True)
        out.append(heads.Unread(len(part)))
    return replace(call, nodes=call.nodes[n:], head_from=0)


# the fewest unread rows that run with fp32 attention (_prompt_alone): below, their attention costs little, and
# splitting them from the last token would add a pass
PROMPT_ROWS = 64


def _within(groups: list[list[int]], rows: list[int], prompt: list[bool], limit: int) -> list[list[int]]:
    """Sub-batches holding prompt rows (`prompt`) split into passes of at most `limit` rows, padding included (a
    request at least each): a batch of prompts is a long prompt too (its attention, and a whole graph's head over
    every row). Sub-batches of decoding steps and trees stay as they are."""
    out = []
    for group in groups:
        if not any(prompt[j] for j in group) or len(group) * max(rows[j] for j in group) <= limit:
            out.append(group)
            continue
        part, widest = [], 0
        for j in group:
            if part and (len(part) + 1) * max(widest, rows[j]) > limit:
                out.append(part)
                part, widest = [], 0
            part.append(j)
            widest = max(widest, rows[j])
        out.append(part)
    return out


def _buckets(shapes: list[tuple[int, int]], min_split: int = 4) -> list[list[int]]:
    """Sub-batches of similar shape, from (cached slots N, new nodes Q) per request. Padding to the largest Q
    runs every request's padded rows through the whole network (one long prefill made a batch of short decoding
    steps several times slower: docs/HISTORY.md "The batched pass"). So: split where Q more than doubles, then,
    inside a group, at gaps where N more than doubles (N pads the attention and the KV copies), leaving
    min_split requests a side."""
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i][1], shapes[i][0]))
    by_q: list[list[int]] = []
    for i in order:
        if by_q and shapes[i][1] <= 2 * max(1, shapes[by_q[-1][0]][1]):
            by_q[-1].append(i)
        else:
            by_q.append([i])
    out = []
    for group in by_q:
        group = sorted(group, key=lambda i: shapes[i][0])
        start = 0
        for j in range(1, len(group)):
            if (shapes[group[j]][0] > 2 * shapes[group[j - 1]][0] + 16 and j - start >= min_split
                    and len(group) - j >= min_split):
                out.append(group[start:j])
                start = j
        out.append(group[start:])
    return out


def _one_pass(model, work: list[tuple[TreeCache, list[int]]], topk: int | None, ahead: bool = False,
              stacks: StaticStacks | None = None, head_from: int = 0, prompt: bool = False) -> list:
    """The model forward for a batch; appends every request's new KV; returns per-request head outputs. prompt:
    attention in fp32 (PassInput.prompt: a prompt's unread rows, alone)."""
    if len(work) == 1 and len(work[0][1]) >= model.min_rows:   # the batch of one: exactly the unpadded pass
        cache, new = work[0]
        cache.drop_padding()
        ids, pos, mask = cache.pass_inputs(new)
        static = {name: a for name, (a, _) in cache.static.items()} if cache.static else None
        out, presents = model.run(PassInput.over(model, ids, pos, mask, cache.past, cache.positions, static=static,
                                                 topk=topk, ahead=ahead, head_from=head_from, prompt=prompt))
        cache.record_pass(new, mask, presents)
        return heads.wrap(out)
    shared = _same_batch([cache for cache, _ in work])
    if shared is not None and shared.Nm + shared.Qm + max(len(new) for _, new in work) > model.cfg.context_length:
        shared = None      # rows would outgrow the context: pack each request's own slots instead of attending
        #                    over ever more padding (LongRoPE graphs from before 2026-12 also refused such a past)
    if shared is not None:             # the rows of the last pass's presents, in their order: no padding copy
        order = sorted(range(len(work)), key=lambda b: work[b][0].batch[1])
        work = [work[b] for b in order]
        gathers = None
    else:                              # packed afresh: each request's own slots only, gathered in one copy
        gathers = [cache.unpad_for_packing() for cache, _ in work]
    inputs = [cache.pass_inputs(new) for cache, new in work]
    # model.min_rows: a graph whose kernels change at one row (onnxruntime's GEMV path) gets a padding row
    Qm = max(model.min_rows, max(len(new) for _, new in work))
    Nm = max(len(cache.nodes) for cache, _ in work)
    results = _one_pass_rows(model, work, inputs, topk, Nm, Qm, shared.presents if shared is not None else None,
                             gathers, ahead, stacks, head_from, prompt)
    return results if shared is None else [results[i] for i in np.argsort(order)]


def _same_batch(caches: list[TreeCache], max_padding: float = 0.10, slack: int = 16) -> BatchKV | None:
    """The batch arrays every one of these caches is a row of, if they are exactly all its rows, unchanged, and
    not mostly padding: rows only grow (by the pass's widest tree) while compaction empties them from the end,
    so once the longest request's own slots fall below 1 - max_padding of the row (+ slack), the batch is packed
    afresh (one copy) instead of attending over dead columns every pass."""
    first = caches[0].batch
    if first is None:
        return None
    shared = first[0]
    T = shared.Nm + shared.Qm
    rows = set()
    for c in caches:
        if c.batch is None or c.batch[0] is not shared or len(c.nodes) != T:
            return None
        rows.add(c.batch[1])
    if rows != set(range(shared.presents[0][0].shape[0])) or len(rows) != len(caches):
        return None
    longest = max(len(c.nodes) - c.padding for c in caches)
    return shared if longest + slack >= (1 - max_padding) * T else None


def _one_pass_rows(model, work, inputs, topk, Nm, Qm, shared_past, gathers, ahead: bool = False,
                   stacks: StaticStacks | None = None, head_from: int = 0, prompt: bool = False) -> list:
    """The batched pass proper; shared_past: the batch arrays to feed as they are (rows in work's order); else
    gathers: per request (its arrays, the slots to take or None for all), packed into new padded arrays."""
    B = len(work)
    ids = np.zeros((B, Qm), np.int64)
    pos = np.zeros((B, Qm), np.int64)
    past_pos = np.zeros((B, Nm), np.int64)
    mask = np.zeros((B, 1, Qm, Nm + Qm), bool)
    mask[:, 0, :, Nm:] = np.eye(Qm, dtype=bool)       # padding rows attend to themselves only
    for b, ((cache, new), (i, p, m)) in enumerate(zip(work, inputs)):
        N, Q = len(cache.nodes), len(new)
        ids[b, :Q], pos[b, :Q], past_pos[b, :N] = i, p, cache.positions
        mask[b, 0, :Q, :N] = m[:, :N]
        mask[b, 0, :Q, Nm:Nm + Q] = m[:, N:]
    past = shared_past if shared_past is not None else _pack(model, gathers, Nm)
    static = None
    if work[0][0].static:
        statics = [cache.static for cache, _ in work]
        static = stacks.get(model, statics) if stacks is not None else _stack_static(statics)
    out, presents = model.run(PassInput.over(model, ids, pos, mask, past, past_pos, static=static, topk=topk,
                                             ahead=ahead, head_from=head_from, prompt=prompt))
    if model.kv_resident:         # else the presents are host arrays already
        presents = [(host(k), host(v)) for k, v in presents]
    batch = None if model.kv_resident else BatchKV(presents, Nm, Qm)
    results = []
    for b, ((cache, new), (_, _, m), head) in enumerate(zip(work, inputs, heads.wrap(out))):
        Q = len(new)
        if batch is not None:
            cache.adopt_batch_row(new, m, batch, b)
        else:
            cache.append_rows(new, m, [(k[b:b + 1, :, Nm:Nm + Q], v[b:b + 1, :, Nm:Nm + Q]) for k, v in presents])
        results.append(head.take(slice(0, Q)))
    return results


def _pack(model, gathers: list, Nm: int) -> list:
    """New padded past arrays [B, kv_heads, Nm, head_dim] per layer from each request's (arrays, slots to take
    or None for all), straight from its old arrays (a batch row's own slots, without its padding): one copy."""
    past = []
    for layer in range(len(gathers[0][0])):
        k = v = None
        for b, (arrays, idx) in enumerate(gathers):
            ck, cv = host(arrays[layer][0])[0], host(arrays[layer][1])[0]
            if k is None:
                k = np.zeros((len(gathers), ck.shape[0], Nm, ck.shape[2]), ck.dtype)
                v = np.zeros_like(k)
            if idx is None:
                k[b, :, :ck.shape[1]], v[b, :, :cv.shape[1]] = ck, cv
            else:
                np.take(ck, idx, axis=1, out=k[b, :, :len(idx)], mode="clip")
                np.take(cv, idx, axis=1, out=v[b, :, :len(idx)], mode="clip")
        past.append((model.to_kv(k), model.to_kv(v)))
    return past


def _stack_static(statics: list[dict]) -> dict[str, np.ndarray]:
    """Per-request static inputs -> batched arrays, zero-padded to the longest along each input's pad axis."""
    out = {}
    for name, (a0, axis) in statics[0].items():
        shape = list(a0.shape)
        shape[0] = len(statics)
        shape[axis] = max(s[name][0].shape[axis] for s in statics)
        arr = np.zeros(shape, a0.dtype)
        for b, s in enumerate(statics):
            a = s[name][0]
            idx = [slice(b, b + 1)] + [slice(0, n) for n in a.shape[1:]]
            arr[tuple(idx)] = a
        out[name] = arr
    return out
