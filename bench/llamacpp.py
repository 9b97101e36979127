"""llama.cpp as a measured peer on the same GGUF file: greedy decoding of the same instruction prompts with both
engines, alternated prompt by prompt, one request at a time, 2 threads each.

Both get the same prompt token ids: the model's chat template rendered by specbeam's tokenizer (one user
message; the template adds its own default system message) and encoded there; llama.cpp evaluates those ids
(`Llama.generate(tokens, temp=0)`: greedy, no repeat penalty), so neither engine's tokenizer or template can
make a difference. Reported: tokens/s of each engine per prompt, their medians and the median of the per-prompt
ratios, and how many prompts give identical greedy token sequences (with the first position where the others
differ). llama.cpp dequantizes the Q4_1 weights block by block in its kernels; specbeam's exports start from the
same dequantized weights (transformers) and int8 re-quantizes them per output row, so small logit differences
can flip a near-tie; the fp32 export shows how much of the disagreement is that re-quantization.

    python -m bench --scenario llamacpp                    # the fetched smollm2 (specbeam fetch smollm2)
    python -m bench.llamacpp --prompts 12 --max_new 128 --precisions int8,fp32,int4
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from . import common
from .common import save_figure

ROOT = Path(__file__).resolve().parents[1]

# short, varied English instructions (written for this benchmark; none is from a training set we know of); a data
# file, so that a recipe (models/smollm2/draft.py keeps them out of its training text) needs no benchmark code
PROMPTS = json.loads((Path(__file__).parent / "data" / "chat_prompts.json").read_text(encoding="utf-8"))


# -- pure parts (tested without llama-cpp-python) -----------------------------------------------------------------
def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def kernels() -> str:
    """llama.cpp's CPU features and kernels as it reports them ("AVX512 = 1 | ... | REPACK = 1"): named in each row."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return (info.decode() if isinstance(info, bytes) else str(info)).replace("CPU : ", "").strip(" |")


def open_llama(gguf, repack: bool = True, **kw):
    """llama_cpp.Llama on `gguf`, at full strength (its repacked kernels on). Only a build with llama.cpp's AMX
    kernels on a CPU with AMX runs without its extra buffer types (use_extra_bufts): 0.3.36's AMX kernels crashed
    (SIGSEGV in the first decode) on a virtual machine that reports amx_int8. Build it without them instead
    (GGML_AMX_*=OFF, bench/README.md) and its repacked AVX-512 kernels run.
    repack=False: no extra buffer types (llama.cpp's `--no-repack`), so every weight is read from the file's mapping:
    the repacked kernels copy their tensors into memory of the process at load, which a model larger than memory
    cannot hold and which no eviction of the file's pages reaches (bench.stream's evicted arm)."""
    from llama_cpp import Llama
    import llama_cpp.llama_cpp as C

    if repack and not (cpu_has_amx() and "AMX" in kernels()):
        return Llama(model_path=str(gguf), **kw)
    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = params
    try:
        return Llama(model_path=str(gguf), **kw)
    finally:
        C.llama_model_default_params = orig


def prompt_ids(tokenizer, text: str) -> list[int]:
    """The ids both engines get: the chat template with one user message and the generation prompt, its
    special tokens as tokens and the user's text as text."""
    return tokenizer.encode_prompt(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def generated(tokens, eos) -> tuple[list[int], int]:
    """(the tokens before the first EOS, the count of generated tokens with that EOS) of one output."""
    tokens, eos = list(tokens), set(eos)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], i + 1
    return tokens, len(tokens)


def first_difference(a, b) -> int | None:
    """The first position where two token sequences differ (a prefix differs at the shorter one's length);
    None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How many of the prompts give identical sequences, and for the others the first differing position."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} outputs against {len(theirs)}")
    firsts = [first_difference(a, b) for a, b in zip(ours, theirs)]
    return {"identical": sum(f is None for f in firsts), "of": len(firsts),
            "first_difference": {str(i): f for i, f in enumerate(firsts) if f is not None}}


def summarize(per_prompt: dict[str, list[float]], base: str) -> dict:
    """Median tokens/s of each engine and the median over prompts of each one's ratio to `base`."""
    out = {"median_tokens_per_second": {k: round(statistics.median(v), 1) for k, v in per_prompt.items()}}
    out["median_ratio_over_" + base] = {
        k: round(statistics.median(x / y for x, y in zip(v, per_prompt[base])), 3)
        for k, v in per_prompt.items() if k != base}
    return out


