"""The engine: load a target (and a draft), validate requests, run them through the scheduler.

Each request is a search object (search.py) with the phases grow -> score -> replay -> commit per target pass;
the scheduler (scheduler.py) batches the passes of many requests. `generate_iter` -> `generate` for batches,
`stream` for one request's text as it becomes final.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from . import invariance
from . import constraints as lexical
from .adaptive import ChoosersByLoad, PassChooser, auto_budget, cost_curve, streamed_cost_curve
from .cache import TreeCache
from .config import STREAMED_TREE, GenerationConfig, ModelFolderError, SpeculativeConfig
from .contract import probe_source
from .draft import custom_drafter, make_drafter
from .encdec import Encoder, EncoderQueue, is_encoder_decoder, logits_processor, shared_cross_layers, shared_statics
from .invariance import Invariance, NotInvariantError, QuantizationWarning, saturation_warning
from .model import OnnxCausalLM
from .results import Alternative, Hypothesis, Result, Stats, StreamChunk, answer_tokens, peak_rss_mb
from .scheduler import Job, Scheduler
from .search import ExactSearch, HeadTree, SamplingSearch
from .tokenizer import PromptText, Tokenizer, check_compatible, check_vocabulary
from .tree import TokenTree

__all__ = ["Alternative", "Engine", "Hypothesis", "PassChooser", "Result", "Stats", "StreamChunk", "peak_rss_mb"]


def check_text(text: str, what: str) -> None:
    """Refuse a text with a lone surrogate (an unpaired \\ud800-\\udfff escape, or an undecodable byte of a
    command-line argument): it has no UTF-8 spelling, and the tokenizer fails on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate at character {e.start} ({text[e.start]!r}): not valid "
                         f"text (an unpaired \\ud800-\\udfff escape or an undecodable byte); pass UTF-8 text") \
            from None


