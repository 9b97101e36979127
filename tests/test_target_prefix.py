"""Target prefix (CTranslate2's target_prefix): the output is forced through the given target tokens and beam
search continues from there. Equal to transformers' generate with the prefix in decoder_input_ids
(encoder-decoder: [decoder start, forced BOS] + prefix) or input_ids (decoder-only: prompt + prefix), sequences
and scores (the prefix counts as prompt for the length penalty); speculative == plain; batched == alone; beam
sampling; the hypotheses include the prefix."""
from pathlib import Path

import numpy as np
import pytest

from specbeam_edge import Engine, SpeculativeConfig
from test_beam import MAX_NEW as DEC_MAX_NEW, PROMPTS, hf_beam, peer  # noqa: F401 (fixture)
from test_encdec import DSBD, LANGS, MAX_NEW, PAD, SOURCES, SPEC, encdec, peers  # noqa: F401
from helpers import assert_same_hypotheses, plain, speculative_equals_plain

PREFIXES = {"marian": [[7, 12], [9]], "m2m100": [[7, 12], [9]], "nllb": [[7, 12], [9]]}
PAIR = Path(__file__).resolve().parents[1] / "models" / "ende"


def _hf_encdec(model, kind, src, prefix, eos, **kw):
    import torch

    start = [model.generation_config.decoder_start_token_id] + ([LANGS["deu_Latn"]] if kind == "nllb" else [])
    with torch.no_grad():
        out = model.generate(torch.tensor([src]), decoder_input_ids=torch.tensor([start + prefix]), do_sample=False,
                             max_new_tokens=MAX_NEW, eos_token_id=eos, output_scores=True,
                             return_dict_in_generate=True, **kw)
    return [s[1:].tolist() for s in out.sequences], getattr(out, "sequences_scores", None)


@pytest.mark.parametrize("kind", ["marian", "m2m100", "nllb"])
@pytest.mark.parametrize("K,lp,extra", [(1, 1.0, {}), (4, 1.0, {}), (4, 2.0, {}), (4, 0.0, {"early_stopping": True}),
                                        (4, 1.0, {"min_new_tokens": 5})])
def test_encoder_decoder_prefix_matches_transformers(peers, kind, K, lp, extra):
    """generate(src, target_prefix=p) == transformers generate(decoder_input_ids=[start(, forced BOS)] + p):
    the same sequences (ours include the forced BOS and the prefix) and sequence scores."""
    model, engine, eos = peers(kind)
    n_ret = min(K, 3)
    for src in SOURCES[kind]:
        for prefix in PREFIXES[kind]:
            hf, hf_scores = _hf_encdec(model, kind, src, prefix, eos, num_beams=K, length_penalty=lp,
                                       num_return_sequences=n_ret, **extra)
            [res] = engine.generate(src, target_prefix=prefix, num_beams=K, max_new_tokens=MAX_NEW, length_penalty=lp,
                                    num_return_sequences=n_ret, eos_token_id=eos, **extra)
            lead = [LANGS["deu_Latn"]] if kind == "nllb" else []
            pad = model.generation_config.pad_token_id
            assert len(res.hypotheses) == len(hf)
            for h, ref in zip(res.hypotheses, hf):
                assert h.tokens[:len(lead + prefix)] == lead + prefix
                assert h.tokens == ref[:len(h.tokens)] and all(t == pad for t in ref[len(h.tokens):]), (h.tokens, ref)
            if K > 1:
                np.testing.assert_allclose([h.score for h in res.hypotheses], hf_scores.tolist(), atol=1e-4)


