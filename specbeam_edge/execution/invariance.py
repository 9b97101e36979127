"""Is a target batch-invariant on this machine? Measured, not assumed (DESIGN "The load-time invariance check").

Exact speculative beam search replays beam search over a tree pass, so a node's logits in that pass must be
those of its path scored alone. Whether a graph gives that depends on its kernels, the onnxruntime version and
the CPU's instruction set, so the engine scores a small branching tree once both ways and compares. The result
is cached per model file, onnxruntime version and CPU, so a start-up pays for it once.
"""
from __future__ import annotations

import base64
import hashlib
import platform
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..cachefile import cache_dir, entries, store_entry
from .pass_input import PassInput
from .runner import host

# largest |tree row - the row alone| over the largest |logit| (measure): fp32 and per-row int8 graphs measure 0 on
# this CPU, quantize_dynamic 1e-2 and more (one activation scale per pass)
TOLERANCE = 1e-5
PROMPT_LEN = 6
# three roots, 12 nodes, depth 4 below the prompt: parents index into this list (-1: child of the prompt's last
# token)
TREE_PARENTS = (-1, -1, -1, 0, 0, 1, 2, 3, 4, 5, 7, 8)
SOURCE_LEN = 5          # encoder-decoder targets: a random source of this many positions


@dataclass(frozen=True)
class Invariance:
    """max_diff: the measured difference (relative to the largest logit); ok: max_diff <= TOLERANCE."""
    max_diff: float
    ok: bool
    cached: bool = False


class NotInvariantError(ValueError):
    """The target is not batch-invariant here: exact speculation would not equal plain search."""


def _tokens(model, n: int, seed: int) -> np.ndarray:
    vocab = model.cfg.vocab_size
    return np.random.default_rng(seed).integers(min(3, vocab - 1), vocab, n)


def _static(model) -> dict | None:
    """Random per-request inputs of the right shapes (cross K/V of a random source: any values will do)."""
    if not model.static_inputs:
        return None
    rng = np.random.default_rng(7)
    types = {i.name: i for i in model.runner.sess.get_inputs()}
    out = {}
    for name in model.static_inputs:
        shape = [1] + [d if isinstance(d, int) else SOURCE_LEN for d in types[name].shape[1:]]
        if types[name].type == "tensor(float16)":
            dtype = np.float16
        elif types[name].type == "tensor(int64)":
            dtype = np.int64
        else:
            dtype = np.float32
        out[name] = (np.ones(shape, dtype) if "mask" in name else rng.standard_normal(shape).astype(dtype))
    return out


def _rows(model, ids, pos, mask, past, static, past_positions):
    """The scored rows' logits (or a top-k head's log-probs), and the presents. past_positions: the position of
    every cached column (sliding-window graphs take them as key_position_ids)."""
    topk = 16 if model.cfg.output == "topk" else None
    head, presents = model.run(PassInput.over(model, ids, pos, mask, past, past_positions, topk=topk, static=static))
    rows = head[0] if isinstance(head, tuple) else head
    return np.asarray(rows[0], np.float32), presents


def _step(model, token, position, past, static, past_positions, rows: int):
    """One plain decoding step: the token's row from a pass of its own over `past` (with the padding rows the
    runtime adds up to `rows`; a padding row sees only itself, as in batch._one_pass_rows), and the past with
    the token's key/value appended."""
    Q = max(1, rows)
    ids, pos = np.zeros(Q, np.int64), np.zeros(Q, np.int64)
    ids[0], pos[0] = token, position
    N = len(past_positions)
    mask = np.zeros((Q, N + Q), bool)
    mask[0, :N + 1] = True
    mask[np.arange(1, Q), N + np.arange(1, Q)] = True
    rows, presents = _rows(model, ids, pos, mask, past, static, past_positions)
    kept = [(model.to_kv(host(k)[:, :, :N + 1]), model.to_kv(host(v)[:, :, :N + 1])) for k, v in presents]
    return rows[0], kept, np.append(past_positions, position)


