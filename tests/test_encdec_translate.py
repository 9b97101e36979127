"""specbeam-translate on encoder-decoder exports, end to end in a subprocess: an Opus-MT-style Marian folder
(SentencePiece files converted at export) and an NLLB-style folder with --src_lang/--tgt_lang; the lines are
the Engine's translations, speculative (draft == target) or not."""
import subprocess
import sys
from pathlib import Path

import pytest

from encdec_models import make_encdec_model
from export.core import export
from specbeam_edge import Engine

ROOT = Path(__file__).resolve().parents[1]
LINES = ["the quick brown fox", "hello world, 42 numbers", "", "Zoe sells shells"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encdec_cli")
    out = {}
    for kind, spm in (("marian", True), ("nllb", False)):
        make_encdec_model(root / f"{kind}_hf", kind, seed=3, spm=spm)
        out[kind] = export(root / f"{kind}_hf", root / kind, quiet=True)
    return out


def _cli(tmp_path, model, *extra):
    inp, outp = tmp_path / "in.txt", tmp_path / "out.txt"
    inp.write_text("\n".join(LINES) + "\n")
    proc = subprocess.run([sys.executable, "-m", "apps.translate", "-i", str(inp), "-o", str(outp), "--model",
                           str(model), "--beam_size", "2", "--max_decoding_length", "6", "-q", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc, (outp.read_text().split("\n")[:-1] if outp.exists() else None)


def _expected(model, **langs):
    eng = Engine(model)
    texts = [t for t in LINES if t]
    res = iter(eng.generate(texts, num_beams=2, max_new_tokens=6, **langs))
    return [next(res).hypotheses[0].text if t else "" for t in LINES]


def test_marian_sentencepiece_export(folders, tmp_path):
    want = _expected(folders["marian"])
    for extra in (["--no_draft"], ["--draft", str(folders["marian"]), "--always_speculate"]):
        proc, got = _cli(tmp_path, folders["marian"], *extra)
        assert proc.returncode == 0, proc.stderr
        assert got == want


def test_nllb_languages(folders, tmp_path):
    langs = dict(src_lang="eng_Latn", tgt_lang="fra_Latn")
    proc, got = _cli(tmp_path, folders["nllb"], "--no_draft", "--src_lang", "eng_Latn", "--tgt_lang", "fra_Latn")
    assert proc.returncode == 0, proc.stderr
    assert got == _expected(folders["nllb"], **langs)
    assert got != _expected(folders["nllb"], src_lang="eng_Latn", tgt_lang="deu_Latn")
    proc, _ = _cli(tmp_path, folders["nllb"], "--no_draft", "--src_lang", "eng_Latn", "--tgt_lang", "xx")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("error: unknown tgt_lang 'xx'; this model's language codes: deu_Latn, "
                                        "eng_Latn, fra_Latn")
