"""Adaptive speculation: the per-pass choice to draft or not, and the measured cost curve behind `budget="auto"`."""
from __future__ import annotations

import time

import numpy as np

from ..execution.pass_input import PassInput


class PassChooser:
    """Adaptive speculation (SpeculativeConfig.adaptive): per target pass, speculate or not, by the measured
    seconds per beam step of each choice (exponential averages of a pass's seconds and of its steps). Each choice is tried `warmup` times first;
    afterwards the slower one is probed now and then so that a change (longer contexts, another domain, a busy
    machine) is noticed: every `probe_every` passes at first, the interval doubling (up to `max_interval`)
    each time a probe confirms the choice. Passes that include the prompt's prefill are not counted.

    Plain passes are measured first. A tree pass also reports the most beam steps it could have given (every
    drafted level accepted; none when it drafted nothing); when even that best case, taken from tree passes that
    follow a tree pass (the first one after plain passes also pays the draft's catch-up over the context), is
    slower per step than plain search, the tree cannot pay on this machine at any acceptance rate, so
    speculation's remaining warm-up is skipped and it is probed only every `hopeless_every` passes (why these
    numbers: docs/HISTORY.md "Adaptive speculation").

    catch_up (a draft model's tree): the first tree pass after plain passes also runs the draft over every token
    it sat out, a cost of switching, not of drafting: that pass is left out of the rates (a probe goes on to the
    next pass). Measured once in a probe's single sample, the catch-up made the coder pair's tree look slower
    than plain search on every probe, and the chooser stopped drafting for good after four requests."""

    def __init__(self, warmup: int = 3, probe_every: int = 16, max_interval: int = 512, smoothing: float = 0.25,
                 hopeless_every: int = 4096, probe_len: int = 1, catch_up: bool = False):
        self.warmup, self.probe_every, self.max_interval, self.smoothing = warmup, probe_every, max_interval, smoothing
        self.hopeless_every = hopeless_every
        # passes per probe, averaged (1: one pass decides): a lookahead head's pass gives 1 step or 2, so one pass
        # alone said "plain" half the time on prompts where the head paid
        self.probe_len = probe_len
        self.catch_up = catch_up
        self._request_probe = None              # the pass of the last probe a request's start asked for
        self._probe: tuple[bool, bool] | None = None     # a probe under way: (arm probed, best choice before it)
        self._probe_taken = 0
        self.rate: dict[bool, float] = {}      # seconds per beam step of each choice
        self.sums: dict[bool, tuple[float, float]] = {}   # its averages of (seconds, steps) per pass
        self.count = {True: 0, False: 0}
        self.passes = 0
        self.interval = probe_every
        self.next_probe = None
        self.probing = False
        self._pass: tuple[object, bool] | None = None   # (pass id, choice): one choice per shared pass
        self.best_case: float | None = None   # lowest seconds per step a tree pass could have reached
        self._last, self.after_tree = False, False   # the previous pass's choice; whether this pass follows a tree

    def cannot_pay(self) -> bool:
        """Even a fully accepted tree would be slower per beam step than plain search (measured)."""
        return self.best_case is not None and False in self.rate and self.best_case > self.rate[False]

    def best(self) -> bool:
        return self.rate[True] <= self.rate[False]

    def new_request(self, after: int = 2) -> None:
        """A request starts: new text, on which the choice that lost may win (a lookahead head's guesses are
        taken on 0-87% of a prompt's passes, by its text): the other choice is probed `after` passes
        into it, and the interval starts again from probe_every (a tree that cannot pay keeps its long one).
        Requests that start within probe_every passes of such a probe (a busy batch) ask for no other. A draft
        model's chooser (catch_up) probes only a tree that is losing (the chosen arm's rate is live) and keeps its
        interval: each of its probes costs two tree passes, and restarting at 16 passes probed a 128-token
        request four times (Qwen2.5-Coder K=4, where trees lose: 0.95x plain)."""
        if len(self.rate) < 2 or min(self.count.values()) < self.warmup or self.cannot_pay():
            return
        # a draft model's tree that is the choice is measured every pass: on text where it stops paying its rate
        # rises past plain search's and the choice turns (a streamed pass of plain search costs a whole read:
        # probing it per request was 28 of the 142 passes of 8 requests at K=4, 1.94x instead of 2.11x)
        if self.catch_up and self.best():
            return
        nxt = self.passes + after
        if self._request_probe is not None and nxt - self._request_probe < self.probe_every:
            return
        self._request_probe = nxt
        if not self.catch_up:
            self.interval = self.probe_every
        self.next_probe = nxt if self.next_probe is None else min(self.next_probe, nxt)

    def peek(self) -> bool:
        """Whether the next pass will likely speculate, without deciding it: a lookahead-head search computes its
        head's guesses in this pass only when the next one may use them (during warm-up always; afterwards the
        best choice, or the other one when the next pass is a probe)."""
        if len(self.rate) < 2 or min(self.count.values()) < self.warmup:
            return True
        if self._probe is not None and self._probe_taken + 1 < self.probe_len:
            return self._probe[0]
        probing = self.next_probe is not None and self.passes + 1 >= self.next_probe
        return (not self.best()) if probing else self.best()

    def choose(self, pass_id=None) -> bool:
        """Speculate on this pass? Requests that share a target pass (the same pass_id) get the same answer:
        a batch drafts together or not at all, so each arm's timing is that of a whole pass."""
        if pass_id is not None and self._pass is not None and self._pass[0] == pass_id:
            return self._pass[1]
        choice = self._choose()
        self._pass = (pass_id, choice) if pass_id is not None else None
        return choice

    def _choose(self) -> bool:
        choice = self._decide()
        self.after_tree, self._last = self._last, choice
        return choice

    def _decide(self) -> bool:
        self.passes += 1
        hopeless = self.cannot_pay()
        for arm in (False, True):
            if self.count[arm] < self.warmup and not (arm and hopeless):
                return arm
        if hopeless and self.interval < self._hopeless_interval():
            self.interval = self._hopeless_interval()
            self.next_probe = self.passes + self.interval
        if self.next_probe is None:
            self.next_probe = self.passes + self.interval
        if self._probe is not None:                   # a probe of several passes goes on
            return self._probe[0]
        self.probing = self.passes >= self.next_probe
        if self.probing:
            self._probe, self._probe_taken = (not self.best(), self.best()), 0
            return self._probe[0]
        return self.best()

    def update(self, speculated: bool, seconds: float, steps: int, max_steps: int | None = None) -> None:
        """One pass's measurement; max_steps (tree passes): the beam steps it would have given had every drafted
        level been accepted (the tree's depth + 1)."""
        if speculated and self.catch_up and not self.after_tree:
            return                   # the draft's catch-up after plain passes: not a sample of either choice
        if speculated and max_steps and self.after_tree:
            best = seconds / max(max_steps, steps)
            self.best_case = best if self.best_case is None else min(self.best_case, best)
        k = max(1, steps)
        old = self.sums.get(speculated)
        probe = self._probe is not None and speculated == self._probe[0]
        if probe:
            self._probe_taken += 1
        # a probe is the first look at its choice in a while: its sample replaces the stale average. The rate is
        # the average seconds over the average steps, not an average of each pass's seconds / steps: a tree's
        # steps vary from pass to pass, and the mean of the ratios overstates its cost (a lookahead head on
        # SmolLM2-135M, 1 or 2 steps a pass: 14.1 ms a step against plain's 13.8, while it ran 1.16x faster)
        if old is None or (probe and self._probe_taken == 1):
            sec, n = seconds, float(k)
        else:       # within a probe: the mean of its passes; otherwise the exponential average
            w = 1 / self._probe_taken if probe else self.smoothing
            sec, n = old[0] + w * (seconds - old[0]), old[1] + w * (k - old[1])
        self.sums[speculated] = (sec, n)
        self.rate[speculated] = sec / n
        self.count[speculated] += 1
        if probe and self._probe_taken >= self.probe_len:
            before = self._probe[1]
            self.probing, self._probe = False, None
            same = self.best() == before
            if not same:
                self.interval = self.probe_every
            else:
                self.interval = (self._hopeless_interval() if self.cannot_pay()
                                 else min(2 * self.interval, self.max_interval))
            self.next_probe = self.passes + self.interval

    def _hopeless_interval(self) -> int:
        return max(self.hopeless_every, self.max_interval)


