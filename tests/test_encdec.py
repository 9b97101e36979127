"""Encoder-decoder models (Marian, M2M100, NLLB-style): export parity with transformers, plain beam search ==
transformers `generate(num_beams=K)` (sequences, and scores to 1e-4), speculative == plain, batched == alone."""
import json

import numpy as np
import onnx
import pytest

from helpers import assert_same_hypotheses, plain, run_drafter, speculative_equals_plain

from encdec_models import LANGS, PAD, VOCAB, make_encdec_model
from export.core import export
from specbeam_edge import Engine, SpeculativeConfig
from specbeam_edge.config import ModelFolderError

KINDS = ["marian", "m2m100", "nllb"]
# two source lengths per kind, each ending in the model's EOS (as its tokenizer appends it)
SOURCES = {"marian": [[5, 17, 33, 8, 0], list(range(40, 61)) + [0]],
           "m2m100": [[5, 17, 33, 8, 2], list(range(40, 61)) + [2]]}
SOURCES["nllb"] = [[LANGS["eng_Latn"]] + s for s in SOURCES["m2m100"]]
MAX_NEW = 10


@pytest.fixture(scope="module")
def encdec(tmp_path_factory):
    """encdec(kind, precision, seed, **config) -> (model folder, torch model), built once per argument set."""
    cache = {}

    def get(kind, precision="fp32", seed=3, output="logits", **kw):
        key = (kind, precision, seed, output, tuple(sorted(kw.items())))
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{kind}_{precision}_{seed}")
            model = make_encdec_model(root / "hf", kind, seed=seed, **kw)
            cache[key] = (export(root / "hf", root / "sb", precision=precision, output=output, quiet=True), model)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def peers(encdec):
    """peers(kind) -> (torch model, engine, eos): two EOS ids the greedy output meets, so hypotheses finish
    mid-search (the model's own EOS is rarely the best token of random weights)."""
    import torch

    cache = {}

    def get(kind):
        if kind not in cache:
            folder, model = encdec(kind)
            with torch.no_grad():
                out = model.generate(torch.tensor([SOURCES[kind][0]]), do_sample=False, max_new_tokens=MAX_NEW,
                                     eos_token_id=None, forced_eos_token_id=None)
            greedy = out[0, 1:].tolist()
            cache[kind] = (model, Engine(folder), [greedy[3], greedy[6]])
        return cache[kind]
    return get


def _hf(model, src, eos, **kw):
    import torch

    with torch.no_grad():
        return model.generate(torch.tensor([src]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos,
                              output_scores=True, return_dict_in_generate=True, **kw)


def _beam_case(peers, kind, K, lp, early, **extra):
    model, engine, eos = peers(kind)
    n_ret = min(K, 3)
    for src in SOURCES[kind]:
        out = _hf(model, src, eos, num_beams=K, length_penalty=lp, early_stopping=early, num_return_sequences=n_ret,
                  **extra)
        hf = [s[1:].tolist() for s in out.sequences]             # without the decoder start token
        [res] = engine.generate(src, num_beams=K, max_new_tokens=MAX_NEW, length_penalty=lp, early_stopping=early,
                                num_return_sequences=n_ret, eos_token_id=eos, **extra)
        ours = [h.tokens for h in res.hypotheses]
        assert len(ours) == len(hf)
        pad = model.generation_config.pad_token_id
        for o, h in zip(ours, hf):      # transformers pads shorter sequences
            assert o == h[:len(o)] and all(t == pad for t in h[len(o):]), (kind, K, lp, early, ours, hf)
        if K > 1:
            np.testing.assert_allclose([h.score for h in res.hypotheses], out.sequences_scores.tolist(), atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K,lp,early", [(1, 1.0, False), (2, 1.0, False), (4, 1.0, False), (4, 0.0, True),
                                        (4, 2.0, "never")])
def test_beam_search_matches_transformers(peers, kind, K, lp, early):
    _beam_case(peers, kind, K, lp, early)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [2, 8])
