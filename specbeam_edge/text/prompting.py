"""The Engine's prompts: texts put into a model folder's format (a chat model's template), conversations fitted to
the context, token ids checked, target prefixes and forced language tokens, and the request's end-of-sequence ids
(a part of `Engine`, generate.py, kept in a file of its own job)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..config import GenerationConfig, SpeculativeConfig
from ..search_setup import DEFAULT
from .tokenizer import PromptText, _chat_template


def check_text(text: str, what: str) -> None:
    """Refuse a text with a lone surrogate (an unpaired \\ud800-\\udfff escape, or an undecodable byte of a
    command-line argument): it has no UTF-8 spelling, and the tokenizer fails on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate at character {e.start} ({text[e.start]!r}): not valid "
                         f"text (an unpaired \\ud800-\\udfff escape or an undecodable byte); pass UTF-8 text") \
            from None


# a chat model's answers run this long unless its folder or the caller says otherwise: the search's own default of
# 128 cut a function in the middle (llama.cpp and Ollama generate until the end-of-text token)
CHAT_MAX_NEW_TOKENS = 512
# and search greedily, as chat tools do: 4 beams ran the coder pair at 6.5 instead of 10.1 tok/s
CHAT_DEFAULTS = {"num_beams": 1, "max_new_tokens": CHAT_MAX_NEW_TOKENS}