@pytest.mark.parametrize("K,lp,extra", [(1, 1.0, {}), (4, 1.0, {}), (4, 2.0, {}), (4, 1.0, {"min_new_tokens": 5})])
def test_decoder_only_prefix_matches_transformers(peer, K, lp, extra):
    """generate(prompt, target_prefix=p) == transformers generate(input_ids=prompt + p), sequences and scores;
    the hypotheses are p + the generated tokens."""
    model, engine, eos = peer
    n_ret = min(K, 3)
    for prompt in PROMPTS:
        for prefix in ([5, 40], [200]):
            hf, hf_scores = hf_beam(model, prompt + prefix, eos, num_beams=K, length_penalty=lp,
                                    num_return_sequences=n_ret, **extra)
            [res] = engine.generate(prompt, target_prefix=prefix, num_beams=K, max_new_tokens=DEC_MAX_NEW,
                                    length_penalty=lp, num_return_sequences=n_ret, eos_token_id=eos, **extra)
            assert len(res.hypotheses) == len(hf)
            for h, ref in zip(res.hypotheses, hf):
                assert h.tokens[:len(prefix)] == prefix
                gen = h.tokens[len(prefix):]
                assert gen == ref[:len(gen)] and all(t == eos[0] for t in ref[len(gen):]), (gen, ref)
            if hf_scores is not None:
                np.testing.assert_allclose([h.score for h in res.hypotheses], hf_scores, atol=1e-4, rtol=1e-5)


def test_prefix_counts_as_prompt_for_the_length_penalty(peer):
    """The score of a prefixed hypothesis normalises by the tokens after the prefix (transformers since its
    decoder_prompt_len): a prompt extended by the prefix gives the same hypotheses and scores."""
    _, engine, eos = peer
    prompt, prefix = PROMPTS[0], [5, 40]
    [a] = engine.generate(prompt, target_prefix=prefix, num_beams=4, max_new_tokens=8, eos_token_id=eos,
                          num_return_sequences=3, length_penalty=2.0)
    [b] = engine.generate(prompt + prefix, num_beams=4, max_new_tokens=8, eos_token_id=eos, num_return_sequences=3,
                          length_penalty=2.0)
    assert [h.tokens for h in a.hypotheses] == [prefix + h.tokens for h in b.hypotheses]
    assert [h.score for h in a.hypotheses] == [h.score for h in b.hypotheses]
    assert a.stats.generated_tokens == b.stats.generated_tokens


@pytest.mark.parametrize("kind", ["marian", "nllb"])
@pytest.mark.parametrize("K", [1, 4])
def test_encoder_decoder_prefix_speculative_equals_plain(encdec, kind, K):
    target, _ = encdec(kind)
    other, _ = encdec(kind, seed=11, decoder_layers=1, encoder_layers=1)
    lookup = SpeculativeConfig(adaptive=False, drafter="lookup", budget=16, max_depth=3, max_branch_width=2)
    for draft, spec in ((target, SPEC), (other, SPEC), (None, lookup)):
        eng = Engine(target, draft=draft)
        for src in SOURCES[kind]:
            for prefix in PREFIXES[kind]:
                ref, fast = speculative_equals_plain(eng, src, spec, target_prefix=prefix, num_beams=K,
                                                     max_new_tokens=14, num_return_sequences=K)
                assert fast.stats.beam_steps == ref.stats.beam_steps


@pytest.mark.parametrize("K", [1, 4])
def test_decoder_only_prefix_speculative_equals_plain(pair, K):
    target, draft = pair
    eng = Engine(target, draft=draft)
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4, max_branch_width=3)
    for prompt in PROMPTS:
        kw = dict(target_prefix=[5, 40, 7], num_beams=K, max_new_tokens=12, num_return_sequences=K)
        [ref] = plain(eng, prompt, **kw)
        [fast] = eng.generate(prompt, speculative=spec, **kw)
        assert_same_hypotheses(fast, ref, scores=False)
        np.testing.assert_allclose([h.score for h in fast.hypotheses], [h.score for h in ref.hypotheses],
                                   atol=1e-5)
        assert all(h.tokens[:3] == [5, 40, 7] for h in ref.hypotheses)


