"""The token tree and the tree-shaped KV cache.

All beams of a request are nodes of one `TokenTree` (flat arrays: token, parent, depth). Each model keeps a
`TreeCache`: KV for the nodes it has scored, laid out in slots, plus `vis[s, t]` = "slot s may attend to slot
t" (t is s or an ancestor of s). The prompt is stored once; beams share their common prefix. Rejected or
abandoned nodes become dead slots and are dropped by `compact`, so memory stays bounded.
"""
from __future__ import annotations

import numpy as np

from .model import OnnxCausalLM


class TokenTree:
    """Append-only registry of nodes: node i has token[i], parent[i] (-1 for the first prompt token), depth[i]."""

    def __init__(self):
        self._tok, self._par, self._dep = [], [], []
        self.children: dict[tuple[int, int], int] = {}

    def __len__(self):
        return len(self._tok)

    def add(self, parent: int, token: int) -> int:
        """The node for `token` below `parent`, created if new (the same child is never added twice)."""
        key = (parent, int(token))
        node = self.children.get(key)
        if node is None:
            node = len(self._tok)
            self._tok.append(int(token))
            self._par.append(parent)
            self._dep.append(0 if parent < 0 else self._dep[parent] + 1)
            self.children[key] = node
        return node

    def add_chain(self, tokens, parent: int = -1) -> list[int]:
        out = []
        for t in tokens:
            parent = self.add(parent, t)
            out.append(parent)
        return out

    def token(self, n: int) -> int:
        return self._tok[n]

    def parent(self, n: int) -> int:
        return self._par[n]

    def depth(self, n: int) -> int:
        return self._dep[n]

    def child(self, parent: int, token: int) -> int | None:
        return self.children.get((parent, int(token)))

    def path(self, n: int) -> list[int]:
        """Tokens from the root to n inclusive."""
        out = []
        while n >= 0:
            out.append(self._tok[n])
            n = self._par[n]
        return out[::-1]


class TreeCache:
    """KV of one model over nodes of a TokenTree; `score` runs the model on new nodes in one pass."""

    def __init__(self, model: OnnxCausalLM, tree: TokenTree):
        self.model, self.tree = model, tree
        self.past = model.empty_past() if model is not None else []   # None: a tree view without a model
        self.slot: dict[int, int] = {}           # node -> slot
        self.nodes: list[int] = []               # slot -> node
        self.vis = np.zeros((0, 0), dtype=bool)  # [slots, slots]
        self.passes = 0
        self.tokens_scored = 0

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
                n = self.tree.parent(n)
            out.extend(reversed(chain))
        return out

    def tree_mask(self, new: list[int]) -> np.ndarray:
        """bool [Q, N + Q]: row j = the cached and new ancestors of new[j], and itself. The one mask builder."""
        N, Q = len(self.nodes), len(new)
        mask = np.zeros((Q, N + Q), dtype=bool)
        index = {n: j for j, n in enumerate(new)}
        for j, n in enumerate(new):
            p = self.tree.parent(n)
            if p in index:
                mask[j] = mask[index[p]]
            elif p >= 0:
                mask[j, :N] = self.vis[self.slot[p]]
            mask[j, N + j] = True
        return mask

    def score(self, new: list[int], topk: int | None = None):
        """One model pass over `new` (each node's parent is cached or earlier in `new`); appends their KV.

        Returns the model head's output for the new nodes, [Q, V] logits (or top-k pairs).
        """
        tr = self.tree
        for n in new:
            p = tr.parent(n)
            if n in self.slot:
                raise ValueError(f"node {n} is already cached")
        mask = self.tree_mask(new)
        ids = np.array([[tr.token(n) for n in new]], dtype=np.int64)
        pos = np.array([[tr.depth(n) for n in new]], dtype=np.int64)
        out, self.past = self.model.forward(ids, pos, mask[None, None], self.past, topk=topk)
        N, Q = len(self.nodes), len(new)
        vis = np.zeros((N + Q, N + Q), dtype=bool)
        vis[:N, :N] = self.vis
        vis[N:] = mask
        self.vis = vis
        for j, n in enumerate(new):
            self.slot[n] = N + j
        self.nodes.extend(new)
        self.passes += 1
        self.tokens_scored += Q
        if isinstance(out, tuple):
            return tuple(o[0] for o in out)
        return out[0]

    def live_slots(self, keep_nodes) -> np.ndarray:
        """Slots on the paths to `keep_nodes` (up to each one's nearest cached ancestor: a draft cache that sat
        out some passes keeps the part of the path it has)."""
        live = np.zeros(len(self.nodes), dtype=bool)
        for n in keep_nodes:
            while n >= 0 and n not in self.slot:
                n = self.tree.parent(n)
            if n >= 0:
                live |= self.vis[self.slot[n]]
        return live

    def compact(self, keep_nodes, min_dead_fraction: float = 0.25) -> bool:
        """Drop slots not on the paths to `keep_nodes` once they are at least `min_dead_fraction` of the cache."""
        live = self.live_slots(keep_nodes)
        dead = len(live) - int(live.sum())
        if dead == 0 or dead < min_dead_fraction * len(live):
            return False
        idx = np.flatnonzero(live)
        self.past = [(np.ascontiguousarray(k[:, :, idx]), np.ascontiguousarray(v[:, :, idx])) for k, v in self.past]
        self.vis = self.vis[np.ix_(idx, idx)]
        self.nodes = [self.nodes[i] for i in idx]
        self.slot = {n: s for s, n in enumerate(self.nodes)}
        return True
