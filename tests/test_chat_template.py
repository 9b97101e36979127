"""Chat templates render exactly as transformers' `apply_chat_template(add_generation_prompt=True)`; a bad
tokenizer_config.json or a missing template gives a clear error."""
import json

import pytest

from helpers import make_tokenizer
from specbeam_edge.config import ModelFolderError
from specbeam_edge.text.tokenizer import Tokenizer

# Representative templates of the families (written here: nothing is downloaded)
CHATML = (  # Qwen-style ChatML with a default system prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (  # bos_token, a dated system header (strftime_now), loop controls, tojson
    "{{- bos_token }}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{%- if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- if message.get('meta') %}{{- message['meta'] | tojson }}{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA = (  # the system prompt folded into the first user turn; roles checked with raise_exception
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + "
    "'\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Answer in French. « Non-ASCII » & <html>"},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello! "},
     {"role": "user", "content": "one more\nline", "meta": {"k": "é", "n": [1, 2]}}],
]


def _folder(tmp_path, name, where="config", bos="<|endoftext|>"):
    folder = tmp_path / name
    make_tokenizer(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    cfg["bos_token"] = {"__type": "AddedToken", "content": bos, "special": True}   # as the Hub stores them
    if where == "config":
        cfg["chat_template"] = TEMPLATES[name]
    elif where == "list":
        cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATES[name]}]
    else:
        (folder / "chat_template.jinja").write_text(TEMPLATES[name])
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("where", ["config", "jinja", "list"])
def test_rendering_equals_transformers(tmp_path, name, where):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, name, where)
    ours, ref = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for conv in CONVERSATIONS:
        want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conv) == want
        assert ours.apply_chat_template(conv, add_generation_prompt=False) == ref.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=False)
    assert "<|endoftext|>" in ours.apply_chat_template(CONVERSATIONS[0]) or name == "chatml"


def test_template_errors_surface(tmp_path):
    from specbeam_edge.text.tokenizer import ChatTemplateError

    tok = Tokenizer(_folder(tmp_path, "gemma"))
    with pytest.raises(ChatTemplateError, match="alternate") as e:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert "the chat template failed" in str(e.value) and "\n" not in str(e.value)


def test_no_template_is_a_clear_error(tmp_path):
    folder = tmp_path / "plain"
    make_tokenizer(folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template .*plain-text prompt"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_invalid_tokenizer_config_names_the_file(tmp_path):
    folder = tmp_path / "bad"
    make_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"bad/tokenizer_config.json: not valid JSON"):
        Tokenizer(folder)
