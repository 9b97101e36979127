"""One answer generated off the UI thread: the engine's search in a QThread that Stop (or closing the window)
ends at the next target pass, keeping the best text found so far."""
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
    """Runs the engine's search for `prompt` one target pass at a time (Engine.generate_passes, as Engine.stream
    does). `progress` carries (final text so far, its draft spans, beam steps so far) after every target pass:
    the text is the prefix every beam agrees on, which with several beams may stay empty for a long time.
    `answered` fires once at the end (finished, stopped or failed) and `answer` then holds the outcome, so a
    caller that waits for the thread can read it directly. A stopped or failed search answers with its best
    hypothesis so far (as if max_new_tokens had been reached), never with less than was shown."""
    progress = Signal(str, list, int)
    answered = Signal()

    def __init__(self, engine, prompt: str, kwargs: dict, spec, model_name: str):
        super().__init__()
        self.engine, self.prompt, self.kwargs, self.spec, self.model_name = engine, prompt, kwargs, spec, model_name
        self.answer = Answer()
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ends the search at the next target pass."""
        self._stop.set()

    def run(self) -> None:
        t0 = time.perf_counter()
        live = _LiveMarks(self.engine.tokenizer)
        state = stats = None
        n_stable = 0
        try:
            gen = self.engine.generation_config(None, **self.kwargs)
            for state, stats in self.engine.generate_passes(self.prompt, gen, self.spec):
                prefix = state.stable_prefix()
                if len(prefix) > n_stable:          # decode only when more tokens became final
                    n_stable = len(prefix)
                    text = self.engine.tokenizer.decode_stable(prefix)
                    if len(text) > len(live.text) and text.startswith(live.text):
                        live.add(text[len(live.text):], stats.from_draft)
                self.progress.emit(live.text, [list(s) for s in live.spans], stats.beam_steps)
                if self._stop.is_set():
                    break
            else:
                self.answer = self._finished(self.engine.result_of(self.prompt, state, stats, gen), stats, t0)
                self.answered.emit()
                return
            self.answer = self._partial(state, stats, live, t0)
        except Exception as e:  # shown in the window, never a crash of the UI
            try:
                self.answer = self._partial(state, stats, live, t0)
            except Exception:
                self.answer = Answer(live.text, live.spans)
            self.answer.error = f"{type(e).__name__}: {e}"
        self.answered.emit()

    def _stats(self, stats, seconds: float, tokens: int) -> dict:
        """tokens: the answer's own (not the search's steps: beam search goes on after its best answer ended)."""
        out = stats.as_dict() if stats is not None else {}
        out.update(model=self.model_name, speculative=self.spec is not None, wall_seconds=round(seconds, 3),
                   generated_tokens=tokens, tokens_per_second=round(tokens / seconds, 2) if seconds > 0 else 0.0)
        return out

    def _finished(self, result, stats, t0: float) -> Answer:
        out = self._stats(stats, time.perf_counter() - t0, result.stats.generated_tokens)
        hyp = result.hypotheses[0]
        out["finish_reason"] = result.finish_reason
        out["tokens"] = list(hyp.tokens)
        spans = draft_spans(self.engine.tokenizer.decode_stable, hyp.tokens, stats.from_draft)
        return Answer(result.text, spans, out)

    def _partial(self, state, stats, live: "_LiveMarks", t0: float) -> Answer:
        """The best hypothesis of a search that was stopped: at least the text streamed so far."""
        tokens = best_so_far(state) if state is not None else []
        eos = set(self.engine.eos)
        tokens = [t for t in tokens if t not in eos]
        out = self._stats(stats, time.perf_counter() - t0, len(tokens))
        out.update(stopped=True, finish_reason="interrupted")
        text = self.engine.tokenizer.decode_stable(tokens)
        if not text.startswith(live.text):      # cannot happen (every beam extends the stable prefix): keep it
            return Answer(live.text, live.spans, out)
        out["tokens"] = tokens
        flags = stats.from_draft if stats is not None else []
        return Answer(text, draft_spans(self.engine.tokenizer.decode_stable, tokens, flags), out)


def best_so_far(state) -> list[int]:
    """Generated tokens of the best hypothesis of a search that has not finished: finished hypotheses and live
    beams compete by length-normalised score, as they do when max_new_tokens is reached. The state is a
    BeamSearch or a SampleState (what Engine.generate_passes yields)."""
    tree, P = state.tree, state.prompt_len
    if hasattr(state, "running"):                      # BeamSearch
        lp = getattr(state, "length_penalty", 1.0)
        cands = [(float(s), n) for n, s, ok in zip(state.fin_nodes, state.fin_scores, state.fin_done)
                 if ok and n >= 0]
        length = max(1, state.cur_len - P)
        cands += [(float(s) / length ** lp, n) for n, s in zip(state.running, state.scores)]
    else:                                              # SampleState
        nodes = set(state.live) | set(state.finished)
        cands = [(state.score[n] / max(1, tree.depths[n] + 1 - P), n) for n in nodes]
    if not cands:
        return list(state.stable_prefix())
    best = max(cands, key=lambda c: c[0])[1]
    return list(tree.path(best)[P:])


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
