"""Build the en->de parallel corpus from Debian packages only (no hub, no web).

Sources (licences recorded in models/ende/README.md):
  - gettext catalogues (.mo) on the base image and in a few downloaded .debs
  - LibreOffice help, aligned paragraph by paragraph through shared `id="par_id..."` attributes
  - GIMP help, aligned block by block within files that have the same number of blocks

Writes train.tsv, valid.tsv, test.tsv (english<TAB>german, one pair a line) into --out, and next to each a
.source file naming each line's source (libreoffice, gimp, mo) for train.py --mix.
The test set is 1,000 LibreOffice help paragraphs (>= 6 English words) that no training run sees.

    python models/build_corpus.py --out data/ende
"""
from __future__ import annotations

import argparse
import gettext
import hashlib
import html
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

DEBS = ["libreoffice-help-en-us", "libreoffice-help-de", "libreoffice-l10n-de", "gimp-help-en",
        "gimp-help-de", "gcc-12-locales", "inkscape"]
BLOCK = re.compile(r"<(p|h[1-6]|title|td|li|dt|caption)\b([^>]*)>(.*?)</\1>", re.S | re.I)


def fetch_debs(work: Path) -> Path:
    """apt-get download the packages and unpack them into work/x (cached)."""
    root = work / "x"
    if root.exists():
        return root
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *DEBS], cwd=work, check=True)
    root.mkdir()
    for deb in sorted(work.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def mo_pairs(root: Path):
    for dp, _, files in os.walk(root):
        if "de" not in Path(dp).parts:
            continue
        for f in files:
            if not f.endswith(".mo") or f.startswith("iso_"):
                continue
            try:
                with open(os.path.join(dp, f), "rb") as fh:
                    cat = gettext.GNUTranslations(fh)._catalog
            except Exception:
                continue
            for k, v in cat.items():
                if isinstance(k, tuple):
                    if k[1] != 0:
                        continue
                    k = k[0]
                if "\x04" in k:
                    k = k.split("\x04", 1)[1]
                yield "mo", k, v


def blocks(text: str):
    out = []
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", text, flags=re.S | re.I)
    for m in BLOCK.finditer(text):
        if re.search(r"<(p|li|td|table|div)\b", m.group(3), re.I):
            continue
        t = re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", m.group(3)))).strip()
        i = re.search(r'\bid="([^"]+)"', m.group(2))
        out.append((i.group(1) if i else None, t))
    return out


def html_blocks(en_root: Path, de_root: Path):
    """(English blocks, German blocks) of every help page present in both languages, in path order."""
    for en_file in sorted(en_root.rglob("*.html")):
        de_file = de_root / en_file.relative_to(en_root)
        if de_file.exists():
            yield blocks(en_file.read_text("utf-8", "replace")), blocks(de_file.read_text("utf-8", "replace"))


def libreoffice_pairs(root: Path):
    help_root = root / "usr/share/libreoffice/help"
    for a, b in html_blocks(help_root / "en-US", help_root / "de"):
        de = {i: t for i, t in b if i}
        for i, t in a:
            if i and i in de:
                yield "libreoffice", t, de[i]


def gimp_pairs(root: Path):
    help_root = root / "usr/share/gimp/2.0/help"
    for a, b in html_blocks(help_root / "en", help_root / "de"):
        if len(a) == len(b):
            for (_, t), (_, u) in zip(a, b):
                yield "gimp", t, u


def clean(s: str) -> str:
    s = s.replace("\t", " ").replace("\r", " ").replace("\n", " ")
    s = re.sub(r"(?<=\w)_(?=\w)|&(?=\w)", "", s) if len(s) < 40 else s  # accelerator markers
    return re.sub(r"\s+", " ", s).strip()


def build_text(out: Path, work: Path, seed: int) -> int:
    """The English prose + code corpus: the Python 3.11 documentation sources (reST: prose with code
    samples), one document per file. Splits by file: 10 validation and 10 test files."""
    root = work / "pydoc"
    if not root.exists():
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=work, check=True)
        subprocess.run(["dpkg-deb", "-x", str(next(work.glob("python3.11-doc_*.deb"))), str(root)], check=True)
    files = sorted((root / "usr/share/doc/python3.11/html/_sources").rglob("*.rst.txt"))
    rng = random.Random(seed)
    rng.shuffle(files)
    splits = {"test": files[:10], "valid": files[10:20], "train": files[20:]}
    for name, fs in splits.items():
        with open(out / f"{name}.txt", "w", encoding="utf-8") as f:
            for p in fs:
                doc = p.read_text("utf-8", "replace").replace("\x00", "")
                f.write(json.dumps(doc) + "\n")        # one JSON string per line: documents keep newlines
    print(f"text corpus: {', '.join(f'{k} {len(v)} files' for k, v in splits.items())}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder for train/valid/test .tsv (or .txt with --text)")
    ap.add_argument("--text", action="store_true",
                    help="build the English prose + code corpus (Python docs, PSF-2.0) instead of en->de pairs")
    ap.add_argument("--work", default=None, help="download/unpack folder (default: OUT/../debs)")
    ap.add_argument("--max_chars", type=int, default=400, help="drop pairs whose sides are longer than this")
    ap.add_argument("--seed", type=int, default=1234, help="split seed")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.text:
        return build_text(out, Path(args.work) if args.work else out.parent / "debs", args.seed)
    root = fetch_debs(Path(args.work) if args.work else out.parent / "debs")

    seen: set[str] = set()
    by_source: dict[str, list[tuple[str, str]]] = {}
    sources = [libreoffice_pairs(root), gimp_pairs(root), mo_pairs(root), mo_pairs(Path("/usr/share/locale"))]
    for gen in sources:
        for src, en, de in gen:
            en, de = clean(en), clean(de)
            if not en or not de or en == de or len(en) > args.max_chars or len(de) > args.max_chars:
                continue
            if "%" in en and len(en) < 12:
                continue
            key = en.lower()
            if key in seen:
                continue
            seen.add(key)
            by_source.setdefault(src, []).append((en, de))

    rng = random.Random(args.seed)
    lo = by_source["libreoffice"]
    rng.shuffle(lo)
    long_ids = [i for i, (en, _) in enumerate(lo) if len(en.split()) >= 6]
    test_ids = set(long_ids[:1000])
    valid_ids = set(long_ids[1000:1500])
    test = [("libreoffice", *lo[i]) for i in sorted(test_ids)]
    valid = [("libreoffice", *lo[i]) for i in sorted(valid_ids)]
    train = [("libreoffice", *p) for i, p in enumerate(lo) if i not in test_ids and i not in valid_ids]
    for src, pairs in by_source.items():
        if src != "libreoffice":
            train.extend((src, *p) for p in pairs)
    rng.shuffle(train)
    for name, rows in (("train", train), ("valid", valid), ("test", test)):
        with open(out / f"{name}.tsv", "w", encoding="utf-8") as f:
            for _, en, de in rows:
                f.write(f"{en}\t{de}\n")
        # one source name a line, aligned with the .tsv: train.py --mix weights the sources by it
        (out / f"{name}.source").write_text("".join(f"{src}\n" for src, _, _ in rows), encoding="utf-8")
    counts = {k: len(v) for k, v in by_source.items()}
    digest = hashlib.sha256((out / "test.tsv").read_bytes()).hexdigest()[:16]
    print(f"pairs by source {counts}; train {len(train)} valid {len(valid)} test {len(test)}; "
          f"test sha256 {digest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
