"""A damaged or hostile model folder config ends in one short line naming the key and the fix: never a traceback,
a file read from outside the folder, seconds of work or a megabyte of message (audit 4)."""
import json
import shutil
import time

import pytest

from specbeam_edge.config import ModelConfig, ModelFolderError
from specbeam_edge.model import OnnxCausalLM


def copy(exported, tmp_path, layout: str):
    dst = tmp_path / layout
    shutil.copytree(exported("llama", layout=layout, std=0.3, seed=3), dst)
    return dst


@pytest.fixture(params=["whole", "split"])
def folder(request, exported, tmp_path):
    return copy(exported, tmp_path, request.param)


def edit(folder, fn):
    path = folder / "specbeam_config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))
    return path


def refusal(folder) -> str:
    """The one-line message loading the folder gives."""
    with pytest.raises(ModelFolderError) as e:
        OnnxCausalLM(folder)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message[:400]
    return message


def test_a_huge_layer_count_is_refused_at_once_in_one_short_line(folder):
    """Before: num_layers 1000000 built a million names per list (seconds) and listed them in a 14-100 MB error."""
    path = edit(folder, lambda c: c.update(num_layers=1_000_000))
    t0 = time.perf_counter()
    message = refusal(folder)
    assert time.perf_counter() - t0 < 1.0
    assert message.startswith(f"{path}: num_layers is 1000000, but ")
    assert message.endswith("set it to the model's layer count or re-export the model")


# -- wrong types and keys: one line naming the key, not a traceback ------------------------------------------------
@pytest.mark.parametrize("layout, key, value, message", [
    ("whole", "model", 7, "files.model must be a file name in the model folder (a string), got 7; re-export"),
    ("split", "layer_weights", 7, "files.layer_weights must be a file name in the model folder (a string), got 7"),
    ("split", "layer_weights", "weights/layer_{0}.bin",
     "files.layer_weights must be a file name with {i} for the layer number (e.g. weights/layer_{i}.bin), got "
     "'weights/layer_{0}.bin'; re-export the model"),
    ("split", "layer_weights", "weights/layer.bin", "files.layer_weights must be a file name with {i}"),
    ("split", "head", ["head.onnx"], "files.head must be a file name in the model folder (a string), got ['head"),
])
def test_a_file_entry_of_the_wrong_kind_is_named(exported, tmp_path, layout, key, value, message):
    """Before: files.model 7 raised a TypeError, layer_weights 7 an AttributeError, {0} an IndexError."""
    folder = copy(exported, tmp_path, layout)
    path = edit(folder, lambda c: c["files"].update({key: value}))
    assert refusal(folder).startswith(f"{path}: {message}")


@pytest.mark.parametrize("tree, message", [
    ({"bogus": 1}, "speculative.bogus is not a tree setting (known: drafter, budget, "),
    ({"budget": -1}, "speculative: budget must be an integer >= 1 or 'auto', got -1; fix or remove it"),
    ([4], "speculative must be a JSON object of tree settings, got [4]; fix or remove it"),
])
def test_a_bad_tree_in_the_folder_is_named(pair, tmp_path, tree, message):
    """Before: an unknown key in `speculative` raised a TypeError from the Engine of a target with a draft."""
    from specbeam_edge.generate import Engine

    folder = tmp_path / "target"
    shutil.copytree(pair[0], folder)
    path = edit(folder, lambda c: c.update(speculative=tree))
    with pytest.raises(ModelFolderError) as e:
        Engine(folder, draft=pair[1]).generate("hello", max_new_tokens=2)
    assert str(e.value).startswith(f"{path}: {message}") and "\n" not in str(e.value)
