"""What the two layouts' runners share (whole_graph.WholeGraph: one graph; pipeline.LayerPipeline: embedding,
layers, head): where and in what dtype the KV cache lives, its shape checked against the config, the run options,
the optional inputs, a head's skipped rows given back as zeros, and a KV tensor read on the host. OnnxCausalLM
picks a runner once, when a model loads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import ModelConfig, ModelFolderError
from ..contract import HEAD_FROM, PROMPT_ATTENTION
from .providers import CUDA
from .sessions import run_options


class Runner:
    """A layout's runner: `run(p, mask, head_feed, names, min_rows)` gives (the head's outputs over every row of the
    pass, presents per layer). Its facts about the graphs, read once at load: needs_key_positions (the graph takes
    key_position_ids), head_rows (its head can skip a pass's leading rows), ahead_input (a whole graph's lookahead
    switch), prompt_attention (its attention in double has an fp32 branch for prompts: `_optional`), arena, and the
    KV cache's kv_device, kv_dtype and kv_resident (`_settle`)."""
    needs_key_positions = False
    head_rows = False
    ahead_input = False
    prompt_attention = False
    arena = True

    def _settle(self, first, past0: str, cfg: ModelConfig, folder: Path, kv_resident: bool | None) -> None:
        """The KV facts, from the input `past0` of session `first`: its shape must match the config; an
        fp16-compute graph (export --compute fp16) keeps its cache in fp16; kv_resident keeps it where the session
        computes it (default: on for CUDA sessions, off on the CPU, where it measured no faster)."""
        past = next(i for i in first.get_inputs() if i.name == past0)
        if past.shape[1] != cfg.num_kv_heads or past.shape[3] != cfg.head_dim:
            raise ModelFolderError(f"{folder}: graph KV shape {past.shape} does not match the config "
                                   f"(num_kv_heads {cfg.num_kv_heads}, head_dim {cfg.head_dim})")
        self.first = first
        self.kv_device = "cuda" if CUDA in first.get_providers() else "cpu"
        self.kv_dtype = np.float16 if past.type == "tensor(float16)" else np.float32
        self.kv_resident = (self.kv_device == "cuda") if kv_resident is None else bool(kv_resident)
        # (runs of the model's own sessions, runs of sessions that hold a layer's weights)
        self.runs = run_options(self.arena, self.kv_device), run_options(True, self.kv_device)

    def _optional(self, sess) -> None:
        """The inputs with defaults (initializers of their names) the runner feeds: HEAD_FROM (whole graphs) and
        PROMPT_ATTENTION. An input with a default cannot be bound: a resident-KV run feeds neither."""
        have = {i.name for i in sess.get_overridable_initializers()} if not self.kv_resident else set()
        self.head_rows = self.head_rows or HEAD_FROM in have
        self.prompt_attention = PROMPT_ATTENTION in have

    def optional_feed(self, p) -> dict:
        """The optional inputs of pass p, as `_optional` found them (HEAD_FROM is the runner's own)."""
        return {PROMPT_ATTENTION: np.array([True])} if p.prompt and self.prompt_attention else {}

    def providers(self) -> list[str]:
        """The execution providers the model's layers run on."""
        return list(self.first.get_providers())

    def streamed_layers(self) -> int:
        """How many of the layers a pass streams (0: all resident, or one graph)."""
        return 0


def host(x) -> np.ndarray:
    """A KV tensor as a host array: itself, or a copy of a resident OrtValue (the rare paths that need the host:
    batched passes, compaction)."""
    return x.numpy() if isinstance(x, ort.OrtValue) else x


def kv_nbytes(x) -> int:
    if isinstance(x, ort.OrtValue):
        return int(np.prod(x.shape())) * (2 if "float16" in x.data_type() else 4)
    return x.nbytes


def rows_back(outs: list, skip: int) -> list:
    """A head's outputs over the rows from `skip` on, given back over every row of the pass: the skipped rows read
    as zeros (nobody reads them)."""
    if not skip:
        return list(outs)
    back = []
    for o in outs:      # np.zeros maps untouched zero pages: the skipped rows cost neither time nor memory
        full = np.zeros((o.shape[0], skip + o.shape[1]) + o.shape[2:], o.dtype)
        full[:, skip:] = o
        back.append(full)
    return back
