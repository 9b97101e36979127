"""The export's progress bar ends at N/N, and onnxruntime's quantizer warnings print on their own lines."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_progress_reaches_the_end_and_warnings_do_not_break_into_it(hf_models, tmp_path):
    src, _ = hf_models("llama")
    out = subprocess.run([sys.executable, "-m", "export", "-i", str(src), "-o", str(tmp_path / "m"), "-p", "int8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    updates = [u for u in re.split(r"[\r\n]", out.stderr) if u.strip()]
    counts = [re.search(r"(\d+)/(\d+) \[", u) for u in updates]
    bars = [(int(m.group(1)), int(m.group(2))) for m in counts if m]
    assert bars and bars[-1][0] == bars[-1][1], updates          # it ends at N/N (it used to end at N-1/N)
    # every other message is a line of its own: no update carries a bar and other text glued together
    for u in updates:
        if re.search(r"\d+/\d+ \[", u):
            assert not re.search(r"WARNING|pre-process|quantiz", u, re.I), u


def test_quiet_encoder_decoder_export_prints_nothing(tmp_path):
    """Before: `export -q` on a Marian/M2M100/NLLB folder still printed transformers' 'Loading weights' bar (its
    from_pretrained ran with bars on; only GGUF input was silenced)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from encdec_models import make_encdec_model

    src = tmp_path / "marian"
    make_encdec_model(src, "marian")
    out = subprocess.run([sys.executable, "-m", "export", "-i", str(src), "-o", str(tmp_path / "m"), "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr[-500:]