@pytest.mark.parametrize("lp", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("early", [False, True, "never"])
def test_beam_search_matches_transformers_full_grid(peers, kind, K, lp, early):
    _beam_case(peers, kind, K, lp, early)


@pytest.mark.parametrize("kind", KINDS)
def test_min_new_tokens_matches_transformers(peers, kind):
    _beam_case(peers, kind, 4, 1.0, False, min_new_tokens=7)


def test_model_eos_forced_at_max_length_and_pad_banned(peers):
    """Marian's own settings: EOS 0 forced at the last step (forced_eos_token_id), pad never generated."""
    model, engine, _ = peers("marian")
    import torch

    for src in SOURCES["marian"]:
        with torch.no_grad():
            out = model.generate(torch.tensor([src]), do_sample=False, num_beams=4, max_new_tokens=MAX_NEW,
                                 output_scores=True, return_dict_in_generate=True)
        [res] = engine.generate(src, num_beams=4, max_new_tokens=MAX_NEW)
        assert res.hypotheses[0].tokens == out.sequences[0, 1:].tolist()
        assert res.hypotheses[0].tokens[-1] == 0 and PAD not in res.hypotheses[0].tokens
        np.testing.assert_allclose(res.hypotheses[0].score, out.sequences_scores[0].item(), atol=1e-4)


def test_nllb_forced_bos_language_token(peers):
    _, engine, _ = peers("nllb")
    [res] = engine.generate(SOURCES["nllb"][0], num_beams=2, max_new_tokens=6)
    assert res.hypotheses[0].tokens[0] == LANGS["deu_Latn"]


def test_config_records_decoding_facts(encdec):
    marian = json.loads((encdec("marian")[0] / "specbeam_config.json").read_text())
    assert marian["encoder_decoder"]["decoder_start_token_id"] == PAD
    assert marian["encoder_decoder"]["suppressed_token_ids"] == [PAD]
    assert marian["encoder_decoder"]["forced_eos_token_id"] == 0
    assert marian["static_inputs"][:3] == ["encoder_attention_mask", "cross_key.0", "cross_value.0"]
    nllb = json.loads((encdec("nllb")[0] / "specbeam_config.json").read_text())
    assert nllb["encoder_decoder"]["forced_bos_token_id"] == LANGS["deu_Latn"]
    assert nllb["encoder_decoder"]["decoder_start_token_id"] == 2


SPEC = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4, max_branch_width=3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("K", [1, 4])
def test_speculative_equals_plain(encdec, kind, K):
    target, _ = encdec(kind)
    other, _ = encdec(kind, seed=11, decoder_layers=1, encoder_layers=1)
    for draft in (target, other):
        eng = Engine(target, draft=draft)
        for src in SOURCES[kind]:
            ref, fast = speculative_equals_plain(eng, src, SPEC, num_beams=K, max_new_tokens=14,
                                                 num_return_sequences=K)
            assert fast.stats.beam_steps == ref.stats.beam_steps
            if draft == target:
                assert fast.stats.target_passes < ref.stats.target_passes


@pytest.mark.parametrize("mode", ["plain", "beam"])
def test_batched_equals_alone(encdec, mode):
    target, _ = encdec("marian")
    draft, _ = encdec("marian", seed=11, decoder_layers=1, encoder_layers=1)
    eng = Engine(target, draft=draft)
    rng = np.random.default_rng(5)
    sources = [rng.integers(1, PAD, int(n)).tolist() + [0] for n in (3, 12, 7, 30, 5, 9)]
    kw = dict(num_beams=4, max_new_tokens=12, num_return_sequences=2,
              speculative=None if mode == "plain" else SPEC)
    alone = [eng.generate(s, **kw)[0] for s in sources]
    together = eng.generate(sources, max_batch_size=4, **kw)
    for a, b in zip(alone, together):
        assert_same_hypotheses(a, b, scores=False)
        np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
    assert max(max(r.stats.batch_sizes) for r in together) > 1


def test_decoder_only_draft_refused(encdec, exported):
    target, _ = encdec("marian")
    with pytest.raises(ModelFolderError, match="both be encoder-decoder models or both decoder-only"):
        Engine(target, draft=exported("llama"))


def test_source_lookup_proposes_source_spans_and_equals_plain(encdec):
    """Prompt lookup over the source: a beam ending in a source n-gram gets the source's continuation; the
    output stays that of plain beam search."""
    from specbeam_edge.decoding.draft import PromptLookupDrafter
    from specbeam_edge.decoding.tree import TokenTree

    spec = SpeculativeConfig(adaptive=False, drafter="lookup", budget=16, max_depth=3, max_branch_width=2)
    d = PromptLookupDrafter(spec, 1, [0], context_length=64, source=[7, 8, 9, 10, 11, 0])
    assert d._continuations([PAD, 5, 8]) == [(9, 10, 11)]
    assert d._continuations([PAD, 9, 10]) == [(11, 0)]
    assert d._continuations([PAD, 9, 4, 9]) == [(4, 9), (10, 11, 0)]       # the beam itself first (latest)
    tree = TokenTree()
    root = tree.add_chain([PAD, 8])[-1]

    class View:        # the drafter reads the tree only
        pass
    view = View()
    view.tree = tree
    assert [tree.tokens[n] for n in run_drafter(d(view, [root], [0.0], 16))] == [9, 10, 11]
    target, _ = encdec("marian")
    eng = Engine(target)
    for src in SOURCES["marian"]:
        for K in (1, 4):
            speculative_equals_plain(eng, src, spec, num_beams=K, max_new_tokens=14, num_return_sequences=K)


@pytest.mark.parametrize("kind", ["marian", "nllb"])
def test_int8_draft_and_fp16_target(encdec, kind):
    """An int8 export of the target drafts for it (output unchanged); fp16 and int8w (int8 weight storage, fp32
    compute) exports decode, and speculation over them equals their own plain search."""
    target, _ = encdec(kind)
    int8, _ = encdec(kind, precision="int8")
    fp16, _ = encdec(kind, precision="fp16")
    int8w, _ = encdec(kind, precision="int8w")
    cfg = json.loads((int8w / "specbeam_config.json").read_text())
    assert cfg["batch_invariant"] and cfg["quantization"]["storage"] == "int8w"
    for f in ("encoder.onnx", "model.onnx"):     # tiny models: the fp32 position tables weigh as much
        assert (int8w / f).stat().st_size < (fp16 / f).stat().st_size
        inits = onnx.load(str(int8w / f)).graph.initializer
        assert any(t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 2 for t in inits)
    for tgt, draft in ((target, int8), (fp16, fp16), (int8w, int8)):
        eng = Engine(tgt, draft=draft)
        for src in SOURCES[kind]:
            speculative_equals_plain(eng, src, SPEC, num_beams=4, max_new_tokens=14, num_return_sequences=2)


def test_text_source_ends_in_eos(peers):
    _, engine, _ = peers("marian")
    ids = engine.encode("hello world")
    assert ids[-1] == 0 and ids[:-1] == engine.tokenizer.encode("hello world")
    assert engine.encode([5, 6]) == [5, 6]          # token ids are taken as they are
    [res] = engine.generate("hello world", num_beams=2, max_new_tokens=5)
    assert res.hypotheses[0].tokens == engine.generate(ids, num_beams=2, max_new_tokens=5)[0].hypotheses[0].tokens


DSBD = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3, draft_width=4, width_threshold=0.5, min_num_beams=1)