@pytest.mark.parametrize("mode", ["plain", "beam"])
def test_prefix_batched_equals_alone(encdec, pair, mode):
    """Requests with different prefixes (and none) in one batch: each gets its output alone."""
    target, _ = encdec("marian")
    draft, _ = encdec("marian", seed=11, decoder_layers=1, encoder_layers=1)
    rng = np.random.default_rng(5)
    sources = [rng.integers(1, PAD, int(n)).tolist() + [0] for n in (3, 12, 7, 30, 5, 9)]
    prefixes = [[7, 12], None, [9], [], [3, 4, 5, 6], [11]]
    t2, d2 = pair
    prompts = [[3, 17, 33, 8], [250, 12, 9], [40, 41], [7] * 9, [100, 3], [5]]
    for eng, srcs in ((Engine(target, draft=draft), sources), (Engine(t2, draft=d2), prompts)):
        kw = dict(num_beams=4, max_new_tokens=12, num_return_sequences=2,
                  speculative=None if mode == "plain" else SPEC)
        alone = [eng.generate(s, target_prefix=p, **kw)[0] for s, p in zip(srcs, prefixes)]
        together = eng.generate(srcs, target_prefix=prefixes, max_batch_size=4, **kw)
        for a, b, p in zip(alone, together, prefixes):
            assert_same_hypotheses(a, b, scores=False)
            np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
        assert max(max(r.stats.batch_sizes) for r in together) > 1
        # no prefix is the plain request
        [none] = eng.generate(srcs[1], **kw)
        assert_same_hypotheses(none, together[1], scores=False)
@pytest.mark.parametrize("spec", [None, DSBD], ids=["beam_sampling", "dsbd"])
def test_prefix_with_beam_sampling(encdec, pair, spec):
    """Seeded beam sampling (and DSBD) from a prefix: batched == alone; decoder-only: the same samples as from
    the prompt extended by the prefix, the prefix before them."""
    target, _ = encdec("nllb")
    draft, _ = encdec("nllb", seed=11, decoder_layers=1, encoder_layers=1)
    kw = dict(num_beams=2, max_new_tokens=8, do_sample=True, seed=7, num_return_sequences=2, speculative=spec,
              temperature=1.5)
    eng = Engine(target, draft=draft)
    prefixes = [[7, 12], [9], None, [5]]
    srcs = SOURCES["nllb"] * 2
    alone = [eng.generate(s, target_prefix=p, **kw)[0] for s, p in zip(srcs, prefixes)]
    together = eng.generate(srcs, target_prefix=prefixes, max_batch_size=4, **kw)
    for a, b, p in zip(alone, together, prefixes):
        assert_same_hypotheses(a, b, scores=False)
        lead = [LANGS["deu_Latn"]] + (p or [])
        assert all(h.tokens[:len(lead)] == lead and PAD not in h.tokens for h in a.hypotheses)
    t2, d2 = pair
    eng = Engine(t2, draft=d2)
    for prompt in PROMPTS:
        [a] = eng.generate(prompt, target_prefix=[5, 40], **kw)
        [b] = eng.generate(prompt + [5, 40], **kw)
        assert [h.tokens for h in a.hypotheses] == [[5, 40] + h.tokens for h in b.hypotheses]
        assert [h.score for h in a.hypotheses] == [h.score for h in b.hypotheses]


def test_stream_and_generate_step_with_a_prefix(peer):
    _, engine, eos = peer
    prompt, prefix = PROMPTS[0], [5, 40]
    [res] = engine.generate(prompt, target_prefix=prefix, num_beams=2, max_new_tokens=8, eos_token_id=eos)
    chunks = list(engine.stream(prompt, target_prefix=prefix, num_beams=2, max_new_tokens=8, eos_token_id=eos))
    assert chunks[-1].result.hypotheses[0].tokens == res.hypotheses[0].tokens
    states = list(engine.generate_passes(prompt, target_prefix=prefix, num_beams=2, max_new_tokens=8, eos_token_id=eos))
    assert states[-1][0].hypotheses(1)[0][0] == res.hypotheses[0].tokens[len(prefix):]


