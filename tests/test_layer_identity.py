"""A streamed layer file is checked on every read by cheap means (a regular file, of the identity it had when its
SHA-256 was checked; hashed again when that changed): a FIFO put in its place, bytes rewritten in place, another
layer's file renamed over it, or the file removed under a running engine each stop with one line naming the file
(before: a hang in open(), wrong text with exit 0, or a FileNotFoundError traceback)."""
import os
import shutil
import signal

import pytest

from specbeam_edge import Engine
from specbeam_edge.config import ModelFolderError


@pytest.fixture
def streamed(exported, tmp_path):
    """An engine streaming every layer of a private copy of a split folder, after one request (every layer's
    SHA-256 checked once)."""
    folder = tmp_path / "split"
    shutil.copytree(exported("llama", layout="split", std=0.3, seed=3), folder)
    engine = Engine(folder, placement=["disk", "disk"])
    want = engine.generate("hello", max_new_tokens=4, num_beams=1)[0].text
    return engine, folder / "weights", want


def _refusal(engine) -> str:
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the read hung"))
    signal.alarm(60)
    try:
        with pytest.raises(ModelFolderError) as e:
            engine.generate("hello", max_new_tokens=4, num_beams=1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_fifo_in_place_of_a_layer_file_is_refused_not_waited_on(streamed):
    engine, weights, _ = streamed
    os.mkfifo(weights / "fifo")
    os.replace(weights / "fifo", weights / "layer_1.bin")      # in one step: a loader never sees no file
    assert _refusal(engine).startswith(f"{weights / 'layer_1.bin'}: not a regular file any more")


@pytest.mark.parametrize("how", ["bytes rewritten in place", "another layer renamed over it"])
def test_a_layer_file_changed_after_its_check_is_hashed_again(streamed, how):
    engine, weights, want = streamed
    path = weights / "layer_1.bin"
    if how == "another layer renamed over it":
        shutil.copy(weights / "layer_0.bin", weights / "other.bin")
        os.replace(weights / "other.bin", path)
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        with open(path, "r+b") as f:                       # the same inode, the same size
            f.write(bytes(data))
    message = _refusal(engine)
    assert message.startswith(f"{path}: SHA-256 ") and "does not match the manifest" in message


def test_a_layer_file_removed_under_a_reader_is_one_line(streamed):
    engine, weights, _ = streamed
    (weights / "layer_0.bin").unlink()
    assert _refusal(engine).startswith(f"{weights / 'layer_0.bin'}: the layer file was removed while the model "
                                       f"was in use")


def test_an_unchanged_file_is_not_hashed_again(streamed, monkeypatch):
    engine, _, want = streamed
    from specbeam_edge.execution import offload

    hashed = []
    real = offload.hashlib.sha256
    monkeypatch.setattr(offload.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    assert engine.generate("hello", max_new_tokens=4, num_beams=1)[0].text == want and hashed == []
