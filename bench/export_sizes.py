"""Export time, peak memory and folder size of random-weight models at the real shapes of each family's small
sizes (Qwen3-0.6B, Llama-3.2-1B, SmolLM2-135M, ...), per precision. Weights are random (bf16 safetensors, as the
Hub ships them): sizes and times do not depend on the values.

    python -m bench.export_sizes --families smollm2,qwen3 --precisions fp16,int8

CPU and memory heavy (Qwen3-0.6B: ~1.2 GB of bf16 weights, several GB of RAM per export). Each export runs in its
own process, so its peak RSS is its own. Writes export_sizes.json into --out (default the ignored
bench/out/results; `--out bench/results` updates the committed record, which `python -m bench` renders into
bench/README.md): a row replaces the one of an earlier run for the same family, precision and layout; the others
stay, each with its run's date. Prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import common

ROOT = Path(__file__).resolve().parents[1]

# name: (the model whose shapes these are, config class, model class, config kwargs from its config.json)
SHAPES = {
    "smollm2": ("SmolLM2-135M", "LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3-0.6B", "Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=True)),
    "gemma3": ("gemma-3-270m", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        vocab_size=262144, hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, intermediate_size=2048, max_position_embeddings=32768, sliding_window=512,
        query_pre_attn_scalar=256, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)),
    "llama3.2": ("Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 500000.0})),
    "smollm3": ("SmolLM3-3B", "SmolLM3Config", "SmolLM3ForCausalLM", dict(
        vocab_size=128256, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=11008, max_position_embeddings=65536, no_rope_layer_interval=4, tie_word_embeddings=True)),
    "phi4mini": ("Phi-4-mini-instruct", "Phi3Config", "Phi3ForCausalLM", dict(
        vocab_size=200064, hidden_size=3072, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, tie_word_embeddings=True, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48})),
    "gemma2": ("gemma-2-2b", "Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=2304, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, intermediate_size=9216, max_position_embeddings=8192, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
}


def _tokenizer(folder: Path):
    """A placeholder tokenizer.json (the export copies it; sizes and times do not depend on it)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))


def make_random(folder: Path, name: str) -> int:
    """Save a random bf16 model of family `name` at its real shapes; returns its parameter count."""
    import torch
    import transformers as tf

    _, cfg_cls, model_cls, kw = SHAPES[name]
    cfg = getattr(tf, cfg_cls)(**kw, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def export_once(src: Path, dst: Path, precision: str, layout: str) -> dict:
    """One `python -m export` in a child process: wall seconds, the child's peak RSS, the folder's bytes."""
    cmd = [sys.executable, "-m", "export", "-i", str(src), "-o", str(dst), "-p", precision, "--layout", layout, "-q"]
    with tempfile.TemporaryFile() as err:            # a file, not a pipe: a chatty child cannot block on it
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)     # the rusage of this child alone
        seconds = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed ({code}): {err.read().decode(errors='replace')[-2000:]}")
    return {"precision": precision, "layout": layout, "export_s": round(seconds, 1),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "size_mb": round(_folder_bytes(dst) / 2**20, 1)}


def merge_rows(out: Path, rows: list[dict]) -> list[dict]:
    """Earlier runs' rows (other families, precisions or layouts) followed by this run's."""
    key = lambda r: (r["family"], r["precision"], r.get("layout", "whole"))   # noqa: E731
    path = out / "export_sizes.json"
    old = json.loads(path.read_text())["rows"] if path.exists() else []
    new = {key(r) for r in rows}
    return [r for r in old if key(r) not in new] + rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.export_sizes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="smollm2,qwen3", help=f"comma list of: {', '.join(SHAPES)}")
    ap.add_argument("--precisions", default="fp16,int8", help="comma list of: fp32, fp16, int8w, int8, int4")
    ap.add_argument("--layout", choices=("whole", "split"), default="whole", help="graph layout of every export")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "results"),
                    help="output folder for the JSON (bench/results: the committed record)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed at the end)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    names = args.families.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(SHAPES)}")
    info = common.machine()
    print(f"machine: {info}", file=sys.stderr)
    work = Path(args.work or tempfile.mkdtemp(prefix="export_sizes."))
    rows = []
    try:
        for name in names:
            src = work / f"hf_{name}"
            t0 = time.perf_counter()
            params = make_random(src, name)
            print(f"{name}: {params / 1e6:.0f}M parameters, random model written in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr)
            for precision in args.precisions.split(","):
                dst = work / f"sb_{name}_{precision}"
                row = {"family": name, "shapes_of": SHAPES[name][0], "date": info["date"][:10],
                       "params_m": round(params / 1e6, 1),
                       "hf_bf16_mb": round(_folder_bytes(src) / 2**20, 1), **export_once(src, dst, precision,
                                                                                       args.layout)}
                rows.append(row)
                print(common.table([row], list(row)), file=sys.stderr)
                shutil.rmtree(dst)
            shutil.rmtree(src)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    path = common.write(Path(args.out), "export_sizes", {"machine": info, "rows": merge_rows(Path(args.out), rows)})
    print(common.table(rows, list(rows[0]) if rows else []))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
