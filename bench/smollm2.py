"""Speculation on a real model: SmolLM2-135M-Instruct (the fetched int8 export) with the draft trained here
(models/smollm2/draft, built by `specbeam fetch smollm2`), one request at a time, against plain search and
against llama.cpp on the same GGUF.

Arms, alternated prompt by prompt (the order reversed every other prompt), 2 threads each:
  greedy:        llama.cpp; specbeam plain; with the draft, adaptive (the default); with the draft, forced; forced
                 with a 6-token chain (one child a level) instead of the default tree
  beam K=4:      plain; with the draft, adaptive; forced
  beam sampling: K=4, do_sample (seeded); with the draft (the draft-sampling tree, forced): speed only, its output
                 is a sample of the same distribution, not the same sample
  lookahead head (when the fetched target has one; no draft model): greedy adaptive, forced with all its guesses and
                 with 1 (each with its chain), forced with min_path_prob 0.1, forced one level deep (no chain);
                 beam K=4 adaptive. The plain arms run a head-less copy of the same graph.
Reported per arm: median tokens/s (generated tokens, EOS included, over wall time), the median per-prompt ratio
to its plain arm (and greedy to llama.cpp), beam steps per target pass, draft tokens accepted, and whether every
speculative output equals its plain output token for token (greedy, K=4).

    python -m bench --scenario smollm2                 # 24 prompts, 128 new tokens
    python -m bench.smollm2 --prompts 6 --max_new 64   # a shorter run
    python -m bench.smollm2 --arms "greedy ahead,beam4 ahead" --tag smollm2_ahead   # the lookahead head's arms
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from . import common
from .common import save_figure
from .llamacpp import PROMPTS, _llama, generated, open_llama, prompt_ids, run_parser

ROOT = Path(__file__).resolve().parents[1]
PLAIN = {"greedy": "greedy plain", "beam4": "beam4 plain", "sample4": "sample4 plain"}


def arms(target, draft, gguf, threads: int, max_new: int, ids_max: int, with_llama: bool = True,
         plain_target=None, only=None):
    """name -> run(ids) -> (tokens, seconds, stats or None). plain_target: the target without its lookahead head
    for the plain arms (what a user without the head runs; the head costs every pass, plain ones too). only:
    substrings of the arms to keep (the plain arms of the kinds kept always run)."""
    from specbeam_edge import Engine, SpeculativeConfig

    plain = Engine(plain_target or target, threads=threads)
    spec = Engine(target, draft=draft, threads=threads)
    head = spec.target.ahead is not None
    forced = SpeculativeConfig(adaptive=False)
    chain = SpeculativeConfig(adaptive=False, budget=6, max_depth=6, max_branch_width=1, draft_width=1)
    sample_tree = SpeculativeConfig(adaptive=False, drafter="sample")

    def ours(engine, spec_cfg, **gen):
        def run(ids, m=max_new):
            t0 = time.perf_counter()
            [r] = engine.generate(ids, speculative=spec_cfg, max_new_tokens=m, **gen)
            return list(r.hypotheses[0].tokens), time.perf_counter() - t0, r.stats
        return run

    greedy, beam4 = dict(num_beams=1, do_sample=False), dict(num_beams=4, do_sample=False)
    sample4 = dict(num_beams=4, do_sample=True, seed=0)
    out = {}
    if with_llama:
        llm = open_llama(gguf, n_ctx=ids_max + max_new + 8, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, seed=0, verbose=False)
        eos = list(plain.eos)

        def llama(ids, m=max_new):
            t0 = time.perf_counter()
            toks, _ = _llama(llm, ids, m, eos)
            return toks, time.perf_counter() - t0, None
        out["greedy llama.cpp"] = llama
    out.update({
        "greedy plain": ours(plain, None, **greedy),
        "greedy draft adaptive": ours(spec, None, **greedy),
        "greedy draft forced": ours(spec, forced, **greedy),
        "greedy draft chain6": ours(spec, chain, **greedy),
        "beam4 plain": ours(plain, None, **beam4),
        "beam4 draft adaptive": ours(spec, None, **beam4),
        "beam4 draft forced": ours(spec, forced, **beam4),
        "sample4 plain": ours(plain, None, **sample4),
        "sample4 draft": ours(spec, sample_tree, **sample4),
    })
    if head:     # the target's own lookahead head (no draft model): adaptive, and forced with 1 and 2 guesses
        out.update({
            "greedy ahead adaptive": ours(spec, SpeculativeConfig(drafter="ahead"), **greedy),
            "greedy ahead forced": ours(spec, SpeculativeConfig(drafter="ahead", adaptive=False), **greedy),
            "greedy ahead forced1": ours(spec, SpeculativeConfig(drafter="ahead", adaptive=False,
                                                                 max_branch_width=1), **greedy),
            # only the guesses whose path the head gives at least 0.1 (tree rows are not free)
            "greedy ahead p0.1": ours(spec, SpeculativeConfig(drafter="ahead", adaptive=False, min_path_prob=0.1),
                                      **greedy),
            # the same graph with its guesses one level deep only (no chain): what the chain adds
            "greedy ahead level1": ours(spec, SpeculativeConfig(drafter="ahead", adaptive=False, max_depth=1),
                                        **greedy),
            "beam4 ahead adaptive": ours(spec, SpeculativeConfig(drafter="ahead"), **beam4),
        })
    if only:
        out = {k: v for k, v in out.items() if k in PLAIN.values() and any(k.startswith(o.split()[0]) for o in only)
               or "llama.cpp" in k or any(o in k for o in only)}
    return out, plain


def bench(target, draft, gguf, *, n_prompts: int = 24, max_new: int = 128, threads: int = 2, with_llama=True,
          out=sys.stderr, plain_target=None, only=None) -> dict:
    from specbeam_edge.text.tokenizer import Tokenizer

    tok = Tokenizer(target)                        # the prompts' ids, without loading the model a second time
    prompts = PROMPTS[:n_prompts]
    ids = [prompt_ids(tok, p) for p in prompts]
    runs, plain = arms(target, draft, gguf, threads, max_new, max(len(i) for i in ids), with_llama,
                       plain_target=plain_target, only=only)
    eos = set(plain.eos)
    for run in runs.values():                      # warm-up: first-call costs (and the invariance check) untimed
        run(ids[0], 8)
    rows = {k: [] for k in runs}
    for n, x in enumerate(ids):
        order = list(runs) if n % 2 == 0 else list(runs)[::-1]
        for k in order:
            toks, secs, stats = runs[k](x)
            count = generated(toks, eos)[1]
            row = {"tokens": toks, "generated": count, "seconds": round(secs, 4),
                   "tokens_per_second": round(count / secs, 2)}
            if stats is not None:
                row.update(target_passes=stats.target_passes, beam_steps=stats.beam_steps,
                           plain_passes=stats.plain_passes, draft_accepted=stats.draft_tokens_accepted,
                           draft_proposed=stats.draft_tokens_proposed)
            rows[k].append(row)
        print(f"prompt {n + 1}/{len(ids)}: " + ", ".join(f"{k} {rows[k][-1]['tokens_per_second']:.0f}"
                                                         for k in runs), file=out, flush=True)
    return summarize(rows, prompts, max_new, threads, gguf)


def pass_costs(target, draft, threads: int, past: int = 96, rows=(1, 4, 16, 64), reps: int = 15) -> dict:
    """Seconds of one pass of each model over `rows` new tokens after `past` cached ones (median of reps,
    target and draft alternated), and the draft's share: what a draft level costs against a target pass."""
    import numpy as np

    from specbeam_edge.execution.model import OnnxCausalLM

    models = {"target": OnnxCausalLM(target, threads=threads), "draft": OnnxCausalLM(draft, threads=threads)}
    rng = np.random.default_rng(0)
    out = {}
    for n in rows:
        times = {k: [] for k in models}
        feeds = {}
        for k, m in models.items():
            ids = rng.integers(3, m.cfg.vocab_size, past + n)
            mask = np.tril(np.ones((past, past), bool))[None, None]
            _, kv = m.forward(ids[None, :past], np.arange(past)[None], mask, m.empty_past(1))
            tm = np.zeros((n, past + n), bool)
            tm[:, :past] = True
            tm[:, past:] = np.tril(np.ones((n, n), bool))
            feeds[k] = (ids[None, past:], np.arange(past, past + n)[None], tm[None, None], kv)
        for r in range(reps):
            for k in (list(models) if r % 2 == 0 else list(models)[::-1]):
                t0 = time.perf_counter()
                models[k].forward(*feeds[k], topk=8)
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[str(n)] = {"target_ms": round(1e3 * med["target"], 3), "draft_ms": round(1e3 * med["draft"], 3),
                       "draft_share": round(med["draft"] / med["target"], 3)}
    return out