@pytest.mark.parametrize("kind", ["marian", "nllb"])
@pytest.mark.parametrize("spec", [None, DSBD], ids=["beam_sampling", "dsbd"])
def test_sampling_batched_equals_alone(encdec, kind, spec):
    """Beam sampling and DSBD (an unrelated draft) on encoder-decoder models: seeded output of a request in a
    batch == alone; the forced BOS leads, pad never appears (bad_words_ids), EOS is forced at max length."""
    target, _ = encdec(kind)
    draft, _ = encdec(kind, seed=11, decoder_layers=1, encoder_layers=1)
    eng = Engine(target, draft=draft)
    kw = dict(num_beams=2, max_new_tokens=8, do_sample=True, seed=7, num_return_sequences=2, speculative=spec,
              temperature=1.5)
    sources = SOURCES[kind] + [s[:3] + s[-1:] for s in SOURCES[kind]]
    alone = [eng.generate(s, **kw)[0] for s in sources]
    together = eng.generate(sources, max_batch_size=4, **kw)
    for a, b in zip(alone, together):
        assert_same_hypotheses(a, b, scores=False)
        np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
    assert max(max(r.stats.batch_sizes) for r in together) > 1
    if spec is not None:
        assert sum(r.stats.draft_tokens_accepted for r in alone) > 0
    hyps = [h.tokens for r in alone for h in r.hypotheses]
    assert all(PAD not in t for t in hyps) and len({tuple(t) for t in hyps}) > 2     # really sampled
    if kind == "marian":        # forced EOS 0: every hypothesis ends in it, at max length at the latest
        assert all(t[-1] == 0 and len(t) <= 8 for t in hyps)
    else:
        assert all(t[0] == LANGS["deu_Latn"] for t in hyps)
        [res] = eng.generate(SOURCES[kind][0], tgt_lang="fra_Latn", **kw)
        assert all(h.tokens[0] == LANGS["fra_Latn"] for h in res.hypotheses)


