"""specbeam-translate --engine ray on a local 2-CPU Ray cluster started here: byte-identical to the single-process
tool over 8 shards; a worker killed mid-run is restarted and its shard retried; a driver killed mid-run resumes
with only the unfinished shards."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from apps.translate.__main__ import main
from apps.translate.ray_plan import Shard, input_files, plan
from helpers import corpus

ROOT = Path(__file__).resolve().parents[1]
N_LINES, SHARD_LINES = 500, 63          # 8 shards, the last one shorter



def test_plan_cuts_files_into_shards_in_input_order():
    assert plan([5, 0, 3], 2) == [Shard(0, 0, 0, 2), Shard(1, 0, 2, 2), Shard(2, 0, 4, 1), Shard(3, 2, 0, 2),
                                  Shard(4, 2, 2, 1)]
    assert Shard(7, 0, 0, 1).part == "part-000007"


def test_inputs_file_folder_and_glob(tmp_path, monkeypatch):
    from apps.translate.files import UsageError

    (tmp_path / "docs" / "sub").mkdir(parents=True)
    for name in ("docs/b.txt", "docs/a.txt", "docs/sub/c.txt", "docs/.hidden", "docs/sub/d.md"):
        (tmp_path / name).write_text("x\n")
    assert input_files(str(tmp_path / "docs" / "a.txt")) == ([(tmp_path / "docs" / "a.txt", "a.txt")], False)
    files, folder = input_files(str(tmp_path / "docs"))
    assert folder and [n for _, n in files] == ["a.txt", "b.txt", "sub/c.txt", "sub/d.md"]
    monkeypatch.chdir(tmp_path)
    files, folder = input_files("docs/**/*.txt")
    assert folder and [n for _, n in files] == ["a.txt", "b.txt", "sub/c.txt"]
    with pytest.raises(UsageError, match=r"no input file matches docs/\*\.de"):
        input_files("docs/*.de")
    with pytest.raises(UsageError, match="input nope.txt does not exist; pass a file, a folder or a glob"):
        input_files("nope.txt")


def test_ray_is_imported_only_by_the_ray_engine_when_it_runs():
    code = ("import sys, specbeam_edge, specbeam_edge.generate, apps.translate.__main__ as m; m.build_parser(); "
            "print(sorted(k for k in sys.modules if k == 'ray' or k.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- on a local Ray cluster --------------------------------------------------------------------------------------
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """A 2-CPU local cluster shared by the tests below; in-process runs join it, subprocesses get its address."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()



@pytest.fixture(scope="module")
def job(pair, tmp_path_factory):
    """The input and the single-process tool's output on it (the reference every Ray run must equal)."""
    d = tmp_path_factory.mktemp("ray")
    lines = corpus(N_LINES, seed=5)
    raw = [line.encode() for line in lines]
    raw[70] = b"broken \xff line"              # invalid UTF-8: a bad line inside shard 1
    raw[80] = " ".join(["fox"] * 120).encode()  # over --max_input_length: truncated, as on the local engine
    inp = d / "in.txt"
    inp.write_bytes(b"\n".join(raw) + b"\n")
    ref = d / "ref.txt"
    assert main(["-i", str(inp), "-o", str(ref), *flags(pair), "-q"]) == 0
    return inp, ref


def flags(pair):
    return ["--model", pair[0], "--draft", pair[1], "--max_decoding_length", "6", "--batch_size", "16",
            "--max_input_length", "100", "--on_error", "copy"]


def ray_args(pair, inp, out, *extra):
    """Without -q: the summary (shards, actors, retries) is part of what the tests check."""
    return ["--engine", "ray", "-i", str(inp), "-o", str(out), "--shard_lines", str(SHARD_LINES), "--actors", "2",
            *flags(pair), *extra]


def records(manifest: Path) -> int:
    """Committed shards in a manifest (its lines after the header)."""
    return max(0, manifest.read_bytes().count(b"\n") - 1) if manifest.exists() else 0


