"""Terminology constraints on the shipped en->de pair: how often the glossary's terms appear, what the constraints
cost, and that speculative constrained search gives plain constrained search's output.

    python -m bench.glossary [--lines 60] [--beams 4] [--out bench/out/results]

Held-out lines (models/ende/test_sample.en) that contain a term of bench/data/glossary_ende.tsv (57 help-domain
terms, LibreOffice's German), one request at a time, K beams. Four arms, alternated line by line (the order
rotates): plain beam search, constrained (the terms of the line), and each with the shipped draft (adaptive
speculation, the default; --forced: a tree every pass). Reports per arm the share of lines whose every term
appears (one of its target forms, in the output text), BLEU/chrF against the reference, tokens/s, and the ratio
of constrained to unconstrained time; the speculative arms' outputs are compared with their plain arms'. JSON and
a plot.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apps.translate.job import glossary_constraints, read_glossary  # noqa: E402
from bench import common  # noqa: E402
from specbeam_edge import Engine, SpeculativeConfig  # noqa: E402
from specbeam_edge.shipped import shipped  # noqa: E402

GLOSSARY = ROOT / "bench" / "data" / "glossary_ende.tsv"
ARMS = ("plain", "glossary", "plain_spec", "glossary_spec")


def run(lines: int, beams: int, max_new: int, forced: bool = False) -> dict:
    src = (ROOT / "models" / "ende" / "test_sample.en").read_text(encoding="utf-8").splitlines()
    ref = (ROOT / "models" / "ende" / "test_sample.de").read_text(encoding="utf-8").splitlines()
    _, terms = read_glossary(GLOSSARY)
    cons = glossary_constraints(terms, src, "insensitive")
    rows = [(s, r, c) for s, r, c in zip(src, ref, cons) if c][:lines]
    plain_eng = Engine(shipped("ende", "target"))
    spec_eng = Engine(shipped("ende", "target"), draft=shipped("ende", "draft"))
    spec = SpeculativeConfig(adaptive=not forced)
    info = common.machine()
    out = {a: {"texts": [], "tokens": [], "seconds": [], "passes": [], "steps": []} for a in ARMS}
    for i, (s, _, c) in enumerate(rows):
        prompt = plain_eng.tokenizer.format_prompt(s)
        for a in ARMS[i % 4:] + ARMS[:i % 4]:                       # alternate: the order rotates per line
            eng = spec_eng if a.endswith("_spec") else plain_eng
            kw = dict(num_beams=beams, max_new_tokens=max_new, speculative=spec if a.endswith("_spec") else None,
                      constraints=c if a.startswith("glossary") else None)
            t0 = time.perf_counter()
            [res] = eng.generate(prompt, **kw)
            dt = time.perf_counter() - t0
            o = out[a]
            o["texts"].append(res.text)
            o["tokens"].append(res.hypotheses[0].tokens)
            o["seconds"].append(dt)
            o["passes"].append(res.stats.target_passes)
            o["steps"].append(res.stats.beam_steps)
    refs = [r for _, r, _ in rows]
    report = {"machine": info, "lines": len(rows), "beams": beams, "max_new_tokens": max_new, "forced": forced,
              "terms_per_line": round(sum(len(c) for *_, c in rows) / len(rows), 2),
              "reference_has_every_term": round(sum(all(any(f in r for f in t) for t in c)
                                                    for _, r, c in rows) / len(rows), 3), "arms": {}}
    for a in ARMS:
        o = out[a]
        hit = sum(all(any(f in text for f in t) for t in c) for text, (*_, c) in zip(o["texts"], rows))
        report["arms"][a] = {"every_term": round(hit / len(rows), 3), **common.text_scores(o, refs)}
    arms = report["arms"]
    report["glossary_over_plain_speed"] = round(arms["plain"]["seconds"] / arms["glossary"]["seconds"], 3)
    report["glossary_spec_over_glossary_speed"] = round(arms["glossary"]["seconds"] /
                                                        arms["glossary_spec"]["seconds"], 3)
    report["glossary_spec_over_plain_speed"] = round(arms["plain"]["seconds"] / arms["glossary_spec"]["seconds"], 3)
    for a in ("plain", "glossary"):
        report[f"{a}_spec_identical"] = sum(x == y for x, y in zip(out[a]["tokens"], out[a + "_spec"]["tokens"]))
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=60)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--forced", action="store_true", help="speculate on every pass (default: adaptive)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    args = ap.parse_args(argv)
    report = run(args.lines, args.beams, args.max_new_tokens, args.forced)
    name = "glossary_forced" if args.forced else "glossary"
    common.report_arms(report, args.out, name, ["every_term", "bleu", "chrf", "seconds", "tok_s", "steps_per_pass"])
    common.arm_bars(report, "every_term", "lines with every term (%)",
                    f"glossary, shipped en->de, K={report['beams']}, {report['lines']} lines", args.out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
