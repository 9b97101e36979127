"""Alternatives at a position (Engine.alternatives): the true top n next tokens after a target prefix, with the
log-probs of transformers' dense log-softmax at that position, each with its best continuation (beam search
from the prefix and that token, == transformers' generate with them forced); speculative == plain."""
import numpy as np
import pytest

from specbeam_edge import Engine, SpeculativeConfig
from test_beam import MAX_NEW as DEC_MAX_NEW, PROMPTS, hf_beam, peer  # noqa: F401 (fixture)
from test_encdec import LANGS, PAD, SOURCES, SPEC, encdec, peers  # noqa: F401 (fixtures)
from test_target_prefix import _hf_encdec

N = 6


def _dense_top(logits, n, banned=()):
    import torch

    lp = torch.log_softmax(logits.double(), -1).numpy()
    lp[list(banned)] = -np.inf
    top = np.argsort(-lp, kind="stable")[:n]
    return top.tolist(), lp[top]


@pytest.mark.parametrize("prefix", [None, [5, 40]])
def test_decoder_only_top_n_is_the_dense_top_n(peer, prefix):
    import torch

    model, engine, eos = peer
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + (prefix or [])])).logits[0, -1]
        want, want_lp = _dense_top(logits, N)
        alts = engine.alternatives(prompt, prefix, n=N, num_beams=4, max_new_tokens=DEC_MAX_NEW, eos_token_id=eos)
        assert [a.token_id for a in alts] == want
        np.testing.assert_allclose([a.logprob for a in alts], want_lp, atol=1e-4)
        assert all(a.logprob >= b.logprob for a, b in zip(alts, alts[1:]))
        for a in alts:          # the continuation: transformers' beam search from prompt + prefix + token
            if a.token_id in eos:       # the output ends there (test_eos_alternative_and_min_new_tokens)
                continue
            forced = (prefix or []) + [a.token_id]
            hf, scores = hf_beam(model, prompt + forced, eos, num_beams=4)
            gen = a.hypothesis.tokens[len(forced):]
            assert a.hypothesis.tokens[:len(forced)] == forced
            assert gen == hf[0][:len(gen)] and all(t == eos[0] for t in hf[0][len(gen):])
            np.testing.assert_allclose(a.hypothesis.score, scores[0], atol=1e-4)


@pytest.mark.parametrize("kind", ["marian", "m2m100", "nllb"])
@pytest.mark.parametrize("prefix", [None, [7, 12]])
def test_encoder_decoder_top_n_is_the_dense_top_n(peers, kind, prefix):
    """The position after [decoder start(, forced BOS)] + prefix; Marian's banned pad is never an alternative."""
    import torch

    model, engine, eos = peers(kind)
    start = [model.generation_config.decoder_start_token_id] + ([LANGS["deu_Latn"]] if kind == "nllb" else [])
    banned = [PAD] if kind == "marian" else []
    for src in SOURCES[kind]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([src]),
                           decoder_input_ids=torch.tensor([start + (prefix or [])])).logits[0, -1]
        want, want_lp = _dense_top(logits, N, banned)
        alts = engine.alternatives(src, prefix, n=N, num_beams=4, max_new_tokens=10, eos_token_id=eos)
        assert [a.token_id for a in alts] == want
        np.testing.assert_allclose([a.logprob for a in alts], want_lp, atol=1e-4)
        for a in alts[:3]:
            if a.token_id in eos:
                continue
            forced = (prefix or []) + [a.token_id]
            hf, scores = _hf_encdec(model, kind, src, forced, eos, num_beams=4)
            toks = a.hypothesis.tokens
            assert toks[:len(start) - 1 + len(forced)] == start[1:] + forced
            assert toks == hf[0][:len(toks)]
            np.testing.assert_allclose(a.hypothesis.score, scores[0].item(), atol=1e-4)


def test_eos_alternative_and_min_new_tokens(peer):
    """An EOS alternative ends the output there (its hypothesis: the prefix and EOS, score 0.0, nothing after);
    min_new_tokens > 0 bans EOS at the position, so it is no alternative."""
    _, engine, _ = peer
    prompt, prefix = PROMPTS[0], [5, 40]
    top = engine.alternatives(prompt, prefix, n=3, eos_token_id=[0])
    eos = top[1].token_id
    alts = engine.alternatives(prompt, prefix, n=3, num_beams=2, max_new_tokens=6, eos_token_id=[eos])
    assert [a.token_id for a in alts] == [a.token_id for a in top]
    assert alts[1].hypothesis.tokens == prefix + [eos] and alts[1].hypothesis.score == 0.0
    banned = engine.alternatives(prompt, prefix, n=3, num_beams=2, max_new_tokens=6, eos_token_id=[eos],
                                 min_new_tokens=2)
    assert eos not in [a.token_id for a in banned]
    assert [a.token_id for a in banned][:1] == [top[0].token_id]


