"""Installs resolve one ONNX Runtime: onnxruntime and onnxruntime-gpu install the same module, so the base
package depends on neither and the [cpu] and [gpu] extras bring one each. The resolver check asks pip what a
fresh environment would install (`pip install --dry-run --ignore-installed --report`); it skips when the package
index cannot be reached."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def resolved(spec: str) -> set[str]:
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--no-build-isolation", "--report", "-", spec], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    if r.returncode != 0:
        if "ResolutionImpossible" in r.stderr or "conflict" in r.stderr.lower():
            pytest.fail(f"pip cannot resolve {spec}: {r.stderr[-2000:]}")
        pytest.skip(f"pip could not resolve {spec} here (package index unreachable?): {r.stderr[-300:]}")
    return {item["metadata"]["name"].lower() for item in json.loads(r.stdout)["install"]}


@pytest.mark.slow
@pytest.mark.parametrize("extras, runtime", [("gpu", "onnxruntime-gpu"), ("cpu", "onnxruntime"),
                                             ("gpu,app", "onnxruntime-gpu")])
def test_each_extra_resolves_one_onnxruntime(extras, runtime):
    names = resolved(f".[{extras}]")
    assert runtime in names and not ({"onnxruntime", "onnxruntime-gpu"} - {runtime}) & names, sorted(names)


def test_base_package_depends_on_no_onnxruntime():
    """The same fact read from pyproject.toml (no network): a base dependency would sit beside [gpu]'s."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtimes = {"onnxruntime", "onnxruntime-gpu"}

    def names(reqs):
        return {r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].split("!")[0].strip().lower()
                for r in reqs}
    assert not names(project["dependencies"]) & runtimes
    extras = project["optional-dependencies"]
    assert names(extras["cpu"]) & runtimes == {"onnxruntime"} and names(extras["gpu"]) & runtimes == {"onnxruntime-gpu"}
    assert all(not names(reqs) & runtimes for name, reqs in extras.items() if name not in ("cpu", "gpu"))


def test_import_without_onnxruntime_names_the_extras():
    code = "import sys; sys.modules['onnxruntime'] = None; import specbeam_edge"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "ImportError: specbeam-edge needs ONNX Runtime, which comes with one of its extras: pip install "
        "'specbeam-edge[cpu]', or 'specbeam-edge[gpu]' for CUDA (never both)")


def test_the_docs_say_how_to_get_torchs_cpu_build():
    """Before: the only advice was a comment that pinning torch avoids its CUDA build, which is true only where a
    CPU wheel of that release is at hand; pip's default index serves Linux torch with its CUDA libraries."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "torch's CPU build" in quick and 'see "Install"' in quick
    install = readme.split("\n## Install", 1)[1].split("\n## ", 1)[0]
    assert "--index-url <PyTorch's CPU wheel index>" in install
    for path in (ROOT / ".ci" / "run", ROOT / "pyproject.toml"):
        text = path.read_text()
        assert "anything unpinned pulls" not in text and "or pip pulls a CUDA build" not in text, path
