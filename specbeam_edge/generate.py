"""The engine: plain and exact speculative beam search over one tree-shaped cache (DESIGN section 6).

The loop per target pass: grow a draft tree -> one target pass over every unscored node -> replay beam search
level by level on the target's log-probs while every kept beam is a scored node -> compact caches -> yield.
"""
from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from .beam import BeamSearch, log_softmax
from .cache import TokenTree, TreeCache
from .config import GenerationConfig, ModelFolderError, SpeculativeConfig
from .draft import make_drafter
from .model import OnnxCausalLM
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

    @property
    def beam_steps_per_pass(self) -> float:
        return self.beam_steps / max(1, self.target_passes)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(beam_steps_per_pass=round(self.beam_steps_per_pass, 3),
                 tokens_per_second=round(self.tokens_per_second, 2))
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


class Engine:
    """A target model, an optional draft model, and their tokenizer; `generate` and `stream`."""

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
            self.draft = OnnxCausalLM(draft, threads=threads, providers=providers)
            check_compatible(self.tokenizer, Tokenizer(draft), self.draft.cfg.vocab_size)
            if self.draft.cfg.vocab_size > self.target.cfg.vocab_size:
                raise ModelFolderError(f"draft vocabulary ({self.draft.cfg.vocab_size}) is larger than the "
                                       f"target's ({self.target.cfg.vocab_size})")
        self.eos = list(self.target.cfg.eos_token_ids)

    def generation_config(self, generation: GenerationConfig | None = None, **overrides) -> GenerationConfig:
        if generation is not None and not overrides:
            return generation
        base = asdict(generation) if generation is not None else self.target.cfg.generation
        return GenerationConfig.from_dict(base, **overrides)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    # -- the decoding loop ---------------------------------------------------------------------------------
    def _search(self, ids: list[int], gen: GenerationConfig, spec: SpeculativeConfig | None):
        """Yields (beam search state, stats) after every target pass."""
        ctx = self.target.cfg.context_length
        if len(ids) >= ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context length is {ctx}")
        max_new = min(gen.max_new_tokens, ctx - len(ids))
        eos = self.eos if gen.eos_token_id is None else list(np.atleast_1d(gen.eos_token_id))
        use_draft = spec is not None and self.draft is not None
        if use_draft:
            spec.check_against(gen.num_beams)
        stats = Stats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        tree = TokenTree()
        last = tree.add_chain(ids)[-1]
        P = len(ids)
        target = TreeCache(self.target, tree)
        draft = TreeCache(self.draft, tree) if use_draft else None
        grow = make_drafter(spec, gen.num_beams, eos, min(ctx, self.draft.cfg.context_length)) if use_draft else None
        bs = BeamSearch(tree, last, num_beams=gen.num_beams, prompt_len=P, max_new_tokens=max_new,
                        eos_token_ids=eos, length_penalty=gen.length_penalty,
                        early_stopping=gen.early_stopping, min_new_tokens=gen.min_new_tokens)
        rows: dict[int, tuple[np.ndarray, int]] = {}   # scored node -> (pass logits, row)
        while not bs.done:
            # 1. grow a draft tree below every running beam
            drafted: list[int] = []
            if use_draft:
                td, d0 = time.perf_counter(), draft.passes
                drafted = grow(draft, bs.running, list(bs.scores))
                stats.draft_passes += draft.passes - d0
                stats.draft_tokens_proposed += len(drafted)
                stats.draft_seconds += time.perf_counter() - td
            # 2. one target pass over every node that is not scored yet (pending beams and the tree)
            new = target.missing_ancestors(list(bs.running) + drafted)
            logits = target.score(new)
            for j, n in enumerate(new):
                if tree.depth(n) >= P - 1:
                    rows[n] = (logits, j)
            stats.target_passes += 1
            stats.target_tokens_scored += len(new)
            # 3. replay beam search while every kept beam is a scored node
            in_tree = set(drafted)
            while not bs.done and all(n in rows for n in bs.running):
                lp = log_softmax(np.stack([rows[n][0][rows[n][1]] for n in bs.running]))
                bs.step(lp)
                stats.beam_steps += 1
                stats.draft_tokens_accepted += sum(n in in_tree for n in set(bs.running))
            # 4. commit: keep only the running beams' paths (lazily), in both caches
            if target.compact(bs.running):
                rows = {n: r for n, r in rows.items() if n in target}
            if draft is not None:
                draft.compact(bs.running)
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

    # -- public API ----------------------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], generation: GenerationConfig | None = None,
               speculative: SpeculativeConfig | None = None, **overrides) -> Iterator[StreamChunk]:
        """Yield text as soon as it is final (the prefix shared by all live and finished beams); the last
        chunk carries the Result."""
        gen = self.generation_config(generation, **overrides)
        ids = self.encode(prompt)
        shown = ""
        bs = stats = None
        for bs, stats in self._search(ids, gen, speculative):
            text = self.tokenizer.decode_stable(bs.stable_prefix())
            if len(text) > len(shown) and text.startswith(shown):
                yield StreamChunk(text[len(shown):], stats)
                shown = text
        result = self._result(prompt, bs, stats, gen)
        final = result.text
        yield StreamChunk(final[len(shown):] if final.startswith(shown) else "", stats, result)

    def generate(self, prompts, generation: GenerationConfig | None = None,
                 speculative: SpeculativeConfig | None = None, **overrides) -> list[Result]:
        """Generate for one prompt (str or token ids) or a list of them; returns one Result per prompt."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, np.integer)))
        batch = [prompts] if single else list(prompts)
        gen = self.generation_config(generation, **overrides)
        out = []
        for p in batch:
            ids = self.encode(p)
            bs = stats = None
            for bs, stats in self._search(ids, gen, speculative):
                pass
            out.append(self._result(p, bs, stats, gen))
        return out

    def _result(self, prompt, bs: BeamSearch, stats: Stats, gen: GenerationConfig) -> Result:
        eos = set(self.eos if gen.eos_token_id is None else np.atleast_1d(gen.eos_token_id).tolist())
        hyps = [Hypothesis(self.tokenizer.decode([t for t in toks if t not in eos]), toks, score)
                for toks, score in bs.hypotheses(gen.num_return_sequences)]
        return Result(prompt, hyps, stats)
