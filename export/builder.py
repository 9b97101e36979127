"""The small ONNX graph builder every exporter graph is assembled with (decoder, encoder-decoder, whole-layout
pieces): nodes, initializers, inputs and outputs collected in order, then one opset-23 model; and the value-info
helper for graph inputs and outputs."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper as oh, numpy_helper as onh

OPSET = 23
F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
KV_CACHE = {"fp32": F32, "fp16": F16}      # --kv_cache: the KV inputs' and outputs' element type


class Builder:
    """A graph under construction: nodes, initializers, inputs and outputs in the order they are added."""

    def __init__(self, attention: str = "fp32", kv_cache: str = "fp32"):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.attention = attention          # "fp32", or "fp64": attention computed in double (attention._attention)
        self.kv = KV_CACHE[kv_cache]        # the KV cache's element type (F16: stored in half, computed in fp32)

    def node(self, op, ins, outs, **attrs):
        self.nodes.append(oh.make_node(op, ins, outs, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def branch(self, cond: str, outs: list[str], then, otherwise, elem=F32):
        """An If node on the bool `cond` giving `outs`: `then()` and `otherwise()` each add their branch's nodes
        to this builder (outer names and initializers stay visible to them) and return their outputs' names,
        which must be distinct from every other name in the model. elem: the outputs' element type, or a list
        of one per output."""
        elems = elem if isinstance(elem, list) else [elem] * len(outs)
        graphs = []
        for build, tag in ((then, "then"), (otherwise, "else")):
            outer, self.nodes = self.nodes, []
            results = build()
            nodes, self.nodes = self.nodes, outer
            graphs.append(oh.make_graph(nodes, f"{outs[0]}.{tag}", [],
                                        [_vi(r, e, None) for r, e in zip(results, elems)]))
        return self.node("If", [cond], outs, then_branch=graphs[0], else_branch=graphs[1])

    def init(self, name, array):
        self.inits.append(onh.from_array(np.ascontiguousarray(array), name))
        return name

    def model(self, name):
        g = oh.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        m = oh.make_model(g, opset_imports=[oh.make_opsetid("", OPSET)], ir_version=10)
        m.producer_name = "specbeam-edge export"
        return m


def _vi(name, elem, shape):
    return oh.make_tensor_value_info(name, elem, shape)