def has_chat_template(folder) -> bool:
    """Whether a model folder has a chat template, read without loading its tokenizer (the CLI picks a chat
    model's defaults before the engine loads); False where the folder cannot be read (the engine says why)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        return bool(_chat_template(folder, config if isinstance(config, dict) else {}))
    except (OSError, ValueError):       # ModelFolderError is a ValueError
        return False


class PromptMixin:
    """Engine's prompt handling; uses the engine's tokenizer, target, draft and encoder."""

    def model_generation(self) -> dict:
        """The model folder's generation settings, the defaults of every request (API, CLI, apps): a decoder-only
        chat model gets CHAT_DEFAULTS (greedy, up to 512 tokens) for what its folder does not name, as `specbeam
        chat` and `generate` do, not the search's 4 beams (translation's default) and 128 tokens."""
        own = dict(self.target.cfg.generation)
        chat = self.tokenizer is not None and self.tokenizer.chat_template and self.encoder is None
        return {**CHAT_DEFAULTS, **own} if chat else own

    def chat_prompt(self, messages: list[dict], room: int = 0) -> tuple[str, int]:
        """(the conversation in the model's chat template, how many of the earliest messages were left out): when
        it is longer than the context less `room` tokens (for the answer), the earliest messages are left out, a
        system message first in the list stays, and the kept history starts with a user message. A model without
        a chat template gets its prompt format around the last message alone (e.g. a translation model)."""
        tok = self.tokenizer
        if not tok.chat_template:
            return tok.format_prompt(messages[-1]["content"]), len(messages) - 1
        head = messages[:1] if messages and messages[0]["role"] == "system" else []
        msgs, left_out = messages[len(head):], 0
        fits = self.target.cfg.context_length - room
        while True:
            prompt = tok.apply_chat_template(head + msgs)
            if len(msgs) <= 1 or len(self.encode(prompt)) <= fits:
                return prompt, left_out
            msgs, left_out = msgs[1:], left_out + 1
            while len(msgs) > 1 and msgs[0]["role"] != "user":    # the history starts with a question
                msgs, left_out = msgs[1:], left_out + 1

    def prompt_text(self, text: str) -> PromptText:
        """A text in the model folder's own prompt format: a chat model's chat template (the text as one user
        message, and the assistant's turn opened), else tokenizer_config.json `prompt_format` (e.g. translation),
        else the text as it is."""
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return self.tokenizer.format_prompt(text)

    def chat(self, messages: list[dict], generation: GenerationConfig | None = None,
             speculative: SpeculativeConfig | str | None = DEFAULT, *, stream: bool = False, **overrides):
        """Answer a conversation (a list of {"role", "content"} messages, the last one the user's), as `specbeam
        chat` does: the messages in the model's chat template with the assistant's turn opened; when the
        conversation is longer than the context less room for the answer (max_new_tokens, at most a quarter of
        the context), the earliest messages are left out (see chat_prompt; Result.left_out says how many).
        Returns a Result (its text is the answer), or with stream=True an iterator of StreamChunk as `stream`
        gives (the last chunk carries the Result). Append {"role": "assistant", "content": result.text} to go on."""
        if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts; for one text, "
                            "use generate (it is put into the chat template as one user message)")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}")
        gen = self.generation_config(generation, **overrides)
        room = min(gen.max_new_tokens, self.target.cfg.context_length // 4)
        prompt, left_out = self.chat_prompt(list(messages), room=room)
        if stream:
            return self._chat_stream(prompt, gen, speculative, left_out)
        [result] = self.generate(prompt, gen, speculative)
        result.left_out = left_out
        return result

    def _chat_stream(self, prompt, gen, speculative, left_out):
        for chunk in self.stream(prompt, gen, speculative):
            if chunk.result is not None:
                chunk.result.left_out = left_out
            yield chunk

    def encode(self, prompt: str | list[int], src_lang: str | None = None, raw: bool = False) -> list[int]:
        """Token ids of a prompt. A text is put into the model folder's prompt format (a chat model's chat
        template as one user message, else tokenizer_config.json `prompt_format`, e.g. the translation pair's
        `<|endoftext|>{source}<|de|>`; see prompt_text) and encoded with the format's
        special tokens as tokens and the text as plain text, even where it spells a special token; a prompt
        built by `tokenizer.format_prompt` or `tokenizer.apply_chat_template` (a PromptText) is not formatted
        again. raw=True: the text is the model's input as written, special tokens included (a prompt formatted
        by hand). Encoder-decoder models: a text is the source as the model's tokenizer builds it (its EOS, and
        with src_lang the language code; encdec.Encoder.source_ids). Token ids are checked against the
        vocabulary and taken as they are."""
        if src_lang is not None and self.encoder is None:
            raise ValueError("src_lang is for encoder-decoder models (NLLB/M2M100); this is a decoder-only model")
        if isinstance(prompt, str):
            if not prompt:      # the format's tokens alone (or a source of EOS alone): junk, not a request
                raise ValueError("the prompt is empty; pass some text (or token ids)")
            check_text(prompt, "the prompt")
            if self.encoder is not None:
                ids = self.encoder.source_ids(prompt, self.tokenizer, src_lang)
            elif self.tokenizer is None:
                raise TypeError("this engine has no tokenizer: pass token ids")
            elif raw and not isinstance(prompt, PromptText):
                ids = self.tokenizer.encode(prompt, special_tokens=True)
            else:
                ids = self.tokenizer.encode_prompt(prompt if isinstance(prompt, PromptText)
                                                   else self.prompt_text(prompt))
        else:
            ids = self._token_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def _token_ids(self, prompt) -> list[int]:
        """A token-id prompt as a list of ints within the vocabulary (the encoder's for encoder-decoder models): a
        negative id would wrap around in the graph's Gather, one past the vocabulary fail inside onnxruntime."""
        if prompt is None or isinstance(prompt, (bytes, bytearray, memoryview, dict)):
            hint = ": decode bytes to a str first" if isinstance(prompt, (bytes, bytearray, memoryview)) else ""
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}{hint}")
        if isinstance(prompt, np.ndarray) and (prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer)):
            raise TypeError(f"a token-id prompt must be a 1-D integer array, got shape {prompt.shape} of "
                            f"{prompt.dtype}")
        try:
            items = list(prompt)
        except TypeError:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}") from None
        vocab = self.target.cfg.vocab_size
        if self.encoder is not None:
            vocab = int(self.target.cfg.raw.get("encoder_decoder", {}).get("source_vocab_size", vocab))
        for i, t in enumerate(items):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"token id {t!r} at position {i} is a {type(t).__name__}; token ids are ints")
            if not 0 <= t < vocab:
                raise ValueError(f"token id {int(t)} at position {i} is outside the model's vocabulary (0-{vocab - 1})")
        return [int(t) for t in items]

    # -- one request's search ------------------------------------------------------------------------------
    def _forced_bos(self, tgt_lang: str | None) -> int | None:
        """tgt_lang -> the forced BOS token (the target language code); None keeps the model's own."""
        if tgt_lang is None:
            return None
        if self.encoder is None:
            raise ValueError("tgt_lang is for encoder-decoder models (NLLB/M2M100); this is a decoder-only model")
        return self.encoder.language_id(tgt_lang, "tgt_lang")

    def decoder_start(self, ids: list[int], tgt_lang: str | None = None) -> list[int]:
        """The tokens the decoder reads before its first answer token: the prompt's `ids` for a decoder-only model,
        the decoder's own start (tgt_lang's forced BOS) for an encoder-decoder one (a target prefix follows it)."""
        if self.encoder is None:
            return list(ids)
        return self.encoder.decoder_prompt(self._forced_bos(tgt_lang))

    def prefix_ids(self, prefix) -> list[int]:
        """A target prefix as token ids: None or "" -> none; a text is encoded as plain target-side text (the
        decoder's tokenizer, no special tokens: the start of a translation as the model writes it); token ids
        are checked against the decoder's vocabulary."""
        if prefix is None or isinstance(prefix, str) and not prefix:
            return []
        if isinstance(prefix, str):
            check_text(prefix, "the target prefix")
            if self.tokenizer is None:
                raise TypeError("this engine has no tokenizer: pass the target prefix as token ids")
            return self.tokenizer.encode(prefix)
        if isinstance(prefix, (bytes, bytearray, memoryview, dict)) or not hasattr(prefix, "__iter__"):
            raise TypeError(f"a target prefix must be a string or a list of token ids, got {type(prefix).__name__}")
        items, vocab = list(prefix), self.target.cfg.vocab_size
        for i, t in enumerate(items):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"target prefix token {t!r} at position {i} is a {type(t).__name__}; token ids "
                                f"are ints")
            if not 0 <= t < vocab:
                raise ValueError(f"target prefix token {int(t)} at position {i} is outside the model's vocabulary "
                                 f"(0-{vocab - 1})")
        return [int(t) for t in items]

    def _eos_of(self, gen: GenerationConfig) -> list[int]:
        """The end-of-sequence ids a request stops on (its settings', else the model's)."""
        return self.eos if gen.eos_token_id is None else [int(t) for t in np.atleast_1d(gen.eos_token_id)]

    @property
    def _decode(self):
        """Token ids -> output text (text constraints match on it); None without a tokenizer."""
        return self.tokenizer.decode if self.tokenizer is not None else None

    @staticmethod
    def _per_prompt(values, n: int, name: str, entry: str, convert) -> list:
        """generate_iter's per-prompt arguments (target_prefix, constraints): None (convert(None) for every
        prompt) or one entry per prompt, each converted; an error names the prompt. entry: what an entry is,
        for the messages."""
        if values is None:
            values = [None] * n
        elif isinstance(values, (str, bytes, bytearray, dict)) or not hasattr(values, "__len__"):
            raise TypeError(f"{name} must be a list with one {entry} per prompt, got {type(values).__name__}")
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts (one {entry} per prompt)")
        out = []
        for i, v in enumerate(values):
            try:
                out.append(convert(v))
            except (TypeError, ValueError) as e:
                if n == 1:
                    raise
                raise type(e)(f"prompt {i}: {e}") from None
        return out

    def _lead(self, prefix: list[int], forced_bos: int | None) -> list[int]:
        """The tokens a hypothesis starts with that its search counts as prompt: with a target prefix, the
        forced BOS (encoder-decoder models) and the prefix; none without one (a forced BOS then counts as
        generated, and the search's own hypotheses hold it)."""
        if not prefix:
            return []
        return (self.encoder.decoder_prompt(forced_bos)[1:] if self.encoder is not None else []) + prefix
