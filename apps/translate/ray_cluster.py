"""The cluster side of --engine ray: the actor that translates whole shards (ShardWorker, one Engine each), what
the cluster's nodes can hold, joining or starting the cluster, and a Ray error as one line. Ray itself is imported
only inside the functions that need it (the parser and a local run never load it).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import dataclass

from tqdm import tqdm

from .files import UsageError
from .job import Settings, open_engine, prepare, translate
from .journal import output_lines, raise_terminated


@dataclass(frozen=True)
class ShardResult:
    data: bytes | None          # the shard's output bytes; None: a bad line stopped it (--on_error fail)
    bad: list                   # [(line number in its file, why)]: bad lines, truncated lines, context cuts
    stats: object               # specbeam_edge Stats


class ShardWorker:
    """Runs in a Ray actor: loads the Engine once, then translates shard after shard with the local tool's
    validation, batching and formatting (so shards join into the single-process output byte for byte)."""

    def __init__(self, args: argparse.Namespace, settings: Settings):
        self.settings = settings
        self.engine = open_engine(args, settings)

    def ready(self) -> int:
        return os.getpid()

    def translate(self, first: int, lines: list[bytes]) -> ShardResult:
        bad = []
        report = lambda n, why: bad.append((n, why))    # noqa: E731
        items, fixed, _ = prepare(self.settings, self.engine, lines, first, report)
        if items is None:
            return ShardResult(None, bad, None)
        outputs = dict(fixed)
        stats = translate(self.settings, self.engine, items, outputs.__setitem__, tqdm(disable=True), first,
                          report, lines=lines)
        return ShardResult(output_lines(outputs, 0, len(lines)), bad, stats)

def check_resources(nodes: list[dict], cpus: float, gpus: float) -> None:
    """Refuse up front an actor that no node of the cluster can hold (Ray would wait for one forever)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    most_cpu = max((r.get("CPU", 0) for r in alive), default=0)
    most_gpu = max((r.get("GPU", 0) for r in alive), default=0)
    if cpus > most_cpu:
        raise UsageError(f"--cpus_per_actor {cpus:g}: no node of the Ray cluster has that many CPUs (the largest "
                         f"has {most_cpu:g}); pass at most {most_cpu:g}")
    if gpus > most_gpu:
        have = f"the largest has {most_gpu:g}" if most_gpu else "it has none"
        raise UsageError(f"--gpus_per_actor {gpus:g}: no node of the Ray cluster has that many GPUs ({have}); "
                         f"pass --gpus_per_actor 0 (or a fraction a node has)")


def actors_that_fit(nodes: list[dict], cpus: float, gpus: float) -> int:
    """How many actors of `cpus` CPUs and `gpus` GPUs the cluster's live nodes hold at once (Ray starts no more:
    the rest would wait for ever)."""
    total = 0
    for n in nodes:
        if not n.get("Alive", True):
            continue
        r = n.get("Resources", {})
        fit = int(r.get("CPU", 0) // cpus) if cpus > 0 else 10**9
        if gpus > 0:
            fit = min(fit, int(r.get("GPU", 0) // gpus))
        total += fit
    return total


def connect(args) -> bool:
    """Join the cluster named by --ray_address / RAY_ADDRESS, or start a local one; True if this call started
    the connection (and so shuts it down at the end). A caller already connected (tests, notebooks) is kept."""
    import ray

    if ray.is_initialized():
        return False
    level = logging.WARNING if args.quiet else logging.INFO
    # Workers' own stderr is not forwarded: what a shard has to say (bad lines, errors) comes back with it.
    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, logging_level=level)
    else:
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=level)
    return True


def keep_sigterm() -> None:
    """ray.init installs Ray's C++ failure handler for SIGTERM (it prints a native stack and exits 15); the
    tool's own handler is put back so that SIGTERM ends the run as the local engine does (one line, exit 143,
    committed shards kept)."""
    if signal.getsignal(signal.SIGTERM) is not raise_terminated:
        signal.signal(signal.SIGTERM, raise_terminated)


def error_line(error: Exception) -> str:
    """One line for a Ray error: the worker's own exception when there is one, not Ray's wrapping."""
    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(error).__name__}: {error}"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
