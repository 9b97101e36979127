"""bench/llamacpp.py: the pure parts (prompt ids from the chat template, EOS handling, agreement counting,
medians) without llama-cpp-python; one slow test runs both engines on a tiny GGUF written here."""
import json

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from bench import llamacpp
from specbeam_edge.text.tokenizer import Tokenizer as SbTokenizer

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chatml")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["What is the capital of France? You are a helpful assistant. system user"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": CHATML}))
    return SbTokenizer(folder)


def test_prompt_ids_are_the_rendered_template_with_its_special_tokens(chatml):
    ids = llamacpp.prompt_ids(chatml, "What is the capital of France?")
    start, end = (chatml.encode(t, special_tokens=True) for t in ("<|im_start|>", "<|im_end|>"))
    assert len(start) == len(end) == 1
    assert ids.count(start[0]) == 3 and ids.count(end[0]) == 2      # system, user, assistant prompt
    assert chatml.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of "
        "France?<|im_end|>\n<|im_start|>assistant\n")


def test_user_text_that_spells_a_special_token_stays_text(chatml):
    ids = llamacpp.prompt_ids(chatml, "say <|im_end|> please")
    end = chatml.encode("<|im_end|>", special_tokens=True)[0]
    assert ids.count(end) == 2                                        # the template's two, not the user's


def test_generated_stops_at_the_first_eos_and_counts_it():
    assert llamacpp.generated([5, 6, 2, 7], eos=[2]) == ([5, 6], 3)
    assert llamacpp.generated([5, 6, 7], eos=[2, 0]) == ([5, 6, 7], 3)
    assert llamacpp.generated([0], eos=[2, 0]) == ([], 1)


def test_first_difference_and_agreement():
    f = llamacpp.first_difference
    assert f([1, 2, 3], [1, 2, 3]) is None
    assert f([1, 2, 3], [1, 9, 3]) == 1
    assert f([1, 2], [1, 2, 3]) == 2 and f([1, 2, 3], [1, 2]) == 2   # one stopped earlier (EOS)
    assert f([], []) is None and f([], [4]) == 0
    a = llamacpp.agreement([[1, 2], [3, 4], [5]], [[1, 2], [3, 5], [5, 6]])
    assert a == {"identical": 1, "of": 3, "first_difference": {"1": 1, "2": 1}}
    with pytest.raises(ValueError):
        llamacpp.agreement([[1]], [])


def test_summarize_takes_the_median_of_per_prompt_ratios():
    s = llamacpp.summarize({"llama.cpp": [10.0, 20.0, 40.0], "specbeam int8": [20.0, 10.0, 60.0]}, "llama.cpp")
    assert s["median_tokens_per_second"] == {"llama.cpp": 20.0, "specbeam int8": 20.0}
    assert s["median_ratio_over_llama.cpp"] == {"specbeam int8": 1.5}     # ratios 2.0, 0.5, 1.5


def test_the_prompts_are_distinct_instructions():
    assert len(llamacpp.PROMPTS) == 24 and len(set(llamacpp.PROMPTS)) == 24
    assert all(8 <= len(p) <= 120 for p in llamacpp.PROMPTS)


@pytest.mark.slow
def test_both_engines_on_a_tiny_gguf(tmp_path):
    """A tiny random Llama written as an F32 GGUF: llama.cpp and our fp32 export of it, greedy; both produce
    tokens, the report has its fields, and most sequences agree (same fp32 weights)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
    pytest.importorskip("gguf")
    import gguf as gg
    import torch

    from export.core import export
    from helpers import make_hf_model
    from test_gguf import write_gguf

    src = tmp_path / "hf"
    torch.manual_seed(0)
    model = make_hf_model(src, "llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(src, model, path, "llama", qtype=gg.GGMLQuantizationType.F32)
    sb = tmp_path / "sb"
    export(path, sb, precision="fp32", output="both", quiet=True)
    data = llamacpp.bench(path, {"fp32": sb}, n_prompts=3, max_new=8, threads=1, lookup=4)
    assert set(data["tokens_per_second"]) == {"llama.cpp", "specbeam fp32", "llama.cpp lookup",
                                              "specbeam fp32 lookup"}
    assert all(n > 0 for v in data["generated_tokens"].values() for n in v)
    agree = data["greedy_agreement_with_llama_cpp"]["specbeam fp32"]
    assert agree["of"] == 3 and agree["identical"] >= 2
    # prompt-lookup speculation: ours gives its plain output; llama.cpp's is reported, whatever it is
    assert data["lookup_equals_own_plain"]["specbeam fp32"]["identical"] == 3
    assert data["lookup_equals_own_plain"]["llama.cpp"]["of"] == 3
    llamacpp.plot(data, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_divergence_reports_both_tokens_under_our_model():
    from types import SimpleNamespace as NS

    asked = {}

    class Fake:
        def generate(self, ids, **kw):
            asked.update(ids=ids, **kw)
            hyps = [NS(tokens=[7], score=-0.51), NS(tokens=[9], score=-0.53), NS(tokens=[3], score=-4.0)]
            return [NS(hypotheses=hyps)]

    d = llamacpp.divergence(Fake(), [1, 2], [5, 7, 8], [5, 9], at=1)
    assert asked["ids"] == [1, 2, 5] and asked["num_beams"] == asked["num_return_sequences"] == 4
    assert asked["length_penalty"] == 0.0 and asked["max_new_tokens"] == 1
    assert d == {"position": 1, "ours": 7, "theirs": 9, "ours_logprob": -0.51, "theirs_logprob": -0.53,
                 "theirs_in_our_top4": True}
    assert llamacpp.divergence(Fake(), [1], [5], [5, 6], at=1) is None      # ours ended there (max length)
