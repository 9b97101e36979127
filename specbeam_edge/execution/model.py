"""An exported causal LM: its config, its layout's runner (whole_graph.py or pipeline.py, picked once at load) and
one pass over a token tree (DESIGN section 4)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import ModelConfig, ModelFolderError
from ..contract import AHEAD_INPUT, AHEAD_OUTPUTS, LOGITS, TOPK_INPUT, TOPK_OUTPUTS, head_io
from .pass_input import PassInput
from .pipeline import LayerPipeline
from .sessions import cap_heap_buffers, trim_heap
from .whole_graph import WholeGraph


# precisions whose graphs quantize activations (export/quant.py, MatMulNBits level 4, quantize_dynamic)
QUANTIZED_ACTIVATIONS = ("int8", "int4", "int8dyn")


def prefill_rows(streamed: int) -> int:
    """The default prefill chunk: PREFILL_CHUNK rows, or STREAMED_CHUNK when layers stream (each chunk reads them
    again)."""
    return STREAMED_CHUNK if streamed else PREFILL_CHUNK


# A chunk's attention buffers are rows x cached tokens (in double for int8/int4): SmolLM2-135M at 5,600 tokens
# peaked at 1.18 GB with 128 rows, 1.23 GB with 256, 1.46 GB with 512 (8.8 GB in one pass); streamed layers are
# read again for every chunk, so they take larger ones
PREFILL_CHUNK, STREAMED_CHUNK = 256, 512


def _runner_fact(name: str) -> property:
    """A fact the model's runner read from its graphs at load (runner.Runner says what each one means)."""
    return property(lambda self: getattr(self.runner, name))