def top_tokens(engine, ids: list[int], n: int = 4) -> dict[int, float]:
    """The engine's n most likely next tokens after `ids` with their log-probabilities (beam search over one
    token with n beams returned: each hypothesis' score is its token's log-prob when length_penalty is 0)."""
    [r] = engine.generate(ids, num_beams=n, num_return_sequences=n, max_new_tokens=1, length_penalty=0.0,
                          do_sample=False)
    return {h.tokens[0]: round(h.score, 4) for h in r.hypotheses if h.tokens}


def divergence(engine, ids, ours_full, theirs_full, at: int) -> dict | None:
    """Where two greedy outputs part: both tokens and their log-probs under `engine` (its top 4) at that
    position; a gap of a few hundredths of a nat is a near-tie that rounding of the weights flips."""
    if at >= len(ours_full) or at >= len(theirs_full):
        return None
    top = top_tokens(engine, list(ids) + list(ours_full[:at]))
    a, b = ours_full[at], theirs_full[at]
    return {"position": at, "ours": a, "theirs": b, "ours_logprob": top.get(a), "theirs_logprob": top.get(b),
            "theirs_in_our_top4": b in top}


# -- the engines --------------------------------------------------------------------------------------------------
def _ours(engine, ids, max_new, eos, speculative=None):
    t0 = time.perf_counter()
    [r] = engine.generate(ids, num_beams=1, do_sample=False, max_new_tokens=max_new, speculative=speculative)
    dt = time.perf_counter() - t0
    full = list(r.hypotheses[0].tokens)
    return full, generated(full, eos)[1] / dt


def _llama(llm, ids, max_new, eos):
    stop = set(eos) | {llm.token_eos()}
    out = []
    t0 = time.perf_counter()
    llm.reset()                                    # the whole prompt is evaluated again, as ours does
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(tok)
        if tok in stop or len(out) >= max_new:
            break
    dt = time.perf_counter() - t0
    return out, generated(out, stop)[1] / dt


def export_for(gguf: Path, precision: str, cache: Path, quiet: bool = True, layout: str = "whole") -> Path:
    """Our export of the GGUF at `precision` (top-k head and logits), made once into `cache`."""
    dst = cache / (f"{gguf.stem}-{precision}" + ("" if layout == "whole" else f"-{layout}"))
    if not (dst / "specbeam_config.json").is_file():
        from export.core import export

        export(gguf, dst, precision=precision, output="both", quiet=quiet, layout=layout)
    return dst