# -- language codes (NLLB / M2M100) and SentencePiece folders ------------------------------------------------
@pytest.mark.parametrize("tgt", ["deu_Latn", "fra_Latn"])
def test_nllb_languages_match_transformers(encdec, tgt):
    """src_lang puts the code before the text (then EOS), tgt_lang is the forced BOS: == transformers generate
    with forced_bos_token_id, for two target languages (the folder's default is deu_Latn)."""
    import torch

    folder, model = encdec("nllb")
    eng = Engine(folder)
    text = "hello world"
    ids = [LANGS["eng_Latn"]] + eng.tokenizer.encode(text) + [2]
    assert eng.encode(text, src_lang="eng_Latn") == ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, num_beams=4, max_new_tokens=MAX_NEW,
                             forced_bos_token_id=LANGS[tgt], output_scores=True, return_dict_in_generate=True)
    [res] = eng.generate(text, num_beams=4, max_new_tokens=MAX_NEW, src_lang="eng_Latn", tgt_lang=tgt)
    assert res.hypotheses[0].tokens[0] == LANGS[tgt]
    assert res.hypotheses[0].tokens == out.sequences[0, 1:].tolist()
    np.testing.assert_allclose(res.hypotheses[0].score, out.sequences_scores[0].item(), atol=1e-4)
    *_, last = eng.stream(text, num_beams=4, max_new_tokens=MAX_NEW, src_lang="eng_Latn", tgt_lang=tgt)
    assert last.result.hypotheses[0].tokens == res.hypotheses[0].tokens


def test_language_errors_name_the_codes(encdec, exported):
    eng = Engine(encdec("nllb")[0])
    codes = "deu_Latn, eng_Latn, fra_Latn"
    with pytest.raises(ValueError, match=f"unknown tgt_lang 'spa_Latn'; this model's language codes: {codes}$"):
        eng.generate("hello", src_lang="eng_Latn", tgt_lang="spa_Latn")
    with pytest.raises(ValueError, match=f"unknown src_lang 'en'; this model's language codes: {codes}$"):
        eng.generate("hello", src_lang="en")
    with pytest.raises(ValueError, match=rf"this model translates between languages: pass src_lang \(one of {codes}\)"):
        eng.generate("hello")
    assert eng.encode([5, 6]) == [5, 6]           # token ids are taken as they are
    with pytest.raises(ValueError, match="tgt_lang='de': this model has no language codes"):
        Engine(encdec("marian")[0]).generate("hello", tgt_lang="de")
    with pytest.raises(ValueError, match="src_lang is for encoder-decoder models"):
        Engine(exported("llama")).generate("hello", src_lang="eng_Latn")


@pytest.mark.parametrize("shared", [True, False])
def test_sentencepiece_marian_folder_end_to_end(encdec, shared):
    """An Opus-MT-style folder (source.spm, target.spm, vocab.json and, with separate vocabularies,
    target_vocab.json; no tokenizer.json) exports; text sources encode as MarianTokenizer does and translate as
    transformers does."""
    import torch
    import transformers as tf

    kw = {} if shared else dict(share_encoder_decoder_embeddings=False, decoder_vocab_size=VOCAB)
    folder, model = encdec("marian", spm=True, **kw)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    assert cfg["encoder_decoder"]["source_tokenizer"] == "source_tokenizer.json"
    slow = tf.MarianTokenizer.from_pretrained(str(folder.parent / "hf"))
    eng = Engine(folder)
    for text in ("the quick brown fox", "hello world, 42 numbers!"):
        ids = slow(text)["input_ids"]
        assert eng.encode(text) == ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, num_beams=4, max_new_tokens=MAX_NEW)
        [res] = eng.generate(text, num_beams=4, max_new_tokens=MAX_NEW)
        assert res.hypotheses[0].tokens == out[0, 1:].tolist()
        assert res.hypotheses[0].text == slow.decode(out[0], skip_special_tokens=True)
    # source text that spells a control token stays text: only the appended EOS is one (SentencePiece's rule)
    eos, pad = cfg["eos_token_ids"][0], cfg["pad_token_id"]
    spelled = eng.encode("the </s> fox <pad>")
    assert spelled.count(eos) == 1 and spelled[-1] == eos and pad not in spelled


