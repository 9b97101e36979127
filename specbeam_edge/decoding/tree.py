"""The token tree: every beam, draft node and prompt token of a request is a node (flat lists: token, parent,
depth). Nodes are never removed; caches decide which nodes keep KV (cache.py)."""
from __future__ import annotations


class TokenTree:
    """Append-only registry of nodes: node n has tokens[n], parents[n] (-1 for the first prompt token) and
    depths[n]. The lists are read directly (`tree.depths[n]`: no call per node in the loops over a pass's nodes);
    only `add` writes them."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.children: dict[tuple[int, int], int] = {}

    def __len__(self):
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """The node for `token` below `parent`, created if new (the same child is never added twice)."""
        key = (parent, int(token))
        node = self.children.get(key)
        if node is None:
            node = len(self.tokens)
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
            self.children[key] = node
        return node

    def add_chain(self, tokens, parent: int = -1) -> list[int]:
        out = []
        for t in tokens:
            parent = self.add(parent, t)
            out.append(parent)
        return out

    def path(self, n: int) -> list[int]:
        """Tokens from the root to n inclusive."""
        tokens, parents, out = self.tokens, self.parents, []
        while n >= 0:
            out.append(tokens[n])
            n = parents[n]
        return out[::-1]
