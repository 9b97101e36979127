"""An exported causal LM: onnxruntime sessions and one forward over a token tree (DESIGN section 4)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import ModelConfig, ModelFolderError, few
from ..contract import (AHEAD_INPUT, AHEAD_OUTPUTS, CONFIG_FILE, HEAD_FROM, HIDDEN, KEY_POSITIONS, LAYER_HIDDEN_OUT,
                       LAYER_PAST, LAYER_PRESENT, LOGITS, TOKEN_INPUTS, TOPK_INPUT, TOPK_OUTPUTS, head_io, past_names,
                       present_names)
from .integrity import verify
from .offload import LayerStore, embedding_table, layer_nbytes, plan
from .providers import CUDA
# default_threads, share_threads and threads_shared: imported from here by the engine and the tools
from .sessions import _session, default_threads, run_options, session_options, share_threads, threads_shared  # noqa


# precisions whose graphs quantize activations (export/quant.py, MatMulNBits level 4, quantize_dynamic)
QUANTIZED_ACTIVATIONS = ("int8", "int4", "int8dyn")


def _declares(sess: ort.InferenceSession, name: str) -> bool:
    return any(i.name == name for i in sess.get_inputs())


def host(x) -> np.ndarray:
    """A KV tensor as a host array: itself, or a copy of a resident OrtValue (the rare paths that need the host:
    batched passes, compaction)."""
    return x.numpy() if isinstance(x, ort.OrtValue) else x


def kv_nbytes(x) -> int:
    if isinstance(x, ort.OrtValue):
        return int(np.prod(x.shape())) * (2 if "float16" in x.data_type() else 4)
    return x.nbytes


def _graph_layers(sess, cfg: ModelConfig, folder: Path) -> int:
    """num_layers, once the whole graph declares as many layers' past inputs: checked before a list per layer
    is built (a config's count of a million took seconds and wrote a 100 MB error)."""
    head, tail = past_names("{i}")[0].split("{i}")
    held = sum(1 for i in sess.get_inputs() if i.name.startswith(head) and i.name.endswith(tail))
    if held != cfg.num_layers:
        raise ModelFolderError(f"{folder / CONFIG_FILE}: num_layers is {cfg.num_layers}, but "
                               f"{cfg.files['model']} has {held} layers; set it to the model's layer count or "
                               f"re-export the model")
    return held


def _rows_back(outs: list, skip: int) -> list:
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


def prefill_rows(streamed: int) -> int:
    """The default prefill chunk: PREFILL_CHUNK rows, or STREAMED_CHUNK when layers stream (each chunk reads them
    again)."""
    return STREAMED_CHUNK if streamed else PREFILL_CHUNK


# A chunk's attention buffers are rows x cached tokens (in double for int8/int4): SmolLM2-135M at 5,600 tokens
# peaked at 1.18 GB with 128 rows, 1.23 GB with 256, 1.46 GB with 512 (8.8 GB in one pass); streamed layers are
# read again for every chunk, so they take larger ones
PREFILL_CHUNK, STREAMED_CHUNK = 256, 512


class OnnxCausalLM:
    """Loads and validates a model folder; `forward` scores new tokens given a tree mask and past KV."""

    def __init__(self, folder: str | Path, *, threads: int | None = None, providers=None,
                 max_memory: int | None = None, host_memory: int | None = 0, placement: list[str] | None = None,
                 spin: bool = True, kv_resident: bool | None = None, min_rows: int | None = None,
                 arena: bool | None = None, prefill_chunk: int | None = None):
        """max_memory (bytes): budget for weights held in memory; in the split layout, layers that do not fit
        are streamed per pass from host memory (up to host_memory bytes, None = unlimited) or from disk.
        placement: an explicit list of 'resident' / 'host' / 'disk' per layer instead of the planner.
        spin: let onnxruntime's threads busy-wait between runs (faster back-to-back runs of one model).
        kv_resident: keep the KV cache where the session computes it (OrtValues bound with IOBinding, see
        `forward`); default: on for CUDA sessions, off on the CPU (where it measured no faster, docs/HISTORY.md "Resident KV caches").
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
        self.cfg = cfg = ModelConfig.load(folder)
        self.folder = Path(folder)
        self.min_rows = (2 if cfg.precision in QUANTIZED_ACTIVATIONS else 1) if min_rows is None else min_rows
        self._name_layers(cfg.num_layers if cfg.layout == "split" else 0)     # whole: once the graph agrees
        # head outputs: 'both' graphs (a draft for exact search and sampling) answer a run that gives a top-k with
        # their top-k outputs and any other with their logits; onnxruntime returns only the outputs asked for
        head_inputs, all_heads = head_io(cfg.output)
        self.has_topk = bool(head_inputs)
        # a lookahead head (export/ahead.py): its guesses come back beside the top-k outputs of every run
        self.ahead = cfg.raw.get("ahead")
        self.ahead_outputs = list(AHEAD_OUTPUTS) if self.ahead else []
        self.ahead_input, self.head_rows = False, cfg.layout == "split"    # graph inputs; whole: see _load_whole
        if self.ahead and (cfg.layout != "whole" or not self.has_topk):
            raise ModelFolderError(f"{self.folder}: a lookahead head needs the whole layout and a top-k head; "
                                   f"export again with --output_kind both")
        # per-request inputs fixed for the whole request (e.g. cross-attention K/V of an encoder-decoder)
        self.static_inputs = list(cfg.raw.get("static_inputs", []))
        if self.static_inputs and cfg.layout != "whole":
            raise ModelFolderError(f"{self.folder}: static inputs {self.static_inputs} need the whole layout")
        if cfg.layout == "whole" and (max_memory is not None or placement is not None):
            raise ModelFolderError(f"{self.folder}: layer streaming (max_memory/placement) needs the split layout; "
                                   f"export with --layout split")
        self.arena = arena
        if cfg.layout == "whole":
            self._load_whole(threads, providers, spin, head_inputs, all_heads)
        else:
            self._load_split(threads, providers, spin, head_inputs, all_heads, max_memory, host_memory, placement)
        self._check_shapes()
        self.prefill_chunk = prefill_chunk or prefill_rows(self.streamed_layers())
        first = self.sess if cfg.layout == "whole" else self.layer
        self.kv_device = "cuda" if CUDA in first.get_providers() else "cpu"
        past0 = self.past_names[0][0] if cfg.layout == "whole" else LAYER_PAST[0]
        # an fp16-compute graph (export --compute fp16) keeps its KV cache in fp16
        self.kv_dtype = np.float16 if next(i.type for i in first.get_inputs() if i.name == past0) == \
            "tensor(float16)" else np.float32
        self.kv_resident = (self.kv_device == "cuda") if kv_resident is None else bool(kv_resident)
        self._runs = run_options(self.arena, self.kv_device), run_options(True, self.kv_device)  # (own layers')
        # the streamed layers share two buffers: one pass at a time per model (threads sharing an Engine)
        self._lock = threading.Lock()

    def _load_whole(self, threads, providers, spin, head_inputs, all_heads) -> None:
        """The whole layout: one graph for every layer and the head."""
        cfg = self.cfg
        self.arena = self.arena is not False          # nothing streams: the arena unless the caller says no
        verify(self.folder, cfg.files.get("sha256"))      # a damaged graph fails by name, not as wrong text
        self.sess = _session(self.folder / cfg.files["model"], threads, providers, spin, self.arena)
        self._name_layers(_graph_layers(self.sess, cfg, self.folder))
        self.needs_key_positions = _declares(self.sess, KEY_POSITIONS)
        # a graph whose head the config does not name (an attach killed between its two renames) runs
        # with the head off
        self.ahead_input = bool(self.ahead) or _declares(self.sess, AHEAD_INPUT)
        # head_rows: the head can skip a pass's leading rows (the split layout's always: the runtime slices its
        # input). HEAD_FROM is an input with a default (0: every row), so callers may leave it out; older exports
        # lack it
        self.head_rows = any(i.name == HEAD_FROM for i in self.sess.get_overridable_initializers())
        want_in = {*TOKEN_INPUTS, *[n for p in self.past_names for n in p],
                   *([KEY_POSITIONS] if self.needs_key_positions else []), *self.static_inputs,
                   *([AHEAD_INPUT] if self.ahead_input else [])}
        self._check_io(self.sess, want_in | set(head_inputs), {*all_heads, *self.present_flat, *self.ahead_outputs},
                       cfg.files["model"])

    def _name_layers(self, layers: int) -> None:
        """Each layer's past and present names (a whole graph's)."""
        self.past_names = [past_names(i) for i in range(layers)]
        self.present_names = [present_names(i) for i in range(layers)]
        self.present_flat = [n for p in self.present_names for n in p]

    def _load_split(self, threads, providers, spin, head_inputs, all_heads, max_memory, host_memory,
                    placement) -> None:
        """The split layout: the embedding, one layer graph fed each layer's weights (resident or streamed:
        offload.py) and the head."""
        cfg, L = self.cfg, self.cfg.num_layers
        # the embedding: a table read a row at a time from its file (a pass reads only its tokens' rows, so it
        # costs no memory budget: offload.TableRows), or an embed graph in older exports
        table = cfg.files.get("embed_table")
        manifest = cfg.files["layer_manifest"]
        fixed = sum(p.stat().st_size for k in ("head",) + (() if table else ("embed",))       # (and their .data)
                    for p in (self.folder / cfg.files[k], self.folder / (cfg.files[k] + ".data")) if p.exists())
        self.placement = plan(L, layer_nbytes(manifest), fixed, max_memory, host_memory, placement)
        if self.arena is None:          # under a budget, nothing the budget does not count stays behind a run
            self.arena = all(p == "resident" for p in self.placement.places)
        self.embed = None if table else _session(self.folder / cfg.files["embed"], threads, providers, spin,
                                                 self.arena)
        # checked against the SHA-256 the export recorded, here and as its rows are read
        self.embed_table = None if not table else embedding_table(self.folder, table, cfg.vocab_size)
        self.layer = _session(self.folder / cfg.files["layer"], threads, providers, spin, self.arena)
        self.head = _session(self.folder / cfg.files["head"], threads, providers, spin, self.arena)
        if self.embed is not None:
            self._check_io(self.embed, {"input_ids"}, {HIDDEN}, cfg.files["embed"])
        self.needs_key_positions = _declares(self.layer, KEY_POSITIONS)
        self._check_io(self.layer, {HIDDEN, "position_ids", "attention_mask", *LAYER_PAST,
                                    *[m["name"] for m in manifest],
                                    *([KEY_POSITIONS] if self.needs_key_positions else [])},
                       {LAYER_HIDDEN_OUT, *LAYER_PRESENT}, cfg.files["layer"])
        self._check_io(self.head, {HIDDEN, *head_inputs}, set(all_heads), cfg.files["head"])
        self.device = "cuda" if "CUDAExecutionProvider" in self.layer.get_providers() else "cpu"
        self.store = LayerStore(self.folder, cfg.files["layer_weights"], manifest, self.placement, self.device)
        whole = max_memory is None and placement is None     # every layer held in memory, no budget to keep
        self.layer_sessions = self._resident_sessions(threads, spin) if whole else {}
        nxt = {}
        for k, i in enumerate(self.store.streamed[:-1]):
            nxt.update({j: self.store.streamed[k + 1] for j in range(i, self.store.streamed[k + 1])})
        self._next_streamed = nxt

    def _resident_sessions(self, threads, spin) -> dict[int, ort.InferenceSession]:
        """Per layer, a session of its own with the layer's weights as initializers (files.layer_resident,
        export/resident.py): onnxruntime prepacks them once instead of taking them as inputs every pass (1.2-1.6x a
        pass, bit for bit the same outputs). On the CPU, for fp32 and int8 exports held wholly in memory: a session
        holds its layer in about 1.4x the file's bytes, more than a memory budget counts, so a budget or a
        placement keeps every layer fed. The layer's buffer is let go (onnxruntime keeps its own copy); the graph's
        tables are read once and shared by every such session. Other layouts, providers and older exports: none
        (every layer runs the one layer graph with its weights fed)."""
        self.layer_feeds: dict[int, dict] = {}
        spec = self.cfg.files.get("layer_resident")
        # fp32 and per-row int8 only: constant fp16 / int8w weights are widened to fp32 at load (twice or four
        # times the memory the plan gave them), and int8w's DequantizeLinear + MatMul get fused into a quantized
        # kernel that is 6e-4 off the fed graph
        if not spec or self.device != "cpu" or not self.store.resident or self.cfg.precision not in ("fp32", "int8"):
            return {}
        tables = np.fromfile(self.folder / spec["tables"], dtype=np.uint8)
        shared = [(t["name"], ort.OrtValue.ortvalue_from_numpy(np.frombuffer(
            tables, dtype=t["dtype"], count=int(np.prod(t["shape"], dtype=np.int64)), offset=t["offset"]).reshape(
            t["shape"]))) for t in spec["tables_manifest"]]
        self._shared_tables = (tables, shared)     # alive as long as the sessions that use them
        fed = set(spec.get("fed", ()))             # small per-layer tensors the graph still takes as inputs
        sessions, feeds = {}, {}
        for i in list(self.store.resident):        # keys only: a list of the views would hold every buffer
            views = self.store.resident[i]
            # no busy-waiting on pools of their own: 28 sessions run one after another, and each one's spinning
            # threads took the cores from the next (3x slower a pass than the one layer graph); a shared pool
            # (share_threads) spins for all of them
            so = session_options(threads, spin=False)
            for name, value in shared:
                so.add_initializer(name, value)
            own = [n for n in views if n not in fed]
            so.add_external_initializers(own, [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(views[n]))
                                               for n in own])
            try:
                sessions[i] = ort.InferenceSession(str(self.folder / spec["graph"]), so,
                                                   providers=["CPUExecutionProvider"])
            except Exception:       # (onnxruntime's Fail) a graph this path cannot take: every layer stays fed
                if sessions:        # the first layer's went through: the same graph cannot fail for another
                    raise
                return {}
            feeds[i] = {n: views[n].copy() for n in views if n in fed}
            del so, views
            self.store.release(i)   # one layer at a time: the peak holds one layer twice, not the model
        self.layer_feeds = feeds
        return sessions

    def head_names(self, topk: int | None, ahead: bool = False) -> list[str]:
        """The head outputs a run returns: a top-k head's (log-probs, ids), a logits head's logits, and a 'both'
        head's top-k when the run gives a k, else its logits; then a lookahead head's guesses when asked for."""
        if self.cfg.output == "topk" or (self.cfg.output == "both" and topk):
            return TOPK_OUTPUTS + (self.ahead_outputs if ahead else [])
        return [LOGITS]

    @staticmethod
    def _check_io(sess, want_in, want_out, name):
        got_in = {i.name for i in sess.get_inputs()}
        got_out = {o.name for o in sess.get_outputs()}
        if got_in != want_in or not want_out <= got_out:
            raise ModelFolderError(f"{name}: graph I/O does not match specbeam_config.json "
                                   f"(missing inputs [{few(sorted(want_in - got_in))}], unexpected inputs "
                                   f"[{few(sorted(got_in - want_in))}], missing outputs "
                                   f"[{few(sorted(want_out - got_out))}]); re-export the model")

    def _check_shapes(self):
        c = self.cfg
        sess = self.sess if c.layout == "whole" else self.layer
        name = self.past_names[0][0] if c.layout == "whole" else LAYER_PAST[0]
        shape = next(i.shape for i in sess.get_inputs() if i.name == name)
        if shape[1] != c.num_kv_heads or shape[3] != c.head_dim:
            raise ModelFolderError(f"{self.folder}: graph KV shape {shape} does not match the config "
                                   f"(num_kv_heads {c.num_kv_heads}, head_dim {c.head_dim})")

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

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                past: list[tuple[np.ndarray, np.ndarray]], topk: int | None = None,
                key_positions: np.ndarray | None = None, static: dict | None = None, ahead: bool = False,
                head_from: int = 0):
        """Score `n_new` tokens.

        input_ids, position_ids: int64 [B, n_new]; tree_mask: bool [B, 1, n_new, n_past + n_new] (True = may
        attend); past: per layer (key, value) [B, kv_heads, n_past, head_dim], numpy or (kv_resident) OrtValues.
        ahead: also return a lookahead head's guesses (a model with one, read with a top-k; its head runs only
        then). key_positions: int64 [B, n_past + n_new], the position of every key column; needed (and only accepted)
        when the graph declares `key_position_ids` (sliding-window layers). static: the graph's `static_inputs`
        (config), batched like input_ids. head_from: the caller reads no head output of the rows before it (a
        prompt's rows): the head runs on the rows from there (a prompt of 300 tokens cost 300 rows of logits over
        the vocabulary) and returns zeros in the others; a whole graph exported before HEAD_FROM scores every row.
        Returns (logits [B, n_new, V] fp32, or (topk_logprobs, topk_ids) for a top-k head and for a 'both' head
        given `topk`, followed by (ahead_logprobs, ahead_ids) when `ahead`; presents per layer
        [B, kv_heads, n_past + n_new, head_dim], OrtValues on the session's device when kv_resident).
        """
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        pos = np.ascontiguousarray(position_ids, dtype=np.int64)
        if pos.size and int(pos.max()) >= self.cfg.context_length:
            raise ValueError(f"position {int(pos.max())} exceeds the model's context length {self.cfg.context_length}")
        mask = self.additive_mask(tree_mask)
        extra = {TOPK_INPUT: np.array([topk or 1], np.int64)} if self.has_topk else {}
        names = self.head_names(topk, ahead)
        if self.ahead_input:
            extra[AHEAD_INPUT] = np.array([AHEAD_OUTPUTS[0] in names])
        if self.needs_key_positions != (key_positions is not None):
            raise ValueError(f"{self.folder}: key_positions must be given iff the graph declares {KEY_POSITIONS}")
        kpos = {KEY_POSITIONS: np.ascontiguousarray(key_positions, dtype=np.int64)} if self.needs_key_positions else {}
        if self.cfg.layout == "whole":
            return self._forward_whole(ids, pos, mask, past, {**kpos, **extra, **(static or {})}, names, head_from)
        with self._lock:
            return self._forward_layers(ids, pos, mask, past, kpos, extra, names, head_from)

    def _forward_whole(self, ids, pos, mask, past, extra: dict, names: list[str], head_from: int):
        """The whole layout: one run of the graph; its head on the rows from head_from on where it takes that input
        (at least min_rows of them: the row floor holds for the head's MatMul too)."""
        feed = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, **extra}
        # (an input with a default cannot be bound: a resident-KV run scores every row)
        rows = self.head_rows and not self.kv_resident
        skip = max(min(int(head_from), ids.shape[1] - max(self.min_rows, 1)), 0) if rows else 0
        if rows:
            feed[HEAD_FROM] = np.array([skip], np.int64)
        for (kn, vn), (k, v) in zip(self.past_names, past):
            feed[kn], feed[vn] = k, v
        if self.kv_resident:
            outs = self._run_bound(self.sess, feed, names, self.present_flat, self._runs[0])
        else:
            outs = self.sess.run(names + self.present_flat, feed, self._runs[0])
        n = len(names)
        head = _rows_back(outs[:n], skip)
        presents = [(outs[n + 2 * i], outs[n + 2 * i + 1]) for i in range(self.cfg.num_layers)]
        return (head[0] if n == 1 else tuple(head)), presents

    def _run_bound(self, sess, feed: dict, host_outputs: list[str], device_outputs: list[str], runs=None) -> list:
        """One run with IOBinding: inputs are host arrays or OrtValues already on the device (bound as they
        are: a resident cache is not copied); `host_outputs` come back as numpy arrays, `device_outputs` stay
        OrtValues on the session's device (allocated by onnxruntime, so nothing crosses the bus). runs: its
        onnxruntime RunOptions."""
        io = sess.io_binding()
        for name, a in feed.items():
            if isinstance(a, ort.OrtValue):
                io.bind_ortvalue_input(name, a)
            else:
                io.bind_cpu_input(name, np.ascontiguousarray(a))
        for name in host_outputs:
            io.bind_output(name, "cpu")
        for name in device_outputs:
            io.bind_output(name, self.kv_device)
        sess.run_with_iobinding(io, runs)
        outs = io.get_outputs()
        return [o.numpy() for o in outs[:len(host_outputs)]] + list(outs[len(host_outputs):])

    def release_memory(self) -> None:
        """Give back what onnxruntime's CPU arenas kept from the last runs (a long prompt's chunks: 0.96 GB held
        after a 5,600-token prompt on SmolLM2-135M, until the next request): the shrinking run option acts at the
        end of a run, so one pass of min_rows tokens over an empty cache ends with the arenas shrunk (0.52 GB).
        Without arenas (streamed layers: no run keeps memory, and the pass would read every layer) nothing to do."""
        if not self.arena or self.kv_device != "cpu" or self.streamed_layers():
            return
        n = max(self.min_rows, 1)
        ids = np.full((1, n), self.cfg.bos_token_id or 0, np.int64)
        mask = np.tril(np.ones((n, n), bool))[None, None]
        kpos = {"key_positions": np.arange(n)[None]} if self.needs_key_positions else {}
        self.forward(ids, np.arange(n)[None], mask, self.empty_past(), topk=1 if self.has_topk else None, **kpos)

    def streamed_layers(self) -> int:
        """How many of the layers a pass streams (0: all resident, or the whole layout)."""
        return len(self.store.streamed) if self.cfg.layout == "split" else 0

    def part_seconds(self, q: int, past: int = 32, reps: int = 3) -> tuple[float, float]:
        """(one decoder layer's, the head's) measured seconds for a pass of q new tokens over `past` cached ones,
        on weights already in memory (split layout): with the streaming time (LayerStore.read_seconds) they model
        a streamed pass's cost without streaming every layer for every tree size (adaptive.streamed_cost_curve)."""
        c, rng = self.cfg, np.random.default_rng(0)
        store = self.store
        # a resident layer (fed, as streamed layers run), else the first streamed one in its own buffer (as a pass
        # gets it; the next pass loads it again), else a layer with its own session (nothing streams)
        i = next(iter(store.resident), store.streamed[0] if store.streamed else next(iter(self.layer_sessions), 0))
        mask = np.zeros((1, 1, q, past + q), np.float32)
        kv = np.zeros((1, c.num_kv_heads, past, c.head_dim), self.kv_dtype)
        feed = {HIDDEN: rng.standard_normal((1, q, c.hidden_size)).astype(np.float32),
                "position_ids": np.full((1, q), past, np.int64), "attention_mask": mask,
                LAYER_PAST[0]: kv, LAYER_PAST[1]: kv}
        if self.needs_key_positions:
            feed[KEY_POSITIONS] = np.arange(past + q, dtype=np.int64)[None]
        head_feed = {HIDDEN: feed[HIDDEN], **({TOPK_INPUT: np.array([1], np.int64)} if self.has_topk else {})}
        names = self.head_names(1 if self.has_topk else None)

        def best(run) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            return min(times)

        with self._lock:        # the stream buffers are this measurement's
            sess = self.layer_sessions.get(i, self.layer)
            feed.update(self.layer_feeds[i] if i in self.layer_sessions else store.get(i))
            layer = best(lambda: sess.run([LAYER_HIDDEN_OUT], feed))
            head = best(lambda: self.head.run(names, head_feed))
        return layer, head

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """hidden [B, n_new, H] fp32 for input_ids [B, n_new]: the table's rows, or the embed graph."""
        if self.embed_table is None:
            return self.embed.run([HIDDEN], {"input_ids": ids})[0]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.embed_table.shape[0]):
            raise ValueError(f"token id out of range [0, {self.embed_table.shape[0]}) for the embedding table")
        return self.embed_table[ids].astype(np.float32, copy=False)

    def _forward_layers(self, ids, pos, mask, past, kpos, extra, names, head_from: int = 0):
        """The split layout: embed, each layer with its weights (streamed ones double-buffered), head."""
        store = self.store
        if store.streamed:
            store.prefetch(store.streamed[0])      # overlaps the embedding lookup
        hidden = self._embed(ids)
        layer_out = [LAYER_HIDDEN_OUT, *LAYER_PRESENT]
        presents = []
        for i, (k, v) in enumerate(past):
            own = self.layer_sessions.get(i)      # a resident layer with its weights inside its session
            weights = self.layer_feeds[i] if own is not None else store.get(i)
            sess, runs = (own, self._runs[1]) if own is not None else (self.layer, self._runs[0])
            if i in self._next_streamed:
                store.prefetch(self._next_streamed[i])   # the next streamed layer loads while this one computes
            t0 = time.perf_counter()
            feed = {HIDDEN: hidden, "position_ids": pos, "attention_mask": mask, LAYER_PAST[0]: k, LAYER_PAST[1]: v,
                    **kpos}
            if self.kv_resident:   # hidden state and cache stay on the device between layers and passes
                hidden, pk, pv = self._run_bound(sess, {**feed, **weights}, [], layer_out, runs)
            elif self.device == "cpu":
                hidden, pk, pv = sess.run(layer_out, {**feed, **weights}, runs)
            else:  # device weights are OrtValues: run with OrtValues throughout
                feed = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in feed.items()}
                outs = self.layer.run_with_ort_values(layer_out, {**feed, **weights})
                hidden, pk, pv = (o.numpy() for o in outs)
            store.stats.compute_seconds += time.perf_counter() - t0
            presents.append((pk, pv))
        store.stats.passes += 1
        for i in store.streamed[:2]:   # both buffers are free: the next pass's first layers load during the
            store.prefetch(i)          # head, the replay and the drafting of the next tree
        skip = max(min(int(head_from), ids.shape[1] - 1), 0)   # one row at least: the head's shapes stay sane
        if skip:
            hidden = host(hidden)[:, skip:]
        if self.kv_resident:
            outs = self._run_bound(self.head, {HIDDEN: hidden, **extra}, names, [], self._runs[0])
        else:
            outs = self.head.run(names, {HIDDEN: hidden, **extra}, self._runs[0])
        outs = _rows_back(outs, skip)
        return (outs[0] if len(outs) == 1 else tuple(outs)), presents
