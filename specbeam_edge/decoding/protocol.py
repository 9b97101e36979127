"""The pass protocol: the messages between a request's search, the scheduler and the batched pass. Start here.

A search (search.py) never runs a model. It is a coroutine that yields what it needs and receives the answer:

    scheduler                         search (one request)                 batched pass (batch.py)
    ---------                         --------------------                 -----------------------
    run(PassContext)        ------->  grows its draft tree level by level
                            <-------  ScoreCall(draft cache, nodes)   ---> score_batch: ONE pass of the draft
                                      (one per level; the drafter          over every request's waiting call;
                                      is a sub-generator, draft.py)        each cache records its rows (or
                            ------->  the level's head output  <---------  becomes a row of a BatchKV)
                            <-------  ScoreCall(target cache, tree,  ---> ONE target pass over every request's
                                      replayed=True)                       tree
                            ------->  the head output
                            <-------  BeamStep(state, rows)  (repeated while the kept beams are scored nodes)
    beam.step_many: the steps of
    every request at once   ------->  None (the state has moved)
                            <-------  Progress(state, stats)   (after every target pass)
                            ------->  PassContext of the next pass
                                      ... until the search returns (the request is finished)

The scheduler (scheduler.py) runs ONE batched pass of one model per round: the drafts first, then the target,
so every request's draft level k is one pass and one target pass scores the trees of all requests. A request
alone is the batch of one: the same code path. `Job` is a request handed to the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # annotations only
    from .beam import BeamRows, BeamSearch
    from .cache import TreeCache
    from ..results import Stats


@dataclass
class ScoreCall:
    """A request's demand for one model pass: score `nodes` (parents before children) in `cache`. replayed: the
    caller keeps the rows and reads rows of several passes together (exact beam search's target), so a 'both'
    head answers it in one kind in every pass (its top-k, even over one row: mixing kinds broke beam steps, and
    a one-row pass's log-softmax in Python rounds differently from the graph's). head_from: the rows before it
    are not read (their head outputs may come back as zeros: OnnxCausalLM.run)."""
    cache: TreeCache
    nodes: list[int]
    topk: int | None = None
    replayed: bool = False
    ahead: bool = False      # a target with a lookahead head also returns its guesses (export/ahead.py)
    head_from: int = 0       # the caller reads no head output of nodes[:head_from] (a prompt's rows)


@dataclass
class BeamStep:
    """A beam step a search asks for: its BeamSearch and the running beams' rows. The scheduler takes the steps
    of every search waiting on one at once (beam.step_many, one array computation over the requests of a
    pass) and sends None back once the state has moved."""
    state: BeamSearch
    rows: BeamRows


@dataclass
class Progress:
    """After a target pass: the request's search state (BeamSearch or SampleState) and its live statistics."""
    state: object
    stats: Stats


@dataclass(frozen=True)
class PassContext:
    """What the scheduler tells a search about the shared target pass it takes part in next: `pass_id` (requests
    of one pass get one adaptive choice) and `load` (the requests sharing it, as far as known: the size of the
    pass just run, which a search records as its batch size). A search gets one when it starts (`run(ctx)`) and
    one in reply to every Progress it yields."""
    pass_id: object = None
    load: int = 1


@dataclass
class Job:
    """A request handed to the scheduler."""
    tag: object          # the caller's name for the request (e.g. its index)
    tokens: int          # its prompt tokens (counted against max_batch_tokens)
    search: object       # ExactSearch or SamplingSearch: `run(ctx)` is the coroutine above
    cancelled: bool = False  # set by the caller (any thread): the scheduler drops the request before its next pass
