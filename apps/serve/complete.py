"""One completion request through a model's Batcher: its prompts prepared (every error a 4xx before anything
runs), submitted together, their text gathered as it becomes final, stop strings cut, and the answer given whole
or as OpenAI's stream of chunks. A client that goes away has its requests cancelled before their next pass."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from specbeam_edge.online import Done, Failed, QueueFull, Update, token_logprobs
from specbeam_edge.results import Stats

from .params import ApiError, Call


class StopScan:
    """A text growing by deltas, cut at the first stop string; `feed` gives what may be sent (a tail that could
    begin a stop string is held back until it cannot)."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent, self.hit = stops, "", 0, False
        self.longest = max((len(s) for s in stops), default=0)

    def feed(self, delta: str) -> str:
        if self.hit:
            return ""
        self.text += delta
        cut = self.cut(self.text, max(0, self.sent - self.longest))
        if cut is not None:
            self.hit, self.text = True, self.text[:cut]
            return self._send(cut)
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._send(len(self.text) - hold)

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def cut(self, text: str, start: int = 0) -> int | None:
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None


@dataclass
class Group:
    """One engine request and the choices it answers (its beams, or one)."""
    prepared: object
    first: int                      # its first choice's index
    count: int
    prompt_tokens: int
    scan: StopScan
    texts: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    stats: Stats | None = None
    done: bool = False


def rest_of_context(served, ids: list[int], call: Call) -> int:
    """max_new_tokens of a request: the call's max_tokens, else the rest of the context; both checked."""
    ctx = served.engine.target.cfg.context_length
    if len(ids) >= ctx:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; the model's context length is {ctx}",
                       param="messages", code="context_length_exceeded")
    room = ctx - len(ids)
    if call.max_tokens is not None and call.max_tokens > room:
        raise ApiError(400, f"max_tokens {call.max_tokens} is more than the context leaves after the prompt's "
                            f"{len(ids)} tokens ({room} of {ctx})", param="max_tokens",
                       code="context_length_exceeded")
    return call.max_tokens or room


