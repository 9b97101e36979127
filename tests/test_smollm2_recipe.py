"""The SmolLM2 draft recipe's pure parts (models/smollm2/draft.py): everyday prompts from WordNet's concordance
counts, and a saved draft read back as a starting point (the warm start of `train --init`)."""
from __future__ import annotations

import json
import random

import pytest

from models.smollm2 import draft as recipe


def _cntlist(folder):
    rows = ["apple%1:13:00:: 1 2", "bread%1:13:00:: 1 5", "ice_cream%1:13:00:: 1 1", "Paris%1:15:00:: 1 9",
            "owl%1:05:00:: 1 1", "hammer%1:06:00:: 1 4", "anvil%1:06:00:: 1 1", "run%2:38:00:: 1 40",
            "anger%1:12:00:: 1 7", "x-ray%1:19:00:: 1 6", "house%1:06:00:: 1 30", "doctor%1:18:00:: 1 12",
            "umbrella%1:06:00:: 1 3"]
    (folder / "usr").mkdir()
    (folder / "usr" / "cntlist.rev").write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_general_prompts_take_common_nouns_of_the_kinds_named(tmp_path):
    _cntlist(tmp_path)
    prompts = recipe.general_prompts(tmp_path, random.Random(0), per_kind=5)
    text = "\n".join(prompts)
    for word in ("apple", "bread", "ice cream", "owl", "hammer", "house", "umbrella", "anger", "doctor"):
        assert word in text, word
    # too rare outside food/animal/plant, a proper noun, a verb sense, a non-alphabetic lemma: never asked about
    for word in ("anvil", "Paris", "run", "x-ray"):
        assert f" {word}" not in text, word
    assert "an owl" in text or "an umbrella" in text or "an apple" in text
    assert not any("a apple" in p or "a owl" in p or "a umbrella" in p for p in prompts)
    assert any("Python" in p for p in prompts) and any("dollars" in p for p in prompts)
    assert len(set(prompts)) > 0.8 * len(prompts)


def test_held_out_prompts_never_enter_the_prompt_file(tmp_path, monkeypatch):
    from bench.llamacpp import PROMPTS
    from models.smollm2 import prompts

    monkeypatch.setattr(prompts, "_download", lambda work: (None, None, None))
    monkeypatch.setattr(prompts, "chatterbot_questions", lambda wheel: [PROMPTS[0], "Hello there?"])
    monkeypatch.setattr(prompts, "doc_prompts", lambda docs, rng: [PROMPTS[3].upper(), "Summarize this."])
    monkeypatch.setattr(prompts, "general_prompts", lambda wn, rng: ["Explain tea in simple terms.", "Hello there?"])
    recipe.build_prompts(type("A", (), {"work": str(tmp_path)}))
    got = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert sorted(got) == sorted(["Hello there?", "Summarize this.", "Explain tea in simple terms."])


def test_a_saved_draft_is_read_back_as_it_was_written(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.helpers import make_hf_model

    def target():
        return make_hf_model(tmp_path / "t", layers=4, hidden=64, vocab=320, tied=True, seed=3)

    token_ids = list(range(0, 320, 3))
    first = recipe.Draft(target(), [0, 2], token_ids)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(torch.randn_like(p) * 0.05)           # differ from the target's layers: a trained draft
    recipe.write_weights({"draft": first.state(), "token_ids": token_ids}, tmp_path / "d")
    (tmp_path / "d" / "train_log.json").write_text(json.dumps({"layers_from_target": [0, 2]}))
    init = recipe._saved_draft(tmp_path / "d")
    assert init["token_ids"] == token_ids and init["layers"] == "0,2"
    second = recipe.Draft(target(), [int(i) for i in init["layers"].split(",")], init["token_ids"])
    second.load(init["draft"])
    mine = dict(first.model.named_parameters()) | {"head": first.head.weight}
    back = dict(second.model.named_parameters()) | {"head": second.head.weight}
    for name, p in mine.items():
        assert torch.equal(back[name], p.detach().half().float()) or name == "model.embed_tokens.weight", name
    assert torch.equal(back["model.embed_tokens.weight"], mine["model.embed_tokens.weight"])   # the target's
    x = torch.tensor([[1, 5, 9, 33]])
    am = torch.ones_like(x)
    rows = torch.arange(4)
    with torch.no_grad():
        assert torch.allclose(first.logits(x, am, rows), second.logits(x, am, rows), atol=2e-2)


def test_a_grown_head_keeps_the_saved_rows_and_takes_new_ones_from_the_embedding(tmp_path):
    torch = pytest.importorskip("torch")
    from tests.helpers import make_hf_model

    model = make_hf_model(tmp_path / "t", layers=2, hidden=64, vocab=320, tied=True, seed=4)
    saved = recipe.Draft(model, [1], [3, 7, 11])
    with torch.no_grad():
        saved.head.weight.mul_(-2.0)
    grown = recipe.Draft(make_hf_model(tmp_path / "u", layers=2, hidden=64, vocab=320, tied=True, seed=4),
                         [1], [3, 5, 7, 11, 200])
    grown.load(saved.state(), head_tokens=[3, 7, 11])
    emb = grown.model.model.embed_tokens.weight
    for j, t in enumerate([3, 5, 7, 11, 200]):
        want = saved.head.weight[[3, 7, 11].index(t)] if t in (3, 7, 11) else emb[t]
        assert torch.equal(grown.head.weight[j], want), t
    with pytest.raises(KeyError):
        grown.load(saved.state(), head_tokens=[3, 7, 12])
