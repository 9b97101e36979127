"""The lookahead head: a small network inside the target graph that guesses the token after the target's own next
token, so greedy search can verify two tokens per target pass with no draft model (DESIGN "Lookahead head").

For every scored node (row t) the target computes its final hidden state h_t (`final_h`, the input of lm_head)
and its best next token a_t (`topk_ids[..., 0]`). The head reads both, EAGLE-style, and predicts what the target
will say after a_t:

    z = [h_t, E[a_t]]                               # E: the target's own embedding table (the Gather of input_ids)
    u = silu(z @ W1 + b1)                           # [2H] -> [H]
    y = rmsnorm(h_t + u @ W2 + b2) * g              # a guess of the next row's final hidden state
    s = log_softmax(y @ E_sub^T)                    # over S frequent tokens (E_sub: rows of E, the tied head)
    ahead_logprobs, ahead_ids = top-m of s          # m guesses, as token ids of the whole vocabulary

With depth D > 1 the head runs again on its own prediction (EAGLE's feature-level chain, the same weights):
level k reads y of level k - 1 in place of h_t and the embedding of level k - 1's best guess, and adds its best
guess; the outputs' last axis is [m guesses of level 1, the best of level 2, ..., of level D], the chain below the
first guess (a tree of 1 + m + D - 1 nodes a beam, verified in one pass).

It runs only in passes whose `ahead_on` input is true (an If node; plain passes skip it).

The head is a side branch: nothing the target's logits, top-k or KV cache depend on changes (tests/test_ahead.py
checks them bit for bit), so exact search stays exact whatever the head guesses; the guesses only decide which
nodes the next pass scores. Its MatMuls run in fp32, or in the target's per-row int8 for int8 targets (about 5 M
multiply-adds a row and level at SmolLM2-135M's size with S = 8,192, 4% of the target's).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as onh

from specbeam_edge.contract import AHEAD_FORM as FORM, AHEAD_INPUT, AHEAD_OUTPUTS, file_sha256

from .embedding import blocks_lookup, embedding_values

FINAL_HIDDEN = "final_h"
WEIGHTS = ("w1", "b1", "w2", "b2", "norm")


def _embedding_table(g: onnx.GraphProto) -> str:
    """The tensor the graph's token embedding Gathers rows from (an initializer, or the output of its Cast or
    DequantizeLinear for fp16 / int8w storage)."""
    for n in g.node:
        if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] == "input_ids":
            return n.input[0]
    raise ValueError("no token embedding (a Gather of input_ids) in the graph: a whole-layout decoder-only "
                     "export is needed")


# the int8 embedding's scales and shapes (export/embedding._int8_rows_embedding), read from the enclosing graph
INT8_TABLE = ("embed.weight.blockscale", "embed.blocks", "embed.last_axis", "embed.flat")


def _lookup(emb: str, tok: str, q: str, inits: set[str]) -> list:
    """Nodes giving q + "e": the embedding rows of `tok`, as the target computes them (an int8 table's codes times
    their block scales, a GGUF's own blocks (embedding.blocks_lookup), fp32 otherwise)."""
    if emb == "embed.codes":
        return blocks_lookup(tok, q + "e", "embed.low_mask" in inits, "embed.bzero" in inits,
                             "embed.boffset" in inits)
    if emb != "embed.weight.i8":
        return [oh.make_node("Gather", [emb, tok], [q + "e"], axis=0)]
    scale, blocks, last, flat = INT8_TABLE
    return [oh.make_node("Gather", [emb, tok], [q + "e.i8"], axis=0),
            oh.make_node("Cast", [q + "e.i8"], [q + "e.f"], to=TensorProto.FLOAT),
            oh.make_node("Reshape", [q + "e.f", blocks], [q + "e.b"]),
            oh.make_node("Gather", [scale, tok], [q + "e.s"], axis=0),
            oh.make_node("Unsqueeze", [q + "e.s", last], [q + "e.s1"]),
            oh.make_node("Mul", [q + "e.b", q + "e.s1"], [q + "e.m"]),
            oh.make_node("Reshape", [q + "e.m", flat], [q + "e"])]


def check_graph(model: onnx.ModelProto) -> None:
    g = model.graph
    names = {o for n in g.node for o in n.output}
    outs = {o.name for o in g.output}
    if FINAL_HIDDEN not in names or "topk_ids" not in outs:
        raise ValueError("the lookahead head needs a whole-layout decoder-only graph with a top-k head "
                         "(export with --output_kind both or topk)")
    if any(o in outs for o in AHEAD_OUTPUTS):
        raise ValueError("the graph already has a lookahead head")


def add_head(model: onnx.ModelProto, weights: dict[str, np.ndarray], token_ids: np.ndarray, guesses: int,
             eps: float, int8: bool = False, reduce_range: bool = True, depth: int = 1) -> None:
    """Add the lookahead head to `model` in place (see the module docstring). weights: w1 [2H, H], b1 [H],
    w2 [H, H], b2 [H], norm [H] (fp32); token_ids: the S vocabulary ids of the head's output rows. int8: its
    three MatMuls in the target's per-row int8 (export/quant.py; for int8 targets: onnxruntime runs the head in
    every pass, plain ones included, and its weights then stream 4x fewer bytes, 6 MB instead of 23 MB at
    SmolLM2-135M's size). depth: levels of guesses (see the module docstring); the outputs' last axis holds the
    `guesses` of level 1, then one guess of each deeper level (guesses + depth - 1 columns)."""
    emb, E, token_ids = _checked(model, weights, token_ids, guesses, depth)
    g = model.graph
    p = "ahead."
    inits = _head_inits(weights, E, token_ids, guesses, p)
    nodes = _levels(emb, {t.name for t in g.initializer}, guesses, depth, eps, p)
    if int8:
        nodes, inits = _rowwise(nodes, inits, [FINAL_HIDDEN, "topk_ids", emb, *INT8_TABLE], reduce_range)
        have = {t.name for t in g.initializer}
        inits = [t for t in inits if t.name not in have]     # quant.py's shared constants, already in an int8 graph
    for i, n in enumerate(nodes):
        n.name = f"{p}{i}.{n.op_type}"
    _add_switched(g, nodes, inits, guesses + depth - 1, p)


def _checked(model: onnx.ModelProto, weights: dict[str, np.ndarray], token_ids, guesses: int, depth: int):
    """add_head's arguments checked against the graph: (the embedding tensor, its fp32 table, the token ids)."""
    check_graph(model)
    if depth < 1 or guesses < 1:
        raise ValueError(f"the head needs guesses >= 1 and depth >= 1, got {guesses} and {depth}")
    g = model.graph
    emb = _embedding_table(g)
    E = embedding_values(g.initializer)
    if E is None:
        raise ValueError(f"the embedding {emb} is not an initializer; export with -p fp32 or int8")
    token_ids = np.asarray(token_ids, np.int64)
    if token_ids.ndim != 1 or len(token_ids) < guesses or token_ids.min() < 0 or token_ids.max() >= E.shape[0]:
        raise ValueError(f"the head's token ids must be {guesses} or more ids of the vocabulary (0-{E.shape[0] - 1})")
    H = E.shape[1]
    shapes = {"w1": (2 * H, H), "b1": (H,), "w2": (H, H), "b2": (H,), "norm": (H,)}
    for k, shape in shapes.items():
        if tuple(weights[k].shape) != shape:
            raise ValueError(f"lookahead weight {k} has shape {tuple(weights[k].shape)}, the graph needs {shape}")
    return emb, E, token_ids


def _head_inits(weights: dict[str, np.ndarray], E: np.ndarray, token_ids: np.ndarray, guesses: int,
                p: str) -> list:
    """The head's weights, its output rows of the embedding table [H, S] and its constants."""
    inits = [onh.from_array(np.asarray(weights[k], np.float32), p + k) for k in WEIGHTS]
    return inits + [onh.from_array(np.ascontiguousarray(E[token_ids].T), p + "head"),     # [H, S]
                    onh.from_array(token_ids, p + "token_ids"),
                    onh.from_array(np.array(0, np.int64), p + "zero"),
                    onh.from_array(np.array([guesses], np.int64), p + "m"),
                    onh.from_array(np.array([1], np.int64), p + "one")]


def _levels(emb: str, init_names: set[str], guesses: int, depth: int, eps: float, p: str) -> list:
    """The head's nodes, level after level, ending in its outputs p + "out_lp" and p + "out_ids"."""
    nodes = [oh.make_node("Gather", ["topk_ids", p + "zero"], [p + "next"], axis=-1)]  # [B, n]: the target's best
    h, lps, ids = FINAL_HIDDEN, [], []
    for level in range(1, depth + 1):
        # level 1 reads the node's own hidden state and its best next token; level k > 1 the hidden state level
        # k - 1 predicted and that level's best guess (the chain below the first guess, EAGLE-style)
        q = f"{p}l{level}."
        tok = p + "next" if level == 1 else f"{p}l{level - 1}.tok"
        k = p + "m" if level == 1 else p + "one"
        nodes += _lookup(emb, tok, q, init_names) + [                                              # [B, n, H]
            oh.make_node("Concat", [h, q + "e"], [q + "z"], axis=-1),
            oh.make_node("MatMul", [q + "z", p + "w1"], [q + "u0"]),
            oh.make_node("Add", [q + "u0", p + "b1"], [q + "u1"]),
            oh.make_node("Sigmoid", [q + "u1"], [q + "sig"]),
            oh.make_node("Mul", [q + "u1", q + "sig"], [q + "u"]),
            oh.make_node("MatMul", [q + "u", p + "w2"], [q + "v0"]),
            oh.make_node("Add", [q + "v0", p + "b2"], [q + "v1"]),
            oh.make_node("Add", [q + "v1", h], [q + "y0"]),
            oh.make_node("RMSNormalization", [q + "y0", p + "norm"], [q + "y"], axis=-1, epsilon=eps),
            oh.make_node("MatMul", [q + "y", p + "head"], [q + "s"]),
            oh.make_node("LogSoftmax", [q + "s"], [q + "lp"], axis=-1),
            oh.make_node("TopK", [q + "lp", k], [q + "out_lp", q + "idx"], axis=-1),
            oh.make_node("Gather", [p + "token_ids", q + "idx"], [q + "out_ids"], axis=0),
        ]
        if level < depth:
            nodes.append(oh.make_node("Gather", [q + "out_ids", p + "zero"], [q + "tok"], axis=-1))
        h = q + "y"
        lps.append(q + "out_lp")
        ids.append(q + "out_ids")
    return nodes + [oh.make_node("Concat", lps, [p + "out_lp"], axis=-1),
                    oh.make_node("Concat", ids, [p + "out_ids"], axis=-1)]


def _add_switched(g: onnx.GraphProto, nodes: list, inits: list, cols: int, p: str) -> None:
    """The head's nodes into `g` as the then branch of an If on the `ahead_on` input, its weights and its I/O."""
    # the head runs inside an If on the `ahead_on` input: onnxruntime runs every node of a graph whatever outputs
    # a run asks for, and plain passes (plain search, adaptive speculation's plain choice) would pay for it
    # (measured on SmolLM2-135M: greedy 0.93x with the head always on); the else branch gives empty guesses
    shape = ["batch", "n_new", cols]
    then = oh.make_graph(nodes, "ahead_then", [],
                         [oh.make_tensor_value_info(p + "out_lp", TensorProto.FLOAT, shape),
                          oh.make_tensor_value_info(p + "out_ids", TensorProto.INT64, shape)])
    empty = [oh.make_node("Constant", [], [p + "none_lp"], value=onh.from_array(np.zeros((0, 0, cols), np.float32))),
             oh.make_node("Constant", [], [p + "none_ids"], value=onh.from_array(np.zeros((0, 0, cols), np.int64)))]
    other = oh.make_graph(empty, "ahead_else", [],
                          [oh.make_tensor_value_info(p + "none_lp", TensorProto.FLOAT, [0, 0, cols]),
                           oh.make_tensor_value_info(p + "none_ids", TensorProto.INT64, [0, 0, cols])])
    g.node.append(oh.make_node("If", [AHEAD_INPUT], AHEAD_OUTPUTS, name=p + "if", then_branch=then,
                               else_branch=other))
    g.initializer.extend(inits)
    g.input.append(oh.make_tensor_value_info(AHEAD_INPUT, TensorProto.BOOL, [1]))
    g.output.extend([oh.make_tensor_value_info(AHEAD_OUTPUTS[0], TensorProto.FLOAT, None),
                     oh.make_tensor_value_info(AHEAD_OUTPUTS[1], TensorProto.INT64, None)])


def _rowwise(nodes, inits, inputs: list[str], reduce_range: bool):
    """The head's nodes and weights with its MatMuls in per-row int8 (quant.rowwise_int8 over the head alone)."""
    from .quant import rowwise_int8

    sub = oh.make_model(oh.make_graph(nodes, "ahead", [oh.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                       for n in inputs],
                                      [oh.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in AHEAD_OUTPUTS],
                                      inits))
    rowwise_int8(sub, reduce_range=reduce_range)
    return list(sub.graph.node), list(sub.graph.initializer)


def strip_head(model: onnx.ModelProto) -> bool:
    """Remove a lookahead head from `model` in place (its nodes, weights and outputs); whether it had one."""
    g = model.graph
    had = any(o.name in AHEAD_OUTPUTS for o in g.output)
    keep_nodes = [n for n in g.node if not any(o.startswith("ahead.") or o in AHEAD_OUTPUTS for o in n.output)]
    keep_inits = [t for t in g.initializer if not t.name.startswith("ahead.")]
    keep_outs = [o for o in g.output if o.name not in AHEAD_OUTPUTS]
    keep_ins = [i for i in g.input if i.name != AHEAD_INPUT]
    for field, items in ((g.node, keep_nodes), (g.initializer, keep_inits), (g.output, keep_outs),
                         (g.input, keep_ins)):
        kept = [type(x)() for x in items]
        for k, x in zip(kept, items):
            k.CopyFrom(x)
        del field[:]
        field.extend(kept)
    return had


def with_hidden_output(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` that also returns `final_h` [batch, n_new, H] (the lookahead recipe's features)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if FINAL_HIDDEN not in {o.name for o in out.graph.output}:
        out.graph.output.append(oh.make_tensor_value_info(FINAL_HIDDEN, TensorProto.FLOAT, ["batch", "n_new", None]))
    return out


def attach(folder: str | Path, weights: dict[str, np.ndarray], token_ids, *, guesses: int = 2, depth: int = 1,
           digest: str | None = None, replace: bool = False) -> dict:
    """Add the lookahead head to an exported folder's model.onnx and record it in specbeam_config.json
    (`ahead`). Each file is written beside the old one and renamed in: the graph first, then the config, so a
    killed attach leaves a graph whose head the config does not name yet (the runtime then ignores it, and the
    next attach replaces it). digest: what the head was built from (fetch.py attaches it again when the shipped
    weights change); replace: swap an existing head. Returns the config entry."""
    folder = Path(folder)
    cfg_path = folder / "specbeam_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    if cfg.get("layout") != "whole" or cfg.get("output") not in ("both", "topk") or cfg.get("encoder_decoder"):
        raise ValueError(f"{folder}: the lookahead head needs a whole-layout decoder-only export with "
                         f"--output_kind both or topk")
    path = folder / cfg["files"]["model"]
    model = onnx.load(str(path))
    if "ahead" in cfg and not replace:
        raise ValueError(f"{folder} already has a lookahead head (replace=True swaps it)")
    strip_head(model)          # also a head whose config entry a killed attach did not write
    quant = cfg.get("quantization") or {}
    add_head(model, weights, np.asarray(token_ids), guesses, _rms_eps(model), int8=cfg.get("precision") == "int8",
             reduce_range=bool(quant.get("reduce_range", True)), depth=depth)
    tmp = path.with_name(path.name + ".ahead.tmp")
    entry = {"input": AHEAD_INPUT, "outputs": AHEAD_OUTPUTS, "guesses": guesses, "depth": depth,
             "tokens": int(len(token_ids)), "form": FORM, "digest": digest}
    cfg["ahead"] = entry
    cfg_tmp = cfg_path.with_name(cfg_path.name + ".tmp")
    try:                # a full disk or an interruption leaves the graph and config as they were, no .tmp files
        onnx.save(model, str(tmp))
        if "sha256" in cfg["files"]:        # the runtime checks the graph against it: the new graph's
            cfg["files"]["sha256"] = {cfg["files"]["model"]: file_sha256(tmp)}
        cfg_tmp.write_text(json.dumps(cfg, indent=1), encoding="utf-8")
        tmp.replace(path)
        cfg_tmp.replace(cfg_path)
        # the graph was read whole and written whole (a lookahead head is for small targets): the tensor file
        # beside it (export/whole.py) is no longer read
        path.with_name(path.name + ".data").unlink(missing_ok=True)
    finally:
        for t in (tmp, cfg_tmp):
            t.unlink(missing_ok=True)
    return entry


def _rms_eps(model: onnx.ModelProto) -> float:
    """The epsilon of the graph's final RMSNormalization (the head normalises as the target does)."""
    for n in model.graph.node:
        if FINAL_HIDDEN in n.output:
            for a in n.attribute:
                if a.name == "epsilon":
                    return a.f
    return 1e-5


def random_weights(hidden: int, seed: int = 0, scale: float = 0.02) -> dict[str, np.ndarray]:
    """Untrained head weights (tests): a head that guesses, still a valid one."""
    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((2 * hidden, hidden)) * scale).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, hidden)) * scale).astype(np.float32),
            "b2": np.zeros(hidden, np.float32), "norm": np.ones(hidden, np.float32)}


def reference(h: np.ndarray, next_ids: np.ndarray, E: np.ndarray, weights: dict, token_ids, guesses: int,
              eps: float, depth: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The head in numpy (tests, and the recipe's check of a trained head): (log-probs, ids) [..., guesses +
    depth - 1]: level 1's `guesses`, then the chain below its first guess, one a level."""
    token_ids = np.asarray(token_ids)
    lps, ids, nxt = [], [], next_ids
    for level in range(depth):
        z = np.concatenate([h, E[nxt]], axis=-1)
        u = z @ weights["w1"] + weights["b1"]
        u = u / (1 + np.exp(-u))
        y = h + u @ weights["w2"] + weights["b2"]
        h = y / np.sqrt((y * y).mean(-1, keepdims=True) + eps) * weights["norm"]
        s = h @ E[token_ids].T
        s = s - s.max(-1, keepdims=True)
        lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
        idx = np.argsort(-lp, axis=-1, kind="stable")[..., :guesses if level == 0 else 1]
        lps.append(np.take_along_axis(lp, idx, -1))
        ids.append(token_ids[idx])
        nxt = ids[-1][..., 0]
    return np.concatenate(lps, -1), np.concatenate(ids, -1)