class OnnxCausalLM:
    """Loads and validates a model folder; `run` scores a pass's new tokens (a PassInput: a tree mask over past KV)
    through the layout's runner (`runner`: WholeGraph or LayerPipeline)."""
    needs_key_positions, head_rows, ahead_input = (_runner_fact(n) for n in ("needs_key_positions", "head_rows",
                                                                             "ahead_input"))
    prompt_attention, arena = _runner_fact("prompt_attention"), _runner_fact("arena")
    kv_device, kv_dtype, kv_resident = (_runner_fact(n) for n in ("kv_device", "kv_dtype", "kv_resident"))

    def __init__(self, folder: str | Path, *, threads: int | None = None, providers=None,
                 max_memory: int | None = None, host_memory: int | None = 0, placement: list[str] | None = None,
                 spin: bool = True, kv_resident: bool | None = None, min_rows: int | None = None,
                 arena: bool | None = None, prefill_chunk: int | None = None):
        """max_memory (bytes): budget for weights held in memory; in the split layout, layers that do not fit
        are streamed per pass from host memory (up to host_memory bytes, None = unlimited) or from disk.
        placement: an explicit list of 'resident' / 'host' / 'disk' per layer instead of the planner.
        spin: let onnxruntime's threads busy-wait between runs (faster back-to-back runs of one model).
        kv_resident: keep the KV cache where the session computes it (OrtValues bound with IOBinding, see
        sessions.run_bound); default: on for CUDA sessions, off on the CPU (where it measured no faster,
        docs/HISTORY.md "Resident KV caches").
        min_rows: the fewest rows a pass scores (batch.py adds padding rows). onnxruntime may compute a one-row
        MatMul on another path (GEMV) whose fp32 sums round differently; int8/int4 activations can turn that last
        bit into a quantization step, so a quantized graph's passes score at least 2 rows unless this machine's
        kernels score one row bit for bit as they score it among others (DESIGN "Quantized targets" point 2).
        Default (None): 1 for fp32/fp16 graphs, 2 for int8/int4/int8dyn graphs. The engine that owns a target
        decides its floor once (Engine: invariance.row_floor, measured per model file, onnxruntime version and
        CPU); a draft needs no invariance (Engine passes 1).
        arena: keep onnxruntime's CPU arena, which holds each session's largest run for good (default: off when
        layers stream, RSS no budget counts; Engine turns it off for their draft; docs/HISTORY.md "Arenas").
        prefill_chunk: the most new rows a pass scores (batch.score_batch splits a longer call, a long prompt, into
        passes of this many rows; default: `prefill_rows`)."""
        cap_heap_buffers()                   # before the first session: its buffers go back to the system when freed
        self.cfg = cfg = ModelConfig.load(folder)
        self.folder = Path(folder)
        self.min_rows = (2 if cfg.precision in QUANTIZED_ACTIVATIONS else 1) if min_rows is None else min_rows
        # head outputs: 'both' graphs (a draft for exact search and sampling) answer a run that gives a top-k with
        # their top-k outputs and any other with their logits; onnxruntime returns only the outputs asked for
        heads = head_io(cfg.output)
        self.has_topk = bool(heads[0])
        # a lookahead head (export/ahead.py): its guesses come back beside the top-k outputs of every run
        self.ahead = cfg.raw.get("ahead")
        self.ahead_outputs = list(AHEAD_OUTPUTS) if self.ahead else []
        # per-request inputs fixed for the whole request (e.g. cross-attention K/V of an encoder-decoder)
        self.static_inputs = list(cfg.raw.get("static_inputs", []))
        self._check_layout(max_memory, placement)
        common = dict(threads=threads, providers=providers, spin=spin, arena=arena, head_io=heads,
                      kv_resident=kv_resident)
        if cfg.layout == "whole":
            self.runner = WholeGraph(self.folder, cfg, ahead=bool(self.ahead), static_inputs=self.static_inputs,
                                     **common)
        else:
            self.runner = LayerPipeline(self.folder, cfg, max_memory=max_memory, host_memory=host_memory,
                                        placement=placement, **common)
        self.prefill_chunk = prefill_chunk or prefill_rows(self.streamed_layers())

    def _check_layout(self, max_memory, placement) -> None:
        """What only one layout can do, refused at load in one line naming the export that can."""
        whole = self.cfg.layout == "whole"
        if self.ahead and (not whole or not self.has_topk):
            raise ModelFolderError(f"{self.folder}: a lookahead head needs the whole layout and a top-k head; "
                                   f"export again with --output_kind both")
        if self.static_inputs and not whole:
            raise ModelFolderError(f"{self.folder}: static inputs {self.static_inputs} need the whole layout")
        if whole and (max_memory is not None or placement is not None):
            raise ModelFolderError(f"{self.folder}: layer streaming (max_memory/placement) needs the split layout; "
                                   f"export with --layout split")

    def head_names(self, topk: int | None, ahead: bool = False) -> list[str]:
        """The head outputs a run returns: a top-k head's (log-probs, ids), a logits head's logits, and a 'both'
        head's top-k when the run gives a k, else its logits; then a lookahead head's guesses when asked for."""
        if self.cfg.output == "topk" or (self.cfg.output == "both" and topk):
            return TOPK_OUTPUTS + (self.ahead_outputs if ahead else [])
        return [LOGITS]

    def empty_past(self, batch: int = 1) -> list[tuple]:
        c = self.cfg
        z = self.to_kv(np.zeros((batch, c.num_kv_heads, 0, c.head_dim), self.kv_dtype))
        return [(z, z) for _ in range(c.num_layers)]

    def to_kv(self, a: np.ndarray):
        """A host KV array as this model keeps its cache: the array itself, or (kv_resident) an OrtValue on the
        session's device."""
        if not self.kv_resident or a.size == 0:   # an empty past stays a host array: bound as it is, no device
            return a                                # allocation of zero bytes
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), self.kv_device, 0)

    def additive_mask(self, mask: np.ndarray) -> np.ndarray:
        return np.where(mask, np.float32(0), np.float32(self.cfg.mask_value)).astype(np.float32)

    def run(self, p: PassInput):
        """Score the pass's new tokens (PassInput says what each field holds). A head that can skip rows
        (head_rows) runs on the rows from p.head_from on and returns zeros in the others. Returns (logits
        [B, n_new, V] fp32, or (topk_logprobs, topk_ids) for a top-k head and for a 'both' head given a top-k,
        followed by (ahead_logprobs, ahead_ids) when p.ahead; presents per layer [B, kv_heads, n_past + n_new,
        head_dim], OrtValues on the session's device when kv_resident)."""
        if p.pos.size and int(p.pos.max()) >= self.cfg.context_length:
            raise ValueError(f"position {int(p.pos.max())} exceeds the model's context length "
                             f"{self.cfg.context_length}")
        if self.needs_key_positions != (p.key_positions is not None):
            raise ValueError(f"{self.folder}: key_positions must be given iff the graph declares key_position_ids")
        names = self.head_names(p.topk, p.ahead)
        head_feed = {TOPK_INPUT: np.array([p.topk or 1], np.int64)} if self.has_topk else {}
        if self.ahead_input:
            head_feed[AHEAD_INPUT] = np.array([AHEAD_OUTPUTS[0] in names])
        outs, presents = self.runner.run(p, self.additive_mask(p.mask), head_feed, names, self.min_rows)
        return (outs[0] if len(outs) == 1 else tuple(outs)), presents

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, past: list, **kw):
        """`run` with the PassInput's fields as arguments (tools and tests): input_ids, position_ids [B, n_new],
        tree_mask bool [B, 1, n_new, n_past + n_new], past per layer; kw: topk, key_positions, static, ahead,
        head_from."""
        return self.run(PassInput(input_ids, position_ids, tree_mask, past, **kw))

    def release_memory(self) -> None:
        """Give back what the last runs kept (a long prompt's chunks: 0.96 GB held after a 5,600-token prompt on
        SmolLM2-135M, until the next request). onnxruntime's CPU arenas: the shrinking run option acts at the end
        of a run, so one pass of min_rows tokens over an empty cache ends with them shrunk (not without arenas:
        streamed layers, where the pass would read every layer); then the C heap's free pages (trim_heap)."""
        if self.kv_device != "cpu":
            return
        if self.arena and not self.streamed_layers():
            n = max(self.min_rows, 1)
            ids = np.full(n, self.cfg.bos_token_id or 0, np.int64)
            self.run(PassInput.over(self, ids, np.arange(n), np.tril(np.ones((n, n), bool)), self.empty_past(),
                                    np.zeros(0, np.int64), topk=1 if self.has_topk else None))
        trim_heap()

    def streamed_layers(self) -> int:
        """How many of the layers a pass streams (0: all resident, or the whole layout)."""
        return self.runner.streamed_layers()

    def part_seconds(self, q: int, past: int = 32, reps: int = 3) -> tuple[float, float]:
        """(one decoder layer's, the head's) measured seconds for a pass of q new tokens over `past` cached ones
        (split layout: LayerPipeline.part_seconds)."""
        return self.runner.part_seconds(q, self.head_names(1 if self.has_topk else None), past, reps)