def measure(model, rows: int | None = None) -> float:
    """Score a branching tree over a prompt in one pass, then each node's path again as plain decoding does
    (one token a pass, padded to `rows` rows, default model.min_rows; over a cache that holds the prompt and the
    path only); the largest difference of a node's row between the two, relative to the largest |logit|.

    Two things differ, and both are what exact speculation needs the kernels to ignore: the number of rows in a
    pass (quantize_dynamic's one activation scale per tensor depends on it; kernels chosen by row count may), and
    the column layout (in the tree pass a node's keys sit among its siblings' masked columns; fp32 attention sums
    round according to where those sit, which int8 activations turn into quantization steps: graphs exported with
    fp32 attention and int8 compute fail here, DESIGN "Layout-exact attention")."""
    rows = model.min_rows if rows is None else rows
    static = _static(model)
    prompt = _tokens(model, PROMPT_LEN, 0)
    causal = np.tril(np.ones((PROMPT_LEN, PROMPT_LEN), bool))
    _, past = _rows(model, prompt, np.arange(PROMPT_LEN), causal, model.empty_past(1), static, np.zeros(0, np.int64))
    past = [(model.to_kv(host(k)), model.to_kv(host(v))) for k, v in past]
    tokens = _tokens(model, len(TREE_PARENTS), 1)
    paths = []
    for j, p in enumerate(TREE_PARENTS):
        paths.append(([] if p < 0 else paths[p]) + [j])
    n = len(TREE_PARENTS)
    mask = np.zeros((n, PROMPT_LEN + n), bool)
    mask[:, :PROMPT_LEN] = True
    for j, path in enumerate(paths):
        mask[j, PROMPT_LEN + np.array(path)] = True
    positions = PROMPT_LEN - 1 + np.array([len(p) for p in paths])
    tree, _ = _rows(model, tokens, positions, mask, past, static, np.arange(PROMPT_LEN))
    worst = 0.0
    for j, path in enumerate(paths):
        kv, cols = past, np.arange(PROMPT_LEN)
        for node in path:
            ref, kv, cols = _step(model, tokens[node], positions[node], kv, static, cols, rows)
        finite = np.isfinite(ref)
        scale = float(np.abs(ref[finite]).max()) or 1.0
        worst = max(worst, float(np.abs(tree[j][finite] - ref[finite]).max()) / scale)
    return worst


