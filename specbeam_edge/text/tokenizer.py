"""Tokenizer of a model folder (`tokenizers`), prompts in the folder's format (chat templates rendered by
chat_template.py), the check of a tokenizer against its model, and the draft/target compatibility check.

Text never becomes control tokens by spelling one: `encode` reads `<|im_start|>` or `</s>` in a text as the
characters they are. Special tokens come only from where a prompt format puts them: `format_prompt` and
`apply_chat_template` return a `PromptText`, the prompt string that also knows which of its parts are the
format's special tokens, and `encode_prompt` encodes those as tokens and everything else, the user's text
included, as plain text."""
from __future__ import annotations

import functools
import json
import re
import string
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from ..config import ModelFolderError, inside
from ..contract import file_sha256, read_json_object
from .chat_template import ChatTemplateError, compile_template, render


class PromptText(str):
    """A prompt built from the folder's format: the string, and `parts`, (text, is_special) pairs that make it up.
    Engine.encode/generate encode it with `Tokenizer.encode_prompt` and never format it again. String operations
    on it (slicing, +) return plain str, which the engine treats as text to be formatted."""

    def __new__(cls, parts):
        parts = tuple(_merge_plain((t, bool(sp)) for t, sp in parts))   # plain parts merged: one text
        self = super().__new__(cls, "".join(t for t, _ in parts))
        self.parts = parts
        return self

    def __reduce__(self):            # pickles (Ray actors) as a PromptText, not as a str
        return PromptText, (self.parts,)


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        tokens = inside(folder, "tokenizer.json")
        try:
            self._tok = _HFTokenizer.from_file(str(tokens))
        except Exception as e:
            raise ModelFolderError(f"{folder}/tokenizer.json: cannot be read ({e})") from None
        self.config = _read_json(inside(folder, "tokenizer_config.json"))
        self.special_tokens = _special_tokens(self.config, _read_json(inside(folder, "special_tokens_map.json")))
        self.chat_template = _chat_template(folder, self.config)
        self.chat_template_file = folder / ("chat_template.jinja" if (folder / "chat_template.jinja").is_file()
                                            else "tokenizer_config.json")
        self.folder = folder
        self.prompt_format = self.config.get("prompt_format")
        specials = sorted({t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content},
                          key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        # what a chat message must not bring into a template: a special token's spelling, or a marker character
        self._hide_re = re.compile("|".join([_MARKED.pattern, *map(re.escape, specials)]))
        self._format = _parse_format(self.prompt_format, folder, self._split_specials)

    @functools.cached_property
    def _plain(self) -> _HFTokenizer:
        """The same tokenizer with special-token matching off: text spelling one stays text (a second instance:
        the flag is per tokenizer, and engines are shared across threads)."""
        tok = _HFTokenizer.from_file(str(self.folder / "tokenizer.json"))
        tok.encode_special_tokens = True
        return tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special_tokens: bool = False) -> list[int]:
        """Token ids of a text. Special tokens spelled in it are plain text unless special_tokens=True (a prompt
        written out by hand, format and all: `generate(..., raw=True)`); a PromptText is encoded by its parts
        (`encode_prompt`)."""
        if isinstance(text, PromptText) and not special_tokens:
            return self.encode_prompt(text)
        return (self._tok if special_tokens else self._plain).encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a prompt: a PromptText's format parts as special tokens, its other parts (the user's text)
        as plain text; any other string as plain text."""
        if not isinstance(prompt, PromptText):
            return self.encode(prompt)
        ids: list[int] = []
        for k, (text, special) in enumerate(prompt.parts):
            if special or k == 0 or self._special_re is None or self._special_re.search(text):
                ids += (self._tok if special else self._plain).encode(text, add_special_tokens=False).ids
                continue
            # text after a special token: encoded behind it, as the whole string would be (a Metaspace
            # pre-tokenizer with prepend_scheme "first" adds no "▁" there; an rstrip token eats the spaces)
            before = prompt.parts[k - 1][0]
            n = len(self._tok.encode(before, add_special_tokens=False).ids)
            ids += self._tok.encode(before + text, add_special_tokens=False).ids[n:]
        return ids

    def _split_specials(self, text: str) -> list[tuple[str, bool]]:
        """A format's literal text as (text, is_special) parts: where it spells a special token, that token."""
        if self._special_re is None:
            return [(text, False)]
        parts, at = [], 0
        for m in self._special_re.finditer(text):
            parts += [(text[at:m.start()], False), (m.group(), True)]
            at = m.end()
        return parts + [(text[at:], False)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stable(self, ids) -> str:
        """Decode a token prefix, dropping a trailing partial UTF-8 character (so it stays a prefix)."""
        return self.decode(ids).rstrip("\ufffd")

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def format_prompt(self, source: str) -> PromptText:
        """The model's fixed prompt format (e.g. translation), from tokenizer_config.json `prompt_format`; the
        source stays plain text even where it spells a special token."""
        if not isinstance(source, str):
            raise TypeError(f"the source must be a string, got {type(source).__name__}")
        fmt = string.Formatter()
        parts = []
        for literal, field, spec, conv in self._format:
            parts += literal
            if field is not None:
                parts.append((fmt.format_field(fmt.convert_field(str(source), conv), spec), False))
        return PromptText(parts)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the conversation as transformers' `apply_chat_template(tokenize=False)` does: the same jinja2
        environment (trim/lstrip blocks, loopcontrols, JSON `tojson`, `raise_exception`, `strftime_now`) and the
        special tokens (`bos_token`, `eos_token`, ...) as variables; extra kwargs (e.g. enable_thinking) too."""
        if not self.chat_template:
            raise ValueError(f"{self.folder}: no chat template (neither chat_template in tokenizer_config.json nor "
                             f"chat_template.jinja); use a plain-text prompt or add a template to the folder")
        # Each special-token spelling in a message (and each marker character) is replaced by a marker before
        # rendering, so that the rendered special tokens are the template's own; the markers then become the
        # plain text they stand for. The string is the one transformers renders.
        originals: list[str] = []

        def hide(text):
            if not isinstance(text, str):
                return text
            def mark(m):
                originals.append(m.group())
                return f"{_OPEN}{len(originals) - 1}{_CLOSE}"
            return self._hide_re.sub(mark, text)

        def hidden(message):
            if not isinstance(message, dict):
                return message
            m = dict(message)
            if isinstance(m.get("content"), list):
                m["content"] = [{**c, "text": hide(c["text"])} if isinstance(c, dict) and "text" in c else c
                                for c in m["content"]]
            else:
                m["content"] = hide(m.get("content"))
            return m
        where = f"{self.chat_template_file}: the chat template"
        try:
            template = compile_template(self.chat_template)
        except ModelFolderError as e:
            raise ChatTemplateError(f"{where}: {str(e).removeprefix('chat template: ')}; fix the template or "
                                    f"put the model's own back") from None
        rendered = render(template, where, dict(messages=[hidden(m) for m in messages],
                                                 tools=kwargs.pop("tools", None),
                                                 documents=kwargs.pop("documents", None),
                                                 add_generation_prompt=add_generation_prompt,
                                                 **{**self.special_tokens, **kwargs}))
        parts = []
        for text, special in self._split_specials(rendered):
            if special:
                parts.append((text, True))
                continue
            at = 0
            for m in _MARKER.finditer(text):
                parts += [(text[at:m.start()], False), (originals[int(m.group(1))], False)]
                at = m.end()
            parts.append((text[at:], False))
        return PromptText(_merge_plain(parts))


# private-use characters mark a message's special-token spellings while a chat template renders
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKED = re.compile(f"[{_OPEN}{_CLOSE}]")
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


def _merge_plain(parts):
    out = []
    for text, special in parts:
        if out and not special and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        elif text:
            out.append((text, special))
    return out


def _parse_format(fmt, folder: Path, split) -> list:
    """tokenizer_config.json `prompt_format` as [(literal parts, field, spec, conversion)]; its only field is
    {source}. None (no format): the source alone."""
    if fmt is None:
        return [([], "source", "", None)]
    where = f"{folder / 'tokenizer_config.json'}: prompt_format {fmt!r}"
    if not isinstance(fmt, str):
        raise ModelFolderError(f"{where} must be a string with a {{source}} field")
    try:
        items = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise ModelFolderError(f"{where} is not a valid format string ({e}); write literal braces as "
                               f"{{{{ }}}}") from None
    out = []
    for literal, field, spec, conv in items:
        if field is not None and field != "source":
            raise ModelFolderError(f"{where} has the field {{{field}}}; the only field filled in is {{source}}")
        if spec and "{" in spec:
            raise ModelFolderError(f"{where}: nested fields are not supported")
        if field is not None and (conv or spec):
            # `{source!r}` puts quotes into the prompt, `{source:>200000000}` a 200 MB prompt (the tokenizer aborts)
            raise ModelFolderError(f"{where}: the {{source}} field takes no conversion or format spec "
                                   f"({'!' + conv if conv else ':' + spec}); write it as {{source}}")
        out.append((split(literal) if literal else [], field, spec or "", conv))
    return out


def check_vocabulary(tokenizer: "Tokenizer", cfg) -> None:
    """The folder's tokenizer.json belongs to its model: no id at or past the model's vocabulary (the graph has
    no row for it: an added special token past it would crash or wrap), a vocabulary no smaller than the model's
    beyond the usual padding (model vocabularies are padded to a multiple of 64 or so, Qwen by a few hundred ids),
    and, for folders exported with it, the SHA-256 the exporter recorded (another model's tokenizer of the same
    size). cfg: the folder's ModelConfig. Raises ModelFolderError with the fix."""
    where = f"{cfg.folder}/tokenizer.json"
    tok = tokenizer._tok
    added = tok.get_added_tokens_decoder()
    top = max([tok.get_vocab_size(with_added_tokens=False) - 1, *added])
    if top >= cfg.vocab_size:
        name = f" ({added[top].content!r})" if top in added else ""
        raise ModelFolderError(f"{where}: has token id {top}{name}, but the model's vocabulary is {cfg.vocab_size} "
                               f"ids (0-{cfg.vocab_size - 1}): it is not this model's tokenizer; re-export the model "
                               f"or put its own tokenizer.json back")
    slack = max(256, cfg.vocab_size // 32)
    if tokenizer.vocab_size < cfg.vocab_size - slack:
        raise ModelFolderError(f"{where}: has {tokenizer.vocab_size} tokens, the model's vocabulary is "
                               f"{cfg.vocab_size} (more than padding): it is not this model's tokenizer; re-export "
                               f"the model or put its own tokenizer.json back")
    want = cfg.raw.get("tokenizer_sha256")
    if isinstance(want, str):
        if file_sha256(cfg.folder / "tokenizer.json") != want:
            raise ModelFolderError(f"{where}: is not the tokenizer the model was exported with (its SHA-256 differs "
                                   f"from specbeam_config.json's tokenizer_sha256); put the exported file back, "
                                   f"re-export, or delete tokenizer_sha256 from the config if the change is "
                                   f"deliberate")


def _read_json(path: Path) -> dict:
    return read_json_object(path, ModelFolderError, {}, fix="fix or remove the file")


def _token_text(v) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    return v.get("content") if isinstance(v, dict) else None


_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict, legacy_map: dict) -> dict:
    out = {}
    for k in _SPECIAL:
        v = _token_text(config.get(k, legacy_map.get(k)))
        if v is not None:
            out[k] = v
    return out


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json (transformers saves it there since v4.50); a list of
    named templates yields the one named "default"."""
    jinja = inside(folder, "chat_template.jinja")
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t


def check_compatible(target: Tokenizer, draft: Tokenizer, draft_vocab: int, target_vocab: int | None = None) -> None:
    """The draft proposes token ids that the target scores, so every id the draft can emit must mean the same to
    both: the same string and the same special flag for every id below the draft's vocabulary, the draft's BPE
    merges a prefix of the target's, the same normalizer, pre-tokenizer and decoder. The target may have more
    (a padded model vocabulary, extra added tokens); tokenizer_config.json may differ (base and instruct models
    name different eos tokens; the target's govern). draft_vocab/target_vocab: the models' vocabulary sizes.
    Raises ModelFolderError naming both folders and the first differences."""
    where = f"draft tokenizer ({draft.folder}) differs from the target's ({target.folder})"
    if target_vocab is not None and draft_vocab > target_vocab:
        raise ModelFolderError(f"{where}: the draft model's vocabulary ({draft_vocab}) is larger than the target "
                               f"model's ({target_vocab}); the draft's must be a prefix of the target's")
    if _same_file(draft.folder / "tokenizer.json", target.folder / "tokenizer.json"):
        return       # the usual pair (sizes of one family): measured 1 ms, against 0.85 s parsing a 109k vocabulary
    a, b = json.loads(draft._tok.to_str()), json.loads(target._tok.to_str())
    if a == b:
        return
    bad = _id_differences(target, draft, min(draft_vocab, draft.vocab_size)) + _pipeline_differences(a, b)
    if bad:
        raise ModelFolderError(f"{where}: {'; '.join(bad)}; pair a draft and a target that share a tokenizer "
                               f"(sizes of one family)")


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def _id_differences(target: Tokenizer, draft: Tokenizer, n: int, limit: int = 3) -> list[str]:
    """The first `limit` ids below n whose string or special flag differs."""
    sa = {i for i, t in draft._tok.get_added_tokens_decoder().items() if t.special}
    sb = {i for i, t in target._tok.get_added_tokens_decoder().items() if t.special}
    out = []
    for i in range(n):
        a, b = draft.id_to_token(i), target.id_to_token(i)
        if a != b or (i in sa) != (i in sb):
            out.append(f"id {i}: draft {_shown(a, i in sa)} vs target {_shown(b, i in sb)}")
            if len(out) == limit:
                break
    return out


def _shown(token: str | None, special: bool) -> str:
    return f"special {token!r}" if special else repr(token)


def _pipeline_differences(a: dict, b: dict) -> list[str]:
    """Differences in how text becomes ids (model type, merges, normalizer, pre-tokenizer) or back (decoder)."""
    out = []
    if a["model"].get("type") != b["model"].get("type"):
        out.append(f"model type: draft {a['model'].get('type')!r} vs target {b['model'].get('type')!r}")
    ma, mb = a["model"].get("merges") or [], b["model"].get("merges") or []
    rank = next((r for r, (x, y) in enumerate(zip(ma, mb)) if x != y), None)
    if rank is not None:
        out.append(f"merge {rank}: draft {_merge(ma[rank])!r} vs target {_merge(mb[rank])!r}")
    elif len(ma) > len(mb):
        out.append(f"the draft has {len(ma)} merges, the target {len(mb)}")
    parts = ("normalizer", "pre_tokenizer", "decoder")
    out += [f"{k.replace('_', '-')} differs" for k in parts if a.get(k) != b.get(k)]
    return out


def _merge(m) -> str:
    return m if isinstance(m, str) else " ".join(m)
