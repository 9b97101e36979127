"""Evaluate a shipped pair on the held-out translation test set.

    python models/evaluate.py --pair models/ende --test data/ende/corpus/test.tsv --lines 300
    python models/evaluate.py --target $DATA/ende/eval/target --systems target_beam4 --lines 300   # a checkpoint

Reports BLEU/chrF (sacrebleu) of the target with greedy and beam-4 search and of the draft alone (greedy),
teacher-forced draft/target agreement (greedy match, top-4 overlap, sum min(p, q)) on the references and on the
target's own beam-4 translations (`agreement_own`: the text speculation has to predict), and beam steps per target
pass of exact speculative beam search at K = 1 and 4. Prints JSON; --out writes it to a file.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbeam_edge import Engine, SpeculativeConfig  # noqa: E402
from specbeam_edge.decoding.beam import log_softmax  # noqa: E402


def teacher_forced(lm, ids: list[int], k: int = 8, static: dict | None = None):
    """(top-k ids [n, k], their log-probs [n, k]) of every position; read from a top-k head when the model has
    one (its log-probs are normalised over the whole vocabulary), else from full logits. static: an
    encoder-decoder's cross K/V and source mask (ids are then the decoder's)."""
    n = len(ids)
    mask = np.tril(np.ones((n, n), bool))[None, None]
    head, _ = lm.forward(np.array([ids]), np.arange(n)[None], mask, lm.empty_past(), topk=k, static=static)
    if isinstance(head, tuple):
        logp, top = head
        return top[0], logp[0]
    logp = log_softmax(head[0])
    top = np.argsort(-logp, -1)[:, :k]
    return top, np.take_along_axis(logp, top, -1)


SYSTEMS = ("agreement", "agreement_own", "target_greedy", "target_beam4", "draft_greedy", "speculative")


def agreement(engine: Engine, prompts, ref, sep: int, report: dict, key: str = "agreement") -> None:
    """Teacher-forced draft/target agreement on the first 200 given translations (German side only): the
    references, or the target's own beam-search outputs (the text speculation has to predict)."""
    match, top4, alpha, n = 0.0, 0.0, 0.0, 0
    for p, r in zip(prompts[:200], ref[:200]):
        # a translation given as text is encoded; the target's own output comes as the tokens it produced (their
        # re-encoding differs where the model chose a non-canonical tokenisation)
        out = engine.tokenizer.encode(r) + list(engine.eos[:1]) if isinstance(r, str) else list(r)
        statics = (None, None)
        if engine.encoder is not None:     # encoder-decoder: the decoder reads its prompt, then the translation
            prompt = engine.encoder.decoder_prompt()
            ids, start = prompt + out, len(prompt) - 1
            statics = [{n: a for n, (a, _) in st.items()} for st in engine.encoder_outputs(engine.encode(p))]
        else:
            ids = engine.encode(p) + out
            start = ids.index(sep)
        (tt, tl), (dd, dl) = (teacher_forced(lm, ids, static=st) for lm, st in zip((engine.target, engine.draft),
                                                                                    statics))
        tt, tl, dd, dl = tt[start:-1], tl[start:-1], dd[start:-1], dl[start:-1]
        match += float((tt[:, 0] == dd[:, 0]).sum())
        top4 += sum(len(set(a[:4]) & set(b[:4])) / 4 for a, b in zip(tt, dd))
        # over the tokens in both top-8 lists: the full sum when the mass lies there, else a lower bound
        for a, la, b, lb in zip(tt, tl, dd, dl):
            q = dict(zip(b.tolist(), np.exp(lb).tolist()))
            alpha += sum(min(pa, q[t]) for t, pa in zip(a.tolist(), np.exp(la).tolist()) if t in q)
        n += len(tt)
    report[key] = {"positions": n, "greedy_match": round(match / n, 4), "top4_overlap": round(top4 / n, 4),
                           "sum_min_p_q_top8": round(alpha / n, 4)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="models/ende", help="folder with target/ and draft/")
    ap.add_argument("--test", default="data/ende/corpus/test.tsv", help="held-out pairs (english<TAB>german)")
    ap.add_argument("--lines", type=int, default=300, help="evaluate the first N test pairs")
    ap.add_argument("--max_new_tokens", type=int, default=160, help="generation limit")
    ap.add_argument("--target", default=None, help="target model folder (default: PAIR/target)")
    ap.add_argument("--draft", default=None, help="draft model folder (default: PAIR/draft)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)} (without the draft ones no draft is loaded)")
    ap.add_argument("--spec_batch", type=int, default=1, help="requests per pass in the speculative runs "
                    "(1: one at a time, the main job; the tree budget is shared by a pass's requests)")
    ap.add_argument("--spec_budget", type=int, default=SpeculativeConfig().budget,
                    help="draft nodes per target pass in the speculative runs (default: SpeculativeConfig's)")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    return ap


