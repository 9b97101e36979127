"""The `distil` command: sequence-level knowledge distillation data, the exported teacher's beam-search translations
of the training sources written as a corpus folder (resumable), for a draft to train on.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


def distil(args) -> None:
    """Sequence-level KD data: the teacher's own beam-search translations of the training sources, written as a
    corpus folder (train.tsv with the teacher's output as the German side; valid/test copied). With
    --return_beams K, all K final beams are written (the draft learns the target's top-K, as AtSpeed does)."""
    from specbeam_edge import Engine

    data, out = Path(args.data), Path(args.out)
    if (out / "train.tsv").exists():
        print(f"distil: {out / 'train.tsv'} exists (delete it to regenerate)", file=sys.stderr)
        return
    rows = [l.rstrip("\n").split("\t") for l in open(data / "train.tsv", encoding="utf-8")]
    has_names = (data / "train.source").exists()
    names = (data / "train.source").read_text(encoding="utf-8").split() if has_names else ["all"] * len(rows)
    if args.sources:                                  # only these corpora (e.g. the test's domain)
        if not has_names:
            raise SystemExit(f"distil --sources needs {data / 'train.source'} (each pair's corpus name)")
        keep = set(args.sources.split(","))
        unknown = sorted(keep - set(names))
        if unknown:
            raise SystemExit(f"distil --sources {args.sources}: no pairs from {unknown}; "
                             f"{data / 'train.source'} names {sorted(set(names))}")
        rows, names = [r for r, n in zip(rows, names) if n in keep], [n for n in names if n in keep]
    out.mkdir(parents=True, exist_ok=True)
    part = out / "train.partial.tsv"                 # resumable: lines already written are skipped
    done = sum(1 for _ in open(part, encoding="utf-8")) // args.return_beams if part.exists() else 0
    engine = Engine(args.teacher)
    with open(part, "a", encoding="utf-8") as f, open(out / "train.partial.source", "a", encoding="utf-8") as fs:
        end = min(len(rows), args.limit or len(rows))
        for s in range(done, end, args.chunk):
            chunk = rows[s:min(s + args.chunk, end)]
            res = engine.generate([engine.tokenizer.format_prompt(r[0]) for r in chunk], num_beams=args.num_beams,
                                  num_return_sequences=args.return_beams, max_new_tokens=args.max_new_tokens)
            for r, name, hyp in zip(chunk, names[s:s + args.chunk], res):
                for h in hyp.hypotheses[:args.return_beams]:
                    f.write(f"{r[0]}\t{' '.join(h.text.split())}\n")
                    fs.write(f"{name}\n")
            f.flush()
            fs.flush()
            print(f"distil: {s + len(chunk)} of {len(rows)} sources", file=sys.stderr, flush=True)
    os.replace(part, out / "train.tsv")
    os.replace(out / "train.partial.source", out / "train.source")
    for f in ("valid.tsv", "valid.source", "test.tsv", "test.source"):
        if (data / f).exists():
            (out / f).write_bytes((data / f).read_bytes())
