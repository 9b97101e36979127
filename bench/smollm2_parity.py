"""The exactness row on a real model: specbeam's plain greedy decoding == transformers' greedy decoding on the
dequantized GGUF, prompt by prompt (SmolLM2-135M-Instruct by default; --model qwen2.5-coder-1.5b: the fetched
Qwen2.5-Coder-1.5B on the coding prompts, its fp32 export in the split layout: the whole one does not fit).

transformers reads the Q4_1 GGUF and dequantizes it to fp32 (the same weights the exporter starts from);
specbeam runs the fp32 export of that GGUF (made once into bench/out/models, as `python -m bench.llamacpp`
does) and, for comparison, the fetched int8 export. Both engines get the same prompt token ids (the chat
template rendered and encoded by specbeam's tokenizer) and decode greedily up to --max_new tokens, stopping at
the model's EOS. Reported: how many prompts give identical token sequences, and for the others the first
position where they part with both engines' log-probs of both tokens there (a near-tie in fp32 rounding, or a
real difference).

    python -m bench.smollm2_parity [--prompts 24] [--max_new 128]
    python -m bench.smollm2_parity --model qwen2.5-coder-1.5b --prompts 4 --max_new 64
"""
from __future__ import annotations

import sys
from pathlib import Path

from . import common
from .llamacpp import (PROMPTS, _ours, agreement, export_for, first_difference, generated, prompt_ids,
                       run_parser, top_tokens)

ROOT = Path(__file__).resolve().parents[1]


def _transformers(gguf: Path, threads: int):
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                    torch_dtype=torch.float32).eval()
    return model


def _hf_greedy(model, ids: list[int], max_new: int, eos: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def _hf_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()


def run(n_prompts: int, max_new: int, threads: int, name: str = "smollm2") -> dict:
    from specbeam_edge import Engine, fetch

    from .stream import PROMPTS as CODE_PROMPTS

    gguf = fetch.gguf_path(name)
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `specbeam fetch {name}` first")
    layout = fetch.source(name).layout
    folders = {"fp32": export_for(gguf, "fp32", ROOT / "bench" / "out" / "models", layout=layout),
               "int8": fetch.model_path(name)}
    engines = {k: Engine(v, threads=threads) for k, v in folders.items()}
    tok = engines["fp32"].tokenizer
    eos = engines["fp32"].eos
    model = _transformers(gguf, threads)
    texts = PROMPTS if name == "smollm2" else CODE_PROMPTS
    prompts = [prompt_ids(tok, p) for p in texts[:n_prompts]]
    outs: dict[str, list[list[int]]] = {"transformers": [], **{k: [] for k in engines}}
    for ids in prompts:
        outs["transformers"].append(generated(_hf_greedy(model, ids, max_new, eos), eos)[0])
        for k, eng in engines.items():
            outs[k].append(generated(_ours(eng, ids, max_new, eos)[0], eos)[0])
    report = {"gguf": gguf.name, "prompts": len(prompts), "max_new_tokens": max_new, "threads": threads,
              "agreement_with_transformers": {k: agreement(outs[k], outs["transformers"]) for k in engines},
              "partings": []}
    for k in engines:
        for i, (a, b) in enumerate(zip(outs[k], outs["transformers"])):
            at = first_difference(a, b)
            if at is None or at >= min(len(a), len(b)):
                continue
            hf = _hf_logprobs(model, prompts[i] + b[:at])
            mine = top_tokens(engines[k], prompts[i] + b[:at], n=8)
            report["partings"].append({
                "export": k, "prompt": i, "position": at, "specbeam_token": a[at], "transformers_token": b[at],
                "transformers_logprobs": [round(float(hf[a[at]]), 4), round(float(hf[b[at]]), 4)],
                "specbeam_logprobs": [mine.get(a[at]), mine.get(b[at])]})
    return report


def main(argv=None) -> int:
    ap = run_parser("python -m bench.smollm2_parity", __doc__, prompts=24)
    ap.add_argument("--model", default="smollm2", help="a fetched model's name (smollm2, qwen2.5-coder-1.5b)")
    a = ap.parse_args(argv)
    machine = common.machine()
    report = run(a.prompts, a.max_new, a.threads, a.model)
    report["machine"] = machine
    path = common.write(Path(a.out), "smollm2_parity" if a.model == "smollm2" else f"{a.model}_parity", report)
    for k, v in report["agreement_with_transformers"].items():
        print(f"specbeam {k}: identical to transformers on {v['identical']} of {v['of']} prompts")
    for p in report["partings"]:
        print(p)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