def load_engines(args, systems: list[str]) -> tuple:
    """(the target's engine, with the draft when a system needs it; the draft's own engine for draft_greedy, None
    when the draft has no encoder of its own or is not scored alone; the target's folder)."""
    pair = Path(args.pair)
    target = Path(args.target) if args.target else pair / "target"
    draft = Path(args.draft) if args.draft else pair / "draft"
    needs_draft = bool(set(systems) & {"agreement", "agreement_own", "draft_greedy", "speculative"})
    engine = Engine(target, draft=draft if needs_draft else None)
    draft_only = None
    if "draft_greedy" in systems and engine.draft_cross is None:
        draft_only = Engine(draft)
    return engine, draft_only, target


def agreements(engine: Engine, systems: list[str], prompts, ref, args, report: dict) -> None:
    """Teacher-forced agreement on the references and on the target's own beam-4 translations, as asked."""
    # agreement, teacher-forced on the reference translations (target side only)
    sep = engine.tokenizer.encode("<|de|>", special_tokens=True)[0] if engine.encoder is None else None
    if "agreement" in systems:
        agreement(engine, prompts, ref, sep, report)
    if "agreement_own" in systems:      # on the target's own beam-4 translations of the same sources
        own = [r.hypotheses[0].tokens for r in engine.generate(prompts[:200], num_beams=4,
                                                                max_new_tokens=args.max_new_tokens)]
        agreement(engine, prompts, own, sep, report, key="agreement_own")


def timed_run(eng, prompts, K, max_new_tokens: int, spec=None, limit=None, batch=32):
    """The translations of `prompts[:limit]` with beam width K, and their time, beam steps per target pass and
    tokens per second."""
    t0 = time.perf_counter()
    res = eng.generate(prompts[:limit], num_beams=K, max_new_tokens=max_new_tokens, speculative=spec,
                       max_batch_size=batch)
    dt = time.perf_counter() - t0
    hyp = [r.text for r in res]
    steps = sum(r.stats.beam_steps for r in res)
    passes = sum(r.stats.target_passes for r in res)
    return hyp, {"seconds": round(dt, 2), "beam_steps_per_pass": round(steps / passes, 3),
                 "tokens_per_second": round(steps / dt, 1)}


def speculative_runs(engine: Engine, systems: list[str], prompts, args, report: dict) -> None:
    """Exact speculative beam search at K = 1 and 4 on the first 100 prompts, against plain search."""
    spec = SpeculativeConfig(adaptive=False, budget=args.spec_budget)
    for K in (1, 4) if "speculative" in systems else ():
        # one request at a time, as the README's main job runs: the tree budget is per target pass, shared by
        # the requests in it, so in a batch of 32 each request drafts max(K, 48 // 32) nodes
        hyp, st = timed_run(engine, prompts, K, args.max_new_tokens, spec, limit=100, batch=args.spec_batch)
        plain, pst = timed_run(engine, prompts, K, args.max_new_tokens, None, limit=100, batch=args.spec_batch)
        report[f"speculative_K{K}"] = {**st, "identical_to_plain": sum(a == b for a, b in zip(hyp, plain)),
                                       "of": len(hyp), "batch": args.spec_batch,
                                       "plain_seconds": pst["seconds"], "spec": vars(spec)}
        print(f"speculative K={K}", report[f"speculative_K{K}"], file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import sacrebleu

    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    engine, draft_only, target = load_engines(args, systems)
    rows = [l.rstrip("\n").split("\t") for l in open(args.test, encoding="utf-8")][: args.lines]
    src, ref = [r[0] for r in rows], [r[1] for r in rows]
    prompts = [engine.tokenizer.format_prompt(s) for s in src]
    report: dict = {"lines": len(rows), "target": str(target)}
    if "draft_greedy" in systems and draft_only is None:   # no encoder of its own: it runs only beside its target
        report["draft_greedy"] = {"skipped": "the draft reads the target's encoder (target_cross_layers)"}
        systems.remove("draft_greedy")
    agreements(engine, systems, prompts, ref, args, report)
    for name, eng, K in (("target_greedy", engine, 1), ("target_beam4", engine, 4), ("draft_greedy", draft_only, 1)):
        if name not in systems:
            continue
        hyp, st = timed_run(eng, prompts, K, args.max_new_tokens)
        report[name] = {"bleu": round(sacrebleu.corpus_bleu(hyp, [ref]).score, 2),
                        "chrf": round(sacrebleu.corpus_chrf(hyp, [ref]).score, 2), **st}
        print(name, report[name], file=sys.stderr)
    speculative_runs(engine, systems, prompts, args, report)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
