"""The tree-shaped KV cache of one request (the pass that fills it, batched over many requests: batch.py).

All beams of a request are nodes of one `TokenTree` (tree.py). Each model keeps a
`TreeCache`: KV for the nodes it has scored, laid out in slots, plus `vis[s, t]` = "slot s may attend to slot
t" (t is s or an ancestor of s). The prompt is stored once; beams share their common prefix. Rejected or
abandoned nodes become dead slots and are dropped by `compact`, so memory stays bounded.

The batched pass (batch.py, which this module does not import) reads and records a pass through the public
methods `pass_inputs`, `record_pass`, `append_rows`, `adopt_batch_row`, `unpad_for_packing` and `drop_padding`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..execution.model import OnnxCausalLM
from ..execution.runner import host, kv_nbytes
from .tree import TokenTree


@dataclass
class BatchKV:
    """The presents of one batched pass, per layer (key, value) [B, kv_heads, Nm + Qm, head_dim] on the host.
    Request b's cache takes row b as its KV (views, no copy: `adopt_batch_row` below) while it stays that
    row, so the next pass over the same requests feeds these arrays as they are. Only the batch writes into
    them: a row compacts in place through `compact_row`."""
    presents: list
    Nm: int
    Qm: int

    def compact_row(self, row: int, idx: np.ndarray) -> None:
        """Move the slots `idx` (in order) of request `row` to the front of its row (one copy of them); what
        follows them becomes that row's padding."""
        n = len(idx)
        for k, v in self.presents:
            k[row, :, :n] = k[row][:, idx]
            v[row, :, :n] = v[row][:, idx]


