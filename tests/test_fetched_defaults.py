"""The API is the CLI for fetched models (issue 66): `Engine(fetch.model_path(NAME))` loads the draft `specbeam
generate --model NAME` loads, `--draft` takes a fetched model's name as `--model` does, and a GGUF file given as a
model is refused with the command that exports it. The fetched folders here are copies of tiny exported models
put where `specbeam fetch` writes them."""
import shutil

import pytest

from specbeam_edge.commands import cli, options
from specbeam_edge import fetch
from specbeam_edge.config import ModelFolderError
from specbeam_edge.generate import Engine

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@pytest.fixture
def fetched(pair, tmp_path, monkeypatch):
    """The coder pair 'fetched': the tiny pair's target and draft in the data folder, each with its marker."""
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    for name, src in ((TARGET, pair[0]), (DRAFT, pair[1])):
        shutil.copytree(src, fetch.folder(name))
        (fetch.folder(name) / fetch.MARKER).write_text("{}")
    return pair


def test_the_engine_of_a_fetched_model_loads_its_draft_as_the_cli_does(fetched):
    """Before: Engine(fetch.model_path(...)) ran without its draft (5.2 vs 9.3 tok/s on the real pair) and
    fetch.draft_path gave None for the 1.5B coder."""
    assert fetch.draft_path(TARGET) == fetch.folder(DRAFT)
    engine = Engine(fetch.model_path(TARGET))
    assert engine.draft is not None and engine.draft.folder.resolve() == fetch.folder(DRAFT).resolve()
    assert Engine(TARGET).draft is not None                                     # a name, as --model takes
    assert Engine(fetch.model_path(TARGET), draft=None).draft is None          # no draft, asked for
    assert Engine(fetched[0]).draft is None                                    # another folder: none by default
    assert fetch.default_draft(str(fetch.model_path(TARGET))) == fetch.default_draft(TARGET)
    plain = Engine(fetch.model_path(TARGET), draft=None)
    same = dict(num_beams=1, max_new_tokens=6)
    assert engine.generate("the lazy dog", **same)[0].text == plain.generate("the lazy dog", **same)[0].text


def test_draft_takes_a_fetched_models_name(fetched, monkeypatch, capsys):
    """Before: `--draft qwen2.5-coder-0.5b` (a name `specbeam list` shows) was 'a folder that does not exist'."""
    seen = []
    real = options.engine_from_args
    monkeypatch.setattr(options, "engine_from_args", lambda args, model, draft: seen.append(draft) or
                        real(args, model, draft))
    assert cli.main(["generate", "the lazy dog", "--model", fetched[0], "--draft", DRAFT, "--num_beams", "1",
                     "--max_new_tokens", "3", "-q"]) == 0, capsys.readouterr().err
    assert seen == [str(fetch.folder(DRAFT))]
    capsys.readouterr()
    monkeypatch.setenv(fetch.ENV, str(fetch.data_dir().parent / "empty"))     # not fetched: says how to fetch it
    assert cli.main(["generate", "x", "--model", fetched[0], "--draft", DRAFT]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"run `specbeam fetch {DRAFT}`" in err, err


@pytest.mark.parametrize("name, fetch_hint", [("my-model.Q4_K_M.gguf", False),
                                              (fetch.SOURCES["smollm2"].member, True)])
def test_a_gguf_file_as_the_model_names_the_command_that_exports_it(tmp_path, monkeypatch, capsys, name,
                                                                     fetch_hint):
    """Before: `--model FILE.gguf` said the folder does not exist."""
    gguf = tmp_path / name
    gguf.write_bytes(b"GGUF")
    assert cli.main(["generate", "x", "--model", str(gguf)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a GGUF file; --model takes a model folder" in err, err
    assert f"`specbeam-export -i {gguf} -p int8 --output_kind both -o " in err
    assert ("`specbeam fetch smollm2` does it for this file" in err) == fetch_hint
    with pytest.raises(ModelFolderError, match="draft .* is a GGUF file"):
        Engine(tmp_path, draft=gguf)
    assert cli.main(["chat", "--model", str(tmp_path / "gone.gguf")]) == 2
    assert "is a GGUF file (and that file does not exist)" in capsys.readouterr().err


def test_no_model_in_a_regular_install_names_the_fetched_models(pair, tmp_path, monkeypatch, capsys):
    """A regular install carries no shipped pair: `specbeam generate` without --model named a path that cannot
    exist; now it names the fetched models, or the fetch that gets one."""
    from specbeam_edge import shipped

    monkeypatch.setattr(shipped, "_BESIDE", tmp_path / "no-models")
    monkeypatch.delenv(shipped.ENV, raising=False)
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    assert cli.main(["generate", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no model is fetched yet" in err and "run `specbeam fetch smollm2`" in err
    shutil.copytree(pair[0], fetch.folder("smollm2"))
    (fetch.folder("smollm2") / fetch.MARKER).write_text("{}")
    assert cli.main(["chat"]) == 2
    err = capsys.readouterr().err
    assert err == "specbeam: error: pass --model: the fetched models are smollm2 (e.g. --model smollm2; " \
                  "`specbeam list`); this installation has no shipped demo pair\n"


def test_max_memory_on_a_fetched_whole_model_names_a_command_a_fetch_user_can_run(pair, tmp_path, monkeypatch,
                                                                                  capsys):
    """Before: "export with --layout split", an exporter flag a fetch user never ran; now the export command of
    the GGUF the fetch kept, and the --model to pass after it."""
    monkeypatch.setenv(fetch.ENV, str(tmp_path / "data"))
    shutil.copytree(pair[0], fetch.folder("smollm2"))
    (fetch.folder("smollm2") / fetch.MARKER).write_text("{}")
    with pytest.raises(ModelFolderError) as e:
        Engine(fetch.model_path("smollm2"), max_memory=100 << 20)
    split = "smollm2-135m-instruct-split"
    assert str(e.value).startswith("smollm2 is exported in the whole layout (every layer in memory), which "
                                   "--max_memory cannot stream: drop --max_memory, or export its kept GGUF")
    assert f"`specbeam-export -i {fetch.gguf_path('smollm2')} -p int8 --output_kind both --layout split -o " \
           f"{split}`, then pass --model {split}" in str(e.value)
    assert cli.main(["generate", "x", "--model", "smollm2", "--max_memory", "100MB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot stream" in err and "--force` downloads it again" in err