def test_prefix_validation(peer):
    _, engine, _ = peer
    with pytest.raises(ValueError, match="target_prefix has 1 entries for 2 prompts"):
        engine.generate([PROMPTS[0], PROMPTS[1]], target_prefix=[[5]])
    with pytest.raises(ValueError, match="prompt 1: target prefix token 99999 at position 0 is outside"):
        engine.generate([PROMPTS[0], PROMPTS[1]], target_prefix=[[5], [99999]])
    with pytest.raises(TypeError, match="target prefix token 'a' at position 1 is a str"):
        engine.generate(PROMPTS[0], target_prefix=[5, "a"])
    with pytest.raises(TypeError, match="one prefix .* per prompt"):
        list(engine.generate_iter([PROMPTS[0]], target_prefix="one text for a list"))
    with pytest.raises(ValueError, match="the prompt and target prefix have 607 tokens"):
        engine.generate(PROMPTS[0], target_prefix=[5] * 600)
    # '' and None are no prefix
    [a], [b] = engine.generate(PROMPTS[0], target_prefix="", max_new_tokens=4), engine.generate(PROMPTS[0],
                                                                                                  max_new_tokens=4)
    assert a.hypotheses[0].tokens == b.hypotheses[0].tokens


@pytest.mark.skipif(not (PAIR / "target" / "model.onnx").exists(), reason="the shipped pair is not in this checkout")
def test_text_prefix_on_the_shipped_pair():
    """A text prefix is encoded as plain target text; the translation (text and tokens) starts with it."""
    eng = Engine(PAIR / "target", PAIR / "draft")
    prefix = eng.tokenizer.encode("Die Datei")
    [res] = plain(eng, "Open the file.", target_prefix="Die Datei", num_beams=4)
    assert res.text.startswith("Die Datei") and res.hypotheses[0].tokens[:len(prefix)] == prefix
    [fast] = eng.generate("Open the file.", target_prefix="Die Datei", num_beams=4, speculative={"adaptive": False})
    assert fast.hypotheses[0].tokens == res.hypotheses[0].tokens


# -- the translate tool: --target_prefix FILE ---------------------------------------------------------------
def _cli_lines():
    from helpers import corpus

    return corpus(5, seed=21)


def test_cli_target_prefix_file(pair, tmp_path, capsys):
    """One prefix a line (an empty line for none): each output line is the API's translation from that prefix
    (it includes the prefix); lines without one are the plain translation."""
    from apps.translate.__main__ import main
    from apps.translate.job import one_line
    from helpers import translate_args

    lines = _cli_lines()
    inp, pre = tmp_path / "in.txt", tmp_path / "prefix.txt"
    inp.write_text("\n".join(lines) + "\n")
    prefixes = ["ab", "", "the c", "", "x"]
    pre.write_text("\n".join(prefixes) + "\n")
    assert main(translate_args(pair, inp, tmp_path / "plain.txt", max_len=6)) == 0
    assert main(translate_args(pair, inp, tmp_path / "out.txt", "--target_prefix", str(pre), max_len=6)) == 0
    got = (tmp_path / "out.txt").read_text().splitlines()
    plain = (tmp_path / "plain.txt").read_text().splitlines()
    eng = Engine(pair[0], draft=pair[1])
    for line, p, g, q in zip(lines, prefixes, got, plain):
        [res] = eng.generate(eng.tokenizer.format_prompt(line), target_prefix=p or None, num_beams=4,
                             max_new_tokens=6)
        assert g == one_line(res.text)
        if p:
            assert res.hypotheses[0].tokens[:len(eng.tokenizer.encode(p))] == eng.tokenizer.encode(p)
        else:
            assert g == q


