"""A damaged or hostile model folder config ends in one short line naming the key and the fix: never a traceback,
a file read from outside the folder, seconds of work or a megabyte of message (audit 4)."""
import json
import shutil
import time

import pytest

from specbeam_edge.config import ModelConfig, ModelFolderError
from specbeam_edge.model import OnnxCausalLM


@pytest.fixture(params=["whole", "split"])
def folder(request, exported, tmp_path):
    dst = tmp_path / request.param
    shutil.copytree(exported("llama", layout=request.param, std=0.3, seed=3), dst)
    return dst


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
