"""Requests that arrive while others run (a server): a request prepared once (`PreparedRequest`, built by
`Engine.request`), and `Batcher`, one thread that runs the scheduler over an open queue, so every request in
flight shares each target pass (continuous batching) and a cancelled one leaves before the next pass.

    prepared = engine.request(prompt, num_beams=4)       # validated here: a bad request never reaches the queue
    batcher.submit(prepared, emit)                        # emit(Update | Done | Failed), from the batcher's thread
    prepared.cancel()                                     # any thread: stopped before its next pass

Each request's output is the one it gets alone (the scheduler's contract, scheduler.py); `Engine.stream` runs a
PreparedRequest through a scheduler of its own the same way.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from .execution.batch import score_batch, score_one
from .decoding.cache import TreeCache
from .decoding.protocol import Job, ScoreCall
from .results import Result, Stats
from .decoding.scheduler import Scheduler
from .decoding.tree import TokenTree


class PreparedRequest:
    """One request, validated and with its search built (Engine.request): its job for a scheduler, its text as
    it becomes final (`new_text`, the prefix every live and finished beam shares) and its Result (`result`)."""

    def __init__(self, engine, prompt, ids: list[int], gen, lead: list[int], search):
        self.engine, self.prompt, self.ids, self.gen, self.lead = engine, prompt, list(ids), gen, list(lead)
        self.job = Job(self, len(ids), search)
        self.shown, self._n_stable = "", 0

    def cancel(self) -> None:
        """Stop the request before its next pass (safe from any thread)."""
        self.job.cancelled = True

    @property
    def cancelled(self) -> bool:
        return self.job.cancelled

    def final_tokens(self, state) -> list[int]:
        """The tokens final so far: the lead (a target prefix) and the prefix all beams share."""
        return self.lead + list(state.stable_prefix())

    def new_text(self, state) -> str:
        """The text that became final since the last call ('' when none did)."""
        prefix = self.final_tokens(state)
        if len(prefix) <= self._n_stable or self.engine.tokenizer is None:
            return ""
        self._n_stable = len(prefix)          # decode only when more tokens became final
        text = self.engine.tokenizer.decode_stable(prefix)
        if len(text) > len(self.shown) and text.startswith(self.shown):
            delta, self.shown = text[len(self.shown):], text
            return delta
        return ""

    def answer_tokens(self, state) -> int:
        return len(self.final_tokens(state)) - len(self.lead)

    def answer_ids(self, tokens) -> list[int]:
        """A hypothesis's own tokens: after the lead, its EOS (the request's, else the model's) left out."""
        eos = set(self.engine._eos_of(self.gen))
        return [t for t in tokens[len(self.lead):] if t not in eos]

    def result(self, state, stats: Stats) -> Result:
        return self.engine.result_of(self.prompt, state, stats, self.gen, self.lead)

    def rest(self, result: Result) -> str:
        """The end of the best answer not yet given by new_text."""
        return result.text[len(self.shown):] if result.text.startswith(self.shown) else ""


@dataclass
class Update:
    """After a target pass: the text that became final (maybe ''), and the request's live statistics."""
    text: str
    stats: Stats


@dataclass
class Done:
    """The request ended: its Result (None when it was cancelled) and the text of the answer's end."""
    result: Result | None
    text: str = ""


@dataclass
class Failed:
    """The request could not finish: the pass it took part in raised."""
    error: BaseException


class QueueFull(RuntimeError):
    """Batcher.submit: the running and waiting requests are at their bound."""


