"""SentencePiece tokenizers of Opus-MT (Marian) and M2M100 folders converted to `tokenizers` JSON at export:
the converted tokenizers encode (and decode) exactly as transformers' slow MarianTokenizer / M2M100Tokenizer on
tiny SentencePiece models trained locally."""
import json
import warnings

import pytest

from encdec_models import TEXTS, write_m2m100_spm, write_marian_spm
from export.encdec_tokenizer import convert, language_codes
from export.hf import ExportError

pytest.importorskip("sentencepiece")

MORE = TEXTS + [">>fra<< the fox", "Übersetzungsmodelle   lesen", "sie verkauft Muscheln <pad> 42"]


def _slow(cls, folder, **kw):
    import transformers as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # "Recommended: pip install sacremoses"
        return getattr(tf, cls).from_pretrained(str(folder), **kw)


@pytest.mark.parametrize("separate", [False, True])
def test_marian_source_and_target_encode_as_transformers(tmp_path, separate):
    write_marian_spm(tmp_path, separate=separate, codes=(">>fra<<",))
    toks = convert(tmp_path, "marian")
    assert sorted(toks) == ["source_tokenizer.json", "tokenizer.json"]
    slow = _slow("MarianTokenizer", tmp_path)
    for text in MORE:
        src = toks["source_tokenizer.json"].encode(text, add_special_tokens=False).ids + [slow.eos_token_id]
        assert src == slow(text)["input_ids"], text
        tgt = toks["tokenizer.json"].encode(text, add_special_tokens=False).ids + [slow.eos_token_id]
        assert tgt == slow(text_target=text)["input_ids"], text
        # the slow tokenizers strip their text: a "▁" before a dropped <unk> leaves a trailing space here; a
        # language code (>>fra<<) is a special token here and dropped from decoded text, the slow one keeps it
        want = slow.decode(tgt, skip_special_tokens=True).replace(">>fra<< ", "")
        assert toks["tokenizer.json"].decode(tgt).rstrip() == want, text
    if separate:       # the two sides really are different vocabularies
        text = "der schnelle braune Fuchs"
        assert slow(text)["input_ids"] != slow(text_target=text)["input_ids"]


def test_m2m100_encodes_as_transformers_with_language_tokens(tmp_path):
    vocab = write_m2m100_spm(tmp_path)
    [tok] = convert(tmp_path, "m2m100").values()
    for src_lang in ("en", "de"):
        slow = _slow("M2M100Tokenizer", tmp_path, src_lang=src_lang)
        for text in TEXTS:
            ours = [slow.get_lang_id(src_lang)] + tok.encode(text, add_special_tokens=False).ids + [2]
            assert ours == slow(text)["input_ids"], text
            assert tok.decode(ours).rstrip() == slow.decode(ours[1:], skip_special_tokens=True), text
    codes = language_codes(json.loads(tok.to_str()))
    assert codes == {c: len(vocab) + i for i, c in enumerate(["en", "ha", "is", "ja", "cs", "ru", "zh", "de"])}
    assert codes == {c: slow.get_lang_id(c) for c in codes}


def test_folder_with_tokenizer_json_is_used_as_is(tmp_path):
    write_m2m100_spm(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert convert(tmp_path, "m2m100") == {}


def test_incomplete_sentencepiece_files_refused(tmp_path):
    write_marian_spm(tmp_path)
    (tmp_path / "target.spm").unlink()
    with pytest.raises(ExportError, match=r"no tokenizer.json, and the SentencePiece files to convert are "
                                          r"incomplete \(missing target.spm\)"):
        convert(tmp_path, "marian")


def test_nllb_codes_read_from_tokenizer_json():
    added = [{"id": 5, "content": "eng_Latn"}, {"id": 6, "content": "__de__"}, {"id": 7, "content": "</s>"},
             {"id": 8, "content": "deu_Latn"}]
    assert language_codes({"added_tokens": added}) == {"eng_Latn": 5, "de": 6, "deu_Latn": 8}


def test_special_tokens_as_added_token_dicts(tmp_path):
    """tokenizer_config.json may store special tokens as serialized AddedTokens."""
    write_marian_spm(tmp_path, codes=(">>fra<<",))
    slow = _slow("MarianTokenizer", tmp_path)          # (it cannot read the dicts itself)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for k in ("eos_token", "unk_token", "pad_token"):
        cfg[k] = {"content": cfg[k], "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = convert(tmp_path, "marian")["source_tokenizer.json"]
    for text in MORE:
        assert tok.encode(text, add_special_tokens=False).ids + [0] == slow(text)["input_ids"], text
