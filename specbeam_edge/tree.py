"""The token tree: every beam, draft node and prompt token of a request is a node (flat lists: token, parent,
depth). Nodes are never removed; caches decide which nodes keep KV (cache.py)."""
from __future__ import annotations


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

    def path(self, n: int) -> list[int]:
        """Tokens from the root to n inclusive."""
        out = []
        while n >= 0:
            out.append(self._tok[n])
            n = self._par[n]
        return out[::-1]
