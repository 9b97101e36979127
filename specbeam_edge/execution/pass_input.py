"""One pass's inputs (`PassInput`), made in one place (`PassInput.over`) for every caller: the batched pass, the
cost curves, the invariance check and the model's own shrinking pass. A runner (whole_graph.py, pipeline.py) turns
it into its graphs' feeds."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PassInput:
    """The new tokens of a pass over a tree and what they see.

    ids, pos: int64 [B, Q]; mask: bool [B, 1, Q, N + Q] (True = may attend); past: per layer (key, value)
    [B, kv_heads, N, head_dim], numpy or (kv_resident) OrtValues. key_positions: int64 [B, N + Q], the position
    of every key column, given iff the graph declares `key_position_ids` (sliding-window layers). static: the
    graph's `static_inputs` (an encoder's cross K/V), batched like ids. topk: the k a top-k head returns (None: a
    'both' head's logits). ahead: also return a lookahead head's guesses. head_from: the caller reads no head
    output of the rows before it (a prompt's rows): a head that can skip rows runs on the rows from there. prompt:
    a graph in double runs this pass's attention in fp32 (contract.PROMPT_ATTENTION: a prompt's unread rows,
    alone, batch.score_batch)."""
    ids: np.ndarray
    pos: np.ndarray
    mask: np.ndarray
    past: list
    key_positions: np.ndarray | None = None
    static: dict | None = None
    topk: int | None = None
    ahead: bool = False
    head_from: int = 0
    prompt: bool = False

    def __post_init__(self):
        self.ids = np.ascontiguousarray(self.ids, dtype=np.int64)
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int64)
        if self.key_positions is not None:
            self.key_positions = np.ascontiguousarray(self.key_positions, dtype=np.int64)

    @classmethod
    def over(cls, model, ids: np.ndarray, pos: np.ndarray, mask: np.ndarray, past: list,
             past_positions: np.ndarray, **kw) -> PassInput:
        """The pass of `model` (an OnnxCausalLM, or a test double with its interface): ids, pos [B, Q] or [Q];
        mask [B, 1, Q, N + Q], or [Q, N + Q] for one request; past_positions [B, N] or [N], the position of every
        cached column (padding columns: anything). Key positions are made for a graph that declares them, a
        head_from kept for a head that can skip rows (OnnxCausalLM.head_rows; test doubles score every row) and
        prompt for a graph with the fp32 branch (OnnxCausalLM.prompt_attention); kw: PassInput's other fields."""
        ids, pos, past_positions = np.atleast_2d(ids), np.atleast_2d(pos), np.atleast_2d(past_positions)
        mask = mask if mask.ndim == 4 else mask[None, None]
        if model.needs_key_positions:
            kw["key_positions"] = np.concatenate([past_positions.astype(np.int64), pos.astype(np.int64)], axis=1)
        if not getattr(model, "head_rows", False):
            kw.pop("head_from", None)
        if not getattr(model, "prompt_attention", False):
            kw.pop("prompt", None)
        return cls(ids, pos, mask, past, **kw)
