"""The small ONNX graph builder every exporter graph is assembled with (decoder, encoder-decoder, whole-layout
pieces): nodes, initializers, inputs and outputs collected in order, then one opset-23 model; and the value-info
helper for graph inputs and outputs."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper as oh, numpy_helper as onh

OPSET = 23
F32 = TensorProto.FLOAT


class Builder:
    """A graph under construction: nodes, initializers, inputs and outputs in the order they are added."""

    def __init__(self, attention: str = "fp32"):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.attention = attention          # "fp32", or "fp64": attention computed in double (attention._attention)

    def node(self, op, ins, outs, **attrs):
        self.nodes.append(oh.make_node(op, ins, outs, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def branch(self, cond: str, outs: list[str], then, otherwise, elem=F32):
        """An If node on the bool `cond` giving `outs`: `then()` and `otherwise()` each add their branch's nodes
        to this builder (outer names and initializers stay visible to them) and return their outputs' names,
        which must be distinct from every other name in the model."""
        graphs = []
        for build, tag in ((then, "then"), (otherwise, "else")):
            outer, self.nodes = self.nodes, []
            results = build()
            nodes, self.nodes = self.nodes, outer
            graphs.append(oh.make_graph(nodes, f"{outs[0]}.{tag}", [], [_vi(r, elem, None) for r in results]))
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

