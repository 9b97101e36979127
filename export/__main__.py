"""specbeam-export: turn a local Hugging Face causal LM folder (or a GGUF file) into a specbeam model folder.

    python -m export -i path/to/hf_model -o models/my_model -p int8 --layout whole
    python -m export -i path/to/model.gguf -o models/my_model
"""
from __future__ import annotations

import argparse
import sys

from specbeam_edge.contract import LAYOUTS, OUTPUT_KINDS

from .hf import ExportError
from .safety import Stopped

EXTRA = "pip install 'specbeam-edge[export]'"


def block_size(text: str) -> int:
    """--block_size: a power of two >= 16 (MatMulNBits' blocks), refused by argparse before any work."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 16 or n & (n - 1):
        raise argparse.ArgumentTypeError(f"{n}: must be a power of two >= 16 (16, 32, 64, 128, ...)")
    return n


def main(argv=None) -> int:
    try:
        from .core import PRECISIONS, export
    except ModuleNotFoundError as e:      # a regular install without the export extra: onnx, torch, transformers
        print(f"specbeam-export: error: the exporter needs the export extra (no module named {e.name!r}): {EXTRA}",
              file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(prog="specbeam-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_io_args(ap)
    _add_form_args(ap, PRECISIONS)
    _add_tuning_args(ap)
    _add_run_args(ap)
    return _run(export, ap.parse_args(argv))


def _add_io_args(ap: argparse.ArgumentParser) -> None:
    """The model to read and the folder to write."""
    ap.add_argument("-i", "--input", required=True, help="local Hugging Face model folder (config.json, "
                    "*.safetensors, tokenizer.json, generation_config.json), or a local .gguf file (dequantized "
                    "by transformers; its tokenizer rebuilt)")
    ap.add_argument("-o", "--output", required=True, help="output specbeam model folder")


def _add_form_args(ap: argparse.ArgumentParser, precisions: tuple) -> None:
    """What the export is: weight precision, layout, outputs, compute type."""
    ap.add_argument("-p", "--precision", choices=precisions, default="fp32",
                    help="weight precision: fp32; fp16 storage; int8w (int8 weight storage, per output channel, "
                    "dequantized at load: fp32 compute, batch-invariant, about half of fp16's size; split layout: "
                    "dequantized per pass, the streamed int8 form for CUDA); "
                    "int8 (int8 compute with one activation scale per row: batch-invariant, exact speculation, "
                    "the fastest exact precision on CPUs); int8dyn (onnxruntime quantize_dynamic: one activation "
                    "scale per tensor, NOT batch-invariant: for drafts); int4 (MatMulNBits; the engine measures "
                    "its invariance at load)")
    ap.add_argument("--layout", choices=LAYOUTS, default="whole",
                    help="one graph, or embed/layer/head graphs with per-layer weight files (for streaming)")
    ap.add_argument("--output_kind", choices=OUTPUT_KINDS, default="logits",
                    help="full logits per node; log-softmax top-k (k is a run-time input) for large vocabularies; "
                         "or both, chosen per run (a draft: exact search reads its top-k, sampling its logits)")
    ap.add_argument("--compute", choices=("fp32", "fp16"), default="fp32",
                    help="fp16: weights, activations and KV cache in fp16 (for GPUs; whole layout; logits fp32)")


def _add_tuning_args(ap: argparse.ArgumentParser) -> None:
    """Quantization details, attention arithmetic and a draft's cut head."""
    ap.add_argument("--block_size", type=block_size, default=32,
                    help="int4 quantization block size (a power of two >= 16)")
    ap.add_argument("--int4_weights", choices=("file", "rtn"), default="file",
                    help="int4 from a GGUF: 'file' keeps the file's own blocks exactly (Q4_K, Q6_K, Q5_0, ...; 5- to "
                         "8-bit kinds as 8-bit codes); 'rtn' re-quantizes every matrix to 4 bits round-to-nearest "
                         "(one more rounding; smaller and faster where the file has 5-8-bit blocks)")
    ap.add_argument("--full_range", action="store_true",
                    help="int8/int8dyn: 8-bit weights (half the rounding error of the default 7 bits) for CPUs with "
                         "VNNI only: without it (AVX2 only) onnxruntime's int8 kernel sums pairs of products in int16, "
                         "which 8-bit weights overflow (logits off by 20-30%%)")
    ap.add_argument("--reduce_range", action="store_true", help=argparse.SUPPRESS)   # the default now (7-bit)
    ap.add_argument("--attention", choices=("fp32", "fp64"), default=None,
                    help="attention arithmetic (default: fp64 for int8 and int4, whose int8 activations would turn "
                         "fp32 rounding that depends on the cache layout into different tokens; fp32 otherwise)")
    ap.add_argument("--kv_cache", choices=("fp32", "fp16"), default=None,
                    help="the KV cache's storage (default: fp16 with --compute fp16, else fp32). fp16 halves a "
                         "long prompt's cache, as llama.cpp's "
                         "default f16 cache does; attention still computes in fp32 or double, each new key and "
                         "value rounded to fp16 before its first use, so speculative search stays exact")
    ap.add_argument("--head_tokens", type=int, default=None, metavar="N",
                    help="for a draft: its head scores only the token ids below N and the tokenizer's added tokens "
                         "(a smaller head, a cheaper draft level; the target still scores every token, so output "
                         "is unchanged). Never for a target: it could not produce the other tokens")


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    """How the export runs: replacing a previous one, progress display."""
    ap.add_argument("--overwrite", action="store_true", help="replace the previous export in the output folder: what "
                    "an export writes is replaced, other files and folders in it are kept; a folder that holds no "
                    "export, the input or a folder around it is refused")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress display")


def _run(export, args: argparse.Namespace) -> int:
    """Run the export the arguments ask for; each failure as one line on stderr and its exit status."""
    try:
        out = export(args.input, args.output, precision=args.precision, layout=args.layout,
                     output=args.output_kind, overwrite=args.overwrite, block_size=args.block_size, quiet=args.quiet,
                     compute=args.compute, reduce_range=not args.full_range, attention=args.attention,
                     head_tokens=args.head_tokens, int4_weights=args.int4_weights, kv_cache=args.kv_cache)
    except ExportError as e:
        print(f"specbeam-export: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(f"specbeam-export: error: this export needs the module {e.name!r}: {EXTRA}", file=sys.stderr)
        return 2
    except OSError as e:                  # a full or read-only disk while writing: the staged folder is gone
        from .safety import os_error_message

        print(f"specbeam-export: error: {os_error_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specbeam-export: interrupted; no partial export was left (the output holds the previous export, or "
              "the new one when the interrupt came as it was put in place)", file=sys.stderr)
        return 130
    except Stopped as e:
        print(f"specbeam-export: stopped by {e.name}; no partial export was left (the output holds the previous "
              f"export, or the new one when the signal came as it was put in place)", file=sys.stderr)
        return 128 + e.args[0]
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
