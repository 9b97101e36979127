"""Hostile chat templates and prompt formats (issue 50 rows 3, 19, 21): rendered within time and output limits,
every failure one line naming the template, in the API and the CLI."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_tokenizer
from specbeam_edge.config import ModelFolderError
from specbeam_edge.text.chat_template import ChatTemplateError
from specbeam_edge.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "mro": "{{ ''.__class__.__mro__ }}",
    "globals": "{{ cycler.__init__.__globals__ }}",
    "format": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "append": "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "raise": "{{ raise_exception('roles must alternate user/assistant/user/assistant') }}",
    "include": "{% include '/etc/passwd' %}",
    "undefined": "{{ nothing.here.at_all }}",
    "range": "{% for i in range(10**9) %}{% endfor %}",
    "multiply": "{{ 'a' * 300000000 }}",
    "power": "{{ 3 ** 100000000 > 1 }}",
    "center": "{{ 'a'.center(900000000) }}",
    "filter": "{{ 'a'|center(900000000) }}",
    "percent": "{{ '%0900000000d' % 1 }}",
    "width": "{{ '{:>900000000}'.format(1) }}",
    "output": "{% for i in range(99999) %}{{ messages|tojson }}{{ 'x' * 90000 }}{% endfor %}",
}


def _tokenizer(tmp_path, template: str) -> Tokenizer:
    make_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps({**cfg, "chat_template": template}))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_fail_in_one_line_naming_the_template(tmp_path, name):
    """Before: raw SecurityError / TemplateError / OverflowError tracebacks, or a 300 MB prompt that aborted the
    process in the tokenizer."""
    tok = _tokenizer(tmp_path, HOSTILE[name])
    with pytest.raises(ChatTemplateError) as e:
        tok.apply_chat_template(HI)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "tokenizer_config.json") in message, message
    assert "the chat template" in message and len(message) < 600


def test_unsafe_attributes_render_as_nothing(tmp_path):
    tok = _tokenizer(tmp_path, "[{{ lipsum.__globals__ }}]{{ messages[0].content }}")
    assert tok.apply_chat_template(HI) == "[]hi"


def test_a_template_that_spins_is_stopped(tmp_path, monkeypatch):
    """Before: nested range(99999) loops spun until the process was killed."""
    from specbeam_edge.text import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    tok = _tokenizer(tmp_path, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
                               "{{ messages[0].content }}")
    with pytest.raises(ChatTemplateError, match="did not finish rendering within 0.5 s"):
        tok.apply_chat_template(HI)
    # the same render on a variable that is already built (no call for a hook to see) is stopped too
    tok = _tokenizer(tmp_path, "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="did not finish"):
        tok.apply_chat_template(HI)


def test_ordinary_templates_still_render(tmp_path):
    tok = _tokenizer(tmp_path, "{% for m in messages %}{{ m.role }}: {{ m.content|trim }}{{ '=' * 3 }}"
                               "{{ '%5d' % 7 }}{{ '{:>4}'.format(loop.index) }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    assert tok.apply_chat_template(HI) == "user: hi===    7   1\nassistant:"


def test_cli_generate_with_a_spinning_template_is_one_line(exported, tmp_path):
    """Before: `specbeam generate --model F hi` spun forever (killed here by the timeout: the test fails)."""
    model = tmp_path / "model"
    shutil.copytree(exported("llama", std=0.3, seed=3), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = "import sys; from specbeam_edge.text import chat_template; chat_template.RENDER_SECONDS = 1.0; " \
           "from specbeam_edge.commands.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "generate", "hi", "--model", str(model)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"specbeam: error: {model / 'tokenizer_config.json'}: the chat template did not "
                                  f"finish rendering within 1 s")


def test_terminal_chat_reports_a_template_error_and_goes_on(exported, tmp_path, monkeypatch, capsys):
    """Before: `specbeam chat` ended with a TemplateError traceback."""
    import io

    from specbeam_edge.commands.cli import main

    model = tmp_path / "model"
    shutil.copytree(exported("llama", std=0.3, seed=3), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}"
                            "{{ messages[0].content }}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\nagain\n")))
    assert main(["chat", "--model", str(model), "--max_new_tokens", "2", "--num_beams", "1"]) == 0
    err = capsys.readouterr().err
    assert "chat: that message was not sent: " in err and "only one message (TemplateError)" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("fmt", ["{source:>200000000}", "{source!r}", "<s>{source!s}</s>", "{source:^10}"])
def test_prompt_format_with_a_spec_or_conversion_is_refused_at_load(tmp_path, fmt):
    """Before: `{source:>200000000}` made a 200 MB prompt (the tokenizer aborted the process, rc 134) and
    `{source!r}` put quotes around every prompt."""
    make_tokenizer(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg_path.write_text(json.dumps({**cfg, "prompt_format": fmt}))
    with pytest.raises(ModelFolderError, match="the {source} field takes no conversion or format spec") as e:
        Tokenizer(tmp_path)
    assert "\n" not in str(e.value)
