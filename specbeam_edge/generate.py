"""The engine: plain and exact speculative beam search over one tree-shaped cache (DESIGN section 6).

The loop per target pass: grow a draft tree -> one target pass over every unscored node -> replay beam search
level by level on the target's log-probs while every kept beam is a scored node -> compact caches -> yield.
"""
from __future__ import annotations

import resource
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from .beam import BeamSearch, log_softmax
from .cache import TokenTree, TreeCache
from .config import GenerationConfig, ModelFolderError, SpeculativeConfig
from .draft import make_drafter
from .model import OnnxCausalLM
from .sampling import SampleState, choose_width, draw, verify_level
from .tokenizer import Tokenizer, check_compatible


def peak_rss_mb() -> float:
    """Peak resident memory of this process (VmHWM; ru_maxrss survives exec and can report a parent's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0
    plain_passes: int = 0             # passes without a tree (adaptive speculation chose not to draft)
    beam_steps: int = 0
    target_tokens_scored: int = 0
    draft_passes: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    time_to_first_token: float | None = None
    peak_memory_mb: float = 0.0
    offload: dict | None = None       # bytes moved and load/wait/compute time per target pass, when streaming
    widths: list = field(default_factory=list)   # beams kept per level (beam sampling)
    from_draft: list = field(default_factory=list)  # per beam step: covered by the draft tree (not the pass's own)

    @property
    def beam_steps_per_pass(self) -> float:
        return self.beam_steps / max(1, self.target_passes)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self, per_step: bool = False) -> dict:
        """Flat statistics; the per-step lists are summarised unless per_step=True."""
        d = asdict(self)
        d.update(beam_steps_per_pass=round(self.beam_steps_per_pass, 3),
                 tokens_per_second=round(self.tokens_per_second, 2))
        if not per_step:
            d["steps_from_draft"] = sum(d.pop("from_draft"))
            widths = d.pop("widths")
            if widths:
                d["mean_width"] = round(sum(widths) / len(widths), 3)
        return d

    def add(self, other: "Stats") -> None:
        for k, v in asdict(other).items():
            if k == "offload":
                self.offload = v
            elif k == "peak_memory_mb":
                self.peak_memory_mb = max(self.peak_memory_mb, v)
            elif k == "time_to_first_token":
                if self.time_to_first_token is None:
                    self.time_to_first_token = v
            else:
                setattr(self, k, getattr(self, k) + v)


@dataclass
class Hypothesis:
    text: str
    tokens: list[int]
    score: float


@dataclass
class Result:
    prompt: str | list[int]
    hypotheses: list[Hypothesis]
    stats: Stats = field(default_factory=Stats)

    @property
    def text(self) -> str:
        return self.hypotheses[0].text


@dataclass
class StreamChunk:
    text: str                 # new final text since the previous chunk
    stats: Stats
    result: Result | None = None   # set on the last chunk


class PassChooser:
    """Adaptive speculation (SpeculativeConfig.adaptive): per target pass, speculate or not, by the measured
    seconds per beam step of each choice (an exponential average). Each choice is tried `warmup` times first;
    afterwards the slower one is probed now and then so that a change (longer contexts, another domain, a busy
    machine) is noticed: every `probe_every` passes at first, the interval doubling (up to `max_interval`)
    each time a probe confirms the choice. Passes that include the prompt's prefill are not counted."""

    def __init__(self, warmup: int = 3, probe_every: int = 16, max_interval: int = 512, smoothing: float = 0.25):
        self.warmup, self.probe_every, self.max_interval, self.smoothing = warmup, probe_every, max_interval, smoothing
        self.rate: dict[bool, float] = {}
        self.count = {True: 0, False: 0}
        self.passes = 0
        self.interval = probe_every
        self.next_probe = None
        self.probing = False

    def best(self) -> bool:
        return self.rate[True] <= self.rate[False]

    def choose(self) -> bool:
        self.passes += 1
        for arm in (True, False):
            if self.count[arm] < self.warmup:
                return arm
        if self.next_probe is None:
            self.next_probe = self.passes + self.interval
        self.probing = self.passes >= self.next_probe
        return (not self.best()) if self.probing else self.best()

    def update(self, speculated: bool, seconds: float, steps: int) -> None:
        before = self.best() if len(self.rate) == 2 else None
        r = seconds / max(1, steps)
        old = self.rate.get(speculated)
        # a probe is the first look at its choice in a while: its sample replaces the stale average
        self.rate[speculated] = r if old is None or self.probing else old + self.smoothing * (r - old)
        self.count[speculated] += 1
        if self.probing:
            self.probing = False
            same = self.best() == before
            self.interval = min(2 * self.interval, self.max_interval) if same else self.probe_every
            self.next_probe = self.passes + self.interval