def test_cli_target_prefix_line_count_mismatch_is_one_line(pair, tmp_path, capsys):
    from apps.translate.__main__ import main
    from helpers import translate_args

    inp, pre = tmp_path / "in.txt", tmp_path / "prefix.txt"
    inp.write_text("\n".join(_cli_lines()) + "\n")
    pre.write_text("ab\ncd\n")
    assert main(translate_args(pair, inp, None, "--target_prefix", str(pre))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 2 lines, the input has 5" in err[0] and str(pre) in err[0]


def test_cli_resume_treats_the_prefix_file_as_a_setting(pair, tmp_path, monkeypatch, capsys):
    """An interrupted run resumes with the same prefix file to the bytes of an uninterrupted run; a changed
    prefix file is refused by name."""
    from apps.translate.__main__ import main
    from helpers import interrupt_after, translate_args

    inp, pre, out, ref = tmp_path / "in.txt", tmp_path / "prefix.txt", tmp_path / "out.txt", tmp_path / "ref.txt"
    inp.write_text("\n".join(_cli_lines()) + "\n")
    pre.write_text("ab\n\nthe c\n\nx\n")
    flags = ("--target_prefix", str(pre), "--batch_size", "1")
    assert main(translate_args(pair, inp, ref, *flags)) == 0
    interrupt_after(monkeypatch, 2)
    assert main(translate_args(pair, inp, out, *flags)) == 130
    monkeypatch.undo()
    pre.write_text("ab\n\nthe d\n\nx\n")
    capsys.readouterr()
    assert main(translate_args(pair, inp, out, "--resume", *flags)) == 2
    err = capsys.readouterr().err
    assert "target_prefix (the file's contents):" in err and "beam_size" not in err
    pre.write_text("ab\n\nthe c\n\nx\n")
    assert main(translate_args(pair, inp, out, "--resume", *flags)) == 0
    assert out.read_bytes() == ref.read_bytes()
    # a run without the prefix file is another setting too
    interrupt_after(monkeypatch, 2)
    out2 = tmp_path / "out2.txt"
    assert main(translate_args(pair, inp, out2, *flags)) == 130
    monkeypatch.undo()
    assert main(translate_args(pair, inp, out2, "--resume", "--batch_size", "1")) == 2


def test_a_prefix_over_the_context_is_that_lines_problem(pair, tmp_path, capsys):
    """Issue 50 row 9: one 600-token line in a --target_prefix file (or a JSON line's target_prefix) refused the
    whole run ("... tokens; the model's context length is ...", no line number). Now that line is refused with
    its number (--on_error) and the others are translated."""
    import json

    from apps.translate.__main__ import main
    from helpers import translate_args

    inp, prefixes = tmp_path / "in.txt", tmp_path / "prefix.txt"
    inp.write_text("the quick brown fox\nhello world\nthis is a tiny test\n")
    prefixes.write_text("the\n" + "word " * 300 + "\n\n")
    out = tmp_path / "out.txt"
    assert main(translate_args(pair, inp, out, "--target_prefix", str(prefixes), "--beam_size", "2")) == 0
    got = out.read_text().splitlines()
    assert len(got) == 3 and got[0].startswith("the") and got[1] == "" and got[2], got
    err = capsys.readouterr().err
    assert "line 2: the target prefix has" in err and "over the model's context" in err, err
    jin = tmp_path / "in.jsonl"
    jin.write_text(json.dumps({"text": "hello", "target_prefix": "word " * 300, "id": 1}) + "\n" +
                   json.dumps({"text": "hello world", "id": 2}) + "\n")
    assert main(translate_args(pair, jin, None, "--jsonl", "--beam_size", "2")) == 0
    cap = capsys.readouterr()
    lines = [json.loads(x) for x in cap.out.splitlines()]
    assert lines[0]["id"] == 1 and lines[0]["translations"] == [] and "target prefix" in lines[0]["problems"][0]
    assert lines[1]["translations"] and "line 1: the target prefix has" in cap.err
