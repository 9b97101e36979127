"""The head's weights read from the checkpoint, for either layout's head: the final norm and lm_head as fp32 or
int8 columns, a chunk of tokens at a time (head_weights), or as the GGUF file's own blocks (head_blocks, the whole
layout's int4 head)."""
from __future__ import annotations

import numpy as np

from .blocks import Blocks
from .hf import Arch, final_norm
from .quant import quantize_columns, row_chunks


def head_weights(w, arch: Arch, head: str, ids, precision: str, reduce_range: bool) -> dict:
    """The head's global weights for graph.head_model: final norm, lm_head [hidden, S] and head_ids. For int8 the
    head is quantized per column (per token) a chunk of tokens at a time, to (codes int8 [hidden, S], scales [S]):
    the same codes quant.rowwise_int8 gives the fp32 matrix, without holding it (933 MB for a 151,936 x 1,536
    head; its codes are 233 MB)."""
    rows = w.shapes[head][0]
    pick = ids if ids is not None and len(ids) < rows else None     # head_tokens: some rows of a full head
    n = rows if pick is None else len(pick)
    if precision == "int8":
        q, s = np.empty((arch.hidden, n), np.int8), np.empty(n, np.float32)
    else:
        lm_head = np.empty((arch.hidden, n), np.float32)
    done = 0
    for start, stop in row_chunks(rows):
        block = np.asarray(w.rows(head, start, stop), np.float32)
        if pick is not None:
            block = block[pick[(pick >= start) & (pick < stop)] - start]
        end = done + len(block)
        if precision == "int8":
            q[:, done:end], s[done:end] = quantize_columns(block.T, reduce_range)
        else:
            lm_head[:, done:end] = block.T
        done = end
    if precision == "int8":
        lm_head = (q, s)
    return {"norm": final_norm(w, arch), "lm_head": lm_head, "head_ids": ids}


def head_blocks(w, head: str, ids):
    """The head matrix's own GGUF blocks (its rows `ids` for a head of some tokens), each chunk of rows checked bit
    for bit against the tensor's values; None when the file stores it otherwise or the values differ."""
    b = w.blocks(head)
    if b is None:
        return None
    if not all(b.rows(a, z).equals(np.asarray(w.rows(head, a, z), np.float32).T)
               for a, z in row_chunks(b.codes.shape[0])):
        return None
    if ids is not None and len(ids) < b.codes.shape[0]:
        b = Blocks(b.kind, b.codes[ids], b.scale[ids], None if b.offset is None else b.offset[ids])
    return b
