"""One answer generated off the UI thread: Engine.stream in a QThread that Stop (or closing the window) ends
at the next target pass, keeping what was streamed so far."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QThread, Signal

from .render import draft_spans


@dataclass
class Answer:
    text: str = ""
    spans: list = field(default_factory=list)    # [start, end) characters of `text` supplied by the draft tree
    stats: dict = field(default_factory=dict)
    error: str | None = None


class Generation(QThread):
    """Runs engine.stream(prompt, ...). `progress` carries the answer so far (text, draft spans) after every
    target pass that made text final; `answered` fires once at the end (finished, stopped or failed) and
    `answer` then holds the outcome, so a caller that waits for the thread can read it directly."""
    progress = Signal(str, list)
    answered = Signal()

    def __init__(self, engine, prompt: str, kwargs: dict, spec, model_name: str):
        super().__init__()
        self.engine, self.prompt, self.kwargs, self.spec, self.model_name = engine, prompt, kwargs, spec, model_name
        self.answer = Answer()
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ends the stream at the next target pass."""
        self._stop.set()

    def run(self) -> None:
        t0, chunk = time.perf_counter(), None
        live = _LiveMarks(self.engine.tokenizer)
        try:
            for chunk in self.engine.stream(self.prompt, speculative=self.spec, **self.kwargs):
                if chunk.text:
                    live.add(chunk.text, chunk.stats.from_draft)
                    self.progress.emit(live.text, [list(s) for s in live.spans])
                if self._stop.is_set():
                    break
        except Exception as e:  # shown in the window, never a crash of the UI
            self.answer = Answer(live.text, live.spans, error=f"{type(e).__name__}: {e}")
        else:
            self.answer = self._finish(chunk, live, time.perf_counter() - t0)
        self.answered.emit()

    def _finish(self, chunk, live: "_LiveMarks", seconds: float) -> Answer:
        stats = chunk.stats.as_dict() if chunk is not None else {}
        # the engine's own clock and token count are set when the search ends; a stopped stream has neither
        steps = chunk.stats.beam_steps if chunk is not None else 0
        stats.update(model=self.model_name, speculative=self.spec is not None, wall_seconds=round(seconds, 3),
                     tokens_per_second=round(steps / seconds, 2) if seconds > 0 else 0.0)
        if chunk is None or chunk.result is None:
            stats.update(stopped=True, generated_tokens=steps)
            return Answer(live.text, live.spans, stats)
        hyp = chunk.result.hypotheses[0]
        stats["tokens"] = list(hyp.tokens)
        spans = draft_spans(self.engine.tokenizer.decode_stable, hyp.tokens, chunk.stats.from_draft)
        return Answer(chunk.result.text, spans, stats)


class _LiveMarks:
    """Draft marks while streaming. A chunk carries text, not token ids, so each chunk's text is encoded again
    by the same tokenizer to place the per-step flags on it; the marks stored with a finished answer come
    from the result's own token ids."""

    def __init__(self, tokenizer):
        self.tokenizer, self.text, self.spans, self.n_tokens = tokenizer, "", [], 0

    def add(self, delta: str, from_draft: list) -> None:
        ids = self.tokenizer.encode(delta)
        flags = list(from_draft[self.n_tokens:self.n_tokens + len(ids)])
        for span in draft_spans(self.tokenizer.decode_stable, ids, flags, offset=len(self.text)):
            if self.spans and self.spans[-1][1] == span[0]:
                self.spans[-1][1] = span[1]
            else:
                self.spans.append(span)
        self.text += delta
        self.n_tokens += len(ids)
