"""The Engine's search construction: a request's tree settings (streaming targets choose their own), the measured
cost curve behind budget "auto", the pass choosers of adaptive speculation, and the search object of one request
(a part of `Engine`, generate.py, kept in a file of its own job)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from .decoding import constraints as lexical
from .decoding.adaptive import ChoosersByLoad, auto_budget, cost_curve, streamed_cost_curve
from .config import DEFAULT_BUDGET, MAX_BUDGET, GenerationConfig, SpeculativeConfig, head_width, streamed_tree
from .contract import probe_source
from .decoding.draft import custom_drafter, make_drafter
from .execution.encdec import EncoderQueue, logits_processor, shared_statics
from .execution.model import OnnxCausalLM
from .decoding.search import BeamSettings, EncoderDecoder, ExactSearch, HeadTree, SamplingSearch, Speculation


# `speculative`'s default in Engine's calls: the engine's own choice (SearchSetup.default_speculative); None runs
# plain search
DEFAULT = "default"


@dataclass(frozen=True)
class Request:
    """One request, normalised (Engine builds it from the API's arguments): `ids` the prompt's token ids (an
    encoder-decoder's: the source), its settings, `drafter` a custom tree-growth callable (draft.py) overriding
    the policy spec names, `static(with_draft)` an encoder-decoder request's encoder outputs when it starts,
    `forced_bos` the target language code, `prefix` the target prefix's token ids, forced after the prompt
    (decoder-only) or the decoder start and forced BOS (encoder-decoder): they count as prompt, as transformers
    counts `input_ids` / `decoder_input_ids` (the length penalty, min_new_tokens and max_new_tokens apply to
    the tokens after them), `constraints` its terminology."""
    ids: tuple[int, ...]
    gen: GenerationConfig
    spec: SpeculativeConfig | None = None
    drafter: object = None
    static: object = None
    forced_bos: int | None = None
    prefix: tuple[int, ...] = ()
    constraints: lexical.Constraints | None = None


class SearchSetup:
    """Engine's search construction; uses the engine's models, tokenizer, encoder and learnt state."""

    def _speculative(self, spec, gen: GenerationConfig) -> SpeculativeConfig | None:
        """A SpeculativeConfig, or a dict of its fields, DEFAULT (default_speculative) or None (plain search), for
        requests of `gen`; tree widths are checked against the vocabulary (a TopK wider than it fails deep inside
        onnxruntime)."""
        if isinstance(spec, str) and spec == DEFAULT:
            spec = self.default_speculative(gen)
        if isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"unknown speculative option(s): {', '.join(sorted(map(str, unknown)))}")
            spec = SpeculativeConfig(**spec)
        if spec is None:
            return None
        if not isinstance(spec, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig, a dict of its fields, {DEFAULT!r} (the "
                            f"engine's default) or None (plain search), got {spec!r:.60}")
        spec = self.speculative_for(spec, gen.num_beams)
        self.check_widths(spec.max_branch_width, spec.draft_width)
        return spec

    def default_speculative(self, gen: GenerationConfig) -> SpeculativeConfig | None:
        """What a request that names no speculative settings runs, as the tools do: with a draft model loaded,
        adaptive speculation with the default tree (drafter 'sample' when sampling; speculative_for then picks a
        streaming target's tree or the folder's own), else plain search (None). The output is plain search's
        either way; without this default a loaded draft sat idle (1.00 tokens a pass)."""
        if self.draft is None:
            return None
        return SpeculativeConfig(drafter="sample" if gen.do_sample else "beam")

    def speculative_for(self, spec: SpeculativeConfig, num_beams: int = 1) -> SpeculativeConfig:
        """The tree settings a request of `num_beams` runs with: its own, except when every tree knob is at its
        default (adaptive as asked) and a draft model drafts: a target streaming layers takes
        config.streamed_tree(num_beams) (a streamed pass costs a read of the weights whatever the tree, so a tree
        sized for resident passes wastes it), a resident one the tree its folder names (config key
        `speculative`), if any. A tree left at the default budget grows to one node a beam (up to MAX_BUDGET)
        when more beams are asked: 81 beams with a draft were refused ("budget (80) must be >= num_beams") though
        no budget was set."""
        tree = self._tree_for(spec, num_beams)
        if tree.budget == DEFAULT_BUDGET and num_beams > DEFAULT_BUDGET:
            tree = replace(tree, budget=min(num_beams, MAX_BUDGET))
        return tree

    def _tree_for(self, spec: SpeculativeConfig, num_beams: int) -> SpeculativeConfig:
        if not isinstance(self.target, OnnxCausalLM) or self.draft is None or \
                replace(spec, adaptive=True) != SpeculativeConfig():
            return spec
        if self.target.streamed_layers() > 0:
            return replace(spec, **streamed_tree(num_beams))
        # a model folder's own tree for its draft in memory (`speculative` in its config: written by fetch for a
        # pair whose tree was measured, e.g. Qwen2.5-Coder's chain of 4)
        tree = self.target.cfg.raw.get("speculative")
        if isinstance(tree, dict) and tree:
            return replace(spec, **{k: v for k, v in tree.items() if k != "adaptive"})
        return spec

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
        # a draft model catches up over the tokens it sat out when drafting resumes (adaptive.PassChooser)
        settings = {"probe_len": 4} if spec.drafter == "ahead" else {"catch_up": spec.drafter != "lookup"}
        with self._lock:
            return self._choosers.setdefault(key, ChoosersByLoad(**settings))

    def _new_search(self, req: Request):
        """Validate one request and build its search object (search.py)."""
        source, ids = self._decoder_chain(req)
        gen = req.gen
        max_new = min(gen.max_new_tokens, self.target.cfg.context_length - len(ids))
        eos = self._request_eos(gen)
        use_draft = self._uses_draft(req)
        encdec = None
        if source is not None:    # the decoder start is the prompt; a forced BOS counts as generated (a target
            #                        prefix and the forced BOS before it count as prompt: decoder_input_ids)
            prompt_len = len(ids) if req.prefix else 1
            encdec = EncoderDecoder(prompt_len, req.static, logits_processor(
                self.encoder.suppressed, self.encoder.forced_eos, prompt_len + max_new))
        if req.constraints is not None and gen.do_sample:
            raise ValueError("constraints are for beam search (do_sample=False): a sample cannot be steered to "
                             "contain them without changing its distribution")
        if gen.do_sample:
            return self._sampling_search(req, ids, max_new, eos, use_draft, encdec)
        speculation = self._speculation(req, eos, source) if use_draft else None
        topk = self._beam_head_k(req, eos, source is not None)
        self._check_beams(gen.num_beams, topk, use_draft)
        return ExactSearch(ids, self.target, self.draft, BeamSettings.of(gen, max_new, eos),
                           speculation=speculation, topk=topk,
                           encdec=encdec, constraints=_after_prefix(req.constraints, req.prefix),
                           min_finished=gen.num_return_sequences)

    def _decoder_chain(self, req: Request) -> tuple[list[int] | None, list[int]]:
        """(the source, or None for a decoder-only model; the token chain the decoder starts from: the prompt
        and target prefix, or the decoder start, forced BOS and prefix), checked against the context lengths."""
        ctx, prefix = self.target.cfg.context_length, list(req.prefix)
        source = None
        if self.encoder is not None:
            if len(req.ids) > self.encoder.context_length:
                raise ValueError(f"the source has {len(req.ids)} tokens; the encoder's context length is "
                                 f"{self.encoder.context_length}")
            source, ids = list(req.ids), self.encoder.decoder_prompt(req.forced_bos) + prefix
        else:
            ids = list(req.ids) + prefix
        if len(ids) >= ctx:
            what = "the prompt" if source is None and not prefix else \
                "the target prefix" if source is not None else "the prompt and target prefix"
            raise ValueError(f"{what} {'have' if 'and' in what else 'has'} {len(ids)} tokens; the model's context "
                             f"length is {ctx}")
        return source, ids

    def _request_eos(self, gen: GenerationConfig) -> list[int]:
        """The EOS ids in force: the request's eos_token_id, else the model's; each inside the vocabulary."""
        eos = self.eos if gen.eos_token_id is None else list(np.atleast_1d(gen.eos_token_id))
        outside = [int(t) for t in eos if int(t) >= self.target.cfg.vocab_size]
        if outside:
            raise ValueError(f"eos_token_id {outside[0]} is outside the model's vocabulary "
                             f"(0-{self.target.cfg.vocab_size - 1}): generation could never stop on it")
        return eos

    def _uses_draft(self, req: Request) -> bool:
        """Whether the request speculates (a draft model, prompt lookup or a lookahead head), its settings checked
        against the search; exact speculation needs an invariant target (refused with the fix otherwise)."""
        spec, gen = req.spec, req.gen
        use_draft = spec is not None and (self.draft is not None or spec.drafter in ("lookup", "ahead"))
        if not use_draft:
            return False
        if spec.drafter == "ahead" and not self.target.ahead:
            raise ValueError(f"drafter='ahead' needs a target with a lookahead head; {self.target.folder} has none "
                             f"(attach one with export.ahead.attach, as `specbeam fetch smollm2` does)")
        spec.check_against(gen.num_beams)
        if gen.do_sample != (spec.drafter == "sample"):
            raise ValueError("do_sample=True needs drafter='sample': trees grown by draft beam search or "
                             "best-first are not samples, and the p/q rule would bias the output"
                             if gen.do_sample else "drafter='sample' is for do_sample=True")
        if not gen.do_sample:
            self._require_invariant()
        return True

    def _sampling_search(self, req: Request, ids, max_new: int, eos, use_draft: bool, encdec) -> SamplingSearch:
        topk = [str(m.folder) for m in (self.target, self.draft if use_draft else None)
                if m is not None and m.cfg.output == "topk"]
        if topk:
            raise ValueError(f"do_sample=True needs full distributions; {', '.join(topk)} has a top-k "
                             "head (export with the default output 'logits' for sampling)")
        if use_draft and self.draft is None:
            raise ValueError("do_sample=True with speculation needs a draft model (drafter='sample')")
        return SamplingSearch(ids, self.target, self.draft if use_draft else None, req.gen, max_new_tokens=max_new,
                              eos=eos, spec=req.spec if use_draft else None, encdec=encdec)

    def _speculation(self, req: Request, eos, source) -> Speculation:
        """How an exact request drafts: the target's lookahead head, or a drafter (draft model, prompt lookup, or
        the caller's) with its per-pass budget; a pass chooser when adaptive."""
        spec, gen, K = req.spec, req.gen, req.gen.num_beams
        adaptive = spec.adaptive and req.drafter is None
        fixed = lambda load, total=spec.budget: max(K, total // load)   # noqa: E731  (a share of the pass's budget)
        if spec.drafter == "ahead":
            # the target's own lookahead head guesses the tokens after each beam's next one: no draft model
            return Speculation(budget_for=fixed,
                               ahead=HeadTree.of(self.target.ahead, spec),
                               chooser=self._chooser(gen, spec) if adaptive else None)
        # the budget is per target pass, shared by the requests in it: a lone request drafts a big tree, a busy
        # batch small ones (a batch of 32 with 48 nodes each made 1,500-node passes, and adaptive speculation's
        # probes of them cost 40% of a 64-line job); "auto" takes the largest pass the measured cost curve
        # affords at this load (K beams per running request)
        if spec.budget == "auto":
            budget_for = lambda load: max(K, self.auto_budget(K * load, spec.auto_slack) // load)   # noqa: E731
            spec = replace(spec, budget=budget_for(1))
        else:
            budget_for = fixed
        ctx = self.target.cfg.context_length
        dctx = self.draft.cfg.context_length if self.draft is not None else ctx
        # prompt lookup of an encoder-decoder request searches its source (source-side spans)
        grow = custom_drafter(req.drafter) if req.drafter else make_drafter(spec, K, eos, min(ctx, dctx),
                                                                            source=source)
        return Speculation(budget_for=budget_for, grow=grow, chooser=self._chooser(gen, spec) if adaptive else None)

    def _check_beams(self, num_beams: int, topk: int | None, use_draft: bool) -> None:
        """Beam search keeps at most as many beams as the vocabulary has tokens (a first step has no more distinct
        continuations; the draft's vocabulary when it drafts), and with a top-k head (k = `topk`) at most what a k
        within the vocabulary holds: onnxruntime refuses a wider TopK, as a traceback. (num_return_sequences <=
        num_beams; sampling draws with replacement, so it has no such bound.)"""
        vocab = self.target.cfg.vocab_size
        if use_draft and self.draft is not None:
            vocab = min(vocab, self.draft.cfg.vocab_size)
        limit, why = vocab, f"its vocabulary has {vocab} tokens"
        if topk is not None:
            extra, width = topk - 2 * num_beams, head_width(self.target.cfg)
            limit = min(limit, (width - extra) // 2)
            why = f"its top-k head reads 2 x num_beams + {extra} of the {width} tokens it scores"
        if num_beams > limit:
            raise ValueError(f"num_beams={num_beams} is more than this model allows ({why}); pass at most {limit}")

    def _beam_head_k(self, req: Request, eos, encdec: bool) -> int | None:
        """The k a top-k (or 'both') head returns per node, or None for full rows. Its best 2K + #EOS + 1 log-probs
        per beam always hold the 2K candidates beam search keeps, even with EOS masked by min_new_tokens; beam
        search then reads [beams, k], never a vocabulary-sized row (beam.BeamRows). Logits processors that move
        tokens (repetition, n-gram bans) and constraints need full rows."""
        gen = req.gen
        n_banned = len(self.encoder.suppressed) if encdec else 0
        history = bool(gen.no_repeat_ngram_size) or gen.repetition_penalty != 1.0
        dense = history or req.constraints is not None
        if dense and self.target.cfg.output == "topk":
            what = "constraints need the log-probs of their tokens" if req.constraints is not None else \
                "no_repeat_ngram_size / repetition_penalty move tokens a top-k head may need beyond its k"
            raise ValueError(f"{self.target.folder}: {what}; export with --output_kind both (or logits) to use them")
        beam_head = self.target.cfg.output in ("topk", "both") and not dense
        return 2 * gen.num_beams + len(eos) + 1 + n_banned if beam_head else None

    def encoder_outputs(self, ids: list[int]) -> tuple:
        """(the target's, the draft's) encoder outputs for a source's `ids`, as the decoders read them (a model
        script's teacher forcing); (None, None) for a decoder-only model."""
        return self._statics([ids], 1)[0](True) or (None, None)

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


def _after_prefix(constraints: lexical.Constraints | None, prefix) -> lexical.Constraints | None:
    """The output includes the target prefix: what it holds counts (a term in it is met, a span in it is copied
    once), so the search neither forces a term again nor doubles the markup."""
    if constraints is not None and prefix:
        start = constraints.start
        for t in prefix:
            start = constraints.advance(start, t)
        constraints.start = start
    return constraints
