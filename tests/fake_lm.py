"""A tiny exact "language model" in numpy with the OnnxCausalLM interface, for distribution tests.

Its KV cache stores each slot's (token, position); the logits of a node are a fixed table lookup on
(parent token, own token), found through the tree mask, so they depend on the path like a real model's.
"""
from types import SimpleNamespace

import numpy as np


class FakeLM:
    needs_key_positions = False
    kv_resident = False
    min_rows = 1
    prefill_chunk = 512

    def __init__(self, vocab: int, seed: int, sharpness: float = 1.5, eos=(0,), ctx: int = 64):
        rng = np.random.default_rng(seed)
        self.table = rng.normal(0, sharpness, size=(vocab + 1, vocab, vocab)).astype(np.float32)
        self.cfg = SimpleNamespace(vocab_size=vocab, context_length=ctx, eos_token_ids=tuple(eos), generation={}, raw={},
                                   output="logits")

    @staticmethod
    def to_kv(a):
        return a

    def empty_past(self):
        return [(np.zeros((1, 1, 0, 2), np.float32), np.zeros((1, 1, 0, 2), np.float32))]

    def run(self, p):
        """A pass (execution.pass_input.PassInput): its head output and presents."""
        return self.forward(p.ids, p.pos, p.mask, p.past)

    def forward(self, input_ids, position_ids, tree_mask, past):
        # no lookahead head: `ahead` is never asked of it (the engine asks only targets whose config has one)
        k = past[0][0]
        new = np.stack([input_ids[0], position_ids[0]], -1).astype(np.float32)[None, None]
        kv = np.concatenate([k, new], axis=2)                       # [1, 1, T, 2]: (token, position)
        toks, pos = kv[0, 0, :, 0].astype(int), kv[0, 0, :, 1].astype(int)
        out = []
        for j in range(input_ids.shape[1]):
            vis = np.flatnonzero(tree_mask[0, 0, j])
            parent = [s for s in vis if pos[s] == position_ids[0, j] - 1]
            ptok = toks[parent[0]] if parent else self.table.shape[0] - 1
            out.append(self.table[ptok, input_ids[0, j]])
        return np.stack(out)[None], [(kv, kv)]
