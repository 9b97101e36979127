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


def test_beam_work_shares_add_up_and_leave_the_methods_as_they_were(tmp_path):
    """bench.beam_work times parts that nest (the replay holds the rows' extraction and the step, the step holds
    the ranking) and restores the methods it wraps."""
    import json

    from bench import beam_work
    from specbeam_edge import beam, search

    before = search.ExactSearch._replay, beam.BeamSearch.step
    assert beam_work.main(["--lines", "4", "--batches", "1,4", "--max_new_tokens", "8", "--out", str(tmp_path)]) == 0
    assert (search.ExactSearch._replay, beam.BeamSearch.step) == before
    for row in json.loads((tmp_path / "beam_work.json").read_text())["rows"]:
        slack = 2e-3                                                 # the JSON rounds to milliseconds
        assert 0 < row["ranking_s"] <= row["step_s"] + slack
        assert row["rows_s"] + row["step_s"] <= row["replay_s"] + slack and row["replay_s"] <= row["wall_s"]
