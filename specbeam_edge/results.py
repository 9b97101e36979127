"""What a request returns: hypotheses, text, and the statistics every caller reads (CLI, apps, bench)."""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field, replace


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
    peak_memory_mb: float = 0.0       # the process's peak resident memory (all requests, the models)
    kv_cache_peak_mb: float = 0.0     # this request's own: the peak of its target KV cache plus its draft's
    offload: dict | None = None       # bytes moved and load/wait/compute time per target pass, when streaming
    batch_sizes: list = field(default_factory=list)  # requests sharing each target pass this request took part in
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
            sizes = d.pop("batch_sizes")
            if sizes:
                d["mean_batch_size"] = round(sum(sizes) / len(sizes), 2)
            widths = d.pop("widths")
            if widths:
                d["mean_width"] = round(sum(widths) / len(widths), 3)
        return d

    def __str__(self) -> str:
        """One line for people (print(result.stats)): tokens, time, speed, passes, drafting, memory."""
        drafted = f", {self.draft_tokens_accepted} of {self.draft_tokens_proposed} drafted tokens accepted" \
            if self.draft_tokens_proposed else ""
        return (f"{self.generated_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.1f} tok/s), "
                f"{self.target_passes} target passes, {self.beam_steps_per_pass:.2f} beam steps a pass{drafted}, "
                f"peak memory {self.peak_memory_mb:.0f} MB")

    def __repr__(self) -> str:
        """The fields of as_dict, its per-step lists summarised and floats rounded: the lists of a long answer
        filled screens (they stay fields; as_dict(per_step=True) gives them)."""
        d = self.as_dict()
        d.pop("offload")
        shown = (f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in d.items())
        return f"Stats({', '.join(shown)})"

    def snapshot(self) -> "Stats":
        """An independent copy (stream chunks carry snapshots, not the live object)."""
        return replace(self, widths=list(self.widths), from_draft=list(self.from_draft),
                       offload=dict(self.offload) if self.offload else None)

    def add(self, other: "Stats") -> None:
        for k, v in asdict(other).items():
            if k == "offload":
                self.offload = v
            elif k in ("peak_memory_mb", "kv_cache_peak_mb"):      # a peak over requests, not a sum
                setattr(self, k, max(getattr(self, k), v))
            elif k == "time_to_first_token":
                if self.time_to_first_token is None:
                    self.time_to_first_token = v
            else:
                setattr(self, k, getattr(self, k) + v)


def answer_tokens(tokens, eos, lead: int = 0) -> int:
    """How many tokens an answer has: a hypothesis's tokens after its `lead` (a target prefix), EOS not counted."""
    return sum(1 for t in list(tokens)[lead:] if t not in eos)


@dataclass
class Hypothesis:
    text: str
    tokens: list[int]
    score: float
    constraints_met: bool | None = None   # with constraints: whether it contains every one (None: none given)
    # why it ended: "stop" (an EOS token), "length" (max_new_tokens), "context" (the model's context length came
    # first), "interrupted" (stopped by the caller: a partial answer); None where unknown
    finish_reason: str | None = None


@dataclass
class Alternative:
    """One of the most probable tokens at a position (Engine.alternatives): its id, its text (as it reads after
    the prefix), its log-prob there, and the best hypothesis that continues with it: beam search from the
    prefix and this token (which it includes; its score is of the tokens after them, 0.0 when the token is
    EOS: none follow)."""
    token_id: int
    token: str
    logprob: float
    hypothesis: Hypothesis

    @property
    def text(self) -> str:
        return self.hypothesis.text


@dataclass
class Result:
    prompt: str | list[int]
    hypotheses: list[Hypothesis]
    stats: Stats = field(default_factory=Stats)
    left_out: int = 0           # Engine.chat: the earliest messages left out to fit the context

    @property
    def text(self) -> str:
        return self.hypotheses[0].text

    @property
    def finish_reason(self) -> str | None:
        """Why the best hypothesis ended: "stop", "length", "context" (see Hypothesis.finish_reason)."""
        return self.hypotheses[0].finish_reason if self.hypotheses else None


@dataclass
class StreamChunk:
    text: str                 # new final text since the previous chunk
    stats: Stats              # a snapshot taken when the chunk was made
    result: Result | None = None   # set on the last chunk