def wait_for(manifest: Path, n: int, timeout=120):
    deadline = time.time() + timeout
    while records(manifest) < n:
        assert time.time() < deadline, f"no {n} committed shard(s) in {timeout} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_ray_output_is_byte_identical_to_single_process(cluster, pair, job, tmp_path, capsys):
    inp, ref = job
    out = tmp_path / "out.txt"
    assert main(ray_args(pair, inp, out)) == 0
    assert out.read_bytes() == ref.read_bytes()
    err = capsys.readouterr().err
    assert "line 71: invalid UTF-8" in err
    assert "line 81: 121 tokens, truncated to the first 100 (--max_input_length)" in err
    assert not (tmp_path / "out.txt.shards").exists()
    # every input line counted, as the local engine counts them (it once said 196 where Ray said 200)
    assert f"specbeam-translate: {N_LINES} lines, " in err
    # --resume on the finished output: nothing to do, said once, the output untouched
    assert main(ray_args(pair, inp, out, "--resume")) == 0
    assert capsys.readouterr().err == (f"specbeam-translate: {out} is complete (its run finished, with these "
                                       f"settings); nothing to do\n")
    assert out.read_bytes() == ref.read_bytes()
    # ... and with another setting it is refused, naming it (before: exit 0, taken as done)
    assert main(ray_args(pair, inp, out, "--resume", "--beam_size", "3")) == 2
    assert "was finished with other settings (beam_size: 4 in the finished run, 3 now)" in capsys.readouterr().err
    # A folder of files: one output per input at the same relative path, each equal to the single file run.
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    raw = inp.read_bytes().split(b"\n")
    (tmp_path / "docs" / "a.txt").write_bytes(b"\n".join(raw[:90]) + b"\n")
    (tmp_path / "docs" / "sub" / "b.txt").write_bytes(b"\n".join(raw[90:130]) + b"\n")
    want = ref.read_bytes().split(b"\n")
    assert main(ray_args(pair, tmp_path / "docs", tmp_path / "outdir")) == 0
    assert (tmp_path / "outdir" / "a.txt").read_bytes() == b"\n".join(want[:90]) + b"\n"
    assert (tmp_path / "outdir" / "sub" / "b.txt").read_bytes() == b"\n".join(want[90:130]) + b"\n"
    assert "a.txt: line 71: invalid UTF-8" in capsys.readouterr().err
    # --on_error fail: the shard holding the bad line stops the run; the shards done before it stay committed.
    assert main(ray_args(pair, inp, tmp_path / "fail.txt", "--on_error", "fail")) == 1
    assert "stopping (--on_error fail); finished shards are kept" in capsys.readouterr().err
    assert not (tmp_path / "fail.txt").exists()


def worker_pids() -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][0].startswith("ray::ShardWorker")]


@pytest.mark.slow
def test_worker_killed_mid_run_is_retried(cluster, pair, job, tmp_path, capsys):
    inp, ref = job
    out = tmp_path / "out.txt"
    killed = []

    def kill_one():
        wait_for(tmp_path / "out.txt.shards" / "manifest", 1)
        pid = worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    assert main(ray_args(pair, inp, out, "--shard_retries", "1")) == 0
    killer.join()
    assert killed and out.read_bytes() == ref.read_bytes()
    err = capsys.readouterr().err
    assert "(in.txt lines " in err and "failed (Actor" in err and "retrying it (1 of 2 tries used)" in err, err
    assert "8 shard(s) on 2 actor(s), 1 retried" in err


