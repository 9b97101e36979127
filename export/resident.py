"""The split layout's graph for resident layers: `layer_resident.onnx`, the layer graph with each layer's weights
as initializers the runtime supplies from that layer's file (onnxruntime's external initializers), so a layer
kept in memory runs on prepacked weights instead of weights fed as inputs every pass (1.2-1.4x per layer on
Qwen2.5-Coder-1.5B int8, outputs bit for bit the same; bench/README "The real pair in memory"). The graph's own
large constants (rotary tables) go to `weights/layer_tables.bin`, which the runtime reads once and shares among
the resident layers' sessions.

    python -m export.resident FOLDER        # adds it to a split export made before it existed
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specbeam_edge.contract import CONFIG_FILE, write_json_object

GRAPH = "layer_resident.onnx"
TABLES = "weights/layer_tables.bin"
ALIGN = 64


def _external(t: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    t.data_location = onnx.TensorProto.EXTERNAL
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


def write(folder: Path, layer: onnx.ModelProto, manifest: list[dict], min_table_bytes: int = 1024) -> dict:
    """Write layer_resident.onnx and weights/layer_tables.bin into the split export `folder` from its layer graph
    (weights as inputs, loaded with its tensors) and layer manifest; returns the config's files.layer_resident
    entry."""
    folder = Path(folder)
    model = onnx.ModelProto.FromString(layer.SerializeToString())
    def nbytes(m):
        return int(np.prod(m["shape"])) * np.dtype(m["dtype"]).itemsize
    # small per-layer tensors (a layer's sliding-window flag) stay inputs: as constants onnxruntime folds what
    # they select and drops them, and then cannot take the layer's own values for them
    fed = [m["name"] for m in manifest if nbytes(m) < min_table_bytes]
    names = {m["name"] for m in manifest} - set(fed)
    if not {m["name"] for m in manifest} <= {i.name for i in model.graph.input}:
        raise ValueError(f"{folder}: the layer graph does not take every manifest tensor as an input")
    inputs = [i for i in model.graph.input if i.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    for m in manifest:         # placeholders: the runtime supplies every layer's own (never read from this file)
        if m["name"] in names:
            t = onnx.TensorProto(name=m["name"], data_type=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(m["dtype"])), dims=m["shape"])
            _external(t, "weights/layer_0.bin", m["offset"], nbytes(m))
            model.graph.initializer.append(t)
    tables, parts, offset = [], [], 0
    for t in model.graph.initializer:
        if t.name in names or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        a = numpy_helper.to_array(t)
        if a.nbytes < min_table_bytes:
            continue
        pad = (-offset) % ALIGN
        parts.append(b"\0" * pad)
        offset += pad
        raw = np.ascontiguousarray(a).tobytes()
        tables.append({"name": t.name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset})
        t.ClearField("raw_data")
        for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            t.ClearField(f)
        _external(t, TABLES, offset, len(raw))
        parts.append(raw)
        offset += len(raw)
    (folder / "weights").mkdir(exist_ok=True)
    (folder / TABLES).write_bytes(b"".join(parts))
    onnx.save(model, folder / GRAPH)
    return {"graph": GRAPH, "tables": TABLES, "tables_manifest": tables, "fed": fed}


def add_to(folder: Path) -> None:
    """Add the resident-layer graph to an existing split export (its config gains files.layer_resident)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    cfg = json.loads(path.read_text())
    if cfg.get("layout") != "split":
        raise ValueError(f"{folder} is not a split-layout export (layout {cfg.get('layout')!r})")
    cfg["files"]["layer_resident"] = write(folder, onnx.load(folder / cfg["files"]["layer"]),
                                           cfg["files"]["layer_manifest"])
    write_json_object(path, cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    try:
        add_to(args.folder)
    except (OSError, ValueError, KeyError) as e:
        print(f"export.resident: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.folder / GRAPH} and {args.folder / TABLES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
