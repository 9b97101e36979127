"""`export --overwrite` onto a split model another process streams: the reader reads through the folder swap and
finishes when the new export holds the same weights, and stops with one line naming the first changed file when
not (before: a FileNotFoundError traceback either way); the folder left is the new export, whole and loadable
(nothing half-written)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specbeam_edge import Engine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = 200          # more than the reader answers while the export runs


@pytest.mark.parametrize("seed", [3, 5], ids=["the same weights", "other weights"])
def test_overwrite_while_a_reader_streams_the_model(hf_models, tmp_path, seed):
    from export import export

    folder = export(hf_models("llama", layers=4, std=0.3, seed=3)[0], tmp_path / "model", layout="split",
                    quiet=True)
    layer = (folder / "weights" / "layer_0.bin").stat().st_size
    budget = sum(p.stat().st_size for p in folder.glob("head.onnx*")) + 3 * layer     # one resident, three streamed
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(PROMPTS)))
    reader = subprocess.Popen([sys.executable, "-m", "specbeam_edge.commands.cli", "generate", "--model", str(folder),
                               "--file", str(prompts), "--max_memory", str(budget), "--max_new_tokens", "24",
                               "--no_draft", "--no_stream"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = reader.stdout.readline()                   # the reader streams: its first answer is out
        assert first, reader.communicate()[1]
        export(hf_models("llama", layers=4, std=0.3, seed=seed)[0], folder, layout="split", overwrite=True,
               quiet=True)
        out, err = reader.communicate(timeout=300)
    finally:
        reader.kill()
    assert "Traceback" not in err, err
    if seed == 3:                        # the same weights: it reads through the swap and answers every prompt
        assert reader.returncode == 0 and f"prompt {PROMPTS}:" in err, err
    else:                                # other weights: it stops at the first changed file, in one line naming it
        last = err.strip().splitlines()[-1]
        assert reader.returncode == 2 and last.startswith(f"specbeam: error: {folder}") and "SHA-256" in last, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "prompts.txt"]     # nothing staged left
    # the new export, whole: every file as its config records (each layer's SHA-256 checked on its first read), and
    # answering as a fresh export of the same weights
    fresh = export(hf_models("llama", layers=4, std=0.3, seed=seed)[0], tmp_path / "fresh", layout="split",
                   quiet=True)
    [got, want] = [Engine(f, placement=["disk"] * 4).generate("hello", max_new_tokens=8, num_beams=2)[0].text
                   for f in (folder, fresh)]
    assert got == want
