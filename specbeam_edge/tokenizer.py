"""Tokenizer of a model folder (`tokenizers`), chat templates (jinja2, as transformers renders them), and the
draft/target compatibility check."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .config import ModelFolderError


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        try:
            self._tok = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:
            raise ModelFolderError(f"{folder}/tokenizer.json: cannot be read ({e})") from None
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        self.prompt_format = self.config.get("prompt_format")
        self.folder = folder

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stable(self, ids) -> str:
        """Decode a token prefix, dropping a trailing partial UTF-8 character (so it stays a prefix)."""
        return self.decode(ids).rstrip("\ufffd")

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def format_prompt(self, source: str) -> str:
        """The model's fixed prompt format (e.g. translation), from tokenizer_config.json `prompt_format`."""
        return self.prompt_format.format(source=source) if self.prompt_format else source

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.folder}: tokenizer_config.json has no chat_template")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(msg):
            raise jinja2.exceptions.TemplateError(msg)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        special = {k: (v if isinstance(v, str) else (v or {}).get("content", ""))
                   for k, v in self.config.items() if k.endswith("_token")}
        return env.from_string(self.chat_template).render(messages=messages,
                                                         add_generation_prompt=add_generation_prompt, **special)


def check_compatible(target: Tokenizer, draft: Tokenizer, draft_vocab: int) -> None:
    """Every token id the draft can emit must map to the same string in the target's tokenizer."""
    bad = []
    for i in range(min(draft_vocab, draft.vocab_size)):
        a, b = draft.id_to_token(i), target.id_to_token(i)
        if a != b:
            bad.append((i, a, b))
            if len(bad) >= 3:
                break
    if bad:
        shown = "; ".join(f"id {i}: draft {a!r} vs target {b!r}" for i, a, b in bad)
        raise ModelFolderError(f"draft tokenizer ({draft.folder}) differs from the target's ({target.folder}): {shown}")
