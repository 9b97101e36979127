"""Helpers shared by the benchmark scenarios: machine facts, medians, output files."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path


def machine() -> dict:
    load = os.getloadavg()
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime

    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in load],
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def write(out: Path, name: str, data: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    head = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "-|-".join("-" * w for w in widths)
    body = [" | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join([head, sep, *body])


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """A benchmark's plot: laid out, written as PNG, closed (a long run makes many)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def arm_bars(report: dict, share: str, share_label: str, title: str, path: Path) -> None:
    """Two bar charts of a report's arms (report["arms"][arm] -> numbers): `share` (a fraction, shown in %) and
    beam steps per second; the figure is written to path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(list(arms), [arms[a][share] * 100 for a in arms], color="#4a7")
    ax[0].set_ylabel(share_label)
    ax[1].bar(list(arms), [arms[a]["tok_s"] for a in arms], color="#47a")
    ax[1].set_ylabel("beam steps / s")
    for a in ax:
        a.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    save_figure(fig, path)


def report_arms(report: dict, out: Path, name: str, cols: list[str], skip=("arms", "machine")) -> Path:
    """Write a report with arms as JSON, print its arms' table and its other numbers; returns the JSON's path."""
    path = write(out, name, report)
    print(table([{"arm": a, **v} for a, v in report["arms"].items()], ["arm", *cols]))
    print({k: v for k, v in report.items() if k not in skip})
    print(f"wrote {path}")
    return path


def text_scores(o: dict, refs: list[str]) -> dict:
    """An arm's translations against references and its speed: o holds per line "texts", "seconds", "steps"
    (beam steps) and "passes" (target passes)."""
    import sacrebleu

    secs = sum(o["seconds"])
    return {"bleu": round(sacrebleu.corpus_bleu(o["texts"], [refs]).score, 2),
            "chrf": round(sacrebleu.corpus_chrf(o["texts"], [refs]).score, 2),
            "seconds": round(secs, 2), "tok_s": round(sum(o["steps"]) / secs, 1),
            "steps_per_pass": round(sum(o["steps"]) / sum(o["passes"]), 3)}