class ChoosersByLoad:
    """One PassChooser per batch occupancy (1, 2-3, 4-7, ...): what drafting costs and buys per beam step
    depends on how many requests share the pass (measured at batch 16: a chooser that had learnt at batch 1 and
    4 left adaptive speculation at 0.76x plain batching)."""

    def __init__(self, **chooser):
        self.by_load: dict[int, PassChooser] = {}
        self.chooser = chooser          # PassChooser's settings

    def at(self, load: int) -> PassChooser:
        return self.by_load.setdefault(1 << (max(1, load).bit_length() - 1), PassChooser(**self.chooser))


def cost_curve(lm, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), past: int = 32,
               reps: int = 3, static: dict | None = None) -> dict[int, float]:
    """Measured pass time (s) of model `lm` over a tree of Q nodes on top of `past` cached tokens. static: an
    encoder-decoder's static inputs (a source's cross K/V and mask, batch 1)."""
    rng = np.random.default_rng(0)
    ctx = lm.cfg.context_length
    _, kv = lm.run(PassInput.over(lm, rng.integers(1, lm.cfg.vocab_size, past), np.arange(past),
                                  np.tril(np.ones((past, past), bool)), lm.empty_past(), np.zeros(0, np.int64),
                                  static=static))
    out = {}
    for q in sizes:
        if past + q > ctx:
            break
        m = np.ones((q, past + q), bool)
        m[:, past:] = np.eye(q, dtype=bool)
        p = PassInput.over(lm, rng.integers(1, lm.cfg.vocab_size, q), np.full(q, past), m, kv, np.arange(past),
                           static=static)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            lm.run(p)
            times.append(time.perf_counter() - t0)
        out[q] = float(np.median(times))
    return out