class TreeCache:
    """KV of one model over nodes of a TokenTree (batch.score_one runs the model on new nodes in one pass)."""

    def __init__(self, model: OnnxCausalLM, tree: TokenTree, static: dict | None = None):
        """static: the request's fixed extra graph inputs, name -> (array with batch axis 1, pad axis), e.g. an
        encoder's cross-attention K/V and source mask; batched passes zero-pad them along the pad axis (so a
        mask input must read 0 as masked)."""
        self.model, self.tree = model, tree
        self.static = static or {}
        self.past = model.empty_past() if model is not None else []   # None: a tree view without a model
        self.slot: dict[int, int] = {}           # node -> slot
        self.nodes: list[int] = []               # slot -> node
        self.vis = np.zeros((0, 0), dtype=bool)  # [slots, slots]
        self.positions = np.zeros(0, np.int64)   # slot -> position (depth) of its token
        self.passes = 0
        self.tokens_scored = 0
        self.peak_bytes = 0                      # the largest this request's KV ever was (slots x layers)
        self.padding = 0                         # dead slots that a batched pass's padding left (nodes -1)
        self.batch: tuple[BatchKV, int] | None = None    # (the batch's presents, this request's row) while the
        #                                          cache is that row, unchanged since: the next pass of the same
        #                                          batch feeds those arrays as they are (see adopt_batch_row)

    def __len__(self):
        return len(self.nodes)

    def __contains__(self, node: int) -> bool:
        return node in self.slot

    def missing_ancestors(self, nodes) -> list[int]:
        """Nodes (and their ancestors) not yet in the cache, parents before children, no duplicates."""
        out, seen = [], set()
        for n in nodes:
            chain = []
            while n >= 0 and n not in self.slot and n not in seen:
                chain.append(n)
                seen.add(n)
                n = self.tree.parents[n]
            out.extend(reversed(chain))
        return out

    def tree_mask(self, new: list[int]) -> np.ndarray:
        """bool [Q, N + Q]: row j = the cached and new ancestors of new[j], and itself. The one mask builder."""
        N, Q = len(self.nodes), len(new)
        mask = np.zeros((Q, N + Q), dtype=bool)
        index = {n: j for j, n in enumerate(new)}
        for j, n in enumerate(new):
            p = self.tree.parents[n]
            if p in index:
                mask[j] = mask[index[p]]
            elif p >= 0:
                mask[j, :N] = self.vis[self.slot[p]]
            mask[j, N + j] = True
        return mask

    def pass_inputs(self, new: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids [Q], positions [Q], tree mask [Q, N + Q]) of a pass over `new` (none of them cached yet)."""
        for n in new:
            if n in self.slot:
                raise ValueError(f"node {n} is already cached")
        tr = self.tree
        return (np.array([tr.tokens[n] for n in new], np.int64), np.array([tr.depths[n] for n in new], np.int64),
                self.tree_mask(new))

    def adopt_batch_row(self, new: list[int], mask: np.ndarray, batch: BatchKV, row: int):
        """Record a batched pass over `new` (its tree mask: `mask`) by taking this request's row of the batch's
        presents as the cache (views: no copy). Its slots: [0, N) its own, [N, Nm) the past padding of the
        batch, [Nm, Nm + Q) the new nodes, [Nm + Q, Nm + Qm) the padding rows; padding slots are dead (node -1,
        seen by nobody, masked in every pass). A pass over the same requests then feeds the batch arrays without
        padding them again."""
        N, Q, Nm, Qm = len(self.nodes), len(new), batch.Nm, batch.Qm
        T = Nm + Qm
        self.past = [(k[row:row + 1], v[row:row + 1]) for k, v in batch.presents]
        vis = np.zeros((T, T), dtype=bool)
        vis[:N, :N] = self.vis
        vis[Nm:Nm + Q, :N] = mask[:, :N]
        vis[Nm:Nm + Q, Nm:Nm + Q] = mask[:, N:]
        self.vis = vis
        for j, n in enumerate(new):
            self.slot[n] = Nm + j
        self.nodes.extend([-1] * (Nm - N) + list(new) + [-1] * (Qm - Q))
        pos = np.zeros(T, np.int64)
        pos[:N] = self.positions
        pos[Nm:Nm + Q] = [self.tree.depths[n] for n in new]
        self.positions = pos
        self.padding += T - N - Q
        self.batch = (batch, row)
        self.passes += 1
        self.tokens_scored += Q
        self._note_peak()

    def record_pass(self, new: list[int], mask: np.ndarray, presents: list[tuple]):
        """Record a pass over `new` (its tree mask: `mask`) whose presents hold, per layer, the cached and the new
        slots: the graph's own concat of this cache's unpadded pass (on a resident model they stay on its
        device), or the rows `append_rows` appended. They become the cache; the new nodes get the next slots."""
        self.batch = None
        N, Q = len(self.nodes), len(new)
        self.past = presents
        vis = np.zeros((N + Q, N + Q), dtype=bool)
        vis[:N, :N] = self.vis
        vis[N:] = mask
        self.vis = vis
        for j, n in enumerate(new):
            self.slot[n] = N + j
        self.nodes.extend(new)
        self.positions = np.concatenate([self.positions, [self.tree.depths[n] for n in new]]).astype(np.int64)
        self.passes += 1
        self.tokens_scored += Q
        self._note_peak()

    def append_rows(self, new: list[int], mask: np.ndarray, kv: list[tuple[np.ndarray, np.ndarray]]):
        """Record a pass over `new` from the new rows only (host arrays, per layer [1, kv_heads, Q, head_dim], cut
        out of a batch's presents): appended to the cached KV."""
        to_kv = self.model.to_kv
        self.record_pass(new, mask, [(to_kv(np.concatenate([host(k0), k], axis=2)),
                                      to_kv(np.concatenate([host(v0), v], axis=2)))
                                     for (k0, v0), (k, v) in zip(self.past, kv)])

    def _note_peak(self):
        """The request's own KV bytes: its slots, not the padding of a batch it is a row of."""
        T = len(self.nodes)
        if not self.past:
            return
        k = self.past[0][0]      # every layer's key and value have its shape
        total = 2 * len(self.past) * (k.nbytes if isinstance(k, np.ndarray) else kv_nbytes(k))
        self.peak_bytes = max(self.peak_bytes, total * (T - self.padding) // max(T, 1))

    def live_slots(self, keep_nodes) -> np.ndarray:
        """Slots on the paths to `keep_nodes` (up to each one's nearest cached ancestor: a draft cache that sat
        out some passes keeps the part of the path it has)."""
        live = np.zeros(len(self.nodes), dtype=bool)
        for n in keep_nodes:
            while n >= 0 and n not in self.slot:
                n = self.tree.parents[n]
            if n >= 0:
                live |= self.vis[self.slot[n]]
        return live

    def compact(self, keep_nodes, min_dead_fraction: float = 0.25) -> bool:
        """Drop slots not on the paths to `keep_nodes` once they are at least `min_dead_fraction` of the cache.
        Batch padding does not count: inside its batch it costs nothing the padded pass would not pay anyway
        (`drop_padding` removes it once the request runs alone)."""
        live = self.live_slots(keep_nodes)
        dead = len(live) - int(live.sum()) - self.padding
        if dead <= 0 or dead < min_dead_fraction * (len(live) - self.padding):
            return False
        self._keep(np.flatnonzero(live))
        return True

    def release(self) -> None:
        """Let go of the KV (the request is finished); the bookkeeping stays for statistics."""
        self.past = [] if self.model is None else self.model.empty_past()
        self.batch = None

    def drop_padding(self) -> None:
        """Leave the batch: this cache's own slots into arrays of its own (a request that continues alone would
        otherwise attend over the padding every pass, and a cache that sits out passes would keep the whole
        batch's arrays alive)."""
        if self.padding or self.batch is not None:
            self.batch = None
            self._keep(np.flatnonzero(np.array(self.nodes) >= 0))

    def unpad_for_packing(self) -> tuple[list, np.ndarray | None]:
        """Renumber the slots without the batch padding, ahead of a pass that packs this cache into a new batch
        array; returns (the current arrays, the slots to take from them, None for all) for that packing, which
        then is the only copy (the arrays are replaced when the pass's presents are recorded)."""
        if not self.padding:
            return self.past, None
        idx = np.flatnonzero(np.array(self.nodes) >= 0)
        old = self.past
        self.batch = None
        self._renumber(idx, len(idx))
        return old, idx

    def _keep(self, idx: np.ndarray) -> None:
        """Keep the slots `idx` (in order). A batch row compacts inside the row and keeps its length: the batch
        moves the kept slots to the row's front (BatchKV.compact_row: one copy of them, as any compaction) and the
        rest becomes padding, so the next pass of the batch still feeds its arrays as they are. Otherwise the kept
        slots become arrays of their own (a resident cache makes a round trip through the host: rare, only once
        >= 25% of it is dead)."""
        if self.batch is not None:
            batch, row = self.batch
            batch.compact_row(row, idx)
            self._renumber(idx, len(self.nodes))
            return
        self.past = [(self.model.to_kv(np.ascontiguousarray(host(k)[:, :, idx])),
                      self.model.to_kv(np.ascontiguousarray(host(v)[:, :, idx]))) for k, v in self.past]
        self._renumber(idx, len(idx))

    def _renumber(self, idx: np.ndarray, length: int) -> None:
        """Slot bookkeeping after keeping the slots `idx`, moved to the front of `length` slots (the rest
        padding: dead, node -1)."""
        n = len(idx)
        vis = np.zeros((length, length), dtype=bool)
        vis[:n, :n] = self.vis[np.ix_(idx, idx)]
        self.vis = vis
        pos = np.zeros(length, np.int64)
        pos[:n] = self.positions[idx]
        self.positions = pos
        self.nodes = [self.nodes[i] for i in idx] + [-1] * (length - n)
        self.slot = {nd: s for s, nd in enumerate(self.nodes) if nd >= 0}
        self.padding = length - n
