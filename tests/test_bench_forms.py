"""bench.forms (the pair in two weight forms) and bench.nbits_stream (a layer's weights as inputs, initializers or
a session per pass): their arguments and the graphs they time, on small shapes."""
import numpy as np
import onnxruntime as ort
import pytest

from bench import forms, nbits_stream


def test_an_arm_names_its_label_folders_and_mode():
    assert forms.parse_arm("a b=/x/t:plain") == ("a b", forms.Path("/x/t"), None, "plain")
    assert forms.parse_arm("s=/x/t+/x/d:spec") == ("s", forms.Path("/x/t"), forms.Path("/x/d"), "spec")
    for bad in ("no-equals", "s=/x/t:spec", "p=/x/t+/x/d:plain", "m=/x/t:greedy"):
        with pytest.raises(SystemExit):
            forms.parse_arm(bad)


@pytest.mark.parametrize("form", ["int8", "blocks"])
def test_a_layers_weights_fed_as_inputs_or_as_a_sessions_initializers_reach_the_same_graph(monkeypatch, form):
    """The timed graphs on small shapes: the layer in the exporter's form, its large tensors split out as inputs
    (the streamed form) and as external placeholders a session is made over (add_external_initializers)."""
    monkeypatch.setattr(nbits_stream, "H", 256)
    monkeypatch.setattr(nbits_stream, "F", 512)
    monkeypatch.setattr(nbits_stream, "MATS", {"q": (256, 64, "q4_k"), "v": (256, 32, "q6_k"),
                                               "down": (512, 256, "q6_k")})
    model = nbits_stream.layer_graph(form)
    ops = {n.op_type for n in model.graph.node}
    assert ("MatMulNBits" in ops) == (form == "blocks") and ("MatMulInteger" in ops) == (form == "int8")
    fed, feeds, ext = nbits_stream.split_weights(model)
    assert feeds and not {t.name for t in fed.graph.initializer} & feeds.keys()
    x = {"x": np.ones((1, 3, 256), np.float32), "u": np.ones((1, 3, 512), np.float32)}
    so = nbits_stream._options(1)
    so.add_external_initializers(list(feeds), [ort.OrtValue.ortvalue_from_numpy(v) for v in feeds.values()])
    resident = ort.InferenceSession(model.SerializeToString(), nbits_stream._options(1))
    over_buffer = ort.InferenceSession(ext.SerializeToString(), so)
    streamed = ort.InferenceSession(fed.SerializeToString(), nbits_stream._options(1))
    want = resident.run(None, x)
    assert all(np.array_equal(a, b) for a, b in zip(over_buffer.run(None, x), want))
    assert [a.shape for a in streamed.run(None, {**x, **feeds})] == [a.shape for a in want]
