"""specbeam-translate --engine ray: the same translation spread over a Ray cluster, one Engine per actor.

    specbeam-translate --engine ray -i corpus/ -o out/ --actors 4 --cpus_per_actor 2 --resume

Input (-i): a file, a folder (its files, recursively, in sorted order) or a quoted glob. Output (-o): a file for
a file input; a folder for a folder or glob, each output at its input's relative path. Each real file is read
once (`**` does not descend into symlinked folders), a glob with `..` after a wildcard is refused, the run's own
files on -o (outputs, shards, lock, pid file) are never input, and an output that would replace an input is
refused. Every input file is cut
into shards of --shard_lines lines; each actor holds one Engine (--cpus_per_actor onnxruntime threads, so the
actors of a node do not oversubscribe its cores) and translates whole shards with the local tool's code
(validation, batching, formatting), so the output is byte-identical to `specbeam-translate` on one machine.

Resume: the driver commits each finished shard atomically: its part file (<output>.shards/part-NNNNNN) written
through a temporary file, fsynced and renamed, then a fsynced record (part checksum) in the shard manifest
(<output>.shards/manifest, the resume journal's format). When every shard is in, each output file is
concatenated from its parts through a temporary file and the shard folder is removed. A killed driver rerun with
--resume translates only the shards the manifest lacks; a killed worker is restarted by Ray and its shard
retried (--shard_retries), each retry reported.

Cluster: a local Ray instance on this machine by default; --ray_address (or RAY_ADDRESS) joins a running one
(`ray start --head` on one machine, `ray start --address HEAD:6379` on the others). Each node needs this
project installed (`pip install "specbeam-edge[ray]"`) and the model folders at the same paths. Ray is an
optional extra, imported only here and only when --engine ray runs.

Ray core actors, not Ray Data's map_batches: the driver commits each shard the moment it is back and counts
and reports every retry, where a dataset would fail as a whole on one block's exception and would add pyarrow
and pandas to the extra.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specbeam_edge.flags import positive_int
from specbeam_edge.results import Stats

from .job import (LABELS, PROG, Settings, UsageError, check_output, file_settings, open_engine, prepare,
                  split_lines, summary, translate)
from .journal import (Journal, OutputLock, atomic_write, atomic_write_chunks, finished_as, output_lines,
                      raise_terminated, remember_finished)

PART_DIGITS = 6


def add_ray_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the Ray engine (cheap: nothing of Ray is imported to build the parser)."""
    ap.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="translate in this process, or on a Ray cluster (pip install 'specbeam-edge[ray]')")
    r = ap.add_argument_group("ray (--engine ray)")
    r.add_argument("--ray_address", default=None,
                   help="a running cluster (`ray start --head` prints it); default: RAY_ADDRESS, else a local "
                        "Ray instance on this machine")
    r.add_argument("--actors", type=positive_int, default=None,
                   help="engines (Ray actors); default: the cluster's CPUs / --cpus_per_actor")
    r.add_argument("--cpus_per_actor", type=positive_int, default=1,
                   help="CPUs reserved per actor, also its onnxruntime threads (unless --threads)")
    r.add_argument("--gpus_per_actor", type=float, default=0,
                   help="GPUs reserved per actor (with --provider cuda)")
    r.add_argument("--shard_lines", type=positive_int, default=1000,
                   help="input lines per shard: the unit of work, of commit and of resume")
    r.add_argument("--shard_retries", type=int, default=2,
                   help="times a failed shard (worker died, error) is tried again before the run gives up on it")


# -- the plan: input files, shards, where outputs go -------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    index: int          # its record key in the manifest and its part file's number
    file: int           # index into the job's input files
    first: int          # input line index (in its file) of its first line
    count: int

    @property
    def part(self) -> str:
        return f"part-{self.index:0{PART_DIGITS}d}"


def _has_magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def own_files(output: Path | None) -> list[str]:
    """Real paths of what a run on -o writes (the output, its shard folder, lock, pid file and journal): never
    read as input, also when -o lies inside the input folder."""
    if output is None:
        return []
    return [os.path.realpath(output.with_name(output.name + suffix))
            for suffix in ("", ".shards", ".lock", ".lock.pid", ".journal")]


