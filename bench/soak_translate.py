"""Fault injection for the translate tool: SIGKILL it at random moments and check nothing is lost or torn.

    python -m bench.soak_translate --kills 20 --lines 200

Runs the tool once uninterrupted, then again under kill -9 at random moments (the first kill inside the first
second, during model loading; a resumed run may be killed again, so kills come twice in a row), each time
continuing with --resume; every file that gets finished must be byte-identical to the uninterrupted run (a run
that finishes before its kill is checked and the next run starts over, so all the kills land). Uses the
shipped pair (plain beam search, short decoding length) unless --model is given. tests/test_faults.py runs a
short version.

--damage: after each kill, one record in the middle of the journal has a byte flipped (as a bad sector would):
the resume must skip just that record and still finish byte-identical. Then the output-path faults run once each
(path_faults): -o a FIFO or a socket (refused, kept), -o the input (refused, input kept), symlinks planted at the
old predictable temporary names (not followed), a mode-600 output (stays 600), a FIFO as the journal (refused
within a timeout, never a hang) and a damaged journal header under --resume (refused, the journal byte for byte
as it was).
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def translate_cmd(inp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "apps.translate", "-i", str(inp), "-o", str(out), "-q", *extra]


def kill_at(cmd: list[str], delay: float) -> int | None:
    """Start cmd, SIGKILL it after `delay` seconds; the exit code if it finished first, else None."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def damage_record(journal: Path, rng: random.Random) -> bool:
    """Flip one byte inside a record that has valid records after it; False if the journal has too few."""
    lines = journal.read_bytes().split(b"\n")
    if len(lines) < 4:                                   # header, two records, the empty tail after the newline
        return False
    k = rng.randrange(1, len(lines) - 2)                 # a middle record: one complete record comes after it
    line = bytearray(lines[k])
    at = rng.randrange(9, len(line)) if len(line) > 9 else 0
    line[at] = (line[at] + 1) % 256 if line[at] + 1 != 10 else 11     # never a newline: one record stays one line
    lines[k] = bytes(line)
    journal.write_bytes(b"\n".join(lines))
    return True


def soak(inp: Path, out: Path, reference: bytes, extra: list[str], delays: list[float], log=print,
         want_kills: int | None = None, damage: random.Random | None = None) -> dict:
    """Kill a run after each delay in turn (a run after a kill resumes it) until want_kills kills landed; a run
    that finishes before its kill is checked against `reference` and the next run starts a fresh round. A last
    run finishes the work.
    damage: flip a byte in a middle journal record after each kill (this Random picks where).
    Returns {"kills", "rounds" (finished files checked), "mismatches", "damaged" (records damaged)}."""
    journal = out.with_name(out.name + ".journal")
    counts = {"kills": 0, "rounds": 0, "mismatches": 0, "damaged": 0}

    def check():
        counts["rounds"] += 1
        counts["mismatches"] += out.read_bytes() != reference or journal.exists()
        out.unlink()

    for n, delay in enumerate(delays):
        rc = kill_at(translate_cmd(inp, out, *extra, *(["--resume"] if journal.exists() else [])), delay)
        if rc is None:
            counts["kills"] += 1
            records = journal.read_bytes().count(b"\n") - 1 if journal.exists() else None
            state = "absent" if records is None else f"{records} records"
            if damage is not None and records and damage_record(journal, damage):
                counts["damaged"] += 1
                state += ", one damaged"
            log(f"kill {counts['kills']}: after {delay:.2f}s, journal {state}")
            if counts["kills"] == want_kills:
                break
        elif rc == 0:
            log(f"run {n + 1}: finished before the kill at {delay:.2f}s; next round")
            check()
        else:
            raise RuntimeError(f"run {n + 1} exited with {rc}")
    if journal.exists() or out.exists():      # killed mid-run (or right after finishing): finish and check
        subprocess.run(translate_cmd(inp, out, *extra, *(["--resume"] if journal.exists() else [])), cwd=ROOT,
                       check=True)
        check()
    return counts