@pytest.mark.slow
def test_driver_killed_then_resume_redoes_only_unfinished_shards(cluster, pair, job, tmp_path, capsys):
    inp, ref = job
    out = tmp_path / "out.txt"
    manifest = tmp_path / "out.txt.shards" / "manifest"
    driver = subprocess.Popen([sys.executable, "-m", "apps.translate", *ray_args(pair, inp, out),
                               "--ray_address", cluster], cwd=ROOT)
    wait_for(manifest, 2)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    done = records(manifest)
    assert 2 <= done < 8 and not out.exists()
    assert main(ray_args(pair, inp, out)) == 2          # without --resume: refused, nothing lost
    assert f"holds {done} finished shard(s) of an interrupted run; pass --resume" in capsys.readouterr().err
    assert main(ray_args(pair, inp, out, "--resume", "--shard_lines", "50")) == 2     # another shard plan
    assert "was written with other settings (shard_lines: 63 in the journal, 50 now)" in capsys.readouterr().err
    assert main(ray_args(pair, inp, out, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"resuming, {done} of 8 shards already done" in err
    assert f"{8 - done} shard(s) on {min(2, 8 - done)} actor(s), 0 retried" in err
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.slow
def test_actor_no_node_can_hold_is_refused_up_front(cluster, pair, job, tmp_path, capsys):
    """Before: --cpus_per_actor 64 on a 2-CPU cluster waited for ever with no message."""
    inp, _ = job
    assert main(ray_args(pair, inp, tmp_path / "out.txt", "--cpus_per_actor", "64")) == 2
    assert ("error: --cpus_per_actor 64: no node of the Ray cluster has that many CPUs (the largest has 2); pass "
            "at most 2\n") in capsys.readouterr().err


@pytest.mark.slow
def test_more_actors_than_the_cluster_holds_start_as_many_as_fit(cluster, pair, job, tmp_path, capsys):
    """Before: --actors 4 on a 2-CPU cluster waited for ever (two actors could never start)."""
    inp, ref = job
    argv = ray_args(pair, inp, tmp_path / "out.txt")
    argv[argv.index("--actors") + 1] = "4"
    assert main(argv) == 0
    assert (tmp_path / "out.txt").read_bytes() == ref.read_bytes()
    err = capsys.readouterr().err
    assert "--actors 4: the cluster holds 2 actor(s) of 1 CPU(s) at once; starting 2" in err and "on 2 actor(s)" in err


@pytest.mark.slow
def test_sigterm_to_the_driver_is_one_line_and_resume_finishes(cluster, pair, job, tmp_path, capsys):
    """Before: SIGTERM went to the handler ray.init installs (sys.exit(15)): a native stack, exit 15."""
    inp, ref = job
    out = tmp_path / "out.txt"
    manifest = tmp_path / "out.txt.shards" / "manifest"
    driver = subprocess.Popen([sys.executable, "-m", "apps.translate", *ray_args(pair, inp, out), "-q",
                               "--ray_address", cluster], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    wait_for(manifest, 1)
    driver.send_signal(signal.SIGTERM)
    err = driver.communicate(timeout=120)[1]
    assert driver.returncode == 143, err
    assert err.endswith("specbeam-translate: terminated; finished lines are kept: rerun with --resume to "
                        "continue\n"), err
    assert "Traceback" not in err and "Stack" not in err
    assert main(ray_args(pair, inp, out, "--resume")) == 0
    assert out.read_bytes() == ref.read_bytes()


@pytest.mark.slow
def test_output_inside_the_input_folder_resumes_and_is_never_read_again(cluster, pair, job, tmp_path, capsys):
    """Before: with -o inside the input folder, a killed driver's --resume was refused ("input changed": the
    shards and the lock were read as input), and a second run translated the first run's output again."""
    inp, ref = job
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "in.txt").write_bytes(inp.read_bytes())
    out = docs / "out"
    manifest = docs / "out.shards" / "manifest"
    driver = subprocess.Popen([sys.executable, "-m", "apps.translate", *ray_args(pair, docs, out), "-q",
                               "--ray_address", cluster], cwd=ROOT)
    wait_for(manifest, 1)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    capsys.readouterr()
    assert main(ray_args(pair, docs, out, "--resume")) == 0
    assert "resuming, " in capsys.readouterr().err
    assert sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*")) == ["in.txt", "out", "out/in.txt"]
    assert (out / "in.txt").read_bytes() == ref.read_bytes()
    assert main(ray_args(pair, docs, out)) == 0                     # again: in.txt only, 8 shards as before
    assert "8 shard(s) on 2 actor(s)" in capsys.readouterr().err
    assert (out / "in.txt").read_bytes() == ref.read_bytes()
