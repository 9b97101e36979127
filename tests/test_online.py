"""online.Batcher: requests that arrive while others run share passes and each gets its answer alone; a cancelled
request stops before its next pass; a pass that raises fails its own requests only."""
import threading

import pytest

from helpers import assert_same_hypotheses
from specbeam_edge import Engine
from specbeam_edge.online import Batcher, Done, Failed, QueueFull, Update


class Inbox:
    """The events of one request, filled by the batcher's thread."""

    def __init__(self, on_update=None):
        self.events, self.done = [], threading.Event()
        self.on_update = on_update

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, Update) and self.on_update is not None:
            self.on_update(self, event)
        if isinstance(event, (Done, Failed)):
            self.done.set()

    def end(self, timeout: float = 120):
        assert self.done.wait(timeout), "the request did not end"
        return self.events[-1]


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(pair[0], draft=pair[1])


@pytest.mark.parametrize("settings", [dict(num_beams=1), dict(num_beams=3, num_return_sequences=2)])
def test_staggered_requests_equal_alone(engine, settings):
    prompts = [[5, 9, 13], [7, 1], [2, 4, 6, 8, 10], [11]]
    alone = [engine.generate(p, speculative="default", max_new_tokens=12, **settings)[0] for p in prompts]
    batcher = Batcher(engine, max_batch_size=3, max_waiting=4)
    try:
        inboxes = [Inbox() for _ in prompts]
        late = []

        def join_late(box, event):      # the others arrive while the first one runs
            if not late:
                late.append(True)
                for p, b in zip(prompts[1:], inboxes[1:]):
                    batcher.submit(engine.request(p, max_new_tokens=12, **settings), b)
        inboxes[0].on_update = join_late
        batcher.submit(engine.request(prompts[0], max_new_tokens=12, **settings), inboxes[0])
        ends = [b.end() for b in inboxes]
    finally:
        batcher.close()
    for want, got in zip(alone, ends):
        assert isinstance(got, Done) and got.result is not None
        assert_same_hypotheses(want, got.result)
    # the first request shared passes with those that arrived while it ran
    assert max(ends[0].result.stats.batch_sizes) > 1, "the late requests waited for the first to end"
    streamed = "".join(e.text for e in inboxes[0].events if isinstance(e, Update)) + ends[0].text
    assert streamed == alone[0].text


def test_cancel_stops_before_the_next_pass(engine):
    batcher = Batcher(engine)
    seen = []

    def cancel_now(box, event):
        seen.append(event.stats.target_passes)
        prepared.cancel()
    try:
        box = Inbox(cancel_now)
        prepared = engine.request([3, 1, 4, 1, 5], num_beams=4, max_new_tokens=40, min_new_tokens=40)
        batcher.submit(prepared, box)
        end = box.end()
        assert isinstance(end, Done) and end.result is None
        assert seen == [1], "a pass ran after the cancel"
        assert prepared.job.search.stats.target_passes == 1
        # the batcher goes on serving
        box2 = Inbox()
        batcher.submit(engine.request([3, 1, 4], num_beams=4, max_new_tokens=4), box2)
        assert box2.end().result.hypotheses[0].tokens == engine.generate([3, 1, 4], num_beams=4, max_new_tokens=4)[0] \
            .hypotheses[0].tokens
    finally:
        batcher.close()


def test_a_failing_pass_fails_its_requests_only(engine, monkeypatch):
    import specbeam_edge.decoding.scheduler as sched

    real, calls = sched.score_batch, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("planted")
        return real(*a, **k)
    monkeypatch.setattr(sched, "score_batch", flaky)
    batcher = Batcher(engine)
    try:
        box = Inbox()
        batcher.submit(engine.request([1, 2, 3], max_new_tokens=4), box)
        assert isinstance(box.end(), Failed)
        box2 = Inbox()
        batcher.submit(engine.request([1, 2, 3], max_new_tokens=4), box2)
        assert isinstance(box2.end(), Done)
    finally:
        batcher.close()


def test_queue_bound(engine):
    batcher = Batcher(engine, max_batch_size=1, max_waiting=1)
    gate = threading.Event()
    try:
        boxes = [Inbox(lambda b, e: gate.wait(30)) for _ in range(2)]
        for b in boxes:
            batcher.submit(engine.request([1, 2], max_new_tokens=3), b)
        with pytest.raises(QueueFull):
            batcher.submit(engine.request([1, 2], max_new_tokens=3), Inbox())
        gate.set()
        assert all(isinstance(b.end(), Done) for b in boxes)
    finally:
        batcher.close()