def _cpu() -> str:
    """The CPU's model and instruction-set flags (the kernels onnxruntime picks depend on them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(model, rows: int | None = None) -> str:
    """The graph files (path, size, mtime), onnxruntime's version, the session's providers, the CPU and the rows
    of the plain steps (default model.min_rows)."""
    rows = model.min_rows if rows is None else rows
    parts = [ort.__version__, _cpu(), model.cfg.layout, ",".join(_providers(model)), f"rows {rows}"]
    for key in ("model", "layer", "head", "embed"):
        name = model.cfg.files.get(key)
        if isinstance(name, str):
            for p in (model.folder / name, model.folder / (name + ".data")):
                if p.is_file():
                    st = p.stat()
                    parts.append(f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}")
    for name in model.cfg.files.get("layer_sha256") or []:
        parts.append(name)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _providers(model) -> list[str]:
    return model.runner.providers()


def check(model, *, use_cache: bool = True, rows: int | None = None) -> Invariance:
    """Measure (or read the cached measurement of) the model's batch invariance on this machine, its plain steps
    scoring `rows` rows a pass (default model.min_rows, what the runtime runs)."""
    rows = model.min_rows if rows is None else rows
    path = cache_dir() / "invariance.json"
    key = cache_key(model, rows)
    if use_cache:
        hit = entries(path).get(key)
        if isinstance(hit, (int, float)):
            return Invariance(float(hit), float(hit) <= TOLERANCE, cached=True)
    diff = measure(model, rows)
    if use_cache:
        store_entry(path, key, diff)
    return Invariance(diff, diff <= TOLERANCE)


def row_floor(model, *, use_cache: bool = True) -> int:
    """The fewest rows a pass of this quantized target must score on this machine: 1 when the check with
    one-row plain steps measures exactly 0 (onnxruntime's one-row kernels give a node the bits a tree pass gives
    it, so no padding row is needed), else model.min_rows (2). Exactly 0, not within TOLERANCE: a last-bit
    difference the random tree shows may be a quantization step on real text (DESIGN "Quantized targets"
    point 2). Cached as check() is, so a model file pays for it once per machine."""
    return 1 if check(model, use_cache=use_cache, rows=1).max_diff == 0.0 else model.min_rows


# precisions whose int8 activations amplify fp32 attention's layout-dependent rounding: exact only with the
# attention the exporter now writes in double for them (export --attention fp64, DESIGN "Layout-exact attention")
LAYOUT_SENSITIVE = ("int8", "int4")


def layout_refusal(model) -> str | None:
    """The one-line message for a target whose graph cannot be layout-exact (an int8/int4 export made before
    attention in double), else None. Structural, because the measured check's random tree rarely lands on one
    of the rounding boundaries that real text hits (SmolLM2-135M int8: 5-9% logit differences on a chat prompt,
    2.9e-7 on the random tree)."""
    cfg = model.cfg
    if cfg.precision not in LAYOUT_SENSITIVE or cfg.raw.get("attention_dtype") == "float64":
        return None
    return (f"{model.folder}: this {cfg.precision} target computes attention in fp32, whose rounding depends on "
            f"where a tree pass's masked columns sit, and its int8 activations turn that into different tokens, so "
            f"speculative output would not equal plain search. Export it again with this version (specbeam-export "
            f"-p {cfg.precision}: attention in double; a fetched model: specbeam fetch NAME --force), or run "
            f"without speculation")


def refusal(model, result: Invariance) -> str:
    """The one-line message of a target refused for exact speculation."""
    precision = model.cfg.precision
    fix = ("re-export it with -p int8 (per-row int8: batch-invariant and fast)"
           if precision in ("int8", "int8dyn", "int4") else "re-export it with -p int8 or -p fp32")
    return (f"{model.folder}: this {precision} target is not batch-invariant on this machine (a tree pass differs "
            f"from its paths scored alone by {result.max_diff:.1e} of the largest logit; the limit is "
            f"{TOLERANCE:.0e}), so speculative output would not equal plain beam search. Run without speculation "
            f"(plain search works), or {fix}")


# -- int8 sums that overflow int16 -----------------------------------------------------------------------------
# A MatMulInteger of [2, 64] uint8 activations (zero point 128) by [64, 16] int8 weights, all 127: the graph
# tests/test_invariance.py builds with onnx and checks against these bytes (zlib, base64), so that the runtime
# measures without onnx.
SATURATION_PROBE = ("eNrj4BDiLS5ITU5KTczVTU1JT7V6ycElw8WYyMVYzsVUlSjEWKnE65tY4lua45lXkpqeWiTEWlCUn5Sq1cPB4cAhIMDsxFju1cBRP"
                    "wpGwSgYsUCLU4DJCVheeDE2RAkDiw8hPi4eDiYhDi4mDiYgdkgCClaCBdngggJOLFwMArwA0/oVBQ==")
_SATURATES: bool | None = None


class QuantizationWarning(UserWarning):
    """A quantized graph whose numbers this machine cannot compute as exported (see saturation_warning)."""


def int8_sums_saturate() -> bool:
    """Does this machine's onnxruntime sum u8 x s8 products in int16 pairs that overflow (AVX2 without VNNI:
    vpmaddubsw)? Measured once per process on a MatMulInteger whose pairs reach 255 x 127 x 2 > 32,767, as 8-bit
    weights can (export/quant.py)."""
    global _SATURATES
    if _SATURATES is None:
        model = zlib.decompress(base64.b64decode(SATURATION_PROBE))
        sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        y = sess.run(None, {"a": np.full((2, 64), 255, np.uint8)})[0]
        _SATURATES = bool((y != (255 - 128) * 127 * 64).any())
    return _SATURATES


def saturation_warning(cfg) -> str | None:
    """A warning for an int8 graph with 8-bit weights (exported with --full_range, or before 7 bits became the
    default) on a machine whose int8 kernel saturates: its logits can be far off (measured 20-33%)."""
    quant = cfg.raw.get("quantization") or {}
    if cfg.raw.get("precision") not in ("int8", "int8dyn") or not isinstance(quant, dict) or \
            quant.get("reduce_range", False) or not int8_sums_saturate():
        return None
    return (f"{cfg.folder}: this CPU's int8 kernel sums pairs of products in 16 bits (no VNNI), which this export's "
            f"8-bit weights overflow: its outputs can be far from the model's; re-export it without --full_range "
            f"(7-bit weights, the default; a fetched model: specbeam fetch NAME --force)")
