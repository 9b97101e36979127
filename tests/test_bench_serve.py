"""bench.serve's load generator and report on the shipped demo model, our server alone (llama.cpp's server is a
peer the benchmark starts only where it is installed): the rounds run, answers at 2 clients equal those at 1."""
import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("matplotlib")


def test_bench_serve_runs(tmp_path):
    from bench import serve

    assert serve.main(["--model", "models/ende/target", "--no_llama", "--clients", "1,2", "--rounds", "1",
                       "--max_tokens", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [r["clients"] for r in report["rows"]] == [1, 2]
    assert all(r["tok_s"] > 0 and r["ttft_p95_s"] >= r["ttft_p50_s"] > 0 for r in report["rows"])
    assert report["identical_to_alone"] == {"2": "2/2"}
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_bench_serve_soak_runs(tmp_path):
    from bench import serve_soak

    assert serve_soak.main(["--model", "models/ende/target", "--clients", "3", "--requests", "4", "--long_tokens",
                            "200", "--max_tokens", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "serve_soak.json").read_text())
    assert report["lost"] == 0 and report["answered"] + report["left_by_client"] == 12
    assert (tmp_path / "serve_soak.png").stat().st_size > 0


def test_bench_serve_baseline_arm(tmp_path):
    """--baseline: the same server from another checkout (here this one) as an arm, with its ratio."""
    from bench import serve

    root = serve.ROOT
    assert serve.main(["--model", str(root / "models/ende/target"), "--no_llama", "--baseline", str(root),
                       "--clients", "1", "--rounds", "1", "--max_tokens", "4", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "serve.json").read_text())["rows"]
    assert [r["arm"] for r in rows] == [serve.OURS, serve.BASELINE] and rows[0][f"x {serve.BASELINE}"] > 0
