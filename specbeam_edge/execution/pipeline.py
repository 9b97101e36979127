"""The split layout's runner: the embedding (a table read by row, or an embed graph in older exports), one layer
graph fed each layer's weights (held in memory, or streamed through two buffers by offload.LayerStore) or a
session of its own per resident layer, and the head; with the counters a streamed pass keeps."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..config import ModelConfig
from ..contract import HIDDEN, KEY_POSITIONS, LAYER_HIDDEN_OUT, LAYER_PAST, LAYER_PRESENT, TOPK_INPUT
from .offload import LayerStore, embedding_table, layer_nbytes, plan
from .pass_input import PassInput
from .runner import Runner, host, rows_back
from .sessions import _session, check_io, declares, run_bound, session_options


class LayerPipeline(Runner):
    """Embedding, each layer with its weights, head. `store` serves the layers' weights (its `stats` count a
    streamed pass's reads and waits), `placement` says where each layer lives, `layer_sessions` holds the resident
    layers that got sessions of their own. One pass at a time per model: the streamed layers share two buffers
    (threads sharing an Engine)."""

    def __init__(self, folder: Path, cfg: ModelConfig, *, threads, providers, spin: bool, arena: bool | None,
                 head_io: tuple[list, list], kv_resident: bool | None, max_memory: int | None,
                 host_memory: int | None, placement: list[str] | None):
        """max_memory, host_memory, placement: OnnxCausalLM's (offload.plan places the layers)."""
        self.folder, self.cfg, L = folder, cfg, cfg.num_layers
        # the embedding: a table read a row at a time from its file (a pass reads only its tokens' rows, so it
        # costs no memory budget: offload.TableRows), or an embed graph in older exports
        table = cfg.files.get("embed_table")
        manifest = cfg.files["layer_manifest"]
        fixed = sum(p.stat().st_size for k in ("head",) + (() if table else ("embed",))       # (and their .data)
                    for p in (folder / cfg.files[k], folder / (cfg.files[k] + ".data")) if p.exists())
        self.placement = plan(L, layer_nbytes(manifest), fixed, max_memory, host_memory, placement)
        # under a budget, nothing the budget does not count stays behind a run
        self.arena = all(p == "resident" for p in self.placement.places) if arena is None else arena
        self.embed = None if table else _session(folder / cfg.files["embed"], threads, providers, spin, self.arena)
        # checked against the SHA-256 the export recorded, here and as its rows are read
        self.embed_table = None if not table else embedding_table(folder, table, cfg.vocab_size)
        self.layer = _session(folder / cfg.files["layer"], threads, providers, spin, self.arena)
        self.head = _session(folder / cfg.files["head"], threads, providers, spin, self.arena)
        self._check(manifest, head_io)
        self.head_rows = True      # the runtime slices the head's input
        self.device = "cuda" if "CUDAExecutionProvider" in self.layer.get_providers() else "cpu"
        self.store = LayerStore(folder, cfg.files["layer_weights"], manifest, self.placement, self.device)
        whole = max_memory is None and placement is None     # every layer held in memory, no budget to keep
        self.layer_feeds: dict[int, dict] = {}
        self.layer_sessions = self._resident_sessions(threads) if whole else {}
        streamed = self.store.streamed
        self._next_streamed = {j: streamed[k + 1] for k, i in enumerate(streamed[:-1])
                               for j in range(i, streamed[k + 1])}
        self._settle(self.layer, LAYER_PAST[0], cfg, folder, kv_resident)
        self._optional(self.layer)
        self.lock = threading.Lock()

    def _check(self, manifest: list[dict], head_io: tuple[list, list]) -> None:
        """Each graph's I/O against the config's."""
        files = self.cfg.files
        if self.embed is not None:
            check_io(self.embed, {"input_ids"}, {HIDDEN}, files["embed"])
        self.needs_key_positions = declares(self.layer, KEY_POSITIONS)
        check_io(self.layer, {HIDDEN, "position_ids", "attention_mask", *LAYER_PAST, *[m["name"] for m in manifest],
                              *([KEY_POSITIONS] if self.needs_key_positions else [])},
                 {LAYER_HIDDEN_OUT, *LAYER_PRESENT}, files["layer"])
        check_io(self.head, {HIDDEN, *head_io[0]}, set(head_io[1]), files["head"])

    def _resident_sessions(self, threads) -> dict[int, ort.InferenceSession]:
        """Per layer, a session of its own with the layer's weights as initializers (files.layer_resident,
        export/resident.py): onnxruntime prepacks them once instead of taking them as inputs every pass (1.2-1.6x a
        pass, bit for bit the same outputs). On the CPU, for fp32 and int8 exports held wholly in memory: a session
        holds its layer in about 1.4x the file's bytes, more than a memory budget counts, so a budget or a
        placement keeps every layer fed. The layer's buffer is let go (onnxruntime keeps its own copy); the graph's
        tables are read once and shared by every such session. Other layouts, providers and older exports: none
        (every layer runs the one layer graph with its weights fed)."""
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

    def streamed_layers(self) -> int:
        return len(self.store.streamed)

    def part_seconds(self, q: int, head_names: list[str], past: int = 32, reps: int = 3) -> tuple[float, float]:
        """(one decoder layer's, the head's) measured seconds for a pass of q new tokens over `past` cached ones,
        on weights already in memory: with the streaming time (LayerStore.read_seconds) they model a streamed
        pass's cost without streaming every layer for every tree size (adaptive.streamed_cost_curve). head_names:
        the head outputs a run returns (OnnxCausalLM.head_names)."""
        c, rng = self.cfg, np.random.default_rng(0)
        store = self.store
        # a resident layer (fed, as streamed layers run), else the first streamed one in its own buffer (as a pass
        # gets it; the next pass loads it again), else a layer with its own session (nothing streams)
        i = next(iter(store.resident), store.streamed[0] if store.streamed else next(iter(self.layer_sessions), 0))
        kv = np.zeros((1, c.num_kv_heads, past, c.head_dim), self.kv_dtype)
        feed = {HIDDEN: rng.standard_normal((1, q, c.hidden_size)).astype(np.float32),
                "position_ids": np.full((1, q), past, np.int64),
                "attention_mask": np.zeros((1, 1, q, past + q), np.float32), LAYER_PAST[0]: kv, LAYER_PAST[1]: kv}
        if self.needs_key_positions:
            feed[KEY_POSITIONS] = np.arange(past + q, dtype=np.int64)[None]
        topk = {TOPK_INPUT: np.array([1], np.int64)} if declares(self.head, TOPK_INPUT) else {}

        def best(run) -> float:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            return min(times)

        with self.lock:        # the stream buffers are this measurement's
            sess = self.layer_sessions.get(i, self.layer)
            feed.update(self.layer_feeds[i] if i in self.layer_sessions else store.get(i))
            layer = best(lambda: sess.run([LAYER_HIDDEN_OUT], feed))
            head = best(lambda: self.head.run(head_names, {HIDDEN: feed[HIDDEN], **topk}))
        return layer, head

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """hidden [B, n_new, H] fp32 for input_ids [B, n_new]: the table's rows, or the embed graph."""
        if self.embed_table is None:
            return self.embed.run([HIDDEN], {"input_ids": ids})[0]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.embed_table.shape[0]):
            raise ValueError(f"token id out of range [0, {self.embed_table.shape[0]}) for the embedding table")
        return self.embed_table[ids].astype(np.float32, copy=False)

    def run(self, p: PassInput, mask: np.ndarray, head_feed: dict, names: list[str], min_rows: int = 1):
        """Embed, each layer with its weights (streamed ones double-buffered), head on the rows from p.head_from
        on (one row at least, whatever min_rows: the head's shapes stay sane)."""
        with self.lock:
            hidden, presents = self._layers(p, mask)
            skip = max(min(int(p.head_from), p.ids.shape[1] - 1), 0)
            if skip:
                hidden = host(hidden)[:, skip:]
            if self.kv_resident:
                outs = run_bound(self.head, {HIDDEN: hidden, **head_feed}, names, [], self.kv_device, self.runs[0])
            else:
                outs = self.head.run(names, {HIDDEN: hidden, **head_feed}, self.runs[0])
            return rows_back(outs, skip), presents

    def _layers(self, p: PassInput, mask: np.ndarray):
        """(the last layer's hidden state, presents per layer)."""
        store = self.store
        if store.streamed:
            store.prefetch(store.streamed[0])      # overlaps the embedding lookup
        hidden = self._embed(p.ids)
        extra = {KEY_POSITIONS: p.key_positions} if p.key_positions is not None else {}
        extra.update(self.optional_feed(p))
        layer_out = [LAYER_HIDDEN_OUT, *LAYER_PRESENT]
        presents = []
        for i, (k, v) in enumerate(p.past):
            own = self.layer_sessions.get(i)      # a resident layer with its weights inside its session
            weights = self.layer_feeds[i] if own is not None else store.get(i)
            sess, runs = (own, self.runs[1]) if own is not None else (self.layer, self.runs[0])
            if i in self._next_streamed:
                store.prefetch(self._next_streamed[i])   # the next streamed layer loads while this one computes
            t0 = time.perf_counter()
            feed = {HIDDEN: hidden, "position_ids": p.pos, "attention_mask": mask, LAYER_PAST[0]: k,
                    LAYER_PAST[1]: v, **extra}
            if self.kv_resident:   # hidden state and cache stay on the device between layers and passes
                hidden, pk, pv = run_bound(sess, {**feed, **weights}, [], layer_out, self.kv_device, runs)
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
        return hidden, presents