class Engine:
    """A target model, an optional draft model, and their tokenizer; `generate` and `stream`."""

    @classmethod
    def from_models(cls, target, draft=None, tokenizer=None) -> "Engine":
        """An engine over already-built model objects (OnnxCausalLM or anything with its interface)."""
        self = cls.__new__(cls)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.eos = list(target.cfg.eos_token_ids)
        self._init_encoders(None, None)
        self._init_state()
        return self

    def __init__(self, target: str | Path, draft: str | Path | None = None, *, threads: int | None = None,
                 max_memory: int | None = None, host_memory: int | None = 0, placement: list[str] | None = None,
                 providers: list[str] | None = None, kv_resident: bool | None = None, min_rows: int | None = None):
        """max_memory/host_memory/placement stream the target's layers (split layout; see offload.py);
        providers: onnxruntime execution providers (default CPU); kv_resident: keep KV caches on the session's
        device between passes (default: on CUDA only; see OnnxCausalLM); min_rows: the target's row floor
        (default: measured for a quantized target, see OnnxCausalLM)."""
        self.target = OnnxCausalLM(target, threads=threads, max_memory=max_memory, host_memory=host_memory,
                                   placement=placement, providers=providers, kv_resident=kv_resident,
                                   min_rows=min_rows)
        if min_rows is None and self.target.min_rows > 1 and not self.target.streamed_layers():
            # a quantized target scores one row a pass where this machine's kernels score one row bit for bit as
            # among others (measured once per model file and CPU, cached; DESIGN "Quantized targets" point 2); a
            # streaming target keeps 2 without measuring (the check would stream every layer some 30 times)
            self.target.min_rows = invariance.row_floor(self.target)
        self.tokenizer = Tokenizer(target)
        check_vocabulary(self.tokenizer, self.target.cfg)
        self.draft = None
        if draft is not None:
            if not Path(draft).is_dir():
                raise ModelFolderError(f"draft model folder {draft} does not exist")
            # the draft is small: one thread and no busy-waiting, so it does not steal the target's cores; with a
            # streaming target those cores wait for the disk while the tree grows, so the draft takes them all
            draft_threads = threads if self.target.streamed_layers() else 1
            self.draft = OnnxCausalLM(draft, threads=draft_threads, providers=providers, spin=False,
                                      kv_resident=kv_resident, min_rows=1)
            draft_tokenizer = Tokenizer(draft)
            check_compatible(self.tokenizer, draft_tokenizer, self.draft.cfg.vocab_size, self.target.cfg.vocab_size)
            check_vocabulary(draft_tokenizer, self.draft.cfg)
        # the target only: a draft's numbers change how fast, never what, the engine outputs
        warning = saturation_warning(self.target.cfg)
        if warning:
            warnings.warn(warning, QuantizationWarning, stacklevel=2)
        self.eos = list(self.target.cfg.eos_token_ids)
        self._init_encoders(threads, providers)
        self._init_state()

    def _init_encoders(self, threads, providers):
        """Encoder-decoder folders (encdec.py): the target's encoder, and the draft's (a draft of an
        encoder-decoder target is one too: it needs its own cross K/V, or reads the target's when it declares
        `target_cross_layers`)."""
        self.encoder = self.draft_encoder = self.draft_cross = None
        kinds = [is_encoder_decoder(m) for m in (self.target, self.draft) if m is not None]
        if len(set(kinds)) > 1:
            raise ModelFolderError(f"the target {self.target.folder} and the draft {self.draft.folder} must both be "
                                   f"encoder-decoder models or both decoder-only")
        if kinds[0]:
            self.encoder = Encoder(self.target, threads=threads, providers=providers)
            if self.draft is not None:
                self.draft_cross = shared_cross_layers(self.encoder, self.draft, self.target)
                if self.draft_cross is None:         # else it reads the target's cross K/V: no encoder pass
                    self.draft_encoder = Encoder(self.draft, threads=1, providers=providers, spin=False)

    def _init_state(self):
        """What an engine learns across requests (cost curve, pass choosers); a lock makes sharing one engine
        across threads safe (each request has its own caches; models serialise their streamed passes)."""
        self._lock = threading.Lock()
        self._curve: dict[int, float] | None = None
        self._choosers: dict = {}
        self._invariance: Invariance | None = None

    def _require_invariant(self) -> None:
        """Exact speculation needs a target whose tree passes equal its single passes on this machine: measured
        once per engine (invariance.py; cached on disk per model file), refused with the fix when it is not."""
        if not isinstance(self.target, OnnxCausalLM):      # test doubles built with from_models
            return
        layout = invariance.layout_refusal(self.target)
        if layout:
            raise NotInvariantError(layout)
        with self._lock:
            if self._invariance is None:
                self._invariance = invariance.check(self.target)
        if not self._invariance.ok:
            raise NotInvariantError(invariance.refusal(self.target, self._invariance))

    def generation_config(self, generation: GenerationConfig | dict | None = None, **overrides) -> GenerationConfig:
        """The request's settings: the model's defaults, then `generation` (a GenerationConfig, or a dict of its
        fields applied over the defaults), then keyword overrides."""
        if isinstance(generation, dict):
            overrides, generation = {**generation, **overrides}, None
        elif generation is not None and not isinstance(generation, GenerationConfig):
            raise TypeError(f"generation must be a GenerationConfig or a dict of its fields, got "
                            f"{type(generation).__name__}")
        if generation is not None and not overrides:
            return generation
        base = asdict(generation) if generation is not None else dict(self.target.cfg.generation)
        return GenerationConfig.from_dict(base, **overrides)

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
             speculative: SpeculativeConfig | None = None, *, stream: bool = False, **overrides):
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

    def _speculative(self, spec) -> SpeculativeConfig | None:
        """A SpeculativeConfig, or a dict of its fields, or None; tree widths are checked against the vocabulary
        (a TopK wider than it fails deep inside onnxruntime)."""
        if isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"unknown speculative option(s): {', '.join(sorted(map(str, unknown)))}")
            spec = SpeculativeConfig(**spec)
        if spec is None:
            return None
        if not isinstance(spec, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, a dict of its fields or None, got "
                            f"{type(spec).__name__}")
        spec = self.speculative_for(spec)
        self.check_widths(spec.max_branch_width, spec.draft_width)
        return spec

    def speculative_for(self, spec: SpeculativeConfig) -> SpeculativeConfig:
        """The tree settings a request runs with: its own, except that a target streaming layers with a draft
        model takes config.STREAMED_TREE when every tree knob is at its default (adaptive as asked). A streamed
        pass costs a read of the weights whatever the tree, so a tree sized for resident passes wastes it."""
        streams = isinstance(self.target, OnnxCausalLM) and self.target.streamed_layers() > 0
        if not streams or self.draft is None or replace(spec, adaptive=True) != SpeculativeConfig():
            return spec
        return replace(spec, **STREAMED_TREE)

    def check_widths(self, max_branch_width: int | None, draft_width: int | None, flags: bool = False) -> None:
        """Tree widths within the vocabulary (the draft's, when it has a smaller one); `flags`: name them as the
        command-line flags."""
        vocab = self.target.cfg.vocab_size
        if self.draft is not None:
            vocab = min(vocab, self.draft.cfg.vocab_size)
        for name, value in (("max_branch_width", max_branch_width), ("draft_width", draft_width)):
            if value is not None and value > vocab:
                what = f"--{name} {value}" if flags else f"{name}={value}"
                raise ValueError(f"{what} is larger than the model's vocabulary ({vocab} tokens); pass at most "
                                 f"{vocab}")

    def cost_curve(self, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), past: int = 32,
                   reps: int = 3) -> dict[int, float]:
        """Measured target pass time (s) over a tree of Q nodes on top of `past` cached tokens."""
        static = None
        if self.encoder is not None:      # a decoder pass reads a source's cross K/V: a source of `past` tokens
            static = {n: a for n, (a, _) in self.encoder.encode([probe_source(past, self.encoder.eos[0])])[0].items()}
        return cost_curve(self.target, sizes, past, reps, static)

    def auto_budget(self, num_beams: int, slack: float = 1.6) -> int:
        """The largest tree whose pass costs at most `slack` times a pass over the beams alone (adaptive.py);
        the cost curve is measured once per engine."""
        with self._lock:
            if self._curve is None:
                streams = isinstance(self.target, OnnxCausalLM) and self.target.streamed_layers()
                self._curve = streamed_cost_curve(self.target) if streams else self.cost_curve()
        return auto_budget(self._curve, num_beams, slack)

    def _chooser(self, gen: GenerationConfig, spec: SpeculativeConfig) -> ChoosersByLoad:
        """Pass choosers per (beams, tree settings) and batch load, kept across requests: what was learnt on
        earlier prompts carries over (a batch job decides after a few lines)."""
        key = (gen.num_beams, gen.length_penalty, replace(spec, adaptive=False))
        # a lookahead head's pass gives 1 or 2 steps: its probes average 4 passes (docs/DESIGN "Lookahead head")
        settings = {"probe_len": 4} if spec.drafter == "ahead" else {}
        with self._lock:
            return self._choosers.setdefault(key, ChoosersByLoad(**settings))

    # -- one request's search ------------------------------------------------------------------------------
    def _forced_bos(self, tgt_lang: str | None) -> int | None:
        """tgt_lang -> the forced BOS token (the target language code); None keeps the model's own."""
        if tgt_lang is None:
            return None
        if self.encoder is None:
            raise ValueError("tgt_lang is for encoder-decoder models (NLLB/M2M100); this is a decoder-only model")
        return self.encoder.language_id(tgt_lang, "tgt_lang")

    def _prefix_ids(self, prefix) -> list[int]:
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

    def _new_search(self, ids: list[int], gen: GenerationConfig, spec: SpeculativeConfig | None, drafter=None,
                    static=None, forced_bos: int | None = None, prefix: list[int] | None = None,
                    constraints: lexical.Constraints | None = None):
        """Validate one request and build its search object (search.py). `drafter` overrides the policy named
        in spec (any callable with the Drafter signature; see draft.py). Encoder-decoder models: ids are the
        source; static(with_draft) gives the request's encoder outputs when it starts (see _statics).
        prefix: target prefix token ids, forced after the prompt (decoder-only) or the decoder start and forced
        BOS (encoder-decoder); they count as prompt, as transformers counts `input_ids` / `decoder_input_ids`
        (the length penalty, min_new_tokens and max_new_tokens apply to the tokens after them)."""
        ctx = self.target.cfg.context_length
        source, prefix = None, list(prefix or [])
        if self.encoder is not None:
            if len(ids) > self.encoder.context_length:
                raise ValueError(f"the source has {len(ids)} tokens; the encoder's context length is "
                                 f"{self.encoder.context_length}")
            source, ids = ids, self.encoder.decoder_prompt(forced_bos) + prefix
        else:
            ids = list(ids) + prefix
        if len(ids) >= ctx:
            what = "the prompt" if source is None and not prefix else \
                "the target prefix" if source is not None else "the prompt and target prefix"
            raise ValueError(f"{what} {'have' if 'and' in what else 'has'} {len(ids)} tokens; the model's context "
                             f"length is {ctx}")
        max_new = min(gen.max_new_tokens, ctx - len(ids))
        eos = self.eos if gen.eos_token_id is None else list(np.atleast_1d(gen.eos_token_id))
        outside = [int(t) for t in eos if int(t) >= self.target.cfg.vocab_size]
        if outside:
            raise ValueError(f"eos_token_id {outside[0]} is outside the model's vocabulary "
                             f"(0-{self.target.cfg.vocab_size - 1}): generation could never stop on it")
        use_draft = spec is not None and (self.draft is not None or spec.drafter in ("lookup", "ahead"))
        if use_draft and spec.drafter == "ahead" and not self.target.ahead:
            raise ValueError(f"drafter='ahead' needs a target with a lookahead head; {self.target.folder} has none "
                             f"(attach one with export.ahead.attach, as `specbeam fetch smollm2` does)")
        if use_draft:
            spec.check_against(gen.num_beams)
            if gen.do_sample != (spec.drafter == "sample"):
                raise ValueError("do_sample=True needs drafter='sample': trees grown by draft beam search or "
                                 "best-first are not samples, and the p/q rule would bias the output"
                                 if gen.do_sample else "drafter='sample' is for do_sample=True")
            if not gen.do_sample:
                self._require_invariant()
        extra = {}
        if source is not None:    # the decoder start is the prompt; a forced BOS counts as generated (a target
            #                        prefix and the forced BOS before it count as prompt: decoder_input_ids)
            prompt_len = len(ids) if prefix else 1
            extra = dict(prompt_len=prompt_len, static=static, process=logits_processor(
                self.encoder.suppressed, self.encoder.forced_eos, prompt_len + max_new))
        if constraints is not None and gen.do_sample:
            raise ValueError("constraints are for beam search (do_sample=False): a sample cannot be steered to "
                             "contain them without changing its distribution")
        if gen.do_sample:
            topk = [str(m.folder) for m in (self.target, self.draft if use_draft else None)
                    if m is not None and m.cfg.output == "topk"]
            if topk:
                raise ValueError(f"do_sample=True needs full distributions; {', '.join(topk)} has a top-k "
                                 "head (export with the default output 'logits' for sampling)")
            if use_draft and self.draft is None:
                raise ValueError("do_sample=True with speculation needs a draft model (drafter='sample')")
            return SamplingSearch(ids, self.target, self.draft if use_draft else None, num_beams=gen.num_beams,
                                  max_new_tokens=max_new, eos=eos, min_new_tokens=gen.min_new_tokens,
                                  temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p, seed=gen.seed,
                                  spec=spec if use_draft else None, **extra)
        grow = chooser = budget_for = None
        ahead = None
        if use_draft and spec.drafter == "ahead":
            # the target's own lookahead head guesses the tokens after each beam's next one: no draft model
            ahead = HeadTree.of(self.target.ahead, spec)
            budget_for = lambda load, total=spec.budget: max(gen.num_beams, total // load)   # noqa: E731
            chooser = self._chooser(gen, spec) if spec.adaptive and drafter is None else None
        elif use_draft:
            # the budget is per target pass, shared by the requests in it: a lone request drafts a big tree, a busy
            # batch small ones (a batch of 32 with 48 nodes each made 1,500-node passes, and adaptive speculation's
            # probes of them cost 40% of a 64-line job); "auto" takes the largest pass the measured cost curve
            # affords at this load (K beams per running request)
            K = gen.num_beams
            if spec.budget == "auto":
                budget_for = lambda load: max(K, self.auto_budget(K * load, spec.auto_slack) // load)   # noqa: E731
                spec = replace(spec, budget=budget_for(1))
            else:
                budget_for = lambda load, total=spec.budget: max(K, total // load)   # noqa: E731
            dctx = self.draft.cfg.context_length if self.draft is not None else ctx
            # prompt lookup of an encoder-decoder request searches its source (source-side spans)
            grow = custom_drafter(drafter) if drafter else make_drafter(spec, gen.num_beams, eos, min(ctx, dctx),
                                                                        source=source)
            chooser = self._chooser(gen, spec) if spec.adaptive and drafter is None else None
        # the beam head (a top-k or 'both' head) returns each node's best log-probs only: 2K + #EOS + 1 per beam
        # always hold the 2K candidates beam search keeps, even with EOS masked by min_new_tokens; beam search
        # then reads [beams, k], never a vocabulary-sized row (beam.BeamRows)
        n_banned = len(self.encoder.suppressed) if source is not None else 0
        history = bool(gen.no_repeat_ngram_size) or gen.repetition_penalty != 1.0
        dense = history or constraints is not None
        beam_head = self.target.cfg.output in ("topk", "both") and not dense
        if dense and self.target.cfg.output == "topk":
            what = "constraints need the log-probs of their tokens" if constraints is not None else \
                "no_repeat_ngram_size / repetition_penalty move tokens a top-k head may need beyond its k"
            raise ValueError(f"{self.target.folder}: {what}; export with --output_kind both (or logits) to use them")
        topk = 2 * gen.num_beams + len(eos) + 1 + n_banned if beam_head else None
        if constraints is not None and prefix:
            # the output includes the target prefix: what it holds counts (a term in it is met, a span in it is
            # copied once), so the search neither forces a term again nor doubles the markup
            start = constraints.start
            for t in prefix:
                start = constraints.advance(start, t)
            constraints.start = start
        return ExactSearch(ids, self.target, self.draft, num_beams=gen.num_beams, max_new_tokens=max_new, eos=eos,
                           length_penalty=gen.length_penalty, early_stopping=gen.early_stopping,
                           min_new_tokens=gen.min_new_tokens, no_repeat_ngram_size=gen.no_repeat_ngram_size,
                           repetition_penalty=gen.repetition_penalty,
                           grow=grow, chooser=chooser, topk=topk,
                           budget_for=budget_for, constraints=constraints,
                           min_finished=gen.num_return_sequences, ahead=ahead, **extra)

    def _statics(self, sources: list[list[int]], batch: int) -> list:
        """Per request, static(with_draft) -> (target's, draft's) encoder outputs, or None for decoder-only
        models. The encoders run when a request starts, over it and the next `batch` - 1 sources."""
        if self.encoder is None:
            return [None] * len(sources)
        tq = EncoderQueue(self.encoder, sources, batch)
        dq = EncoderQueue(self.draft_encoder, sources, batch) if self.draft_encoder is not None else None

        def static(i, with_draft):
            t = tq.get(i)
            if not with_draft:
                return t, None
            if self.draft_cross is not None:
                return t, shared_statics(t, self.draft_cross)
            return t, (dq.get(i) if dq is not None else None)
        return [lambda with_draft, i=i: static(i, with_draft) for i in range(len(sources))]

    # -- public API: generate_passes -> stream (one request); generate_iter -> generate (batches) -------------
    def generate_passes(self, prompt: str | list[int], generation: GenerationConfig | None = None,
                        speculative: SpeculativeConfig | None = None, *, drafter=None, src_lang: str | None = None,
                        tgt_lang: str | None = None, raw: bool = False, target_prefix=None, constraints=None,
                        **overrides):
        """One request alone (a batch of one): yields (search state, live stats) after every target pass; the
        state is a BeamSearch (`running`, `scores`, `hypotheses(n)`, `stable_prefix()`) or, when sampling, a
        SampleState. drafter: a custom tree-growth callable (exact beam search only). target_prefix: see
        generate (the state's hypotheses and stable prefix then start after it); constraints: this request's
        (see generate_iter)."""
        gen = self.generation_config(generation, **overrides)
        speculative = self._speculative(speculative)
        forced_bos = self._forced_bos(tgt_lang)
        ids = self.encode(prompt, src_lang, raw)
        prefix = self._prefix_ids(target_prefix)
        job = Job(0, len(ids), self._new_search(ids, gen, speculative, drafter, self._statics([ids], 1)[0],
                                                forced_bos, prefix,
                                                lexical.parse(constraints, self._prefix_ids, self._decode,
                                                              self._eos_of(gen))))
        for _, progress, finished in Scheduler(self.target, max_batch_size=1).run([job]):
            if not finished:
                yield progress.state, progress.stats


    def stream(self, prompt: str | list[int], generation: GenerationConfig | None = None,
               speculative: SpeculativeConfig | None = None, *, src_lang: str | None = None,
               tgt_lang: str | None = None, raw: bool = False, target_prefix=None, constraints=None,
               **overrides) -> Iterator[StreamChunk]:
        """Yield text as soon as it is final (the prefix shared by all live and finished beams), one chunk per
        target pass; the last chunk carries the Result. A chunk's text is empty when that pass made nothing new
        final (with beams > 1 the beams often still disagree): such chunks are kept on purpose, as the live
        progress of a search (their stats count passes and tokens) and the points where a caller can stop it;
        skip them with `if chunk.text`. src_lang/tgt_lang: NLLB/M2M100 language codes (see generate_iter); raw:
        see encode; target_prefix: see generate (the first chunk with text starts with the prefix's); constraints:
        this prompt's (see generate_iter)."""
        gen = self.generation_config(generation, **overrides)
        forced = self._prefix_ids(target_prefix)
        lead = self._lead(forced, self._forced_bos(tgt_lang))
        shown, n_stable = "", 0
        bs = stats = None
        for bs, stats in self.generate_passes(prompt, gen, speculative, src_lang=src_lang, tgt_lang=tgt_lang,
                                            raw=raw, target_prefix=forced, constraints=constraints):
            prefix, delta = lead + bs.stable_prefix(), ""
            if len(prefix) > n_stable:        # decode only when more tokens became final
                n_stable = len(prefix)
                text = self.tokenizer.decode_stable(prefix)
                if len(text) > len(shown) and text.startswith(shown):
                    delta, shown = text[len(shown):], text
            snap = stats.snapshot()
            snap.generated_tokens = len(prefix) - len(lead)     # the answer's tokens final so far
            yield StreamChunk(delta, snap)   # one chunk per target pass (maybe empty): callers can stop here
        result = self._result(prompt, bs, stats, gen, lead)
        final = result.text
        yield StreamChunk(final[len(shown):] if final.startswith(shown) else "", stats, result)

    def generate(self, prompts, generation: GenerationConfig | None = None,
                 speculative: SpeculativeConfig | None = None, drafter=None, *, max_batch_size: int = 32,
                 max_batch_tokens: int | None = None, src_lang: str | None = None, tgt_lang: str | None = None,
                 raw: bool = False, target_prefix=None, constraints=None, **overrides) -> list[Result]:
        """Generate for one prompt (str or token ids) or a list of them; returns one Result per prompt, in order.
        A list is decoded in batches (continuous batching; see generate_iter). A text is put into the model
        folder's prompt format unless raw=True (see encode). drafter: a custom tree-growth callable (exact beam
        search only). target_prefix: the start of the output, forced (CTranslate2's target_prefix): one prefix
        (a text or token ids) for one prompt, a list of them (None or '' for none) for a list of prompts; see
        generate_iter. constraints: terminology that must appear in the output (lexically constrained beam
        search): for one prompt a list of constraints, for a list of prompts one such list (or None) per prompt;
        see generate_iter."""
        if prompts is None or isinstance(prompts, (bytes, bytearray, memoryview, dict, int, np.integer)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got "
                            f"{type(prompts).__name__}")
        if isinstance(prompts, str) or isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            batch, one = [prompts], True      # one prompt
        else:
            batch, one = list(prompts), False
            if batch and isinstance(batch[0], (int, np.integer)):
                batch, one = [batch], True    # one token-id prompt
        if one and target_prefix is not None:
            target_prefix = [target_prefix]
        if one and constraints is not None:
            constraints = [constraints]
        out: list[Result | None] = [None] * len(batch)
        for i, result in self.generate_iter(batch, generation, speculative, drafter=drafter,
                                            max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                            src_lang=src_lang, tgt_lang=tgt_lang, raw=raw,
                                            target_prefix=target_prefix, constraints=constraints, **overrides):
            out[i] = result
        return out

    def generate_iter(self, prompts, generation: GenerationConfig | None = None,
                      speculative: SpeculativeConfig | None = None, drafter=None, *, max_batch_size: int = 32,
                      max_batch_tokens: int | None = None, src_lang: str | None = None, tgt_lang: str | None = None,
                      raw: bool = False, target_prefix=None, constraints=None,
                      **overrides) -> Iterator[tuple[int, Result]]:
        """Yield (index into prompts, Result) in completion order. Up to max_batch_size requests (and
        max_batch_tokens prompt tokens) share every target pass and every draft level's pass; a finished
        request leaves at once and the next one joins. Each request's output is the one it gets alone.
        NLLB/M2M100: src_lang puts the source language code into text prompts (as transformers' tokenizers do;
        token-id prompts are taken as they are), tgt_lang forces the target language code as the first token.
        target_prefix: None, or one prefix per prompt (a text, encoded as plain target-side text, or token ids;
        None or '' for none): the output starts with it and the search continues from there, as transformers'
        generate(input_ids=prompt + prefix) (decoder-only) or generate(decoder_input_ids=[decoder start, forced
        BOS] + prefix) (encoder-decoder): the prefix counts as prompt for the length penalty, min_new_tokens and
        max_new_tokens. Each hypothesis includes the prefix (its tokens and text; its score is of the tokens
        after it), as CTranslate2 returns it.
        constraints: None, or one list of constraints (or None) per prompt. A constraint is a text, token ids, or
        a tuple/list of alternatives (texts or token ids), any one of which satisfies it; a text is encoded as
        target-side text, alone and after a space. Beam search (num_beams >= 2) then allocates its beams over
        the number of constraint tokens met (dynamic beam allocation, Post & Vilar 2018) and a hypothesis may end
        only when it contains every constraint (tokens after the target prefix); each hypothesis says whether it
        does (Hypothesis.constraints_met: False only when the length limit came first). Exact and speculative
        search give the same output, as without constraints."""
        gen = self.generation_config(generation, **overrides)
        speculative = self._speculative(speculative)
        forced_bos = self._forced_bos(tgt_lang)
        if prompts is None or isinstance(prompts, (str, bytes, bytearray, dict)):
            raise TypeError(f"prompts must be a list of prompts (strings or token-id lists), got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        # every prompt is validated before any decoding starts: a bad one fails the call, not a batch midway
        sources = []
        for i, p in enumerate(prompts):
            try:
                sources.append(self.encode(p, src_lang, raw))
            except (TypeError, ValueError) as e:
                if len(prompts) == 1:
                    raise
                raise type(e)(f"prompt {i}: {e}") from None
        prefixes = self._per_prompt(target_prefix, len(prompts), "target_prefix",
                                    "prefix (a string, token ids, None or '')", self._prefix_ids)
        lexicon = self._per_prompt(constraints, len(prompts), "constraints", "list of constraints (or None)",
                                   lambda c: lexical.parse(c, self._prefix_ids, self._decode,
                                                                     self._eos_of(gen)))
        statics = self._statics(sources, max_batch_size)
        jobs = [Job(i, len(ids), self._new_search(ids, gen, speculative, drafter, statics[i], forced_bos,
                                                  prefixes[i], lexicon[i]))
                for i, ids in enumerate(sources)]
        sched = Scheduler(self.target, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens)
        for i, progress, finished in sched.run(jobs):
            if finished:
                yield i, self._result(prompts[i], progress.state, progress.stats, gen,
                                      self._lead(prefixes[i], forced_bos))

    # -- alternatives at a position (interactive translation) ----------------------------------------------
    def alternatives(self, prompt: str | list[int], target_prefix=None, n: int = 5,
                     generation: GenerationConfig | None = None, speculative: SpeculativeConfig | None = None, *,
                     drafter=None, src_lang: str | None = None, tgt_lang: str | None = None, raw: bool = False,
                     max_batch_size: int = 32, **overrides) -> list[Alternative]:
        """The n most probable tokens after `target_prefix` (a text or token ids; None: the output's first
        position), best first, each with its log-prob there and its best continuation: beam search (these
        settings) from the prefix and that token, as generate(target_prefix=prefix + [token]) returns it
        (CTranslate2's return_alternatives, but the true top n of the model's distribution at the position: one
        pass over the prompt and prefix, every token ranked, not the beams' candidates). The log-probs are the
        log-softmax of the model's logits; tokens the search can never emit there (an encoder-decoder's banned
        pad, EOS under min_new_tokens) are left out. The continuations run as one batch (speculative when
        asked: the same output)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        gen = replace(self.generation_config(generation, **overrides), num_return_sequences=1)
        if gen.do_sample:
            raise ValueError("alternatives continue each token with (exact) beam search; do_sample is for generate")
        if gen.no_repeat_ngram_size or gen.repetition_penalty != 1.0:
            raise ValueError("alternatives rank the model's own log-probs; no_repeat_ngram_size / "
                             "repetition_penalty would change them (leave them unset)")
        forced_bos = self._forced_bos(tgt_lang)
        ids = self.encode(prompt, src_lang, raw)
        prefix = self._prefix_ids(target_prefix)
        logp = self._next_logprobs(ids, prefix, forced_bos, gen, min(int(n), self.target.cfg.vocab_size))
        order = np.argsort(-logp, kind="stable")[:int(n)]
        order = [int(t) for t in order if np.isfinite(logp[t])]
        eos = set(self.eos if gen.eos_token_id is None else np.atleast_1d(gen.eos_token_id).tolist())
        go_on = [t for t in order if t not in eos]
        hyps = dict(zip(go_on, self.generate([ids] * len(go_on), gen, speculative, drafter,
                                             max_batch_size=max_batch_size, tgt_lang=tgt_lang,
                                             target_prefix=[prefix + [t] for t in go_on]))) if go_on else {}
        lead = (self.encoder.decoder_prompt(forced_bos)[1:] if self.encoder is not None else []) + prefix
        decode = self.tokenizer.decode if self.tokenizer else (lambda ids: "")
        before, out = decode(prefix), []
        for t in order:
            after = decode(prefix + [t])
            text = after[len(before):] if after.startswith(before) else decode([t])
            if not text and self.tokenizer is not None:       # a special token (EOS): its name
                text = self.tokenizer.id_to_token(t) or ""
            hyp = hyps[t].hypotheses[0] if t in hyps else Hypothesis(before, lead + [t], 0.0)
            out.append(Alternative(t, text, float(logp[t]), hyp))
        return out

    def _next_logprobs(self, ids: list[int], prefix: list[int], forced_bos: int | None,
                       gen: GenerationConfig, n: int) -> np.ndarray:
        """fp32 log-probs [V] of the token after the prompt (an encoder-decoder's source: its decoder start and
        forced BOS) and the prefix: one target pass over them; the tokens the search bans there are -inf."""
        ctx, static = self.target.cfg.context_length, None
        if self.encoder is not None:
            static = self.encoder.encode([ids])[0]
            chain = self.encoder.decoder_prompt(forced_bos) + prefix
        else:
            chain = list(ids) + prefix
        if len(chain) >= ctx:
            raise ValueError(f"the prompt and target prefix have {len(chain)} tokens; the model's context length "
                             f"is {ctx}")
        tree = TokenTree()
        nodes = tree.add_chain(chain)
        cache = TreeCache(self.target, tree, static)
        try:
            # a top-k head returns the k it is asked for (its graph's TopK input): n and room for the bans below;
            # any other head its logits
            banned = (len(self.encoder.suppressed) if self.encoder is not None else 0) + len(self.eos) + \
                len(np.atleast_1d(gen.eos_token_id if gen.eos_token_id is not None else []))
            k = min(n + banned, self.target.cfg.vocab_size) if self.target.cfg.output == "topk" else None
            out = cache.score(nodes, k).take([len(nodes) - 1])
        finally:
            cache.release()
        V = self.target.cfg.vocab_size
        if hasattr(out, "logits"):
            logp = out.log_probs()[0].astype(np.float32)
        else:       # a top-k head: its k best log-probs are the true top k (k = n; the vocabulary at most)
            logp = np.full(V, -np.inf, np.float32)
            logp[out.ids[0]] = out.logprobs[0]
        if self.encoder is not None and self.encoder.suppressed:
            logp[np.array(self.encoder.suppressed, np.int64)] = -np.inf
        if gen.min_new_tokens > 0:
            eos = self.eos if gen.eos_token_id is None else list(np.atleast_1d(gen.eos_token_id))
            logp[np.array(eos, np.int64)] = -np.inf
        return logp

    def _result(self, prompt, bs, stats: Stats, gen: GenerationConfig, lead=()) -> Result:
        """lead: the target prefix tokens the hypotheses start with (see _lead)."""
        eos = set(self.eos if gen.eos_token_id is None else np.atleast_1d(gen.eos_token_id).tolist())
        decode = self.tokenizer.decode if self.tokenizer else (lambda ids: "")
        hyps = [Hypothesis(decode([t for t in toks if t not in eos]), toks, score,
                           finish_reason=self._finish_reason(toks, eos, bs, gen))
                for toks, score in ((list(lead) + t, s) for t, s in bs.hypotheses(gen.num_return_sequences))]
        if hasattr(bs, "constraints_met"):
            for h, met in zip(hyps, bs.constraints_met(len(hyps))):
                h.constraints_met = met
        if hyps:        # the answer's own tokens (the best hypothesis's, EOS and a target prefix not counted), not
            #            the search's steps (beam search goes on after its best hypothesis ended)
            stats.generated_tokens = answer_tokens(hyps[0].tokens, eos, len(lead))
        return Result(prompt, hyps, stats)

    def _finish_reason(self, toks: list[int], eos: set, bs, gen: GenerationConfig) -> str:
        """Why a hypothesis ended: "stop" (an EOS token), "length" (max_new_tokens), "context" (the model's
        context length came first)."""
        if toks and toks[-1] in eos:
            return "stop"
        limit = getattr(bs, "max_length", getattr(bs, "max_len", None))
        if limit is not None and limit - bs.prompt_len < gen.max_new_tokens:
            return "context"
        return "length"
