"""Placeholders and markup on the shipped en->de pair: how many lines keep every span verbatim with and without
--keep_markup, what it costs, and what prompt lookup (which copies spans from the source) does to that cost.

    apt-get download util-linux-locales && dpkg-deb -x util-linux-locales_*.deb x
    python -m bench.markup --mo x/usr/share/locale/de/LC_MESSAGES/util-linux.mo [--lines 300] [--beams 4]

Held-out lines: the single-line messages of a German gettext catalog (util-linux's is not among the catalogs the
pair was trained on) whose English text holds a span (specbeam_edge/text/markup.py: printf and brace placeholders,
tags, URLs, e-mail addresses, `code`, accelerators), a deterministic sample. One request at a time, K beams; arms
alternated line by line (the order rotates): plain beam search; keep_markup (the spans as constraints; a line
whose constraints did not fit falls back to the plain translation, as the translate tool does, and pays both);
keep_markup with prompt lookup drafting (adaptive=False: a tree every pass). Reports per arm the share of lines
whose every span survives (survives(): as often as in the source, closing tags after opening ones), BLEU/chrF
against the catalog's German, seconds, beam steps per pass; the lookup arm's outputs are compared with keep_markup's.
JSON and a plot.
"""
from __future__ import annotations

import argparse
import gettext
import hashlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from specbeam_edge import Engine, SpeculativeConfig  # noqa: E402
from specbeam_edge.text.markup import find_spans, markup_constraints, survives  # noqa: E402
from specbeam_edge.shipped import shipped  # noqa: E402

ARMS = ("plain", "keep_markup", "keep_markup_lookup")


def catalog_lines(mo: Path, n: int) -> list[tuple[str, str]]:
    """(English, German) single-line messages whose English holds a span: n of them, sampled by hash."""
    with open(mo, "rb") as f:
        cat = gettext.GNUTranslations(f)._catalog
    pairs = {k.strip(): v.strip() for k, v in cat.items()
             if isinstance(k, str) and isinstance(v, str) and k.strip() and v.strip()
             and "\n" not in k.strip() and "\n" not in v.strip()}
    rows = [(k, v) for k, v in pairs.items() if find_spans(k)]
    rows.sort(key=lambda kv: hashlib.sha256(kv[0].encode()).hexdigest())
    return rows[:n]


def run(mo: Path, lines: int, beams: int, max_new: int) -> dict:
    rows = catalog_lines(mo, lines)
    eng = Engine(shipped("ende", "target"))
    lookup = SpeculativeConfig(adaptive=False, drafter="lookup", budget=16, max_depth=6)
    info = common.machine()
    out = {a: {"texts": [], "tokens": [], "seconds": [], "passes": [], "steps": [], "fallback": 0} for a in ARMS}
    for i, (src, _) in enumerate(rows):
        prompt = eng.tokenizer.format_prompt(src)
        cons = markup_constraints(find_spans(src))
        for a in ARMS[i % 3:] + ARMS[:i % 3]:
            kw = dict(num_beams=beams, max_new_tokens=max_new, constraints=None if a == "plain" else cons,
                      speculative=lookup if a.endswith("lookup") else None)
            t0 = time.perf_counter()
            [res] = eng.generate(prompt, **kw)
            o = out[a]
            passes, steps = res.stats.target_passes, res.stats.beam_steps
            if a != "plain" and res.hypotheses[0].constraints_met is False:      # the tool's fallback
                o["fallback"] += 1
                [res] = eng.generate(prompt, num_beams=beams, max_new_tokens=max_new)
                passes, steps = passes + res.stats.target_passes, steps + res.stats.beam_steps
            o["seconds"].append(time.perf_counter() - t0)
            o["texts"].append(res.text)
            o["tokens"].append(res.hypotheses[0].tokens)
            o["passes"].append(passes)
            o["steps"].append(steps)
    refs = [r for _, r in rows]
    report = {"machine": info, "catalog": mo.name, "lines": len(rows), "beams": beams, "max_new_tokens": max_new,
              "spans_per_line": round(sum(len(find_spans(s)) for s, _ in rows) / len(rows), 2),
              "reference_keeps_every_span": round(sum(survives(find_spans(s), r) == [] for s, r in rows)
                                                  / len(rows), 3), "arms": {}}
    for a in ARMS:
        o = out[a]
        kept = sum(survives(find_spans(s), t) == [] for (s, _), t in zip(rows, o["texts"]))
        report["arms"][a] = {"every_span_kept": round(kept / len(rows), 3), "fallback_lines": o["fallback"],
                             **common.text_scores(o, refs)}
    arms = report["arms"]
    report["keep_markup_over_plain_speed"] = round(arms["plain"]["seconds"] / arms["keep_markup"]["seconds"], 3)
    report["lookup_over_keep_markup_speed"] = round(arms["keep_markup"]["seconds"] /
                                                    arms["keep_markup_lookup"]["seconds"], 3)
    report["lookup_identical"] = sum(x == y for x, y in zip(out["keep_markup"]["tokens"],
                                                            out["keep_markup_lookup"]["tokens"]))
    report["examples"] = [{"source": s, "plain": p, "keep_markup": k}
                          for (s, _), p, k in zip(rows, out["plain"]["texts"], out["keep_markup"]["texts"])
                          if p != k][:8]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mo", type=Path, required=True, help="a German gettext catalog (.mo)")
    ap.add_argument("--lines", type=int, default=300)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "results")
    args = ap.parse_args(argv)
    report = run(args.mo, args.lines, args.beams, args.max_new_tokens)
    common.report_arms(report, args.out, "markup", ["every_span_kept", "fallback_lines", "bleu", "chrf", "seconds",
                                                    "tok_s", "steps_per_pass"], skip=("arms", "machine", "examples"))
    common.arm_bars(report, "every_span_kept", "lines keeping every span (%)",
                    f"markup, shipped en->de, {report['catalog']}, K={report['beams']}, {report['lines']} lines",
                    args.out / "markup.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