def summarize(rows: dict, prompts, max_new, threads, gguf) -> dict:
    speed = {k: [r["tokens_per_second"] for r in v] for k, v in rows.items()}
    data = {"gguf": Path(gguf).name, "threads": threads, "prompts": len(prompts), "max_new_tokens": max_new,
            "median_tokens_per_second": {k: round(statistics.median(v), 1) for k, v in speed.items()},
            "median_ratio_to_plain": {}, "beam_steps_per_target_pass": {}, "identical_to_plain": {}}
    for k, v in rows.items():
        kind = k.split()[0]
        base = PLAIN[kind]
        if k != base and "llama.cpp" not in k:
            data["median_ratio_to_plain"][k] = round(statistics.median(
                a / b for a, b in zip(speed[k], speed[base])), 3)
            if kind != "sample4":
                same = sum(a["tokens"] == b["tokens"] for a, b in zip(v, rows[base]))
                data["identical_to_plain"][k] = {"identical": same, "of": len(v)}
        if v and "target_passes" in v[0]:
            data["beam_steps_per_target_pass"][k] = round(sum(r["beam_steps"] for r in v)
                                                          / max(1, sum(r["target_passes"] for r in v)), 3)
    if "greedy llama.cpp" in speed:
        data["median_ratio_to_llama_cpp"] = {k: round(statistics.median(
            a / b for a, b in zip(speed[k], speed["greedy llama.cpp"])), 3)
            for k in speed if k.startswith("greedy") and k != "greedy llama.cpp"}
    data["rows"] = {k: [{kk: vv for kk, vv in r.items() if kk != "tokens"} for r in v] for k, v in rows.items()}
    data["loadavg_at_end"] = [round(x, 2) for x in __import__("os").getloadavg()]
    return data


