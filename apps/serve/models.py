"""The models a server holds: each an Engine (with the draft the tools give it) and a Batcher that runs its
requests together, loaded in the background while /health answers 503."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from specbeam_edge.config import AHEAD_MIN_PATH_PROB, SpeculativeConfig
from specbeam_edge.fetch import default_ahead, default_draft, resolve_model

from .params import ApiError

# a model's answer runs to its end token or the context, as llama-server and Ollama do, unless the request or
# --max_tokens says less
NO_DRAFT = "none"


@dataclass
class ModelSpec:
    """What the command line asked for: a fetched model's name or a folder, its draft (None: the tools'
    default, NO_DRAFT: none), and the id clients name it by."""
    model: str
    draft: str | None = None
    name: str = ""

    def __post_init__(self):
        if not self.name:
            self.name = self.model if os.path.sep not in self.model else os.path.basename(os.path.normpath(
                self.model))


@dataclass
class Served:
    """One loaded model: its engine, batcher, and how its requests speculate by default."""
    name: str
    engine: object
    batcher: object
    ahead: bool = False                 # greedy requests draft with the target's lookahead head
    created: int = 0
    kv_tokens: int | None = None        # --kv_memory in tokens of this model's KV cache (None: no bound)

    @property
    def chat(self) -> bool:
        return bool(self.engine.tokenizer is not None and self.engine.tokenizer.chat_template)

    @property
    def translation(self) -> bool:
        return self.engine.encoder is not None or not self.chat

    def speculative(self, overrides: dict):
        """The tools' choice (specbeam generate): the draft when one is loaded (the engine's default), else the
        lookahead head for greedy search when the fetched model's head was measured to pay, else plain. A seeded
        sample drafts only with a batch-invariant draft: speculative sampling's draws follow the draft's numbers,
        and a draft whose numbers change with the requests beside it (int8 with dynamic activation scales) would
        give one seed other answers under other load; plain sampling keeps the seed's answer."""
        draft = self.engine.draft
        if draft is not None and overrides.get("do_sample") and overrides.get("seed") is not None and \
                not draft.cfg.raw.get("batch_invariant", False):
            return None
        if draft is not None:
            return "default"
        if self.ahead and overrides.get("num_beams", 1) == 1 and not overrides.get("do_sample"):
            return SpeculativeConfig(drafter="ahead", adaptive=False, min_path_prob=AHEAD_MIN_PATH_PROB)
        return None


class Registry:
    """The served models by name; `ready` once all loaded, `error` the one line that stopped loading."""

    def __init__(self, specs: list[ModelSpec], load):
        self.specs, self._load = specs, load
        self.models: dict[str, Served] = {}
        self.ready, self.error = False, None
        self._thread: threading.Thread | None = None
        self.on_error = self.on_ready = lambda: None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="specbeam-load", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    def _run(self) -> None:
        try:
            for spec in self.specs:
                self.models[spec.name] = self._load(spec)
            self.ready = True
            self.on_ready()
        except Exception as e:       # noqa: BLE001  (said in one line on stderr and by /health)
            self.error = str(e) or type(e).__name__
            self.on_error()

    def get(self, name: str | None) -> Served:
        if not self.ready:
            raise ApiError(503, self.error or "the model is loading; retry when GET /health answers 200",
                           headers={"Retry-After": "5"})
        if name is None:
            return next(iter(self.models.values()))
        if name not in self.models:
            raise ApiError(404, f"the model '{name}' does not exist; this server has "
                                f"{', '.join(sorted(self.models))}", param="model", code="model_not_found")
        return self.models[name]

    def close(self) -> None:
        for m in self.models.values():
            m.batcher.close()


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token takes in `model` (keys and values of every layer)."""
    import numpy as np

    c = model.cfg
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * np.dtype(model.kv_dtype).itemsize


def resolve(spec: ModelSpec) -> tuple[str, str | None, bool]:
    """(the target folder, its draft folder or None, whether greedy requests draft with its lookahead head), as
    `specbeam generate` resolves --model and --draft."""
    folder = resolve_model(spec.model)
    if not Path(folder).expanduser().is_dir():
        raise FileNotFoundError(f"--model {spec.model}: no such folder or fetched model (specbeam list shows the "
                                f"fetched ones; specbeam fetch NAME gets one)")
    if spec.draft == NO_DRAFT:
        return folder, None, False
    draft = resolve_model(spec.draft) if spec.draft else default_draft(spec.model)
    ahead = draft is None and default_ahead(spec.model)
    return folder, draft, ahead
