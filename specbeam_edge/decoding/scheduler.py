"""Continuous batching: many request searches share every model pass (docs/HISTORY.md "The batched pass").

Each running search waits on one `ScoreCall`. Per round the scheduler runs ONE batched pass of one model over
all calls waiting on it: draft models first (so every request's draft level k is one pass), then the target
(one pass scores the trees of all requests); after a target pass the beam steps the searches then ask for
(`BeamStep`) are taken together, one array computation for all of them (beam.step_many), until every search
waits on its next pass again. A finished request leaves at once and the next queued one joins,
its prefill sharing the next target pass. The messages and their order: protocol.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from . import beam
from ..execution.batch import StaticStacks, score_batch
from .protocol import BeamStep, Job, PassContext, Progress, ScoreCall

# a prompt over this many prefill chunks grows onnxruntime's arenas well past a decoding pass's needs: once the
# scheduler runs idle after one, the models give that memory back (one tiny pass each)
LONG_PROMPT_CHUNKS = 2


def _prefill_chunk(model) -> float:
    return getattr(model, "prefill_chunk", float("inf"))          # test doubles: no chunks


@dataclass
class _Running:
    job: Job
    coro: object
    call: ScoreCall | BeamStep | None = None


class Scheduler:
    """Runs jobs with at most `max_batch_size` requests and `max_batch_tokens` prompt tokens in flight
    (None: no token limit; a single request larger than the limit still runs, alone). The jobs' iterator is asked
    again after every round once it ran dry, so an open queue (online.Batcher) can add requests while others run;
    a job whose `cancelled` is set leaves before the next pass (reported finished, with its state so far)."""

    def __init__(self, target, *, max_batch_size: int = 32, max_batch_tokens: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.target = target
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.target_passes = 0
        self.models_seen: dict[int, object] = {}        # every model a pass ran (the target, drafts)

    def run(self, jobs: Iterable[Job]) -> Iterator[tuple[object, Progress, bool]]:
        """Yields (tag, progress, finished) after every target pass of every request; finished=True once per
        request, with its final state."""
        queue = iter(jobs)
        nxt = next(queue, None)
        running: list[_Running] = []
        upcoming = PassContext((id(self), 0), 1)        # what the running requests were told about the next pass
        stacks = StaticStacks()                          # the running requests' stacked encoder outputs
        long_prompt = False                              # since the scheduler last ran idle
        while running or nxt is not None:
            # cancelled requests leave before the next pass (a client that went away: apps/serve)
            for r in [r for r in running if r.job.cancelled]:
                running.remove(r)
                yield r.job.tag, self._stop(r), True
            while nxt is not None and nxt.cancelled:
                nxt = next(queue, None)
            tokens = sum(r.job.tokens for r in running)
            joining: list[Job] = []
            while nxt is not None and len(running) + len(joining) < self.max_batch_size and (
                    not (running or joining) or self.max_batch_tokens is None
                    or tokens + nxt.tokens <= self.max_batch_tokens):
                joining.append(nxt)
                tokens += nxt.tokens
                nxt = next(queue, None)
                while nxt is not None and nxt.cancelled:
                    nxt = next(queue, None)
            # joiners share the next pass with the running requests, which already chose for it under their label
            first = PassContext((id(self), self.target_passes), upcoming.load if running else len(joining))
            for job in joining:
                long_prompt = long_prompt or job.tokens > LONG_PROMPT_CHUNKS * _prefill_chunk(self.target)
                yield from self._advance(_Running(job, job.search.run(first)), None, running, first)
            if not running:
                continue
            # one batched pass of one model: a draft first if any request is drafting, else the target
            models = {id(r.call.cache.model): r.call.cache.model for r in running}
            model = next((m for m in models.values() if m is not self.target), self.target)
            group = [r for r in running if r.call.cache.model is model]
            outs = score_batch([r.call for r in group], stacks)
            self.models_seen[id(model)] = model
            if model is self.target:
                self.target_passes += 1
                upcoming = PassContext((id(self), self.target_passes), len(running))
            for r, out in zip(group, outs):
                yield from self._advance(r, out, running, upcoming)
            # the beam steps of every request that scored in this pass, as one array computation
            while stepping := [r for r in running if isinstance(r.call, BeamStep)]:
                beam.step_many([r.call.state for r in stepping], [r.call.rows for r in stepping])
                for r in stepping:
                    yield from self._advance(r, None, running, upcoming)
            if long_prompt and not running:      # idle after a long prompt: its passes' memory goes back
                self._release_memory()
                long_prompt = False
            if nxt is None:       # an open queue (Batcher, online.py) may have been given requests meanwhile
                nxt = next(queue, None)

    def _release_memory(self) -> None:
        """The models' arenas give back what a long prompt's passes took (OnnxCausalLM.release_memory: one tiny
        pass each; test doubles have none)."""
        for model in self.models_seen.values():
            release = getattr(model, "release_memory", None)
            if release is not None:
                release()

    @staticmethod
    def _stop(r: _Running) -> Progress:
        """End a cancelled request's search where it stands: its coroutine closed, its caches let go."""
        r.coro.close()
        search = r.job.search
        search.release()
        return Progress(search.state, search.stats)

    def _advance(self, r: _Running, value, running: list[_Running], ctx: PassContext):
        """Send a pass's output into a search and run it to its next ScoreCall, reporting Progress on the way (a
        search receives `ctx`, the next pass's context, in reply to each Progress); adds or removes it from
        `running`."""
        try:
            item = r.coro.send(value)
            while isinstance(item, Progress):
                yield r.job.tag, item, False
                item = r.coro.send(ctx)
        except StopIteration:
            if r in running:
                running.remove(r)
            search = r.job.search
            yield r.job.tag, Progress(search.state, search.stats), True
            return
        r.call = item
        if r not in running:
            running.append(r)
