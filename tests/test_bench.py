"""The arithmetic benchmarks report: the speculation ceiling from measured pass-cost curves."""
import pytest

from bench.cost import _at, ceiling


def test_ceiling_on_flat_and_linear_curves():
    flat = {"1": 2.0, "4": 2.0, "16": 2.0, "64": 2.0}
    rows = ceiling(flat, {"1": 0.5, "4": 0.5, "16": 0.5}, Ks=(1, 4), depths=(2, 4))
    for r in rows:     # a pass costs the same whatever its size: every accepted level is a free step
        assert r["free_draft"] == r["depth"] + 1
        assert r["with_draft"] == pytest.approx((r["depth"] + 1) * 2.0 / (2.0 + r["depth"] * 0.5), abs=0.01)
    # K wide at each depth, then the default tree at budget 80: K=1 4 wide x 6, K=4 16 wide x 5
    assert [(r["K"], r["width"], r["depth"]) for r in rows] == [(1, 1, 2), (1, 1, 4), (1, 4, 6),
                                                                 (4, 4, 2), (4, 4, 4), (4, 16, 5)]
    at48 = ceiling(flat, {"1": 0.5, "4": 0.5, "16": 0.5}, Ks=(4,), depths=(2,), budget=48)
    assert (at48[-1]["width"], at48[-1]["depth"], at48[-1]["tree"]) == (16, 3, "default, budget 48")
    linear = {str(q): 0.1 * q for q in (1, 2, 4, 8, 16, 32, 64, 128)}
    for r in ceiling(linear, linear, Ks=(1, 4), depths=(2, 4)):
        # cost grows with nodes: a K-wide tree gains nothing, a wider one loses (K + W d nodes for d + 1 steps)
        assert r["free_draft"] == pytest.approx(min(1.0, (r["depth"] + 1) * r["K"]
                                                    / (r["K"] + r["width"] * r["depth"])), abs=0.01)


def test_curve_interpolation_hits_measured_points():
    ms = {"1": 1.0, "4": 2.0, "16": 8.0}
    assert _at(ms, 4) == pytest.approx(2.0) and _at(ms, 1) == pytest.approx(1.0)
    assert 2.0 < _at(ms, 8) < 8.0


def test_export_sizes_rows_accumulate_and_render(tmp_path):
    """A run of bench.export_sizes replaces only its own rows, and bench/README.md shows them (the report once
    dropped the section, so a `python -m bench` run erased it)."""
    import json

    from bench.export_sizes import merge_rows
    from bench.report import render

    def row(family, precision, mb):
        return {"family": family, "shapes_of": family.upper(), "date": "2026-12-01", "params_m": 1.0,
                "hf_bf16_mb": 2.0, "precision": precision, "layout": "whole", "export_s": 1.0, "peak_rss_gb": 0.1,
                "size_mb": mb}

    assert merge_rows(tmp_path, [row("a", "fp16", 10)]) == [row("a", "fp16", 10)]
    (tmp_path / "export_sizes.json").write_text(json.dumps({"rows": [row("a", "fp16", 10), row("a", "int8w", 5)]}))
    rows = merge_rows(tmp_path, [row("a", "fp16", 11), row("b", "int8w", 7)])
    assert [(r["family"], r["precision"], r["size_mb"]) for r in rows] == [("a", "int8w", 5), ("a", "fp16", 11),
                                                                          ("b", "int8w", 7)]
    (tmp_path / "export_sizes.json").write_text(json.dumps({"machine": {"date": "2026-12-01"}, "rows": rows}))
    readme = tmp_path / "README.md"
    render(tmp_path, readme, "python -m bench")
    text = readme.read_text()
    assert "## Export size per precision" in text and "| B | 1 | 2 | int8w | whole |" in text


def test_rowcost_steps_needed_follow_the_measured_times(monkeypatch, pair):
    """bench.cost.alternated: each model's rows are timed in every round (order reversed every other round),
    and the steps a pass needed for a goal are the goal times the pass's time over one row's."""
    import bench.cost as cost

    calls = []

    def fake(lm, past_len, q, reps):
        calls.append((str(lm.folder), q))
        return 0.01 * (1 + 0.1 * (q - 1))          # 10 ms, +1 ms a row
    monkeypatch.setattr(cost, "pass_time", fake)
    data = cost.alternated(list(pair), sizes=(1, 2, 4), rounds=2, reps=1, threads=1, goals=(1.5,))
    assert [c[0] for c in calls] == [pair[0]] * 3 + [pair[1]] * 3 + [pair[1]] * 3 + [pair[0]] * 3
    for d in data["models"].values():
        assert d["ms"] == {"1": 10.0, "2": 11.0, "4": 13.0}
        assert d["needed_steps_a_pass"]["1.5"] == {"1": 1.5, "2": 1.65, "4": 1.95}


def test_render_keeps_the_hand_written_sections(tmp_path):
    """A section no result file makes (a record of a run outside `python -m bench`) stays where it stands; the
    generated sections are rewritten from their JSON, and one new to the README goes after the last generated
    one. The render used to write only its own sections, so a `--out bench/results` run erased the others."""
    import json

    from bench.report import TITLES, render

    cost = {"past_len": 8, "models": {"m (fp32)": {"ms": {"1": 1.5, "2": 2.5}}}}
    (tmp_path / "cost.json").write_text(json.dumps({**cost, "machine": {"date": "today"}}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# Benchmarks\n\nold preamble\n\n## {TITLES['cost']}\n\nstale numbers\n\n"
                      f"## A run by hand\n\nkept | as | written\n")
    render(tmp_path, readme, "python -m bench")
    text = readme.read_text()
    assert "stale numbers" not in text and "| m (fp32) | 1.5 | 2.5 |" in text and "old preamble" not in text
    assert text.index(TITLES["cost"]) < text.index("## A run by hand\n\nkept | as | written")
    (tmp_path / "kv.json").write_text(json.dumps({
        "rows": [{"engine": "e"}], "prompts": 1, "K": 1, "max_new_tokens": 1, "threads": 1, "reps": 1, "summary": "s",
        "pass_ms_by_new_and_cached": {}, "op_profile": {"Q": 1, "N": 1, "us_by_op": {}}}))
    render(tmp_path, readme, "python -m bench")
    text = readme.read_text()
    assert text.index(TITLES["cost"]) < text.index(TITLES["kv"]) < text.index("## A run by hand")
    assert text.count("kept | as | written") == 1
