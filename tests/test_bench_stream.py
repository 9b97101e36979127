"""bench.stream's own arithmetic (the real pair runs only in the benchmark): the weights a streamed pass reads, the
per-arm summary and ratios, the disk read and the eviction of a mapped file's pages."""
import json
import mmap

import pytest

from bench import stream


def _rows(n, seconds, steps=None, passes=None):
    return {"n": n, "seconds": seconds, "steps": steps or n, "passes": passes or n, "bytes_per_token": 10,
            "peak_rss_mb": 100.0, "tokens": [1] * n}


def test_ratios_are_medians_of_per_prompt_ratios():
    rows = {"plain K=1": [_rows(10, 10.0), _rows(10, 20.0), _rows(10, 5.0)],
            "spec K=1": [_rows(10, 2.0, passes=2), _rows(10, 5.0, passes=2), _rows(10, 2.5, passes=2)],
            "llama.cpp evicted": [_rows(10, 10.0), _rows(10, 10.0), _rows(10, 10.0)]}
    r = stream.ratios(rows)
    assert r["spec K=1 / plain K=1"] == pytest.approx(4.0)          # per prompt 5, 4, 2: the median
    assert r["spec K=1 / llama.cpp evicted"] == pytest.approx(4.0)  # 5, 2, 4
    s = stream.summarize(rows, {"spec K=1": {"ready": "spec K=1", "resident": 1}})
    assert s["spec K=1"]["steps_per_pass"] == 5.0 and s["spec K=1"]["resident"] == 1
    assert s["plain K=1"]["tok_s"] == 1.0


def test_target_bytes_counts_layers_and_head_not_the_mapped_table(exported):
    folder = exported("llama", "int8", layout="split", std=0.3, seed=3)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    want = sum((folder / cfg["files"]["layer_weights"].format(i=i)).stat().st_size for i in range(cfg["num_layers"]))
    assert stream.target_bytes(folder) == want + (folder / "head.onnx").stat().st_size
    assert stream.direct_read_mb_s([folder / "head.onnx"]) > 0


def test_evict_drops_this_process_pages_of_a_mapped_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (4 << 20))
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert sum(m[i] for i in range(0, len(m), 4096)) == 1024      # every page touched
        assert _rss_kb(path) == 4096
        stream._evict(path)
        assert _rss_kb(path) == 0                                     # the process holds none of its pages
        assert m[len(m) - 1] == 1                                     # and reads them again on use
        m.close()


def _rss_kb(path) -> int:
    """Rss of this process's mapping of `path` (/proc/self/smaps)."""
    lines, name = open("/proc/self/smaps").read().splitlines(), str(path.resolve())
    at = next(i for i, line in enumerate(lines) if line.endswith(name))
    return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:"))