def bench(gguf: Path, folders: dict[str, Path], *, n_prompts: int = 12, max_new: int = 128, threads: int = 2,
          lookup: int = 0, out=sys.stderr) -> dict:
    """specbeam (each export in `folders`, by name) and llama.cpp, greedy, alternated prompt by prompt.
    lookup > 0: two more arms, both engines with prompt-lookup speculation (llama.cpp's LlamaPromptLookupDecoding
    proposing `lookup` tokens, specbeam's lookup drafter forced on the first export), each checked against its
    own plain greedy output."""
    import llama_cpp

    from specbeam_edge import Engine, SpeculativeConfig

    engines = {f"specbeam {k}": Engine(p, draft=None, threads=threads) for k, p in folders.items()}   # plain
    first = next(iter(engines.values()))
    eos = list(first.eos)
    prompts = PROMPTS[:n_prompts]
    ids = [prompt_ids(first.tokenizer, p) for p in prompts]
    llm = open_llama(gguf, n_ctx=max(len(i) for i in ids) + max_new + 8, n_threads=threads,
                     n_threads_batch=threads, n_batch=512, seed=0, verbose=False)
    runs = {"llama.cpp": lambda x, m=max_new: _llama(llm, x, m, eos)}
    runs.update({k: (lambda x, m=max_new, e=e: _ours(e, x, m, eos)) for k, e in engines.items()})
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        llm_lookup = open_llama(gguf, n_ctx=max(len(i) for i in ids) + max_new + 8, n_threads=threads,
                                n_threads_batch=threads, n_batch=512, seed=0, verbose=False,
                                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup))
        spec = SpeculativeConfig(drafter="lookup", adaptive=False)
        first_name = next(iter(engines))
        runs["llama.cpp lookup"] = lambda x, m=max_new: _llama(llm_lookup, x, m, eos)
        runs[first_name + " lookup"] = lambda x, m=max_new: _ours(first, x, m, eos, spec)
    for run in runs.values():                      # warm-up: first-call costs out of the timings
        run(ids[0], 8)
    speed = {k: [] for k in runs}
    full = {k: [] for k in runs}                   # as generated, the EOS included
    for n, x in enumerate(ids):
        order = list(runs) if n % 2 == 0 else list(runs)[::-1]      # alternated: neither always goes first
        for k in order:
            toks, tps = runs[k](x)
            speed[k].append(tps)
            full[k].append(toks)
        print(f"prompt {n + 1}/{len(ids)}: " + ", ".join(f"{k} {speed[k][-1]:.1f}" for k in runs) + " tok/s",
              file=out)
    stop = set(eos) | {llm.token_eos()}
    tokens = {k: [generated(t, stop)[0] for t in v] for k, v in full.items()}
    data = {"gguf": gguf.name, "llama_cpp_python": llama_cpp.__version__, "threads": threads,
            "prompts": len(ids), "max_new_tokens": max_new, "prompt_tokens": [len(i) for i in ids],
            "generated_tokens": {k: [len(t) for t in v] for k, v in tokens.items()},
            "tokens_per_second": {k: [round(s, 2) for s in v] for k, v in speed.items()},
            **summarize(speed, "llama.cpp"),
            "greedy_agreement_with_llama_cpp": {k: agreement(tokens[k], tokens["llama.cpp"])
                                                for k in runs if k != "llama.cpp"}}
    if lookup:
        mine = next(iter(engines))
        data["lookup_equals_own_plain"] = {"llama.cpp": agreement(tokens["llama.cpp lookup"], tokens["llama.cpp"]),
                                           mine: agreement(tokens[mine + " lookup"], tokens[mine])}
        data["lookup_num_pred_tokens"] = lookup
    names = list(engines)
    if len(names) > 1:
        data["greedy_agreement_between_exports"] = {f"{a} vs {b}": agreement(tokens[a], tokens[b])
                                                    for i, a in enumerate(names) for b in names[i + 1:]}
    data["divergences"] = {}
    for k in names:
        found = {}
        for i, f in data["greedy_agreement_with_llama_cpp"][k]["first_difference"].items():
            d = divergence(engines[k], ids[int(i)], full[k][int(i)], full["llama.cpp"][int(i)], f)
            if d is not None:
                found[i] = d
        data["divergences"][k] = found
    data["texts"] = {k: [first.tokenizer.decode(t) for t in v] for k, v in tokens.items()}
    data["loadavg_at_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    return data


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, v in data["tokens_per_second"].items():
        ax.plot(range(1, len(v) + 1), v, marker="o", label=f"{name} (median "
                f"{data['median_tokens_per_second'][name]:.0f})")
    ax.set(xlabel="prompt", ylabel="generated tokens/s", ylim=(0, None),
           title=f"greedy, {data['max_new_tokens']} new tokens, {data['threads']} threads: {data['gguf']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def default_inputs(precisions=("int8", "fp32"), cache: Path | None = None) -> tuple[Path, dict[str, Path]]:
    """The fetched smollm2's checked GGUF and folders: the fetched export (int8) and the other precisions made
    from the same GGUF into bench/out/models."""
    from specbeam_edge import fetch

    gguf = fetch.gguf_path("smollm2")
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `specbeam fetch smollm2` first")
    src = fetch.source("smollm2")
    cache = cache or ROOT / "bench" / "out" / "models"
    folders = {p: (fetch.model_path("smollm2") if p == src.precision else export_for(gguf, p, cache))
               for p in precisions}
    return gguf, folders


def run_parser(prog: str, doc: str, prompts: int):
    """The flags both real-model benchmarks take: how many prompts, new tokens, threads, where results go."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=prompts, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "results"))
    return ap


def main(argv=None) -> int:
    ap = run_parser("python -m bench.llamacpp", __doc__, prompts=12)
    ap.add_argument("--precisions", default="int8,fp32", help="our exports of the same GGUF (comma list)")
    ap.add_argument("--lookup", type=int, default=0, metavar="N",
                    help="also both engines with prompt-lookup speculation (llama.cpp proposing N tokens)")
    a = ap.parse_args(argv)
    gguf, folders = default_inputs(tuple(a.precisions.split(",")))
    info = common.machine()                 # before the run: its load average is the machine's, not ours
    data = bench(gguf, folders, n_prompts=a.prompts, max_new=a.max_new, threads=a.threads, lookup=a.lookup)
    data["machine"] = info
    out = Path(a.out)
    common.write(out, "llamacpp", data)
    plot(data, out / "llamacpp.png")
    print(json.dumps({k: data[k] for k in data if k not in ("texts", "tokens_per_second")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