class Engine:
    """A target model, an optional draft model, and their tokenizer; `generate` and `stream`."""

    @classmethod
    def from_models(cls, target, draft=None, tokenizer=None) -> "Engine":
        """An engine over already-built model objects (OnnxCausalLM or anything with its interface)."""
        self = cls.__new__(cls)
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.eos = list(target.cfg.eos_token_ids)
        return self

    def __init__(self, target: str | Path, draft: str | Path | None = None, *, threads: int | None = None,
                 max_memory: int | None = None, host_memory: int | None = 0, placement: list[str] | None = None,
                 providers: list[str] | None = None):
        """max_memory/host_memory/placement stream the target's layers (split layout; see offload.py);
        providers: onnxruntime execution providers (default CPU)."""
        self.target = OnnxCausalLM(target, threads=threads, max_memory=max_memory, host_memory=host_memory,
                                   placement=placement, providers=providers)
        self.tokenizer = Tokenizer(target)
        self.draft = None
        if draft is not None:
            if not Path(draft).is_dir():
                raise ModelFolderError(f"draft model folder {draft} does not exist")
            # the draft is small: one thread and no busy-waiting, so it does not steal the target's cores
            self.draft = OnnxCausalLM(draft, threads=1, providers=providers, spin=False)
            check_compatible(self.tokenizer, Tokenizer(draft), self.draft.cfg.vocab_size)
            if self.draft.cfg.vocab_size > self.target.cfg.vocab_size:
                raise ModelFolderError(f"draft vocabulary ({self.draft.cfg.vocab_size}) is larger than the "
                                       f"target's ({self.target.cfg.vocab_size})")
        self.eos = list(self.target.cfg.eos_token_ids)

    def generation_config(self, generation: GenerationConfig | None = None, **overrides) -> GenerationConfig:
        if generation is not None and not overrides:
            return generation
        base = asdict(generation) if generation is not None else dict(self.target.cfg.generation)
        return GenerationConfig.from_dict(base, **overrides)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def cost_curve(self, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), past: int = 32,
                   reps: int = 3) -> dict[int, float]:
        """Measured target pass time (s) over a tree of Q nodes on top of `past` cached tokens."""
        lm, rng = self.target, np.random.default_rng(0)
        ctx = lm.cfg.context_length
        mask = np.tril(np.ones((past, past), bool))[None, None]
        _, kv = lm.forward(rng.integers(1, lm.cfg.vocab_size, (1, past)), np.arange(past)[None], mask,
                           lm.empty_past())
        out = {}
        for q in sizes:
            if past + q > ctx:
                break
            m = np.ones((1, 1, q, past + q), bool)
            m[0, 0, :, past:] = np.eye(q, dtype=bool)
            ids, pos = rng.integers(1, lm.cfg.vocab_size, (1, q)), np.full((1, q), past)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                lm.forward(ids, pos, m, kv)
                times.append(time.perf_counter() - t0)
            out[q] = float(np.median(times))
        return out

    def auto_budget(self, num_beams: int, slack: float = 1.6) -> int:
        """Hardware-aware tree budget (as Sequoia): the largest tree whose pass costs at most `slack` times a
        pass over the beams alone, on this machine and placement. Measured once per engine."""
        if not hasattr(self, "_curve"):
            self._curve = self.cost_curve()
        base = min((t for q, t in self._curve.items() if q >= num_beams), default=None)
        if base is None:
            return num_beams
        fits = [q for q, t in self._curve.items() if q >= num_beams and t <= slack * base]
        return max(max(fits, default=num_beams), num_beams)

    def _beam_logprobs(self, rows, running, topk) -> np.ndarray:
        """[beams, V] log-probs of the running beams from the pass outputs (dense; -inf outside the top-k)."""
        if not topk:
            return log_softmax(np.stack([rows[n][0][rows[n][1]] for n in running]))
        lp = np.full((len(running), self.target.cfg.vocab_size), -np.inf, np.float32)
        for b, n in enumerate(running):
            (vals, ids), j = rows[n]
            lp[b, ids[j]] = vals[j]
        return lp

    def _chooser(self, gen: GenerationConfig, spec: SpeculativeConfig) -> PassChooser:
        """One PassChooser per (beams, tree settings), kept across requests: what was learnt on earlier
        prompts carries over (a batch job decides after a few lines)."""
        if not hasattr(self, "_choosers"):
            self._choosers = {}
        key = (gen.num_beams, gen.length_penalty, replace(spec, adaptive=False))
        return self._choosers.setdefault(key, PassChooser())

    # -- the decoding loop ---------------------------------------------------------------------------------
    def _search(self, ids: list[int], gen: GenerationConfig, spec: SpeculativeConfig | None, drafter=None):
        """Yields (beam search state, stats) after every target pass. `drafter` overrides the policy named in
        spec (any callable with the Drafter signature; see draft.py)."""
        ctx = self.target.cfg.context_length
        if len(ids) >= ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context length is {ctx}")
        max_new = min(gen.max_new_tokens, ctx - len(ids))
        eos = self.eos if gen.eos_token_id is None else list(np.atleast_1d(gen.eos_token_id))
        use_draft = spec is not None and (self.draft is not None or spec.drafter == "lookup")
        if use_draft:
            spec.check_against(gen.num_beams)
            if gen.do_sample != (spec.drafter == "sample"):
                raise ValueError("do_sample=True needs drafter='sample': trees grown by draft beam search or "
                                 "best-first are not samples, and the p/q rule would bias the output"
                                 if gen.do_sample else "drafter='sample' is for do_sample=True")
        if use_draft and not getattr(self.target.cfg, "raw", {}).get("batch_invariant", True):
            warnings.warn(f"{self.target.folder}: this {self.target.cfg.precision} graph quantizes activations "
                          "per pass, so tree passes round differently from single passes; speculative output can "
                          "differ from plain beam search beyond near-ties. Use an fp32/fp16 (or split int8) "
                          "export for exact results.", stacklevel=3)
        if gen.do_sample:
            topk = [str(m.folder) for m in (self.target, self.draft if use_draft else None)
                    if m is not None and m.cfg.output == "topk"]
            if topk:
                raise ValueError(f"do_sample=True needs full distributions; {', '.join(topk)} has a top-k "
                                 "head (export with the default output 'logits' for sampling)")
            if use_draft and self.draft is None:
                raise ValueError("do_sample=True with speculation needs a draft model (drafter='sample')")
            yield from self._sample_search(ids, gen, spec if use_draft else None, eos, max_new)
            return
        stats = Stats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        tree = TokenTree()
        last = tree.add_chain(ids)[-1]
        P = len(ids)
        target = TreeCache(self.target, tree)
        # the draft's cache (a lookup drafter needs only the tree, which it reaches through this object)
        draft = TreeCache(self.draft, tree) if use_draft else None
        grow = None
        if use_draft and spec.budget == "auto":
            spec = replace(spec, budget=self.auto_budget(gen.num_beams, spec.auto_slack))
        if use_draft:
            dctx = self.draft.cfg.context_length if self.draft is not None else ctx
            grow = drafter or make_drafter(spec, gen.num_beams, eos, min(ctx, dctx))
        bs = BeamSearch(tree, last, num_beams=gen.num_beams, prompt_len=P, max_new_tokens=max_new,
                        eos_token_ids=eos, length_penalty=gen.length_penalty,
                        early_stopping=gen.early_stopping, min_new_tokens=gen.min_new_tokens)
        rows: dict[int, tuple[np.ndarray, int]] = {}   # scored node -> (pass output, row)
        # a top-k head returns each node's best log-probs only: 2K + #EOS + 1 per beam always hold the 2K
        # candidates beam search keeps, even with EOS masked by min_new_tokens
        topk = 2 * gen.num_beams + len(eos) + 1 if self.target.cfg.output == "topk" else None
        chooser = self._chooser(gen, spec) if use_draft and spec.adaptive and drafter is None else None
        while not bs.done:
            tp = time.perf_counter()
            speculate = use_draft and (chooser is None or chooser.choose())
            steps0 = stats.beam_steps
            # 1. grow a draft tree below every running beam
            drafted: list[int] = []
            if speculate:
                td, d0 = time.perf_counter(), draft.passes
                drafted = grow(draft, bs.running, list(bs.scores))
                stats.draft_passes += draft.passes - d0
                stats.draft_tokens_proposed += len(drafted)
                stats.draft_seconds += time.perf_counter() - td
            # 2. one target pass over every node that is not scored yet (pending beams and the tree)
            new = target.missing_ancestors(list(bs.running) + drafted)
            logits = target.score(new, topk=topk)
            for j, n in enumerate(new):
                if tree.depth(n) >= P - 1:
                    rows[n] = (logits, j)
            stats.target_passes += 1
            stats.plain_passes += use_draft and not speculate
            stats.target_tokens_scored += len(new)
            # 3. replay beam search while every kept beam is a scored node
            in_tree = set(drafted)
            first = True
            while not bs.done and all(n in rows for n in bs.running):
                lp = self._beam_logprobs(rows, bs.running, topk)
                bs.step(lp)
                stats.beam_steps += 1
                stats.from_draft.append(not first)
                first = False
                stats.draft_tokens_accepted += sum(n in in_tree for n in set(bs.running))
            # 4. commit: keep only the running beams' paths (lazily), in both caches
            if target.compact(bs.running):
                rows = {n: r for n, r in rows.items() if n in target}
            if speculate and draft is not None:    # a draft that sat this pass out catches up when next used
                draft.compact(bs.running)
            if chooser is not None and stats.target_passes > 1:   # the first pass carries the prefill
                chooser.update(speculate, time.perf_counter() - tp, stats.beam_steps - steps0)
            if stats.time_to_first_token is None:
                stats.time_to_first_token = time.perf_counter() - t0
            stats.seconds = time.perf_counter() - t0
            yield bs, stats
        stats.generated_tokens = bs.cur_len - P
        stats.peak_memory_mb = peak_rss_mb()
        store = getattr(self.target, "store", None)
        if store is not None and store.streamed:
            stats.offload = {**store.stats.per_pass(), "placement": list(store.placement.places)}
        stats.seconds = time.perf_counter() - t0

    def _sample_search(self, ids, gen: GenerationConfig, spec: SpeculativeConfig | None, eos, max_new):
        """Beam sampling (spec None) or speculative beam sampling (DSBD) over the same tree caches."""
        rng = np.random.default_rng(gen.seed)
        stats = Stats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        tree = TokenTree()
        P = len(ids)
        st = SampleState(tree, tree.add_chain(ids)[-1], prompt_len=P, max_new_tokens=max_new, eos=eos,
                         min_new_tokens=gen.min_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
                         top_p=gen.top_p)
        target = TreeCache(self.target, tree)
        draft = TreeCache(self.draft, tree) if spec else None
        K = gen.num_beams
        W = (spec.draft_width or max(K, spec.max_branch_width)) if spec else K
        t_rows: dict[int, np.ndarray] = {}
        d_rows: dict[int, np.ndarray] = {}

        def scored(cache, rows, nodes):
            new = cache.missing_ancestors(nodes)
            if new:
                lp = log_softmax(cache.score(new))
                rows.update({n: lp[j] for j, n in enumerate(new) if tree.depth(n) >= P - 1})
            return len(new)

        while not st.done:
            # 1. the draft samples gamma levels of beam sampling (i.i.d. draws, q recorded per level)
            levels, parents, dscore = [], list(st.live), dict(st.score)
            td = time.perf_counter()
            for j in range(spec.max_depth if spec else 0):
                if st.cur_len + j >= st.max_len or not parents:
                    break
                scored(draft, d_rows, parents)
                stats.draft_passes += 1
                space = sorted(set(parents))
                q = st.joint(space, parents, d_rows.__getitem__, dscore, st.cur_len + j)
                V = len(q) // len(space)
                picks = draw(q, W, rng)
                kids = [tree.add(space[i // V], i % V) for i in picks]
                for i, c in zip(picks, kids):
                    dscore[c] = dscore[space[i // V]] + float(d_rows[space[i // V]][i % V])
                levels.append((space, q, picks))
                parents = [c for c in kids if tree.token(c) not in st.eos]
                stats.draft_tokens_proposed += len(set(kids))
            stats.draft_seconds += time.perf_counter() - td
            # 2. one target pass over the pending beams and every drafted node
            drafted = [tree.add(sp[i // (len(q) // len(sp))], i % (len(q) // len(sp)))
                       for sp, q, picks in levels for i in picks]
            stats.target_tokens_scored += scored(target, t_rows, list(st.live) + drafted)
            stats.target_passes += 1
            # 3. verify level by level; a short level is completed from the residual and ends the pass
            full = True
            for space, q, picks in levels:
                p = st.joint(space, st.live, t_rows.__getitem__, st.score, st.cur_len)
                k = choose_width(p, q, W, spec.width_threshold, spec.min_num_beams, K)
                out, accepted = verify_level(p, q, picks, k, rng)
                full = accepted == k
                st.advance(out, space, len(q) // len(space), t_rows.__getitem__)
                stats.beam_steps += 1
                stats.from_draft.append(full)
                stats.draft_tokens_accepted += accepted
                if not full or st.done:
                    break
            if full and not st.done and all(n in t_rows for n in st.live):
                space = sorted(set(st.live))
                p = st.joint(space, st.live, t_rows.__getitem__, st.score, st.cur_len)
                st.advance(draw(p, K, rng), space, len(p) // len(space), t_rows.__getitem__)
                stats.beam_steps += 1
                stats.from_draft.append(False)
            if spec and spec.single_sequence and st.live:
                st.live = st.live[:1]          # memory-saving mode: one sequence between passes
            # 4. commit
            keep = list(st.live)
            if target.compact(keep):
                t_rows = {n: r for n, r in t_rows.items() if n in target}
            if draft is not None and draft.compact(keep):
                d_rows = {n: r for n, r in d_rows.items() if n in draft}
            if stats.time_to_first_token is None:
                stats.time_to_first_token = time.perf_counter() - t0
            stats.seconds = time.perf_counter() - t0
            yield st, stats
        stats.widths = st.widths
        stats.generated_tokens = st.cur_len - P
        stats.peak_memory_mb = peak_rss_mb()
        stats.seconds = time.perf_counter() - t0

    # -- public API ----------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], generation: GenerationConfig | None = None,
               speculative: SpeculativeConfig | None = None, **overrides) -> Iterator[StreamChunk]:
        """Yield text as soon as it is final (the prefix shared by all live and finished beams), one chunk per
        target pass (empty when nothing new became final); the last chunk carries the Result."""
        gen = self.generation_config(generation, **overrides)
        ids = self.encode(prompt)
        shown, n_stable = "", 0
        bs = stats = None
        for bs, stats in self._search(ids, gen, speculative):
            prefix, delta = bs.stable_prefix(), ""
            if len(prefix) > n_stable:        # decode only when more tokens became final
                n_stable = len(prefix)
                text = self.tokenizer.decode_stable(prefix)
                if len(text) > len(shown) and text.startswith(shown):
                    delta, shown = text[len(shown):], text
            yield StreamChunk(delta, stats)   # one chunk per target pass (maybe empty): callers can stop here
        result = self._result(prompt, bs, stats, gen)
        final = result.text
        yield StreamChunk(final[len(shown):] if final.startswith(shown) else "", stats, result)

    def generate(self, prompts, generation: GenerationConfig | None = None,
                 speculative: SpeculativeConfig | None = None, drafter=None, **overrides) -> list[Result]:
        """Generate for one prompt (str or token ids) or a list of them; returns one Result per prompt.
        drafter: a custom tree-growth callable (exact beam search only)."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        gen = self.generation_config(generation, **overrides)
        out = []
        for p in batch:
            ids = self.encode(p)
            bs = stats = None
            for bs, stats in self._search(ids, gen, speculative, drafter):
                pass
            out.append(self._result(p, bs, stats, gen))
        return out

    def generate_iter(self, prompts, generation: GenerationConfig | None = None,
                      speculative: SpeculativeConfig | None = None, *, max_batch_size: int = 32,
                      max_batch_tokens: int | None = None, **overrides) -> Iterator[tuple[int, Result]]:
        """Yield (index into prompts, Result) in completion order; requests share target passes up to
        max_batch_size requests / max_batch_tokens cached tokens."""
        gen = self.generation_config(generation, **overrides)
        for i, p in enumerate(prompts):
            ids = self.encode(p)
            bs = stats = None
            for bs, stats in self._search(ids, gen, speculative):
                pass
            yield i, self._result(p, bs, stats, gen)

    def _result(self, prompt, bs: BeamSearch, stats: Stats, gen: GenerationConfig) -> Result:
        eos = set(self.eos if gen.eos_token_id is None else np.atleast_1d(gen.eos_token_id).tolist())
        decode = self.tokenizer.decode if self.tokenizer else (lambda ids: "")
        hyps = [Hypothesis(decode([t for t in toks if t not in eos]), toks, score)
                for toks, score in bs.hypotheses(gen.num_return_sequences)]
        return Result(prompt, hyps, stats)