def _under(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def _is_own(path: Path, own: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(_under(real, o) for o in own)


def _own_below(root: Path, own: list[str]) -> list[str]:
    """The run's own paths that can hold inputs' siblings: an -o folder that holds the input root itself is
    not excluded as a whole (output_paths refuses any output that would replace an input)."""
    real = os.path.realpath(root)
    return [o for o in own if not _under(real, o)]


def input_files(spec: str, output: Path | None = None) -> tuple[list[tuple[Path, str]], bool]:
    """(path, name relative to the input root) of every input file, and whether -o is a folder (a folder or a
    glob input) rather than a file (a file input). Each real file is listed once (a symlink loop or a second
    link to a file is not translated twice; `**` does not descend into symlinked folders), and the run's own
    files on `output` are never inputs."""
    path = Path(spec)
    own = own_files(output)
    if path.is_file():
        return [(path, path.name)], False
    if path.is_dir():
        if output is not None and os.path.realpath(output) == os.path.realpath(path):
            raise UsageError(f"-o {output} is the input folder: the outputs would replace their inputs; write to "
                             f"another folder")
        files = [p for p in sorted(path.rglob("*")) if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        own = _own_below(path, own)
        files = _unique(p for p in files if not _is_own(p, own))
        if not files:
            raise UsageError(f"input folder {path} holds no files")
        return [(p, p.relative_to(path).as_posix()) for p in files], True
    if not _has_magic(spec):
        raise UsageError(f"input {spec} does not exist; pass a file, a folder or a glob")
    prefix = _prefix(path.parts)
    rest = path.parts[len(prefix):]
    if ".." in rest:
        raise UsageError(f"input glob {spec}: '..' after a wildcard could leave the input folder (and put outputs "
                         f"outside -o); name the folder before the first wildcard instead")
    root = Path(*prefix) if prefix else Path(".")
    hidden_ok = any(part.startswith(".") for part in rest)
    files = [p for p in sorted(root.glob(str(Path(*rest)))) if p.is_file()
             and (hidden_ok or not any(part.startswith(".") for part in p.relative_to(root).parts))]
    own = _own_below(root, own)
    files = _unique(p for p in files if not _is_own(p, own))
    if not files:
        raise UsageError(f"no input file matches {spec}")
    return [(p, p.relative_to(root).as_posix()) for p in files], True


def _unique(paths) -> list[Path]:
    """The first path to each real file (sorted order in, sorted order out)."""
    seen, out = set(), []
    for p in paths:
        real = os.path.realpath(p)
        if real not in seen:
            seen.add(real)
            out.append(p)
    return out


def _prefix(parts: tuple[str, ...]) -> list[str]:
    """The folders of a glob before its first wildcard: outputs keep the paths below them."""
    out = []
    for p in parts[:-1]:
        if _has_magic(p):
            break
        out.append(p)
    return out


def output_paths(output: Path, files: list[tuple[Path, str]], folder: bool) -> list[Path]:
    """Where each input file's output goes; fails before any work if -o cannot take them (a special file, a
    file where a folder is needed, or an output that is one of the inputs)."""
    if not folder:
        check_output(str(output), str(files[0][0]))
        return [output]
    if output.exists() and not output.is_dir():
        raise UsageError(f"output {output} is a file; with a folder or glob input, -o is a folder")
    if not output.parent.is_dir():
        raise UsageError(f"the output's directory {output.parent} does not exist; create it first")
    outs = [output / name for _, name in files]
    inputs = {os.path.realpath(p): p for p, _ in files}
    for out in outs:
        if os.path.realpath(out) in inputs:
            raise UsageError(f"output {out} would replace the input {inputs[os.path.realpath(out)]}; write to "
                             f"another -o")
    return outs


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


def plan(counts: list[int], shard_lines: int) -> list[Shard]:
    """Shards in input order: every file cut into runs of shard_lines lines (a shard never spans two files)."""
    shards = []
    for f, n in enumerate(counts):
        for first in range(0, n, shard_lines):
            shards.append(Shard(len(shards), f, first, min(shard_lines, n - first)))
    return shards


def input_sha256(names: list[str], raws: list[bytes]) -> str:
    h = hashlib.sha256()
    for name, raw in zip(names, raws):
        h.update(f"{name}\0{hashlib.sha256(raw).hexdigest()}\0".encode())
    return h.hexdigest()


# -- the worker: one Engine, whole shards ------------------------------------------------------------------------
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


# -- the driver --------------------------------------------------------------------------------------------------
def run_ray(args, s: Settings) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("--engine ray needs Ray: pip install 'specbeam-edge[ray]'") from None
    files, folder = input_files(args.input, Path(args.output))
    outputs = output_paths(Path(args.output), files, folder)
    # The driver decides the settings from the model folder alone (no Engine here): bad settings and a broken
    # folder fail before the cluster starts, and the manifest refuses a resume under other settings.
    setting = {**file_settings(s), "shard_lines": args.shard_lines}
    if folder:
        Path(args.output).mkdir(exist_ok=True)
    with OutputLock(Path(args.output)):
        if args.resume and finished(args, files, outputs, file_settings(s)):
            return 0
        return RayRun(args, s, files, outputs, setting).run()


def finished(args, files, outputs: list[Path], settings: dict) -> bool:
    """--resume after a run that finished (no shard folder; every output there with its line count): say so. Each
    output must have been finished from its input with these settings where its record says (journal.finished_as)."""
    out = Path(args.output)
    if out.with_name(out.name + ".shards").exists() or not all(o.is_file() for o in outputs):
        return False
    recorded = 0
    for (path, _), o in zip(files, outputs):
        raw = path.read_bytes()
        want = len(split_lines(raw)) * args.n_best
        have = o.read_bytes().count(b"\n")
        if have != want:
            raise UsageError(f"{o} exists without a shard folder and holds {have} lines, not the {want} of a "
                             f"finished run on {path}; delete it (or drop --resume) to translate again")
        recorded += finished_as(o, hashlib.sha256(raw).hexdigest(), settings, LABELS)
    how = ("with these settings" if recorded == len(outputs) else
           "no record of its settings is left, so only its line count was checked")
    print(f"{PROG}: {args.output} is complete (its run finished, {how}); nothing to do", file=sys.stderr)
    return True


class RayRun:
    """One run of the driver: the manifest, the shards still to do, the actors, progress and the summary."""

    def __init__(self, args, settings: Settings, files, outputs: list[Path], setting: dict):
        self.args, self.settings, self.outputs, self.prog = args, settings, outputs, PROG
        self.names = [name for _, name in files]
        raws = []
        for path, _ in files:
            try:
                raws.append(path.read_bytes())
            except OSError as e:
                raise UsageError(f"cannot read input {path}: {e.strerror}") from None
        self.lines = [split_lines(raw) for raw in raws]
        self.input_sha256 = [hashlib.sha256(raw).hexdigest() for raw in raws]   # the record of finished runs'
        self.file_settings = {k: v for k, v in setting.items() if k != "shard_lines"}
        self.shards = plan([len(x) for x in self.lines], args.shard_lines)
        out = Path(args.output)
        self.state = out.with_name(out.name + ".shards")
        if self.state.is_symlink() or (self.state.exists() and not self.state.is_dir()):
            raise UsageError(f"{self.state} is not a folder of this run's shards (a link or a file); remove it, or "
                             f"write to another -o")
        self.state.mkdir(exist_ok=True)
        self.manifest = Journal(out, input_sha256(self.names, raws), setting, args.resume,
                                path=self.state / "manifest", unit="shard", labels=LABELS)
        for note in self.manifest.notes:
            self.say(note)
        self.todo = [s for s in self.shards if not self._committed(s)]
        self.retries = self.failed = self.n_actors = 0

    def say(self, message: str) -> None:
        print(f"{self.prog}: {message}", file=sys.stderr)

    def _committed(self, shard: Shard) -> bool:
        """In the manifest, and its part file still holds what was committed."""
        rec = self.manifest.done.get(shard.index)
        if rec is None:
            return False
        try:
            ok = hashlib.sha256((self.state / shard.part).read_bytes()).hexdigest() == rec[0]
        except OSError:
            ok = False
        if not ok:
            self.say(f"{self.state / shard.part} is missing or damaged; that shard is translated again")
        return ok

    def where(self, shard: Shard) -> str:
        return f"shard {shard.index} ({self.names[shard.file]} lines {shard.first + 1}-{shard.first + shard.count})"

    def commit(self, shard: Shard, data: bytes) -> None:
        """Part file first (atomic), then its manifest record: a crash between the two only redoes the shard."""
        atomic_write(self.state / shard.part, data, follow_symlinks=False)
        self.manifest.add(shard.index, [hashlib.sha256(data).hexdigest()])

    def run(self) -> int:
        if len(self.todo) < len(self.shards):
            self.say(f"resuming, {len(self.shards) - len(self.todo)} of {len(self.shards)} shards already done")
        stats = Stats()
        try:
            if self.todo and not self.translate(stats):
                return 1
        finally:
            self.manifest.close()
        self.assemble()
        if not self.args.quiet:
            lines = sum(s.count for s in self.todo)
            print(f"{summary(stats, lines, stats.seconds)}; {len(self.todo)} shard(s) on {self.n_actors} actor(s), "
                  f"{self.retries} retried", file=sys.stderr)
        if self.args.stats:
            print(json.dumps(stats.as_dict()), file=sys.stderr)
        return 0

    def translate(self, stats) -> bool:
        """Start the cluster and the actors, translate every shard still to do; False if any shard failed."""
        import ray

        started = connect(self.args)
        keep_sigterm()
        actors = []
        try:
            actors = self.start_actors()
            t0 = time.time()        # stats.seconds counts translation, not cluster start/stop or model loading
            ok = self.schedule(actors, stats)
            stats.seconds = time.time() - t0
            return ok
        finally:
            for a in actors:
                ray.kill(a)
            if started:
                ray.shutdown()

    def start_actors(self) -> list:
        import ray

        a = self.args
        nodes = ray.nodes()
        check_resources(nodes, a.cpus_per_actor, a.gpus_per_actor)
        fit = actors_that_fit(nodes, a.cpus_per_actor, a.gpus_per_actor)
        if a.actors and a.actors > fit:
            self.say(f"--actors {a.actors}: the cluster holds {fit} actor(s) of {a.cpus_per_actor} CPU(s) at once; "
                     f"starting {fit}")
        n = min(a.actors or fit, fit)
        self.n_actors = n = max(1, min(n, len(self.todo)))
        worker_args = copy.copy(a)
        worker_args.threads = a.threads or a.cpus_per_actor
        # A worker that dies (killed, out of memory, node lost) is restarted by Ray; its shard is retried by
        # the driver (max_task_retries=0) so that every retry is counted and reported.
        cls = ray.remote(ShardWorker).options(num_cpus=a.cpus_per_actor, num_gpus=a.gpus_per_actor,
                                              max_restarts=-1, max_task_retries=0)
        actors = [cls.remote(worker_args, self.settings) for _ in range(n)]
        try:
            ray.get([x.ready.remote() for x in actors])
        except ray.exceptions.RayError as e:
            raise UsageError(f"a Ray worker could not load the model: {_cause(e)}") from None
        return actors

    def schedule(self, actors: list, stats) -> bool:
        """One shard in flight per actor; each result committed as it arrives; failed shards retried. A worker
        that died is pinged until Ray has restarted it (its Engine loaded again), then gets shards again."""
        import ray

        self.pending, self.idle, self.inflight, self.tries = deque(self.todo), list(actors), {}, {}
        self.stats, self.done = stats, len(self.shards) - len(self.todo)
        total, left = sum(len(x) for x in self.lines), sum(s.count for s in self.todo)
        self.progress = tqdm(total=total, initial=total - left, unit="line", file=sys.stderr,
                             disable=True if self.args.quiet else None, dynamic_ncols=True)   # None: TTY only
        try:
            while self.pending or self.inflight:
                self.submit()
                if not self.inflight:           # every worker is gone for good
                    break
                (ref,), _ = ray.wait(list(self.inflight), num_returns=1)
                shard, actor = self.inflight.pop(ref)
                if shard is None:
                    self.on_ping(ref, actor)
                elif not self.on_shard(ref, shard, actor):
                    return False
        finally:
            self.progress.close()
        if self.pending:
            self.failed += len(self.pending)
            self.say(f"no worker left (each died for good); {len(self.pending)} shard(s) not translated")
        if self.failed:
            self.say(f"{self.failed} shard(s) failed; finished shards are kept: fix the cause and rerun with "
                     f"--resume")
        return not self.failed

    def submit(self) -> None:
        while self.idle and self.pending:
            shard, actor = self.pending.popleft(), self.idle.pop()
            lines = self.lines[shard.file][shard.first:shard.first + shard.count]
            self.inflight[actor.translate.remote(shard.first, lines)] = (shard, actor)
            self.tries[shard.index] = self.tries.get(shard.index, 0) + 1

    def ping(self, actor) -> None:
        self.inflight[actor.ready.remote()] = (None, actor)

    def on_ping(self, ref, actor) -> None:
        import ray

        try:
            ray.get(ref)
            self.idle.append(actor)
        except ray.exceptions.ActorUnavailableError:    # still restarting: calls fail at once, so ask again soon
            time.sleep(0.5)
            self.ping(actor)
        except ray.exceptions.RayError as e:
            self.progress.write(f"{self.prog}: a worker died for good ({_cause(e)}); going on without it",
                                file=sys.stderr)

    def on_shard(self, ref, shard: Shard, actor) -> bool:
        """Commit a finished shard, or queue it again; False when a bad line stops the run (--on_error fail)."""
        import ray

        try:
            res = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.retry(shard, _cause(e))
            self.ping(actor)            # the worker died: back to work once Ray has restarted it
            return True
        except ray.exceptions.RayError as e:
            self.retry(shard, _cause(e))
            self.idle.append(actor)
            return True
        self.idle.append(actor)
        for number, why in res.bad:
            where = f"{self.names[shard.file]}: " if len(self.names) > 1 else ""
            self.progress.write(f"{self.prog}: {where}line {number}: {why}", file=sys.stderr)
        if res.data is None:
            self.say("stopping (--on_error fail); finished shards are kept")
            return False
        self.commit(shard, res.data)
        self.stats.add(res.stats)
        self.done += 1
        self.progress.update(shard.count)
        self.progress.set_postfix_str(f"{self.done}/{len(self.shards)} shards, {self.stats.generated_tokens} tok",
                                      refresh=False)
        return True

    def retry(self, shard: Shard, why: str) -> None:
        tried = self.tries[shard.index]
        if tried > self.args.shard_retries:
            self.failed += 1
            self.progress.write(f"{self.prog}: {self.where(shard)} failed {tried} time(s), giving up on it: {why}",
                                file=sys.stderr)
            return
        self.retries += 1
        self.progress.write(f"{self.prog}: {self.where(shard)} failed ({why}); retrying it "
                            f"({tried} of {self.args.shard_retries + 1} tries used)", file=sys.stderr)
        self.pending.appendleft(shard)

    def assemble(self) -> None:
        """Every shard is in: each output file from its parts (atomically, in input order), then no state."""
        for f, out in enumerate(self.outputs):
            out.parent.mkdir(parents=True, exist_ok=True)
            parts = [self.state / s.part for s in self.shards if s.file == f]
            atomic_write_chunks(out, (p.read_bytes() for p in parts))
            remember_finished(out, self.input_sha256[f], self.file_settings)
        shutil.rmtree(self.state)


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


def _cause(error: Exception) -> str:
    """One line for a Ray error: the worker's own exception when there is one, not Ray's wrapping."""
    cause = getattr(error, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(error).__name__}: {error}"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
