"""`python -m bench` writes into an ignored folder unless --out is given (before: the tracked bench/results/)."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_out_is_ignored_by_git():
    from bench.__main__ import parser

    out = Path(parser().parse_args([]).out)
    assert out == ROOT / "bench" / "out" / "results"
    probe = out / "e2e.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, f"{probe} is not ignored by git"
    assert Path(parser().parse_args(["--out", "x"]).out) == Path("x")


def test_export_sizes_default_out_is_ignored_too():
    """Before: python -m bench.export_sizes wrote into the tracked bench/results/ by default."""
    from bench.export_sizes import parser

    assert Path(parser().parse_args([]).out) == ROOT / "bench" / "out" / "results"


def test_beam_work_compares_the_arms_and_leaves_the_functions_as_they_were(tmp_path):
    """bench.beam_work runs both arms (steps together, each search alone) with the same output, times parts that
    nest (a step holds its ranking) and restores what it wraps."""
    import json

    from bench import beam_work
    from specbeam_edge.decoding import beam, search

    before = search.ExactSearch._beam_logprobs, beam.step_many, beam.BeamRows.top
    assert beam_work.main(["--lines", "4", "--batches", "1,4", "--max_new_tokens", "8", "--repeats", "2",
                           "--out", str(tmp_path)]) == 0
    assert (search.ExactSearch._beam_logprobs, beam.step_many, beam.BeamRows.top) == before
    assert (tmp_path / "beam_work.png").stat().st_size > 0
    for row in json.loads((tmp_path / "beam_work.json").read_text())["rows"]:
        assert row["identical"] is True
        assert 0 < row["ranking_share"] <= row["step_share"] + 1e-3 <= 1
        assert row["alone_s"] > 0 and row["together_s"] > 0