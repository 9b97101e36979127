"""The split layout's embedding table (weights/embed.bin, and an int8 table's scale file) is checked against the
SHA-256 the export recorded: at load, cached by the file's identity as the whole layout's graph is, and on a read
whenever the table's identity changed since (as the streamed layers are). Before, rows reordered in place with the
config's SHA-256 kept answered garbage, exit 0, with or without --max_memory."""
import json
import os
import shutil

import numpy as np
import pytest

from specbeam_edge import Engine
from specbeam_edge.commands.cli import main as cli_main
from specbeam_edge.config import ModelFolderError


@pytest.fixture
def split(exported, tmp_path):
    """A private copy of a split folder (an fp32 table) and its files.embed_table."""
    folder = tmp_path / "split"
    shutil.copytree(exported("llama", layout="split", std=0.3, seed=3), folder)
    return folder, json.loads((folder / "specbeam_config.json").read_text())["files"]["embed_table"]


def _reorder_rows(table, rows: int) -> None:
    """The table's rows reversed in place: the same inode and size, every row still a valid row."""
    data = np.fromfile(table, np.uint8).reshape(rows, -1)[::-1]
    with open(table, "r+b") as f:
        f.write(data.tobytes())


def _one_line(excinfo, path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def test_the_export_records_every_table_file_sha256(split, exported):
    from specbeam_edge.contract import file_sha256

    folder, table = split
    assert table["sha256"] == file_sha256(folder / table["file"])
    int8 = exported("llama", precision="int8", layout="split", std=0.3, seed=3)
    t8 = json.loads((int8 / "specbeam_config.json").read_text())["files"]["embed_table"]
    assert t8["scale_sha256"] == file_sha256(int8 / t8["scale_file"])


@pytest.mark.parametrize("budget", [None, "layers stream"])
def test_rows_reordered_before_load_are_refused_at_load(split, budget, capsys):
    folder, table = split
    _reorder_rows(folder / table["file"], table["shape"][0])
    flags = [] if budget is None else ["--max_memory", "1MB"]
    args = ["generate", "hello", "--model", str(folder), "--max_new_tokens", "4", "--no_draft", *flags]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{folder / table['file']}: SHA-256 " in err, err
    with pytest.raises(ModelFolderError) as e:
        Engine(folder, placement=None if budget is None else ["disk", "disk"])
    assert "does not match" in _one_line(e, folder / table["file"])


def test_a_changed_scale_file_is_refused_at_load(exported, tmp_path):
    folder = tmp_path / "int8"
    shutil.copytree(exported("llama", precision="int8", layout="split", std=0.3, seed=3), folder)
    table = json.loads((folder / "specbeam_config.json").read_text())["files"]["embed_table"]
    scales = np.fromfile(folder / table["scale_file"], np.float32)
    scales[:2] = scales[1::-1] * 2
    scales.tofile(folder / table["scale_file"])
    with pytest.raises(ModelFolderError) as e:
        Engine(folder)
    assert "does not match" in _one_line(e, folder / table["scale_file"])


@pytest.fixture
def loaded(split):
    """An engine on the split copy after one request (the table's SHA-256 checked at load), with its answer."""
    folder, table = split
    engine = Engine(folder, placement=["disk", "disk"])
    want = engine.generate("hello", max_new_tokens=4, num_beams=1)[0].text
    return engine, folder / table["file"], table, want


@pytest.mark.parametrize("how", ["rows reordered in place", "another table renamed over it"])
def test_a_table_changed_after_load_is_hashed_again_on_the_next_read(loaded, how):
    engine, path, table, _ = loaded
    if how == "rows reordered in place":
        _reorder_rows(path, table["shape"][0])
    else:
        other = path.with_name("other.bin")
        shutil.copy(path, other)
        _reorder_rows(other, table["shape"][0])
        os.replace(other, path)
    with pytest.raises(ModelFolderError) as e:
        engine.generate("hello", max_new_tokens=4, num_beams=1)
    assert "does not match" in _one_line(e, path)


def test_a_table_removed_under_a_reader_is_one_line(loaded):
    engine, path, _, _ = loaded
    path.unlink()
    with pytest.raises(ModelFolderError) as e:
        engine.generate("hello", max_new_tokens=4, num_beams=1)
    assert "removed while the model was in use" in _one_line(e, path)


def test_an_unchanged_table_is_not_hashed_again(loaded, monkeypatch):
    """A read of an unchanged table costs an fstat; a second load finds its version in the cache."""
    engine, path, table, want = loaded
    from specbeam_edge.execution import integrity
    from specbeam_edge.execution.offload import embedding_table

    hashed = []
    real = integrity.hashlib.sha256
    monkeypatch.setattr(integrity.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    assert engine.generate("hello", max_new_tokens=4, num_beams=1)[0].text == want
    embedding_table(path.parent.parent, table, table["shape"][0])
    assert hashed == []