def path_faults(inp: Path, work: Path, extra: list[str], reference: bytes, log=print) -> list[str]:
    """The output-path and journal-header faults, each once; returns what went wrong (empty: all held)."""
    import socket
    import stat

    bad = []

    def tool(out: Path, *more: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(translate_cmd(inp, out, *extra, *more), cwd=ROOT, capture_output=True, timeout=timeout)

    def expect(name: str, ok: bool) -> None:
        log(f"{name}: {'held' if ok else 'FAILED'}")
        if not ok:
            bad.append(name)

    fifo = work / "fifo"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(work / "sock"))
    try:
        for name, path in (("-o a FIFO", fifo), ("-o a socket", work / "sock")):
            rc = tool(path).returncode
            expect(name, rc == 2 and not stat.S_ISREG(os.stat(path).st_mode))
    finally:
        sock.close()
    before = inp.read_bytes()
    expect("-o the input", subprocess.run(translate_cmd(inp, inp, *extra), cwd=ROOT, capture_output=True)
           .returncode == 2 and inp.read_bytes() == before)
    out = work / "planted.txt"
    victim = work / "victim"
    victim.write_bytes(b"precious\n")
    for k in range(64):                                  # the old names for the next pids
        pid = os.getpid() + k
        for name in (f".{out.name}.{pid}.tmp", f".{out.name}.journal.{pid}.tmp", f".{out.name}.lock.pid.{pid}.tmp"):
            (work / name).symlink_to(victim)
    rc = tool(out).returncode
    expect("planted symlinks", rc == 0 and victim.read_bytes() == b"precious\n" and not out.is_symlink()
           and out.read_bytes() == reference)
    private = work / "private.txt"
    private.write_bytes(b"")
    private.chmod(0o600)
    expect("mode 600 kept", tool(private).returncode == 0 and stat.S_IMODE(private.stat().st_mode) == 0o600)
    fifo_out = work / "fifo_journal.txt"
    os.mkfifo(work / "fifo_journal.txt.journal")
    try:
        expect("a FIFO journal", tool(fifo_out, "--resume", timeout=120).returncode == 2)
    except subprocess.TimeoutExpired:
        expect("a FIFO journal (hung)", False)
    head = work / "head.txt"
    journal = head.with_name(head.name + ".journal")
    damaged = b'0badc0de {"journal": 1, "input_sha256": "x", "settings": {}}\n' + b'00000000 {"i": 0, "out": []}\n'
    journal.write_bytes(damaged)                         # a header whose checksum fails, and a record after it
    expect("a damaged header under --resume", tool(head, "--resume").returncode == 2
           and journal.read_bytes() == damaged and not head.exists())
    return bad


def random_delays(kills: int, span: float, rng: random.Random) -> list[float]:
    """The first kill inside the first second; then random moments up to `span` seconds into a run, two of
    them short (a run killed again right after the previous kill: twice in a row, early)."""
    delays = [rng.uniform(0.05, 1.0)] + [rng.uniform(0.3, span) for _ in range(kills - 1)]
    for k in rng.sample(range(1, kills), min(2, kills - 1)):
        delays[k] = rng.uniform(0.05, 1.0)
    return delays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs that must land (runs finishing first are "
                                                            "checked and do not count)")
    ap.add_argument("--lines", type=int, default=200, help="input lines (from the shipped held-out sample)")
    ap.add_argument("--span", type=float, default=None,
                    help="latest kill moment in seconds (default: 0.6x the uninterrupted run's time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where to write (default: a temporary folder)")
    ap.add_argument("--model", default=None, help="target model folder (default: the shipped ende pair)")
    ap.add_argument("--damage", action="store_true",
                    help="also damage a journal record after each kill, and run the output-path faults once each")
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.workdir or tempfile.mkdtemp(prefix="soak_translate_"))
    work.mkdir(parents=True, exist_ok=True)
    src = (ROOT / "models" / "ende" / "test_sample.en").read_bytes().split(b"\n")[: args.lines]
    inp = work / "in.txt"
    inp.write_bytes(b"\n".join(src) + b"\n")
    extra = ["--no_draft", "--max_decoding_length", "24", "--batch_size", "8"]
    if args.model:
        extra += ["--model", args.model]
    full = work / "full.txt"
    t0 = time.time()
    subprocess.run(translate_cmd(inp, full, *extra), cwd=ROOT, check=True)
    # a resumed run has less left to do than a fresh one: kills up to 0.6x the fresh run's time mostly land
    span = args.span or 0.6 * (time.time() - t0)
    print(f"uninterrupted run: {span:.1f}s for {len(src)} lines")
    rng = random.Random(args.seed)
    delays = random_delays(3 * args.kills, span, rng)      # runs that finish first do not count as kills
    counts = soak(inp, work / "out.txt", full.read_bytes(), extra, delays, want_kills=args.kills,
                  damage=random.Random(args.seed + 1) if args.damage else None)
    print(f"{counts['kills']} kills ({counts['damaged']} with a damaged record) over {counts['rounds']} finished "
          f"file(s); {counts['mismatches']} differ from the uninterrupted run ({work})")
    bad = path_faults(inp, work, extra, full.read_bytes()) if args.damage else []
    if bad:
        print(f"output-path faults that did not hold: {', '.join(bad)}")
    return 0 if counts["mismatches"] == 0 and counts["rounds"] and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
