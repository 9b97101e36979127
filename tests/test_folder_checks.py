"""A damaged or hostile model folder config ends in one short line naming the key and the fix: never a traceback,
a file read from outside the folder, seconds of work or a megabyte of message (audit 4)."""
import json
import os
import shutil
import time

import pytest

from specbeam_edge.config import ModelConfig, ModelFolderError
from specbeam_edge.execution.model import OnnxCausalLM


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
    ({"budget": -1}, "speculative: budget must be an integer in [1, 1024] (draft nodes a pass) or 'auto', got -1; "
                     "fix or remove it"),
    # before: no answer to one line in 60 s
    ({"budget": 100000, "max_depth": 100000}, "speculative: budget must be an integer in [1, 1024] (draft nodes a "
                                              "pass) or 'auto', got 100000; fix or remove it"),
    ({"max_depth": 100000}, "speculative: max_depth must be in [1, 64], got 100000; fix or remove it"),
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


# -- nothing outside the model folder is read ----------------------------------------------------------------------
@pytest.mark.parametrize("layout, key", [("whole", "model"), ("split", "head"), ("split", "layer")])
@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_file_entry_outside_the_folder_is_refused(exported, tmp_path, layout, key, where):
    """Before: an absolute or ../ files.model loaded a graph from another folder."""
    folder = copy(exported, tmp_path, layout)
    name = json.loads((folder / "specbeam_config.json").read_text())["files"][key]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(folder / name, elsewhere / name)
    value = str(elsewhere / name) if where == "absolute" else f"../elsewhere/{name}"
    path = edit(folder, lambda c: c["files"].update({key: value}))
    assert refusal(folder) == (f"{path}: files.{key} is {value!r}, outside the model folder; name a file inside "
                               f"the folder (re-export the model)")


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_linked_from_outside_is_refused(exported, tmp_path, name):
    """Before: a chat_template.jinja linked to any file was read (and rendered) as the model's template."""
    from specbeam_edge.generate import Engine
    from specbeam_edge.text.tokenizer import Tokenizer

    folder = copy(exported, tmp_path, "whole")
    secret = tmp_path / "secret.txt"
    secret.write_text((folder / name).read_text() if (folder / name).is_file() else "{{ 'secret' }}")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    for load in (Tokenizer, Engine):
        with pytest.raises(ModelFolderError) as e:
            load(folder)
        assert str(e.value) == (f"{folder / name} links outside the model folder (to {str(secret)!r}); put a copy "
                                f"of the file in the folder instead of a link")


def test_links_within_the_folder_and_a_linked_folder_still_load(exported, tmp_path):
    from specbeam_edge.text.tokenizer import Tokenizer

    folder = copy(exported, tmp_path, "whole")
    (folder / "templates").mkdir()
    (folder / "templates" / "chat.jinja").write_text("{{ messages[0]['content'] }}")
    (folder / "chat_template.jinja").symlink_to(folder / "templates" / "chat.jinja")
    (tmp_path / "linked").symlink_to(folder, target_is_directory=True)
    assert Tokenizer(tmp_path / "linked").apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    OnnxCausalLM(tmp_path / "linked")


# -- whole-layout integrity: the graph's SHA-256 recorded at export, checked on load -------------------------------
def flip_byte(path, at: int = 1000):
    data = bytearray(path.read_bytes())
    data[min(at, len(data) - 1)] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_whole_graph_with_a_damaged_byte_is_refused_by_name(exported, tmp_path):
    """Before: only split folders carried SHA-256s; a whole graph's damaged weights ran and wrote other text."""
    from specbeam_edge.generate import Engine

    folder = copy(exported, tmp_path, "whole")
    sums = json.loads((folder / "specbeam_config.json").read_text())["files"]["sha256"]
    assert "model.onnx" in sums
    Engine(folder).generate("hello", max_new_tokens=2)            # verified, and remembered
    damaged = folder / sorted(sums)[-1]                            # the tensors' file where there is one
    flip_byte(damaged, damaged.stat().st_size // 2)
    message = refusal(folder)
    assert message.startswith(f"{damaged}: SHA-256 ") and message.endswith(
        "recorded at export (the file was damaged or replaced); restore it or re-export the model")


def test_a_whole_graph_is_hashed_once_per_file_version(exported, tmp_path, monkeypatch):
    from specbeam_edge.execution import integrity

    folder = copy(exported, tmp_path, "whole")
    hashed = []
    real = integrity.file_sha256
    monkeypatch.setattr(integrity, "file_sha256", lambda p: hashed.append(p.name) or real(p))
    OnnxCausalLM(folder)
    first = len(hashed)
    OnnxCausalLM(folder)
    assert first >= 1 and len(hashed) == first                     # the second load costs a stat
    os.utime(folder / "model.onnx")                                # rewritten (same bytes): hashed again
    OnnxCausalLM(folder)
    assert hashed[first:] == ["model.onnx"]


def test_whole_folders_exported_before_the_field_still_load(exported, tmp_path):
    folder = copy(exported, tmp_path, "whole")
    edit(folder, lambda c: c["files"].pop("sha256"))
    OnnxCausalLM(folder)
    edit(folder, lambda c: c["files"].update(sha256={"model.onnx": "00"}))
    assert refusal(folder).endswith("files.sha256 must map file names to hex SHA-256 digests; re-export the model")


@pytest.mark.parametrize("damage", ["[" * 100_000, '{"a": ' * 100_000, "\x00garbage", '{"k": [1, 2'],
                         ids=["deep_list", "deep_object", "garbage", "truncated"])
def test_a_damaged_checksum_cache_is_dropped_not_fatal(exported, tmp_path, damage):
    """Before: a deeply nested JSON in the cache raised RecursionError on every load; now it is recomputed."""
    from apps.translate.fingerprint import cache_path, folder_sha256
    from specbeam_edge.execution import integrity
    from specbeam_edge.cachefile import cache_dir

    folder = copy(exported, tmp_path, "whole")
    for path in (cache_dir() / integrity.CACHE_FILE, cache_path()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(damage)
    OnnxCausalLM(folder)                                           # verified again, and the cache written anew
    assert json.loads((cache_dir() / integrity.CACHE_FILE).read_text())
    assert "model.onnx" in folder_sha256(folder) and json.loads(cache_path().read_text())


def test_a_bounded_cache_file_keeps_the_newest_entries(tmp_path):
    """The record of finished translate runs is one entry per output: bounded (keep=), the oldest dropped first,
    and an entry stored again counts as new."""
    from specbeam_edge.cachefile import entries, store_entry

    path = tmp_path / "c.json"
    for key in "abcd":
        store_entry(path, key, key.upper(), keep=3)
    assert list(entries(path)) == ["b", "c", "d"]
    store_entry(path, "b", "B2", keep=3)
    store_entry(path, "e", "E", keep=3)
    assert entries(path) == {"d": "D", "b": "B2", "e": "E"}