def streamed_cost_curve(lm, sizes=(1, 2, 4, 8, 16, 32, 64), past: int = 32,
                        reps: int = 3) -> dict[int, float]:
    """Modelled pass time (s) over a tree of Q nodes for a target that streams layers (split layout): each part
    measured once on this machine, not every tree size streamed (a pass reads ~1 GB for Qwen2.5-Coder-1.5B):
    a layer's compute at Q rows (times the layers), the head's, and the read of the streamed layers. The stream
    of layer i+1 overlaps the compute of layer i (offload.py), so the layers cost max(reading, computing):
    a tree costs nothing extra until its compute outgrows the disk. Sizes stop at 64: the model leaves out the
    drafting, which grows with the tree (a 0.5B draft level at 16 rows cost 3-5x one at 1-4 rows here), and on
    Qwen2.5-Coder-1.5B trees of 64 and 128 nodes gave the same speed; larger ones' logits (Q x vocabulary floats)
    would also outgrow the memory budget."""
    stream = lm.streamed_layers() * lm.runner.store.read_seconds()
    out = {}
    for q in sizes:
        if past + q > lm.cfg.context_length:
            break
        layer, head = lm.part_seconds(q, past, reps)
        out[q] = max(stream, lm.cfg.num_layers * layer) + head
    return out


def auto_budget(curve: dict[int, float], num_beams: int, slack: float = 1.6) -> int:
    """Hardware-aware tree budget (as Sequoia): the largest tree whose pass costs at most `slack` times a pass
    over the beams alone, on this machine and placement."""
    base = min((t for q, t in curve.items() if q >= num_beams), default=None)
    if base is None:
        return num_beams
    fits = [q for q, t in curve.items() if q >= num_beams and t <= slack * base]
    return max(max(fits, default=num_beams), num_beams)
