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
optional extra, imported only by this module and ray_cluster.py and only when --engine ray runs.

Here: the flags and the driver (RayRun: manifest, scheduling, retries, assembly); ray_plan.py: the input files,
outputs and shards; ray_cluster.py: the actor (ShardWorker) and the cluster.

Ray core actors, not Ray Data's map_batches: the driver commits each shard the moment it is back and counts
and reports every retry, where a dataset would fail as a whole on one block's exception and would add pyarrow
and pandas to the extra.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shutil
import sys
import time
from collections import deque
from pathlib import Path

from tqdm import tqdm

from specbeam_edge.commands.flags import positive_int
from specbeam_edge.results import Stats

from .files import UsageError, split_lines
from .job import LABELS, PROG, Settings, file_settings, summary
from .journal import (Journal, OutputLock, atomic_write, atomic_write_chunks, finished_as, finished_note,
                      lines_sha256, remember_finished)
from .ray_cluster import ShardWorker, actors_that_fit, check_resources, connect, error_line, keep_sigterm
from .ray_plan import Shard, input_files, input_sha256, output_paths, plan


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
        lines = split_lines(path.read_bytes())
        want = len(lines) * args.n_best
        have = o.read_bytes().count(b"\n")
        if have != want:
            raise UsageError(f"{o} exists without a shard folder and holds {have} lines, not the {want} of a "
                             f"finished run on {path}; delete it (or drop --resume) to translate again")
        recorded += finished_as(o, lines_sha256(lines), settings, LABELS)
    print(f"{PROG}: {finished_note(args.output, recorded == len(outputs))}", file=sys.stderr)
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
        self.input_sha256 = [lines_sha256(lines) for lines in self.lines]     # the record of finished runs'
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
            raise UsageError(f"a Ray worker could not load the model: {error_line(e)}") from None
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
            self.progress.write(f"{self.prog}: a worker died for good ({error_line(e)}); going on without it",
                                file=sys.stderr)

    def on_shard(self, ref, shard: Shard, actor) -> bool:
        """Commit a finished shard, or queue it again; False when a bad line stops the run (--on_error fail)."""
        import ray

        try:
            res = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            self.retry(shard, error_line(e))
            self.ping(actor)            # the worker died: back to work once Ray has restarted it
            return True
        except ray.exceptions.RayError as e:
            self.retry(shard, error_line(e))
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
