"""The engine: load a target (and a draft), validate requests, run them through the scheduler.

Each request is a search object (search.py) with the phases grow -> score -> replay -> commit per target pass;
the scheduler (scheduler.py) batches the passes of many requests. `generate_iter` -> `generate` for batches,
`stream` for one request's text as it becomes final. Prompt handling (prompting.py) and search construction
(search_setup.py) are parts of Engine kept in files of their own.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from .execution import invariance
from .decoding import constraints as lexical
from .decoding.adaptive import PassChooser
from .execution.batch import score_one
from .decoding.cache import TreeCache
from .config import GenerationConfig, ModelFolderError, SpeculativeConfig, check_full_head
from .execution.encdec import Encoder, is_encoder_decoder, shared_cross_layers
from .fetch import default_draft, resolve_model, streaming_refusal
from .execution.invariance import Invariance, NotInvariantError, QuantizationWarning, saturation_warning
from .execution.model import OnnxCausalLM
from .execution.sessions import share_threads, threads_shared
from .online import PreparedRequest
from .text.prompting import PromptMixin
from .results import Alternative, Hypothesis, Result, Stats, StreamChunk, answer_tokens, peak_rss_mb
from .decoding.protocol import Job
from .decoding.scheduler import Scheduler
from .search_setup import DEFAULT, Request, SearchSetup
from .text.tokenizer import Tokenizer, check_compatible, check_vocabulary
from .decoding.tree import TokenTree

__all__ = ["Alternative", "Engine", "Hypothesis", "PassChooser", "Result", "Stats", "StreamChunk", "peak_rss_mb"]


class Engine(PromptMixin, SearchSetup):
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

    def __init__(self, target: str | Path, draft: str | Path | None = DEFAULT, *, threads: int | None = None,
                 max_memory: int | None = None, host_memory: int | None = 0, placement: list[str] | None = None,
                 providers: list[str] | None = None, kv_resident: bool | None = None, min_rows: int | None = None,
                 shared_pool: bool = True, prefill_chunk: int | None = None):
        """target, draft: model folders, or the names of fetched models (`specbeam list`); draft "default" (the
        default) is the draft the tools use with a fetched model (fetch.default_draft: the 1.5B coder's 0.5B), none
        for another folder; None: no draft. max_memory/host_memory/placement stream the target's layers (split
        layout; see offload.py); providers: onnxruntime execution providers (default CPU); kv_resident: keep KV
        caches on the session's device between passes (default: on CUDA only; see OnnxCausalLM); min_rows: the
        target's row floor (default: measured for a quantized target, see OnnxCausalLM); prefill_chunk: a prompt's
        rows a pass scores (OnnxCausalLM's; fewer lower a long prompt's peak memory). shared_pool: run every
        session of the process on one onnxruntime thread pool of `threads` threads, as the tools do
        (model.share_threads: the first engine sizes it; afterwards onnxruntime refuses sessions with pools of
        their own); False keeps a pool per session, unless the process already shares one."""
        target = resolve_model(target, "target")
        if max_memory is not None or placement is not None:
            refusal = streaming_refusal(target)        # a fetched whole-layout model: the command that splits it
            if refusal:
                raise ModelFolderError(refusal)
        draft = default_draft(target) if isinstance(draft, str) and draft == DEFAULT else \
            None if draft is None else resolve_model(draft, "draft")
        if shared_pool:
            share_threads(threads)
        self.target = OnnxCausalLM(target, threads=threads, max_memory=max_memory, host_memory=host_memory,
                                   placement=placement, providers=providers, kv_resident=kv_resident,
                                   min_rows=min_rows, prefill_chunk=prefill_chunk)
        if min_rows is None and self.target.min_rows > 1 and not self.target.streamed_layers():
            # a quantized target scores one row a pass where this machine's kernels score one row bit for bit as
            # among others (measured once per model file and CPU, cached; DESIGN "Quantized targets" point 2); a
            # streaming target keeps 2 without measuring (the check would stream every layer some 30 times)
            self.target.min_rows = invariance.row_floor(self.target)
        self.tokenizer = Tokenizer(target)
        check_vocabulary(self.tokenizer, self.target.cfg)
        check_full_head(self.target.cfg)
        self.draft = None
        if draft is not None:
            if not Path(draft).is_dir():
                raise ModelFolderError(f"draft model folder {draft} does not exist")
            # with a pool of its own the draft is small: one thread and no busy-waiting, so it does not steal the
            # target's cores; with a streaming target those cores wait for the disk while the tree grows, so the
            # draft takes them all, as it does on the pool the process shares (model.share_threads)
            streams = bool(self.target.streamed_layers())
            draft_threads = threads if streams or threads_shared() else 1
            # a streaming target's budget holds for its draft's runs too: no arena keeps their largest run's memory
            self.draft = OnnxCausalLM(draft, threads=draft_threads, providers=providers, spin=False,
                                      kv_resident=kv_resident, min_rows=1, arena=False if streams else None,
                                      prefill_chunk=prefill_chunk)
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

    def reset_learning(self) -> None:
        """Forget what the engine learned across requests (cost curve, pass choosers, the invariance
        measurement): a benchmark's warm-up then does not carry into its run (bench/kv.py)."""
        self._init_state()

    def skip_invariance_check(self) -> None:
        """Speculate even on a target the invariance check refuses, for a benchmark that measures what the check
        prevents (bench/quant.py): speculative output may then differ from plain search."""
        measured = self._invariance.max_diff if self._invariance is not None else float("nan")
        self._invariance = Invariance(measured, True)

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
        """The request's settings: the model's defaults (model_generation: a chat model answers up to 512 tokens),
        then `generation` (a GenerationConfig, or a dict of its fields applied over the defaults), then keyword
        overrides."""
        if isinstance(generation, dict):
            overrides, generation = {**generation, **overrides}, None
        elif generation is not None and not isinstance(generation, GenerationConfig):
            raise TypeError(f"generation must be a GenerationConfig or a dict of its fields, got "
                            f"{type(generation).__name__}")
        if generation is not None and not overrides:
            return generation
        base = asdict(generation) if generation is not None else self.model_generation()
        return GenerationConfig.from_dict(base, **overrides)

    # -- public API: request -> generate_passes -> stream (one request); generate_iter -> generate (batches) ---
    def request(self, prompt: str | list[int], generation: GenerationConfig | None = None,
                speculative: SpeculativeConfig | str | None = DEFAULT, *, drafter=None, src_lang: str | None = None,
                tgt_lang: str | None = None, raw: bool = False, target_prefix=None, constraints=None,
                **overrides) -> PreparedRequest:
        """One request validated and its search built, ready for a scheduler (online.Batcher runs requests that
        arrive while others run; stream runs one alone): every error of the request is raised here. The
        arguments are generate_passes'."""
        gen = self.generation_config(generation, **overrides)
        speculative = self._speculative(speculative, gen)
        forced_bos = self._forced_bos(tgt_lang)
        ids = self.encode(prompt, src_lang, raw)
        prefix = self.prefix_ids(target_prefix)
        request = Request(tuple(ids), gen, speculative, drafter, self._statics([ids], 1)[0], forced_bos,
                          tuple(prefix), lexical.parse(constraints, self.prefix_ids, self._decode, self._eos_of(gen)))
        return PreparedRequest(self, prompt, ids, gen, self._lead(prefix, forced_bos), self._new_search(request))

    def generate_passes(self, prompt: str | list[int], generation: GenerationConfig | None = None,
                        speculative: SpeculativeConfig | str | None = DEFAULT, *, drafter=None,
                        src_lang: str | None = None, tgt_lang: str | None = None, raw: bool = False,
                        target_prefix=None, constraints=None, **overrides):
        """One request alone (a batch of one): yields (search state, live stats) after every target pass; the
        state is a BeamSearch (`running`, `scores`, `hypotheses(n)`, `stable_prefix()`) or, when sampling, a
        SampleState. drafter: a custom tree-growth callable (exact beam search only). target_prefix: see
        generate (the state's hypotheses and stable prefix then start after it); constraints: this request's
        (see generate_iter)."""
        prepared = self.request(prompt, generation, speculative, drafter=drafter, src_lang=src_lang,
                                tgt_lang=tgt_lang, raw=raw, target_prefix=target_prefix, constraints=constraints,
                                **overrides)
        for _, progress, finished in Scheduler(self.target, max_batch_size=1).run([prepared.job]):
            if not finished:
                yield progress.state, progress.stats

    def stream(self, prompt: str | list[int], generation: GenerationConfig | None = None,
               speculative: SpeculativeConfig | str | None = DEFAULT, *, src_lang: str | None = None,
               tgt_lang: str | None = None, raw: bool = False, target_prefix=None, constraints=None,
               **overrides) -> Iterator[StreamChunk]:
        """Yield text as soon as it is final (the prefix shared by all live and finished beams), one chunk per
        target pass; the last chunk carries the Result. A chunk's text is empty when that pass made nothing new
        final (with beams > 1 the beams often still disagree): such chunks are kept on purpose, as the live
        progress of a search (their stats count passes and tokens) and the points where a caller can stop it;
        skip them with `if chunk.text`. src_lang/tgt_lang: NLLB/M2M100 language codes (see generate_iter); raw:
        see encode; target_prefix: see generate (the first chunk with text starts with the prefix's); constraints:
        this prompt's (see generate_iter)."""
        prepared = self.request(prompt, generation, speculative, src_lang=src_lang, tgt_lang=tgt_lang, raw=raw,
                                target_prefix=target_prefix, constraints=constraints, **overrides)
        for _, progress, finished in Scheduler(self.target, max_batch_size=1).run([prepared.job]):
            if finished:
                result = prepared.result(progress.state, progress.stats)
                yield StreamChunk(prepared.rest(result), progress.stats, result)
                return
            delta = prepared.new_text(progress.state)
            snap = progress.stats.snapshot()
            snap.generated_tokens = prepared.answer_tokens(progress.state)     # the answer's tokens final so far
            yield StreamChunk(delta, snap)   # one chunk per target pass (maybe empty): callers can stop here

    def generate(self, prompts, generation: GenerationConfig | None = None,
                 speculative: SpeculativeConfig | str | None = DEFAULT, drafter=None, *, max_batch_size: int = 32,
                 max_batch_tokens: int | None = None, src_lang: str | None = None, tgt_lang: str | None = None,
                 raw: bool = False, target_prefix=None, constraints=None, **overrides) -> list[Result]:
        """Generate for one prompt (str or token ids) or a list of them; returns one Result per prompt, in order.
        A list is decoded in batches (continuous batching; see generate_iter). A text is put into the model
        folder's prompt format unless raw=True (see encode). speculative: a SpeculativeConfig (or a dict of its
        fields); by default ("default") adaptive speculation when a draft model is loaded, as the tools run
        (default_speculative); None: plain search. drafter: a custom tree-growth callable (exact beam
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
                      speculative: SpeculativeConfig | str | None = DEFAULT, drafter=None, *, max_batch_size: int = 32,
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
        speculative = self._speculative(speculative, gen)
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
                                    "prefix (a string, token ids, None or '')", self.prefix_ids)
        lexicon = self._per_prompt(constraints, len(prompts), "constraints", "list of constraints (or None)",
                                   lambda c: lexical.parse(c, self.prefix_ids, self._decode,
                                                                     self._eos_of(gen)))
        statics = self._statics(sources, max_batch_size)
        jobs = [Job(i, len(ids), self._new_search(Request(tuple(ids), gen, speculative, drafter, statics[i],
                                                          forced_bos, tuple(prefixes[i] or ()), lexicon[i])))
                for i, ids in enumerate(sources)]
        sched = Scheduler(self.target, max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens)
        for i, progress, finished in sched.run(jobs):
            if finished:
                yield i, self.result_of(prompts[i], progress.state, progress.stats, gen,
                                      self._lead(prefixes[i], forced_bos))

    # -- alternatives at a position (interactive translation) ----------------------------------------------
    def alternatives(self, prompt: str | list[int], target_prefix=None, n: int = 5,
                     generation: GenerationConfig | None = None,
                     speculative: SpeculativeConfig | str | None = DEFAULT, *, drafter=None,
                     src_lang: str | None = None, tgt_lang: str | None = None, raw: bool = False,
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
        prefix = self.prefix_ids(target_prefix)
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
            out = score_one(cache, nodes, k).take([len(nodes) - 1])
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

    def result_of(self, prompt, bs, stats: Stats, gen: GenerationConfig, lead=()) -> Result:
        """A request's Result from its search state: its hypotheses decoded, each with why it ended. lead: the target prefix tokens the hypotheses start with (see _lead)."""
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