def test_sentencepiece_m2m100_languages_match_transformers(encdec):
    import torch
    import transformers as tf

    folder, model = encdec("m2m100", spm=True)
    eng = Engine(folder)
    slow = tf.M2M100Tokenizer.from_pretrained(str(folder.parent / "hf"), src_lang="de")
    text = "der schnelle braune Fuchs"
    ids = slow(text)["input_ids"]
    assert eng.encode(text, src_lang="de") == ids
    for tgt in ("en", "ru"):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, num_beams=2, max_new_tokens=MAX_NEW,
                                 forced_bos_token_id=slow.get_lang_id(tgt))
        [res] = eng.generate(text, num_beams=2, max_new_tokens=MAX_NEW, src_lang="de", tgt_lang=tgt)
        assert res.hypotheses[0].tokens == out[0, 1:].tolist()


def _cut_draft(hf, out, keep, *, perturb_encoder=False, own=False):
    """A draft cut from the target's HF folder as models/train.py --freeze_encoder leaves it: the target's
    encoder, embedding and cross K/V projections, decoder layers `keep` (their other weights retrained: here
    perturbed), and the config marker the export reads. own: also return the same draft exported without the
    marker (with its own encoder)."""
    import shutil

    import torch
    from transformers import AutoModelForSeq2SeqLM

    from export.encdec import TARGET_CROSS_KEY

    model = AutoModelForSeq2SeqLM.from_pretrained(hf)
    stack = model.model.decoder
    stack.layers = torch.nn.ModuleList(stack.layers[i] for i in keep)
    model.config.decoder_layers = len(keep)
    setattr(model.config, TARGET_CROSS_KEY, list(keep))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".decoder.layers." in name and "encoder_attn.k_proj" not in name and "encoder_attn.v_proj" not in name:
                p.add_(0.1 * torch.randn_like(p))
            if perturb_encoder and ".encoder.layers.0.fc1" in name:
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(out)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf / f).is_file():
            shutil.copy(hf / f, out / f)
    shared = export(out, out.parent / (out.name + "_sb"), precision="fp32", quiet=True)
    if not own:
        return shared
    cfg = json.loads((out / "config.json").read_text())
    del cfg[TARGET_CROSS_KEY]
    (out / "config.json").write_text(json.dumps(cfg))
    return shared, export(out, out.parent / (out.name + "_own"), precision="fp32", quiet=True)


@pytest.mark.parametrize("kind", ["marian", "m2m100"])
def test_draft_sharing_the_target_encoder(encdec, kind, tmp_path):
    """A draft declaring target_cross_layers ships no encoder and runs no encoder pass: it gets the target's
    cross K/V of those layers, which equal what its own encoder gives, and speculation still equals plain
    search."""
    target, _ = encdec(kind)
    hf = target.parent / "hf"
    draft, own_folder = _cut_draft(hf, tmp_path / "draft", [1], own=True)
    assert json.loads((draft / "specbeam_config.json").read_text())["encoder_decoder"]["target_cross_layers"] == [1]
    assert not (draft / "encoder.onnx").exists() and (own_folder / "encoder.onnx").is_file()
    eng = Engine(target, draft=draft)
    assert eng.draft_cross == [1] and eng.draft_encoder is None
    with pytest.raises(ModelFolderError, match="has no encoder: it is a draft that reads its target's"):
        Engine(draft)
    own = Engine(own_folder)               # the same draft exported with its own encoder
    for src in SOURCES[kind]:
        [t] = eng.encoder.encode([src])
        [d] = own.encoder.encode([src])
        shared = eng._statics([src], 1)[0](True)[1]
        assert sorted(shared) == sorted(d)
        for name, (arr, axis) in d.items():
            np.testing.assert_allclose(shared[name][0], arr, atol=1e-5)
            assert shared[name][1] == axis
        for K in (1, 4):
            _, fast = speculative_equals_plain(eng, src, SPEC, num_beams=K, max_new_tokens=14, num_return_sequences=K)
            assert fast.stats.draft_tokens_proposed > 0
    # batched requests share it too
    together = eng.generate(SOURCES[kind], num_beams=4, max_new_tokens=14, speculative=SPEC, max_batch_size=2)
    for src, b in zip(SOURCES[kind], together):
        [a] = plain(eng, src, num_beams=4, max_new_tokens=14)
        assert_same_hypotheses(a, b, scores=False)