def test_alternatives_speculative_equal_plain(pair):
    target, draft = pair
    eng = Engine(target, draft=draft)
    spec = SpeculativeConfig(adaptive=False, drafter="beam", budget=24, max_depth=4, max_branch_width=3)
    for prompt in PROMPTS:
        plain = eng.alternatives(prompt, [5], n=4, num_beams=4, max_new_tokens=10, speculative=None)
        fast = eng.alternatives(prompt, [5], n=4, num_beams=4, max_new_tokens=10, speculative=spec)
        assert [(a.token_id, a.logprob, a.hypothesis.tokens) for a in plain] == \
            [(a.token_id, a.logprob, a.hypothesis.tokens) for a in fast]


def test_alternatives_nllb_speculative_equal_plain(encdec):
    target, _ = encdec("nllb")
    other, _ = encdec("nllb", seed=11, decoder_layers=1, encoder_layers=1)
    eng = Engine(target, draft=other)
    for src in SOURCES["nllb"]:
        plain = eng.alternatives(src, [7], n=4, num_beams=4, max_new_tokens=10, speculative=None)
        fast = eng.alternatives(src, [7], n=4, num_beams=4, max_new_tokens=10, speculative=SPEC)
        assert [a.hypothesis.tokens for a in plain] == [a.hypothesis.tokens for a in fast]


def test_alternatives_validation(peer):
    _, engine, _ = peer
    with pytest.raises(ValueError, match="n must be a positive int"):
        engine.alternatives(PROMPTS[0], None, n=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.alternatives(PROMPTS[0], None, n=2, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="do_sample is for generate"):
        engine.alternatives(PROMPTS[0], None, n=2, do_sample=True)
    assert len(engine.alternatives(PROMPTS[0], None, n=2, max_new_tokens=2)) == 2


# -- the translate tool: --alternatives N (JSON lines) ------------------------------------------------------
def test_cli_alternatives_json_lines(pair, tmp_path):
    """One JSON object per input line (an empty line: no alternatives); the alternatives are the API's at the
    position after the line's target prefix."""
    import json

    from apps.translate.__main__ import main
    from apps.translate.job import one_line
    from helpers import corpus, translate_args

    lines = corpus(3, seed=21) + [""]
    inp, pre, out = tmp_path / "in.txt", tmp_path / "prefix.txt", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    prefixes = ["ab", "", "the c", ""]
    pre.write_text("\n".join(prefixes) + "\n")
    assert main(translate_args(pair, inp, out, "--alternatives", "3", "--target_prefix", str(pre), max_len=6)) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[3] == {"alternatives": []}
    eng = Engine(pair[0], draft=pair[1])
    for line, p, row in zip(lines[:3], prefixes, rows):
        alts = eng.alternatives(eng.tokenizer.format_prompt(line), p or None, n=3, num_beams=4, max_new_tokens=6)
        assert [a["token_id"] for a in row["alternatives"]] == [a.token_id for a in alts]
        assert [a["text"] for a in row["alternatives"]] == [one_line(a.text) for a in alts]
        assert [a["token"] for a in row["alternatives"]] == [a.token for a in alts]
        np.testing.assert_allclose([a["logprob"] for a in row["alternatives"]], [a.logprob for a in alts], atol=1e-6)
        assert all(a.text.startswith(p) for a in alts)


@pytest.mark.parametrize("flags,why", [(["--n_best", "2"], "--n_best"), (["--with_score"], "--with_score"),
                                       (["--engine", "ray", "-o", "x"], "local engine")])
def test_cli_alternatives_refuses_text_output_flags(pair, tmp_path, capsys, flags, why):
    from apps.translate.__main__ import main

    inp = tmp_path / "in.txt"
    inp.write_text("a b\n")
    with pytest.raises(SystemExit) as e:
        main(["-i", str(inp), "--model", pair[0], "--alternatives", "2", *flags])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_topk_head_gives_the_same_top_n_up_to_its_k(peer, exported):
    """A top-k head asked for n tokens returns the true top n: the same alternatives as the logits head's."""
    _, dense, eos = peer
    topk = Engine(exported("llama", output="topk", std=0.3, seed=3))
    a = dense.alternatives(PROMPTS[0], [5], n=3, num_beams=2, max_new_tokens=6, eos_token_id=eos)
    b = topk.alternatives(PROMPTS[0], [5], n=3, num_beams=2, max_new_tokens=6, eos_token_id=eos)
    assert [x.token_id for x in a] == [x.token_id for x in b]
    np.testing.assert_allclose([x.logprob for x in a], [x.logprob for x in b], atol=1e-4)
    c = topk.alternatives(PROMPTS[0], [5], n=8, num_beams=2, max_new_tokens=6, eos_token_id=eos)
    d = dense.alternatives(PROMPTS[0], [5], n=8, num_beams=2, max_new_tokens=6, eos_token_id=eos)
    assert [x.token_id for x in c] == [x.token_id for x in d]
    assert [x.hypothesis.tokens for x in c] == [x.hypothesis.tokens for x in d]
