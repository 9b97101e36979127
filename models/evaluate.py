"""Evaluate a shipped pair on the held-out translation test set.

    python models/evaluate.py --pair models/ende --test data/ende/corpus/test.tsv --lines 300

Reports BLEU/chrF (sacrebleu) of the target with greedy and beam-4 search and of the draft alone (greedy),
teacher-forced draft/target agreement (greedy match, top-4 overlap, sum min(p, q)), and beam steps per target
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
from specbeam_edge.beam import log_softmax  # noqa: E402


def teacher_forced(engine: Engine, ids: list[int]):
    n = len(ids)
    mask = np.tril(np.ones((n, n), bool))[None, None]
    out = []
    for lm in (engine.target, engine.draft):
        logits, _ = lm.forward(np.array([ids]), np.arange(n)[None], mask, lm.empty_past())
        out.append(log_softmax(logits[0]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="models/ende", help="folder with target/ and draft/")
    ap.add_argument("--test", default="data/ende/corpus/test.tsv", help="held-out pairs (english<TAB>german)")
    ap.add_argument("--lines", type=int, default=300, help="evaluate the first N test pairs")
    ap.add_argument("--max_new_tokens", type=int, default=160, help="generation limit")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    import sacrebleu

    pair = Path(args.pair)
    engine = Engine(pair / "target", draft=pair / "draft")
    draft_only = Engine(pair / "draft")
    rows = [l.rstrip("\n").split("\t") for l in open(args.test, encoding="utf-8")][: args.lines]
    src, ref = [r[0] for r in rows], [r[1] for r in rows]
    prompts = [engine.tokenizer.format_prompt(s) for s in src]
    report: dict = {"lines": len(rows)}

    # agreement, teacher-forced on the reference translations (target side only)
    sep = engine.tokenizer.encode("<|de|>")[0]
    match, top4, alpha, n = 0.0, 0.0, 0.0, 0
    for p, r in zip(prompts[:200], ref[:200]):
        ids = engine.encode(p) + engine.tokenizer.encode(r) + list(engine.eos[:1])
        t, d = teacher_forced(engine, ids)
        start = ids.index(sep)
        t, d = t[start:-1], d[start:-1]
        match += float((t.argmax(-1) == d.argmax(-1)).sum())
        tt = np.argsort(-t, -1)[:, :4]
        dd = np.argsort(-d, -1)[:, :4]
        top4 += sum(len(set(a) & set(b)) / 4 for a, b in zip(tt, dd))
        alpha += float(np.minimum(np.exp(t), np.exp(d)).sum())
        n += len(t)
    report["agreement"] = {"positions": n, "greedy_match": round(match / n, 4), "top4_overlap": round(top4 / n, 4),
                           "sum_min_p_q": round(alpha / n, 4)}

    def run(eng, K, spec=None, limit=None):
        t0 = time.perf_counter()
        res = eng.generate(prompts[:limit], num_beams=K, max_new_tokens=args.max_new_tokens, speculative=spec)
        dt = time.perf_counter() - t0
        hyp = [r.text for r in res]
        steps = sum(r.stats.beam_steps for r in res)
        passes = sum(r.stats.target_passes for r in res)
        return hyp, {"seconds": round(dt, 2), "beam_steps_per_pass": round(steps / passes, 3),
                     "tokens_per_second": round(steps / dt, 1)}

    for name, eng, K in (("target_greedy", engine, 1), ("target_beam4", engine, 4), ("draft_greedy", draft_only, 1)):
        hyp, st = run(eng, K)
        report[name] = {"bleu": round(sacrebleu.corpus_bleu(hyp, [ref]).score, 2),
                        "chrf": round(sacrebleu.corpus_chrf(hyp, [ref]).score, 2), **st}
        print(name, report[name], file=sys.stderr)
    spec = SpeculativeConfig()
    for K in (1, 4):
        hyp, st = run(engine, K, spec, limit=100)
        plain, _ = run(engine, K, None, limit=100)
        report[f"speculative_K{K}"] = {**st, "identical_to_plain": sum(a == b for a, b in zip(hyp, plain)),
                                       "of": len(hyp), "spec": vars(spec)}
        print(f"speculative K={K}", report[f"speculative_K{K}"], file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
