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
