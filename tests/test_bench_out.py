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