class Batcher:
    """Continuous batching for requests that arrive while others run: up to `max_batch_size` requests share
    every pass, up to `max_waiting` more wait their turn (submit refuses the next with QueueFull). One thread runs
    the scheduler while there is work and sleeps otherwise; a pass that raises fails the requests in it, and the
    next ones run on a new scheduler."""

    def __init__(self, engine, *, max_batch_size: int = 8, max_waiting: int = 32,
                 max_batch_tokens: int | None = None):
        self.engine, self.max_batch_size, self.max_waiting = engine, max_batch_size, max_waiting
        self.max_batch_tokens = max_batch_tokens
        self._waiting: deque[PreparedRequest] = deque()
        self._emit: dict[int, tuple[PreparedRequest, object]] = {}   # id(prepared) -> (it, its emit) until it ends
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="specbeam-batcher", daemon=True)
        self._thread.start()

    @property
    def load(self) -> tuple[int, int]:
        """(requests in flight, of them waiting)."""
        with self._cond:
            return len(self._emit), len(self._waiting)

    def submit(self, prepared: PreparedRequest, emit) -> None:
        """Queue a request; `emit(event)` receives its Update after every target pass, then one Done or Failed
        (called on the batcher's thread: keep it short)."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if len(self._emit) >= self.max_batch_size + self.max_waiting:
                raise QueueFull(f"{len(self._emit)} requests are in flight (at most {self.max_batch_size} run "
                                f"and {self.max_waiting} wait)")
            self._emit[id(prepared)] = (prepared, emit)
            self._waiting.append(prepared)
            self._cond.notify()

    def close(self) -> None:
        """Stop taking requests, cancel those in flight, and end the thread."""
        with self._cond:
            self._closed = True
            for p, _ in self._emit.values():
                p.cancel()
            self._cond.notify()
        self._thread.join(timeout=30)

    def _next_job(self) -> Job:
        """The open queue the scheduler reads: the next waiting request, or StopIteration while none waits (the
        scheduler asks again after every round)."""
        with self._cond:
            if not self._waiting or self._closed:
                raise StopIteration
            return self._waiting.popleft().job

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed and not self._waiting:
                    return
            sched = Scheduler(self.engine.target, max_batch_size=self.max_batch_size,
                              max_batch_tokens=self.max_batch_tokens)
            try:
                for prepared, progress, finished in sched.run(_Open(self._next_job)):
                    self._deliver(prepared, progress, finished)
            except Exception as e:          # noqa: BLE001  (a pass that raised: its requests fail, others go on)
                with self._cond:
                    waiting = {id(p) for p in self._waiting}
                    failed = [v for k, v in self._emit.items() if k not in waiting]
                for p, emit in failed:
                    self._end(p)
                    emit(Failed(e))

    def _deliver(self, prepared: PreparedRequest, progress, finished: bool) -> None:
        _, emit = self._emit.get(id(prepared), (None, None))
        if emit is None:
            return
        if not finished:
            emit(Update(prepared.new_text(progress.state), progress.stats.snapshot()))
            return
        self._end(prepared)
        if prepared.cancelled:
            emit(Done(None))
            return
        try:
            result = prepared.result(progress.state, progress.stats)
        except Exception as e:        # noqa: BLE001
            emit(Failed(e))
            return
        emit(Done(result, prepared.rest(result)))

    def _end(self, prepared: PreparedRequest) -> None:
        with self._cond:
            self._emit.pop(id(prepared), None)


class _Open:
    """An iterator over an open queue: `take()` gives the next job or raises StopIteration while none waits."""

    def __init__(self, take):
        self._take = take

    def __iter__(self):
        return self

    def __next__(self):
        return self._take()


def token_logprobs(engine, ids: list[int], answer: list[int], top: int = 0,
                   chunk: int = 64) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per answer token: (its log-prob under the target after the prompt `ids` and the answer before it, the `top`
    best (token, log-prob) there), from passes over the prompt and answer as a chain (OpenAI's `logprobs`). A top-k
    head gives the log-probs among its k (a token outside them: -inf). Decoder-only models."""
    if engine.encoder is not None:
        raise ValueError("logprobs are for decoder-only models")
    V = engine.target.cfg.vocab_size
    k = min(V, max(top, 20)) if engine.target.cfg.output == "topk" else None
    tree = TokenTree()
    nodes = tree.add_chain(list(ids) + list(answer))
    cache = TreeCache(engine.target, tree)
    out: list[tuple[float, list[tuple[int, float]]]] = []
    start = len(ids) - 1           # the row of the prompt's last token predicts the answer's first
    try:
        if start > 0:              # the prompt's other rows: their K/V only, no head output read
            score_batch([ScoreCall(cache, nodes[:start], k, head_from=start)])
        for a in range(start, len(nodes) - 1, chunk):
            rows = nodes[a:min(a + chunk, len(nodes) - 1)]
            out += _chunk_logprobs(score_one(cache, rows, k), answer[a - start:a - start + len(rows)], top)
    finally:
        cache.release()
    return out


def _chunk_logprobs(head, tokens, top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """(each row's chosen token's log-prob, its `top` best) for a pass's rows: one log-softmax over the chunk and
    the top found by partition, not a sort of the vocabulary per token."""
    tokens = np.asarray(tokens, np.int64)
    rows = np.arange(len(tokens))
    if hasattr(head, "logits"):
        logp = head.log_probs().astype(np.float32)                       # [R, V]
        chosen = logp[rows, tokens]
        if top:
            part = np.sort(np.argpartition(-logp, top - 1, axis=1)[:, :top], axis=1)   # ties: lower id first
            order = np.argsort(-np.take_along_axis(logp, part, 1), axis=1, kind="stable")
            ids = np.take_along_axis(part, order, 1)
            lps = np.take_along_axis(logp, ids, 1)
        else:
            ids = lps = np.zeros((len(rows), 0))
    else:           # a top-k head: sorted, best first; a token outside its k has no log-prob there
        hit = head.ids == tokens[:, None]
        chosen = np.where(hit.any(1), np.where(hit, head.logprobs, 0).sum(1), -np.inf)
        ids, lps = head.ids[:, :top], head.logprobs[:, :top]
    return [(float(c), [(int(t), float(lp)) for t, lp in zip(i, lp_)]) for c, i, lp_ in zip(chosen, ids, lps)]
