"""The shipped en->de pair: loads and validates, tokenizer round-trips held-out text, draft/target
compatibility, golden greedy outputs (any change to numerics or export shows up), speculative == plain,
and the examples/ scripts run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from specbeam_edge import Engine, ModelFolderError, SpeculativeConfig
from specbeam_edge.execution.model import OnnxCausalLM
from specbeam_edge.text.tokenizer import Tokenizer
from helpers import plain

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "models" / "ende"
GOLDEN = Path(__file__).with_name("golden_ende.json")
PROMPTS = ["Click the Save button.", "The file could not be opened.", "Select a cell range in the sheet."]


@pytest.fixture(scope="module")
def engine():
    return Engine(PAIR / "target", draft=PAIR / "draft")


def test_folders_load_and_validate():
    for name in ("target", "draft", "variants/target_int8"):
        lm = OnnxCausalLM(PAIR / name)
        assert lm.cfg.vocab_size == 8192 and lm.cfg.eos_token_ids == (0,)


def test_shipped_folders_check_their_tokenizer(tmp_path):
    """Before: no shipped config carried tokenizer_sha256, so a tokenizer.json with two vocabulary entries
    swapped loaded and translated silently. Every shipped folder names its tokenizer's SHA-256 now; a changed
    tokenizer is refused."""
    import shutil

    from specbeam_edge.contract import file_sha256

    folders = sorted(p.parent for p in (ROOT / "models").glob("**/specbeam_config.json"))
    assert len(folders) >= 5
    for folder in folders:
        cfg = json.loads((folder / "specbeam_config.json").read_text())
        assert cfg.get("tokenizer_sha256") == file_sha256(folder / "tokenizer.json"), folder
    copy = tmp_path / "target"
    shutil.copytree(PAIR / "target", copy)
    tok = json.loads((copy / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelFolderError, match="is not the tokenizer the model was exported with"):
        Engine(str(copy))


def test_tokenizer_round_trips_held_out_text():
    tok = Tokenizer(PAIR / "target")
    for f in ("test_sample.en", "test_sample.de"):
        for line in (PAIR / f).read_text("utf-8").splitlines():
            assert tok.decode(tok.encode(line)) == line


def test_pair_is_compatible_and_a_foreign_draft_is_refused(exported):
    Engine(PAIR / "target", draft=PAIR / "draft")
    with pytest.raises(ModelFolderError, match="tokenizer"):
        Engine(PAIR / "target", draft=exported("llama"))


def test_golden_greedy(engine):
    got = {p: engine.generate(engine.tokenizer.format_prompt(p), num_beams=1, max_new_tokens=48)[0].text
           for p in PROMPTS}
    if not GOLDEN.exists():   # after re-training: write the new golden file, and fail until it is committed
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
        pytest.fail(f"wrote {GOLDEN.name}; review and commit it")
    assert got == json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain_on_shipped_pair(engine, K):
    src = (PAIR / "test_sample.en").read_text("utf-8").splitlines()[:6]
    prompts = [engine.tokenizer.format_prompt(s) for s in src]
    ref = plain(engine, prompts, num_beams=K, max_new_tokens=96)
    # one request at a time, as the main job runs (a batch shares the tree budget among its requests)
    fast = engine.generate(prompts, num_beams=K, max_new_tokens=96, speculative=SpeculativeConfig(adaptive=False),
                           max_batch_size=1)
    assert [r.text for r in ref] == [r.text for r in fast]
    steps = sum(r.stats.beam_steps for r in fast)
    passes = sum(r.stats.target_passes for r in fast)
    # measured on this pair (100 held-out paragraphs, models/ende/README.md): 4.13 steps per pass at K=1, 2.61
    # at K=4 (the default budget of 80); the floors leave room for these six lines
    assert steps / passes > (3.0 if K == 1 else 2.0), steps / passes


@pytest.mark.parametrize("script", ["translate_list.py", "stream_answer.py", "compare.py"])
def test_examples_run(script):
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert lines and all(l.strip() for l in lines)
    if script == "compare.py":          # the same text with and without the draft
        assert lines[0].split("\t")[1] == lines[1].split("\t")[1]


def test_evaluate_reports_every_system_on_the_shipped_pair(tmp_path):
    """models/evaluate.py end to end on four held-out lines: scores, agreement on the references and on the
    target's own translations, and speculative runs one request at a time that match plain search."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("specbeam_models_evaluate", ROOT / "models" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)

    en = (PAIR / "test_sample.en").read_text("utf-8").splitlines()[:4]
    de = (PAIR / "test_sample.de").read_text("utf-8").splitlines()[:4]
    (tmp_path / "test.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in zip(en, de)), encoding="utf-8")
    out = tmp_path / "eval.json"
    assert evaluate.main(["--pair", str(PAIR), "--test", str(tmp_path / "test.tsv"), "--lines", "4",
                          "--max_new_tokens", "48", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    for key in ("agreement", "agreement_own"):
        assert rep[key]["positions"] > 0 and 0 <= rep[key]["greedy_match"] <= 1, rep[key]
    assert 0 < rep["target_beam4"]["bleu"] <= 100 and 0 < rep["draft_greedy"]["chrf"] <= 100
    for K in (1, 4):
        run = rep[f"speculative_K{K}"]
        assert run["batch"] == 1 and run["identical_to_plain"] == run["of"] == 4, run
        assert run["beam_steps_per_pass"] > 1
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        evaluate.main(["--pair", str(PAIR), "--test", str(tmp_path / "test.tsv"), "--systems", "nope"])