def test_draft_sharing_another_encoder_is_refused(encdec, tmp_path):
    target, _ = encdec("m2m100")
    hf = target.parent / "hf"
    bad = _cut_draft(hf, tmp_path / "bad", [0], perturb_encoder=True)
    with pytest.raises(ModelFolderError, match=r"target_cross_layers \[0\]\), but its cross K/V differ .* another "
                                               r"target"):
        Engine(target, draft=bad)
    good = _cut_draft(hf, tmp_path / "good", [0, 1])
    cfg_path = good / "specbeam_config.json"
    cfg = json.loads(cfg_path.read_text())
    probe = cfg["encoder_decoder"].pop("target_cross_probe")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match=r"target_cross_probe missing or malformed .* re-export the draft"):
        Engine(target, draft=good)
    one_nan = {k: [float("nan")] + v[1:] if k == "cross_value.1" else v for k, v in probe["values"].items()}
    for bad, why in (({**probe, "values": one_nan}, r"differ from .* by nan"),
                     ({**probe, "source": [10 ** 6] * 3}, r"cannot reproduce the draft's encoder fingerprint")):
        cfg["encoder_decoder"]["target_cross_probe"] = bad
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(ModelFolderError, match=why):
            Engine(target, draft=good)
    cfg["encoder_decoder"]["target_cross_probe"] = probe
    for layers in ([0], "0,1", [0, True], [0, -1]):
        cfg["encoder_decoder"]["target_cross_layers"] = layers
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(ModelFolderError, match=r"target_cross_layers must list one target decoder layer "
                                                   r"\(an integer >= 0\) per draft decoder layer \(2\)"):
            Engine(target, draft=good)
    cfg["encoder_decoder"]["target_cross_layers"] = [0, 2]      # a target with more layers than this one
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match=r"reads the cross K/V of target decoder layers \[0, 2\], but .* has "
                                               r"2: it was trained for another target"):
        Engine(target, draft=good)


def test_large_shared_encoder_draft_ships_no_encoder_data(encdec, tmp_path, monkeypatch):
    """A graph past protobuf's limit keeps its tensors in <graph>.data: a draft sharing its target's encoder
    must drop that file with encoder.onnx (it kept it: the whole encoder again)."""

    target, _ = encdec("m2m100")
    monkeypatch.setattr("export.save.EXTERNAL_DATA_BYTES", 0)    # every graph counts as large
    draft = _cut_draft(target.parent / "hf", tmp_path / "draft", [1])
    assert sorted(p.name for p in draft.iterdir() if ".onnx" in p.name) == ["model.onnx", "model.onnx.data"]
    assert Engine(target, draft=draft).draft_cross == [1]