def plot(data: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["median_tokens_per_second"])
    fig, ax = plt.subplots(figsize=(8, 3.8))
    vals = [data["median_tokens_per_second"][k] for k in names]
    colors = ["#999" if "llama" in k else "#4a7" if "draft" in k else "#c73" if "ahead" in k else "#47a"
              for k in names]
    ax.barh(names[::-1], vals[::-1], color=colors[::-1])
    for i, (k, v) in enumerate(zip(names[::-1], vals[::-1])):
        r = data["median_ratio_to_plain"].get(k)
        ax.text(v, i, f" {v:.0f}" + (f" ({r:.2f}x plain)" if r else ""), va="center", fontsize=8)
    ax.set(xlabel="generated tokens/s (median over prompts)",
           title=f"SmolLM2-135M int8, {data['prompts']} prompts x {data['max_new_tokens']} tokens, "
                 f"{data['threads']} threads")
    save_figure(fig, path)


def headless_copy(target, dst: Path):
    """The fetched target without its lookahead head (export.ahead.strip_head), for the plain arms; None when the
    target has no head. Made once (the graph's digest recorded beside it)."""
    import onnx

    from export import ahead
    from specbeam_edge.contract import file_sha256

    target = Path(target)
    cfg = json.loads((target / "specbeam_config.json").read_text())
    if not cfg.get("ahead"):
        return None
    digest = file_sha256(target / "model.onnx")
    if (dst / "source.sha256").is_file() and (dst / "source.sha256").read_text() == digest:
        return dst
    import shutil

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(target, dst, ignore=shutil.ignore_patterns("model.onnx"))
    model = onnx.load(str(target / "model.onnx"))
    ahead.strip_head(model)
    onnx.save(model, str(dst / "model.onnx"))
    cfg.pop("ahead")
    if "sha256" in cfg["files"]:            # the runtime checks the graph: the stripped one's
        cfg["files"]["sha256"] = {"model.onnx": file_sha256(dst / "model.onnx")}
    (dst / "specbeam_config.json").write_text(json.dumps(cfg, indent=1))
    (dst / "source.sha256").write_text(digest)
    return dst


def default_inputs():
    from specbeam_edge import fetch

    target, draft = fetch.model_path("smollm2"), fetch.draft_path("smollm2")
    if draft is None:
        raise SystemExit("the smollm2 draft is not built: run `specbeam fetch smollm2` (it builds the draft from "
                         "models/smollm2/draft)")
    return target, draft, fetch.gguf_path("smollm2")


def main(argv=None) -> int:
    ap = run_parser("python -m bench.smollm2", __doc__, prompts=24)
    ap.add_argument("--no_llama", action="store_true", help="leave llama.cpp out (no llamacpp extra)")
    ap.add_argument("--arms", default=None,
                    help="comma-separated substrings of the arms to run, e.g. 'greedy ahead,greedy draft' (each "
                         "kind's plain arm and llama.cpp always run)")
    ap.add_argument("--tag", default="smollm2", help="the results' file names (<out>/<tag>.json, .png)")
    ap.add_argument("--plain_target", default=None,
                    help="the target without its lookahead head for the plain arms (default: a head-less copy "
                         "of the fetched graph, made once into bench/out/models, which git ignores)")
    a = ap.parse_args(argv)
    target, draft, gguf = default_inputs()
    out = Path(a.out)
    plain_target = a.plain_target or headless_copy(target, ROOT / "bench" / "out" / "models" / "smollm2-headless")
    info = common.machine()                 # before the run: its load average is the machine's, not ours
    data = bench(target, draft, gguf, n_prompts=a.prompts, max_new=a.max_new, threads=a.threads,
                 with_llama=not a.no_llama, plain_target=plain_target,
                 only=[x.strip() for x in a.arms.split(",")] if a.arms else None)
    data["pass_costs"] = pass_costs(target, draft, a.threads)
    data["machine"] = info
    common.write(out, a.tag, data)
    plot(data, out / f"{a.tag}.png")
    print(json.dumps({k: data[k] for k in data if k != "rows"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
