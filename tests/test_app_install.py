"""A regular (non-editable) install into a fresh virtual environment, then the README's jobs from another
directory: only project-named packages land in site-packages, every module of the checkout is in them, the
commands run, and a missing shipped model says what to do. Nothing is downloaded: the venv sees the packages of
the environment running the tests (a .pth file) and pip installs with --no-deps --no-index."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
SOURCE = ("pyproject.toml", "README.md", "specbeam_edge", "apps", "export", "models/smollm2")
INSTALLED = {"specbeam_edge": "specbeam_edge", "specbeam_apps": "apps", "specbeam_export": "export",
             "specbeam_models/smollm2": "models/smollm2"}
SENTENCE = "Click the Save button to store the document."

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    src = base / "src"                     # a copy: the build writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(ROOT / name, src / name)
    env_dir = base / "venv"
    # The new venv sees this interpreter's packages through a .pth file: --system-site-packages would give it the
    # base Python's, whose setuptools may be too old for pyproject.toml's license (an SPDX string) when the tests
    # run in a virtual environment (CI's). A plain path line: the editable install's own .pth hooks stay off.
    # --without-pip: the venv's bundled setuptools would shadow this environment's newer one in the build.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    py = env_dir / "bin" / "python"
    new_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    new_site.mkdir(parents=True, exist_ok=True)
    here = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (new_site / "_parent_env.pth").write_text("".join(f"{d}\n" for d in here))
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(src)], check=True, cwd=base)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    elsewhere = base / "elsewhere"
    elsewhere.mkdir()
    return env_dir / "bin", site, elsewhere


def run(bin_dir, elsewhere, *cmd, stdin=None, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECBEAM_MODELS")} | (env or {})
    return subprocess.run([str(bin_dir / cmd[0]), *cmd[1:]], input=stdin, capture_output=True, text=True,
                          cwd=elsewhere, env=env, timeout=300)


def test_only_project_named_packages_are_installed(venv):
    _, site, _ = venv
    record = next(site.glob("specbeam_edge-*.dist-info")) / "RECORD"
    tops = {line.split("/")[0] for line in record.read_text().splitlines()
            if not line.startswith("..") and ".dist-info" not in line.split("/")[0]}
    assert tops == {k.split("/")[0] for k in INSTALLED}
    for name in ("apps", "bench", "export", "models", "tests"):
        assert not (site / name).exists()
    # every module of the checkout's packages is installed (a new subpackage must be listed in pyproject.toml)
    for installed, repo in INSTALLED.items():
        want = {p.relative_to(ROOT / repo) for p in (ROOT / repo).rglob("*.py")}
        have = {p.relative_to(site / installed) for p in (site / installed).rglob("*.py")}
        assert want == have, installed


def test_fetch_finds_the_head_and_draft_in_a_regular_install(venv):
    """`specbeam fetch smollm2` attaches the lookahead head and builds the draft from files a regular install
    carries (they were only in the checkout's models/: greedy ran at 1.0 tokens a pass after such a fetch)."""
    bin_dir, site, elsewhere = venv
    code = ("from specbeam_apps import fetch as pipeline; from specbeam_edge import fetch; "
            "s = fetch.source('smollm2'); "
            "print(pipeline._shipped_ahead(s)); print(pipeline._shipped_draft(s))")
    proc = run(bin_dir, elsewhere, "python", "-c", code, env={"SPECBEAM_MODELS": str(elsewhere / "none")})
    assert proc.returncode == 0, proc.stderr
    ahead, draft = proc.stdout.split()
    assert ahead == str(site / "specbeam_models" / "smollm2" / "ahead")
    assert draft == str(site / "specbeam_models" / "smollm2" / "draft")
    for folder, name in ((ahead, "ahead.safetensors"), (draft, "draft.safetensors")):
        assert (Path(folder) / name).read_bytes() == (MODELS / "smollm2" / Path(folder).name / name).read_bytes()


def test_readme_job_from_another_directory(venv):
    bin_dir, _, elsewhere = venv
    pair = ["--model", str(MODELS / "ende" / "target"), "--draft", str(MODELS / "ende" / "draft")]
    proc = run(bin_dir, elsewhere, "specbeam", "translate", "--beam_size", "4", "-q", *pair, stdin=SENTENCE + "\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "Klicken Sie auf die Schaltfläche Speichern, um das Dokument zu speichern.\n"
    same = run(bin_dir, elsewhere, "specbeam-translate", "--beam_size", "4", "-q", *pair, stdin=SENTENCE + "\n")
    assert same.stdout == proc.stdout
    assert run(bin_dir, elsewhere, "specbeam-export", "--help").returncode == 0
    assert "specbeam-chat" in run(bin_dir, elsewhere, "specbeam-chat", "--help").stdout


def test_shipped_models_from_another_directory(venv):
    bin_dir, site, elsewhere = venv
    missing = run(bin_dir, elsewhere, "specbeam", "generate", "Open the file.")
    assert missing.returncode == 2 and missing.stdout == ""
    # a regular install has no shipped demo pair: it names the fetch that gives a model (issue 66)
    assert missing.stderr == (
        "specbeam: error: pass --model: no model is fetched yet and this installation has no shipped demo pair; "
        "run `specbeam fetch smollm2` (93 MB), then --model smollm2 (or pass a model folder)\n")
    found = run(bin_dir, elsewhere, "specbeam", "generate", "Open the file.", "--num_beams", "4",
                env={"SPECBEAM_MODELS": str(MODELS)})
    assert found.returncode == 0, found.stderr
    assert found.stdout == "Öffnen Sie die Datei.\n"