def test_evaluate_agreement_of_an_encoder_decoder_pair(encdec, tmp_path):
    """models/evaluate.py's teacher-forced agreement runs on encoder-decoder pairs: a target agrees with itself
    everywhere, and with a draft sharing its encoder (other decoder weights) less."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("specbeam_models_evaluate",
                                                  Path(__file__).parents[1] / "models" / "evaluate.py")
    evaluate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate)
    target, _ = encdec("m2m100")
    refs = [[7, 9, 11, 13, 2], [20, 21, 22, 2]]
    report = {}
    evaluate.agreement(Engine(target, draft=target), SOURCES["m2m100"], refs, None, report, key="self")
    assert report["self"]["positions"] == 9
    assert report["self"]["greedy_match"] == report["self"]["top4_overlap"] == 1.0
    draft = _cut_draft(target.parent / "hf", tmp_path / "draft", [1])
    evaluate.agreement(Engine(target, draft=draft), SOURCES["m2m100"], refs, None, report, key="cut")
    assert report["cut"]["positions"] == 9 and report["cut"]["top4_overlap"] < 1.0
    # that draft has no encoder, so it has no greedy score of its own: the report says why instead of failing
    # the scores are the target's greedy outputs against the references: the first reference is the target's
    # own output, printable characters only (so chrF is well above 0), the second is not; the expected numbers come from sacrebleu here
    import sacrebleu

    eng = Engine(target)
    sources = ["a b c", "b c"]
    hyp = [r.text for r in eng.generate([eng.tokenizer.format_prompt(s) for s in sources], num_beams=1,
                                        max_new_tokens=6)]
    refs = ["".join(ch for ch in hyp[0] if ch.isprintable()), "e f"]     # a TSV line holds no tab or newline
    assert refs[0].strip(), hyp
    test = tmp_path / "test.tsv"
    test.write_text("".join(f"{s}\t{r}\n" for s, r in zip(sources, refs)), encoding="utf-8")
    out = tmp_path / "eval.json"
    evaluate.main(["--target", str(target), "--draft", str(draft), "--test", str(test), "--systems",
                   "target_greedy,draft_greedy", "--max_new_tokens", "6", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["draft_greedy"] == {"skipped": "the draft reads the target's encoder (target_cross_layers)"}
    assert rep["target_greedy"]["chrf"] == round(sacrebleu.corpus_chrf(hyp, [refs]).score, 2) > 0
    assert rep["target_greedy"]["bleu"] == round(sacrebleu.corpus_bleu(hyp, [refs]).score, 2)


def test_auto_budget_measures_the_decoder_with_a_source(encdec):
    """budget='auto' measures the target's pass cost; an encoder-decoder's decoder pass needs a source's cross
    K/V (it used to fail for want of them)."""
    target, _ = encdec("m2m100")
    eng = Engine(target, draft=target)
    curve = eng.cost_curve(sizes=(1, 2, 4), reps=1)
    assert sorted(curve) == [1, 2, 4] and all(t > 0 for t in curve.values())
    auto = SpeculativeConfig(adaptive=False, budget="auto", max_depth=3)
    for src in SOURCES["m2m100"]:
        speculative_equals_plain(eng, src, auto, num_beams=2, max_new_tokens=10)


@pytest.mark.parametrize("kind", ["marian", "m2m100"])
def test_both_head_draft_equals_plain_and_drafts_from_its_topk(encdec, kind, top_calls):
    """An encoder-decoder draft exported with --output_kind both: exact speculation equals plain and its draft
    levels come from the graph's TopK (no Python top-k over full rows); sampling reads its logits."""
    target, _ = encdec(kind)
    draft, _ = encdec(kind, seed=11, decoder_layers=1, encoder_layers=1, output="both")
    eng = Engine(target, draft=draft)
    for src in SOURCES[kind]:
        _, fast = speculative_equals_plain(eng, src, SPEC, num_beams=4, max_new_tokens=14, num_return_sequences=4)
        assert fast.stats.draft_passes > 0
    # two rows or more: the graph's TopK; Python's top-k over logits for one row only
    assert top_calls["TopK"] and all(rows == 1 for rows in top_calls["Dense"])
    # sampling reads the logits: the same draws as the logits-only export of the same draft
    logits_draft, _ = encdec(kind, seed=11, decoder_layers=1, encoder_layers=1)
    sampling = SpeculativeConfig(adaptive=False, drafter="sample", max_depth=3)
    [s, ref] = [Engine(target, draft=d).generate(SOURCES[kind][0], num_beams=2, do_sample=True, seed=1,
                                                 max_new_tokens=8, speculative=sampling)[0]
                for d in (draft, logits_draft)]
    assert s.stats.generated_tokens > 0 and s.text == ref.text


def test_a_damaged_encoder_or_decoder_graph_is_refused_by_name(encdec, tmp_path):
    """Encoder-decoder folders carry files.sha256 as decoder-only ones do (their config writer had none, so a
    replaced encoder.onnx loaded and answered from other weights): each graph is checked on load."""
    import shutil

    from specbeam_edge import ModelFolderError

    target, _ = encdec("marian")
    cfg = json.loads((target / "specbeam_config.json").read_text())
    assert set(cfg["files"]["sha256"]) >= {"model.onnx", "encoder.onnx"}
    for name in ("encoder.onnx", "model.onnx"):
        copy = tmp_path / name.replace(".", "_")
        shutil.copytree(target, copy)
        data = bytearray((copy / name).read_bytes())
        data[-1] ^= 1                                  # the last byte: a weight, the graph still parses
        (copy / name).write_bytes(bytes(data))
        with pytest.raises(ModelFolderError, match=f"{name}: SHA-256 .* does not match"):
            Engine(copy, draft=None)
