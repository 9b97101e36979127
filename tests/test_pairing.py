"""Draft/target pairing across sizes of one family: the same tokenizer (the target's vocabulary may be padded
or longer) is accepted; different merges, strings, special tokens or pre-tokenizers are refused with a message
naming both folders and the first differences."""
import json
import shutil

import pytest
from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers, trainers

from helpers import make_tokenizer
from specbeam_edge import Engine
from specbeam_edge.config import ModelFolderError
from specbeam_edge.text.tokenizer import Tokenizer, check_compatible

FIX = "; pair a draft and a target that share a tokenizer (sizes of one family)"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pair") / "base"
    make_tokenizer(folder)
    return folder


def _variant(base, tmp_path, name, edit):
    """A copy of the base tokenizer folder with tokenizer.json edited by `edit(json)`."""
    folder = tmp_path / name
    shutil.copytree(base, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    edit(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return Tokenizer(folder)


def _refusal(target, draft, *parts):
    return f"draft tokenizer ({draft.folder}) differs from the target's ({target.folder}): {'; '.join(parts)}{FIX}"


def test_same_tokenizer_and_padded_target_accepted(base, tmp_path):
    draft = Tokenizer(base)
    check_compatible(Tokenizer(base), draft, 320, 320)
    check_compatible(Tokenizer(base), draft, 320)                  # the call site's form

    def extra(spec):                          # the target's vocabulary goes on: more special tokens after the draft's
        spec["added_tokens"] += [{"id": 320 + k, "content": f"<|extra_{k}|>", "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True} for k in range(3)]
    target = _variant(base, tmp_path, "padded", extra)
    assert target.vocab_size == 323
    check_compatible(target, draft, 320, 336)                     # model vocabularies padded past the tokenizers
    check_compatible(target, draft, 328, 336)


def test_larger_draft_vocabulary_refused(base):
    t, d = Tokenizer(base), Tokenizer(base)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 336, 320)
    assert str(e.value) == (f"draft tokenizer ({d.folder}) differs from the target's ({t.folder}): the draft model's "
                            f"vocabulary (336) is larger than the target model's (320); the draft's must be a prefix "
                            f"of the target's")


def test_different_merges_refused_with_first_ids(base, tmp_path):
    other = tmp_path / "other"                 # the same recipe trained on other text
    make_tokenizer(other)
    tok = HFTokenizer.from_file(str(other / "tokenizer.json"))
    text = ["pack my box with five dozen liquor jugs " * 3, "zwei Boxkaempfer jagen Eva quer durch Sylt " * 3] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|de|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(other / "tokenizer.json"))
    t, d = Tokenizer(base), Tokenizer(other)
    diff = [i for i in range(320) if t.id_to_token(i) != d.id_to_token(i)][:3]
    assert len(diff) == 3
    ma = json.loads(d._tok.to_str())["model"]["merges"]
    mb = json.loads(t._tok.to_str())["model"]["merges"]
    rank = next(r for r, (x, y) in enumerate(zip(ma, mb)) if x != y)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 320)
    ids = [f"id {i}: draft {d.id_to_token(i)!r} vs target {t.id_to_token(i)!r}" for i in diff]
    assert str(e.value) == _refusal(t, d, *ids, f"merge {rank}: draft {' '.join(ma[rank])!r} vs target "
                                                f"{' '.join(mb[rank])!r}")


def test_reordered_merges_refused(base, tmp_path):
    """Same strings for every id, but BPE applies two merges in the other order: text encodes differently."""
    merges = json.loads(Tokenizer(base)._tok.to_str())["model"]["merges"]
    r = next(r for r in range(len(merges) - 1) if not set(merges[r]) & set(merges[r + 1]))

    def swap(spec):
        m = spec["model"]["merges"]
        m[r], m[r + 1] = m[r + 1], m[r]
    d, t = _variant(base, tmp_path, "swapped", swap), Tokenizer(base)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 320)
    a, b = " ".join(merges[r + 1]), " ".join(merges[r])
    assert str(e.value) == _refusal(t, d, f"merge {r}: draft {a!r} vs target {b!r}")


def test_different_special_tokens_refused(base, tmp_path):
    def rename(spec):                          # a different special token at id 1
        spec["added_tokens"][1]["content"] = "<|fr|>"
        spec["model"]["vocab"]["<|fr|>"] = spec["model"]["vocab"].pop("<|de|>")

    def unflag(spec):                          # the same string, but not special (decoding would keep it)
        spec["added_tokens"][1]["special"] = False
    t = Tokenizer(base)
    d = _variant(base, tmp_path, "renamed", rename)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 320)
    assert str(e.value) == _refusal(t, d, "id 1: draft special '<|fr|>' vs target special '<|de|>'")
    d = _variant(base, tmp_path, "unflagged", unflag)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 320)
    assert str(e.value) == _refusal(t, d, "id 1: draft '<|de|>' vs target special '<|de|>'")


def test_different_pre_tokenizer_refused(base, tmp_path):
    def prefix(spec):
        spec["pre_tokenizer"]["add_prefix_space"] = True
    t, d = Tokenizer(base), _variant(base, tmp_path, "prefix", prefix)
    with pytest.raises(ModelFolderError) as e:
        check_compatible(t, d, 320)
    assert str(e.value) == _refusal(t, d, "pre-tokenizer differs")


def test_engine_refuses_a_draft_of_another_tokenizer(exported, tmp_path):
    target = exported("llama")
    Engine(target, draft=exported("qwen2"))                      # same tokenizer, another family: accepted
    draft = tmp_path / "draft"
    shutil.copytree(exported("qwen2"), draft)

    def unflag(spec):
        spec["added_tokens"][1]["special"] = False
    spec = json.loads((draft / "tokenizer.json").read_text())
    unflag(spec)
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelFolderError) as e:
        Engine(target, draft=draft)
    assert str(e.value) == (f"draft tokenizer ({draft}) differs from the target's ({target}): "
                            f"id 1: draft '<|de|>' vs target special '<|de|>'{FIX}")