def prepare(served, call: Call, prompts: list[list[int]]) -> list[Group]:
    """The engine requests of a call (run in a worker thread: building a search may measure the model once)."""
    groups, index = [], 0
    for ids in prompts:
        max_new = rest_of_context(served, ids, call)
        for s in range(call.samples):
            overrides = dict(call.overrides, max_new_tokens=max_new)
            if "seed" in overrides:
                overrides["seed"] += s
            beams = overrides.get("num_beams", 1)
            if call.max_tokens is None and served.kv_tokens is not None:    # the answer's room within --kv_memory
                max_new = max(1, min(max_new, served.kv_tokens // beams - len(ids)))
                overrides["max_new_tokens"] = max_new
            need = kv_tokens(len(ids), max_new, overrides)
            if served.kv_tokens is not None and need > served.kv_tokens:
                raise ApiError(400, f"this request may hold {need} tokens of KV cache ((prompt + max_tokens) x "
                                    f"beams); the server's --kv_memory holds {served.kv_tokens}: ask for fewer "
                                    f"max_tokens or beams", param="max_tokens", code="kv_memory_exceeded")
            try:
                prepared = served.engine.request(ids, speculative=served.speculative(overrides), **overrides)
            except (ValueError, TypeError) as e:
                raise ApiError(400, str(e)) from None
            prepared.job.tokens = need          # what the batcher admits against --kv_memory
            count = call.per_request if call.samples == 1 else 1
            groups.append(Group(prepared, index, count, len(ids), StopScan(call.stop)))
            index += count
    return groups


def kv_tokens(prompt: int, max_new: int, overrides: dict) -> int:
    """The tokens of KV cache a request may hold at most: its beams' whole sequences."""
    return (prompt + max_new) * overrides.get("num_beams", 1)


class Bridge:
    """Engine requests in one model's batcher, their events bridged into this event loop: `next` gives (index, event)
    one at a time; a full queue is a 429 and cancels what it had submitted."""

    def __init__(self, batcher, prepared: list):
        self.batcher, self.prepared = batcher, prepared
        self.events: asyncio.Queue = asyncio.Queue()
        self._get: asyncio.Future | None = None

    def submit(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            for i, p in enumerate(self.prepared):
                self.batcher.submit(p, lambda ev, i=i: loop.call_soon_threadsafe(self.events.put_nowait, (i, ev)))
        except QueueFull as e:
            self.cancel()
            raise ApiError(429, f"the server is busy: {e}; retry shortly", code="queue_full",
                           headers={"Retry-After": "2"}) from None

    def cancel(self) -> None:
        for p in self.prepared:
            p.cancel()
        if self._get is not None and not self._get.done():
            self._get.cancel()

    async def next(self, timeout: float | None = None) -> tuple[int, object]:
        """The next event; TimeoutError after `timeout` seconds without one (one pending get across timeouts, so a
        timed-out wait loses no event)."""
        if self._get is None:
            self._get = asyncio.ensure_future(self.events.get())
        done, _ = await asyncio.wait({self._get}, timeout=timeout)
        if not done:
            raise TimeoutError
        item, self._get = self._get.result(), None
        return item


async def follow(request, step, finished) -> bool:
    """Await `step(0.5)` until `finished()`; False as soon as the client has gone (asked twice a second, whatever
    the events: a fast model never leaves the wait idle)."""
    checked = time.monotonic()
    while not finished():
        try:
            await step(0.5)
        except TimeoutError:
            pass
        if time.monotonic() - checked >= 0.5:
            checked = time.monotonic()
            if await request.is_disconnected():
                return False
    return True


class Run:
    """A call's groups in one model's batcher: their text as it may be sent, stop strings cut, each group's
    choices when it ends."""

    def __init__(self, served, call: Call, groups: list[Group], n_choices: int):
        self.served, self.call, self.groups, self.n_choices = served, call, groups, n_choices
        self.bridge = Bridge(served.batcher, [g.prepared for g in groups])
        self.id = uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.failed: BaseException | None = None
        self.t0 = time.perf_counter()

    def submit(self) -> None:
        self.bridge.submit()

    def cancel(self) -> None:
        self.bridge.cancel()

    @property
    def finished(self) -> bool:
        return all(g.done for g in self.groups)

    async def next(self, timeout: float | None = None):
        """(group, the text that may be sent now for its choices) after its next event; (group, None) when it
        ended (its texts and reasons set)."""
        g, event = await self.bridge.next(timeout)
        group = self.groups[g]
        if isinstance(event, Update):
            delta = group.scan.feed(event.text)
            if group.scan.hit:             # a stop string: the rest is not needed
                group.prepared.cancel()
            return group, delta
        if isinstance(event, Failed):
            self.failed, group.done = event.error, True
            self.cancel()
            return group, None
        self._finish(group, event)
        return group, None

    def _finish(self, group: Group, event: Done) -> None:
        prepared = group.prepared
        search = prepared.job.search
        group.stats, group.done = search.stats, True
        if event.result is None:           # stopped at a stop string (or by the client)
            tokens = prepared.answer_ids(prepared.final_tokens(search.state))
            group.texts = [group.scan.text] * group.count
            group.reasons = ["stop"] * group.count
            group.tokens = [self._tokens_of(tokens, group.scan.text)] * group.count
            return
        hyps = (event.result.hypotheses * group.count)[:group.count]
        for h in hyps:
            cut = group.scan.cut(h.text)
            text = h.text if cut is None else h.text[:cut]
            tokens = prepared.answer_ids(h.tokens)
            group.texts.append(text)
            group.reasons.append("stop" if cut is not None or h.finish_reason == "stop" else "length")
            group.tokens.append(tokens if cut is None else self._tokens_of(tokens, text))

    def _tokens_of(self, tokens: list[int], text: str) -> list[int]:
        """The tokens of an answer cut at a stop string: the longest prefix whose text lies within it (decoded
        lengths grow with the prefix: a bisection, not a decode per token)."""
        decode = self.served.engine.tokenizer.decode
        lo, hi = 0, len(tokens)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(decode(tokens[:mid])) <= len(text) else (lo, mid - 1)
        return tokens[:lo]

    def stats(self) -> Stats:
        total = Stats()
        for g in self.groups:
            if g.stats is not None:
                total.add(g.stats)
        return total

    async def logprobs(self, g: Group, j: int) -> list:
        if not self.call.logprobs:
            return []
        ids = g.prepared.ids + g.prepared.lead
        return await run_in_threadpool(token_logprobs, self.served.engine, ids, g.tokens[j], self.call.top_logprobs)
