"""The runtime's tests need numpy and onnxruntime, not the export stack: with torch and transformers made
unimportable, every test module still collects (tests that build models import torch inside the test), and the
numpy-only sampling tests run."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKER = '''import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(name + " is blocked: this run has no torch")
sys.meta_path.insert(0, _Block())
'''


def _pytest(tmp_path, *args):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


def test_tests_collect_and_numpy_tests_run_without_torch(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env={"PYTHONPATH": str(tmp_path)},
                           capture_output=True, text=True)
    assert "blocked" in probe.stderr, "the blocker must make torch unimportable"
    collected = _pytest(tmp_path, "--collect-only", "tests")
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    counts = dict(line.rsplit(": ", 1) for line in collected.stdout.splitlines() if line.startswith("tests/"))
    assert "ERROR" not in collected.stdout and set(counts) == {f"tests/{p.name}" for p in (ROOT / "tests").glob(
        "test_*.py")}, collected.stdout[-3000:]
    ran = _pytest(tmp_path, "tests/test_sampling.py", "-k", "width_selection or refused")
    assert ran.returncode == 0 and ran.stdout.split()[0] == "." * 7, ran.stdout[-3000:] + ran.stderr[-3000:]
