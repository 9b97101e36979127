"""Layer streaming: offloaded == resident, the memory budget holds, and bad budgets/files fail clearly."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specbeam_edge import Engine, ModelFolderError, SpeculativeConfig

from helpers import assert_same_hypotheses, plain
from specbeam_edge.execution.model import OnnxCausalLM
from specbeam_edge.execution.offload import plan

PROMPT = [5, 17, 33, 8, 99, 41, 7]
PLACEMENTS = [["disk"] * 4, ["host"] * 4, ["resident", "disk", "host", "disk"], ["disk", "resident", "resident", "host"]]


@pytest.fixture(scope="module")
def split4(exported):
    return exported("llama", "fp32", "split", layers=4, std=0.3, seed=3)


def run_tree(lm):
    P = len(PROMPT)
    mask = np.tril(np.ones((P, P), bool))[None, None]
    a, past = lm.forward(np.array([PROMPT]), np.arange(P)[None], mask, lm.empty_past())
    tm = np.ones((1, 1, 3, P + 3), bool)
    tm[0, 0, 0, P + 1:] = False
    tm[0, 0, 1, P + 2] = False
    b, _ = lm.forward(np.array([[3, 4, 5]]), np.array([[P, P + 1, P + 2]]), tm, past)
    return a, b


@pytest.mark.parametrize("places", PLACEMENTS, ids=lambda p: "-".join(x[0] for x in p))
def test_offloaded_equals_resident(split4, places):
    ref = run_tree(OnnxCausalLM(split4))
    lm = OnnxCausalLM(split4, placement=places)
    for _ in range(2):                       # twice: buffers are reused across passes
        got = run_tree(lm)
        for x, y in zip(ref, got):
            np.testing.assert_array_equal(x, y)
    streamed = sum(p != "resident" for p in places)
    assert lm.runner.store.stats.bytes_moved == 4 * streamed * lm.runner.store.nbytes


def test_direct_and_buffered_disk_reads_agree(split4, monkeypatch):
    """Disk layers are read with O_DIRECT into page-aligned buffers where the file system allows it, and with
    buffered reads (page cache dropped) where it does not; both give the resident model's outputs."""
    ref = run_tree(OnnxCausalLM(split4))
    lm = OnnxCausalLM(split4, placement=["disk"] * 4)
    assert all(b.ctypes.data % 4096 == 0 and b.size % 4096 == 0 for b in lm.runner.store.buffers)
    for x, y in zip(ref, run_tree(lm)):
        np.testing.assert_array_equal(x, y)
    from specbeam_edge.execution.offload import LayerStore

    read_with = LayerStore._read_with

    def refuse_direct(self, i, buf, flags):                   # e.g. tmpfs refuses O_DIRECT
        if flags:
            raise OSError(22, "Invalid argument")
        return read_with(self, i, buf, flags)

    monkeypatch.setattr(LayerStore, "_read_with", refuse_direct)
    lm = OnnxCausalLM(split4, placement=["disk"] * 4)
    for x, y in zip(ref, run_tree(lm)):
        np.testing.assert_array_equal(x, y)
    assert lm.runner.store.direct is False


def test_offloaded_generation_identical(split4):
    ref = Engine(split4, draft=split4)
    off = Engine(split4, draft=split4, placement=["disk", "host", "disk", "resident"])
    spec = SpeculativeConfig(adaptive=False, budget=24, max_depth=4)
    for K in (1, 4):
        a = ref.generate(PROMPT, num_beams=K, max_new_tokens=12, speculative=spec)[0]
        b = off.generate(PROMPT, num_beams=K, max_new_tokens=12, speculative=spec)[0]
        assert a.hypotheses[0].tokens == b.hypotheses[0].tokens and a.hypotheses[0].score == b.hypotheses[0].score
        assert b.stats.offload["bytes_moved_per_pass"] == 3 * off.target.runner.store.nbytes


def test_planner_and_bad_budgets(split4):
    p = plan(8, 100, 50, max_memory=50 + 200 + 300)
    assert p.places == ("resident",) * 3 + ("disk",) * 5
    assert plan(8, 100, 50, max_memory=None).places == ("resident",) * 8
    assert plan(8, 100, 50, max_memory=400, host_memory=200).places == ("resident",) + ("host",) * 2 + ("disk",) * 5
    with pytest.raises(ValueError, match="resident minimum"):
        OnnxCausalLM(split4, max_memory=1000)



def test_streaming_needs_split_layout(exported):
    with pytest.raises(ModelFolderError, match="split layout"):
        OnnxCausalLM(exported("llama"), max_memory=10**9)


def test_truncated_or_missing_weight_file(split4, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(split4, bad)
    f = bad / "weights" / "layer_2.bin"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ModelFolderError, match="layer_2.bin: truncated"):
        OnnxCausalLM(bad, placement=["disk"] * 4)
    f.unlink()
    with pytest.raises(ModelFolderError, match="layer_2.bin"):
        OnnxCausalLM(bad, placement=["disk"] * 4)


RSS_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, {root!r})
from specbeam_edge.execution.model import OnnxCausalLM
lm = OnnxCausalLM({folder!r}, max_memory={budget})
P = 16
mask = np.tril(np.ones((P, P), bool))[None, None]
for _ in range(3):
    lm.forward(np.arange(1, P + 1)[None], np.arange(P)[None], mask, lm.empty_past())
# VmHWM, not ru_maxrss: the latter survives exec and would report the parent's (pytest + torch) peak
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({{"rss_mb": hwm / 1024,
                  "places": list(lm.runner.placement.places), "layer_mb": lm.runner.store.nbytes / 2**20}}))
"""


@pytest.mark.slow
def test_memory_budget_holds(hf_models, tmp_path):
    """A budget of 3 resident layers + 2 streaming buffers out of 10 layers: the weights' share of peak RSS
    (peak minus the all-resident peak less all 10 layers) stays within that budget + 12 MiB."""
    from export import export

    src, _ = hf_models("llama", layers=10, hidden=512, heads=8, kv_heads=4)
    folder = export(src, tmp_path / "big", layout="split", quiet=True)
    root = str(Path(__file__).resolve().parents[1])

    def measure(budget):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT.format(root=root, folder=str(folder), budget=budget)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    full = measure(None)
    layer = full["layer_mb"] * 2**20
    # the head graph and its tensors (head.onnx.data); the embedding table is read by row, outside the budget
    fixed = sum(p.stat().st_size for p in folder.glob("head.onnx*"))
    budgeted = measure(int(fixed + 2 * layer + 3 * layer))
    assert budgeted["places"].count("resident") == 3
    saved = full["rss_mb"] - budgeted["rss_mb"]
    assert saved >= (10 - 3 - 2) * full["layer_mb"] - 12, (full, budgeted)


def test_embedding_table_is_read_by_row_and_checked(split4, tmp_path):
    """The split layout's embedding is a table read a row at a time from weights/embed.bin (no graph holding it
    whole, no mapping whose touched pages stay in the process): a pass reads only its rows, the same rows as the
    file's; a truncated table or an id outside it fails by name instead of giving wrong text."""
    import shutil
    cfg = json.loads((split4 / "specbeam_config.json").read_text())
    assert "embed" not in cfg["files"] and not (split4 / "embed.onnx").exists()
    lm = OnnxCausalLM(split4)
    t = cfg["files"]["embed_table"]
    whole = np.fromfile(split4 / t["file"], dtype=t["dtype"]).reshape(t["shape"])
    ids = np.array([[5, 3, 5, 0], [cfg["vocab_size"] - 1, 3, 2, 2]])
    np.testing.assert_array_equal(lm.runner._embed(ids), whole[ids].astype(np.float32))
    assert str((split4 / t["file"]).resolve()) not in open("/proc/self/maps").read()     # nothing mapped
    with pytest.raises(ValueError, match="out of range"):
        lm.runner._embed(np.array([[cfg["vocab_size"]]]))
    with pytest.raises(ValueError, match="out of range"):
        lm.runner._embed(np.array([[-1]]))         # numpy would wrap a negative index to the last row
    bad = tmp_path / "bad"
    shutil.copytree(split4, bad)
    table = bad / cfg["files"]["embed_table"]["file"]
    table.write_bytes(table.read_bytes()[:-4])
    with pytest.raises(ModelFolderError, match="embed.bin: .*bytes, the embedding table needs"):
        OnnxCausalLM(bad)


def test_a_budget_keeps_no_arena_and_stays_exact(split4):
    """Under a budget (layers stream) the target's sessions and its draft's run without onnxruntime's arena (the
    memory of their largest run goes back instead of staying as RSS no budget counts); a model held wholly in
    memory keeps it; the logits are the same either way."""
    arena = lambda sess: sess.get_session_options().enable_cpu_mem_arena
    ids, pos, mask = np.array([[3, 7, 1]]), np.arange(3)[None], np.tril(np.ones((3, 3), bool))[None, None]
    whole = OnnxCausalLM(split4)
    streamed = OnnxCausalLM(split4, placement=["disk", "resident", "resident", "resident"])
    assert arena(whole.runner.head) and arena(whole.runner.layer)
    assert not arena(streamed.runner.head) and not arena(streamed.runner.layer)
    np.testing.assert_array_equal(whole.forward(ids, pos, mask, whole.empty_past(1))[0],
                                  streamed.forward(ids, pos, mask, streamed.empty_past(1))[0])
    assert arena(Engine(split4, draft=split4).draft.runner.head)
    assert not arena(Engine(split4, draft=split4, placement=["disk"] + ["resident"] * 3).draft.runner.head)


def test_streamed_target_grows_the_streamed_tree_and_stays_exact(split4):
    """A target that streams layers, with a draft and every tree knob at its default, runs config.STREAMED_TREE
    (best-first, deeper, with a path-probability floor); its output is plain search's, K=1 and K=4."""
    from dataclasses import replace
    from specbeam_edge.config import STREAMED_BEAM_TREE, STREAMED_TREE
    resident_alone = Engine(split4)
    off = Engine(split4, draft=split4, placement=["disk", "host", "disk", "resident"])
    default = SpeculativeConfig(adaptive=False)
    chosen = off.speculative_for(default)
    assert (chosen.drafter, chosen.budget, chosen.max_depth, chosen.min_path_prob) == tuple(
        STREAMED_TREE[k] for k in ("drafter", "budget", "max_depth", "min_path_prob"))
    assert chosen.min_path_prob > 0          # K=1 grows deep only where the draft is sure
    assert chosen.adaptive is False
    # beam search gets the shallower, wider streamed tree (a pass keeps 3-4 of its levels)
    beams = off.speculative_for(default, num_beams=4)
    assert (beams.max_depth, beams.max_branch_width, beams.budget) == (
        STREAMED_BEAM_TREE["max_depth"], STREAMED_BEAM_TREE["max_branch_width"], "auto") != \
        (STREAMED_TREE["max_depth"], STREAMED_TREE["max_branch_width"], STREAMED_TREE["budget"])
    assert beams.min_path_prob == 0
    mine = replace(default, budget=7)                        # a knob the user set is kept as given
    assert off.speculative_for(mine) == mine
    resident = Engine(split4, draft=split4)
    assert resident.speculative_for(default) == default      # resident passes keep the usual tree
    for K in (1, 4):
        [a] = plain(resident_alone, PROMPT, num_beams=K, max_new_tokens=12)
        b = off.generate(PROMPT, num_beams=K, max_new_tokens=12, speculative=default)[0]
        # tokens exactly; scores to fp32 rounding (a one-row fp32 pass may take another kernel path than a tree's
        # rows, as in test_speculative)
        assert_same_hypotheses(a, b)
        assert b.stats.target_passes < a.stats.target_passes       # the draft is the target: it all matches


def test_streamed_cost_curve_is_the_disk_until_compute_outgrows_it(split4, monkeypatch):
    """The modelled streamed pass: max(reading the streamed layers, computing every layer) + the head; measured
    parts, no pass over every tree size."""
    from specbeam_edge.decoding.adaptive import streamed_cost_curve
    lm = OnnxCausalLM(split4, placement=["disk", "host", "disk", "resident"])
    assert lm.streamed_layers() == 3 and lm.runner.store.read_seconds() > 0
    monkeypatch.setattr(lm.runner.store, "read_seconds", lambda: 1.0)             # a slow disk: 3 s a pass
    monkeypatch.setattr(lm, "part_seconds", lambda q, past, reps: (0.01 * q, 0.5))
    curve = streamed_cost_curve(lm, sizes=(1, 16, 64, 128))
    assert curve == pytest.approx({1: 3.5, 16: 3.5, 64: 3.5, 128: 4 * 1.28 + 0.5})
    # the real measurement: `reps` passes of a decoder layer, then of the head, over q rows each, the fastest of
    # each kept (a clock that says how long each pass took)
    import time

    import onnxruntime as ort

    from specbeam_edge.contract import HIDDEN, LAYER_HIDDEN_OUT
    monkeypatch.undo()
    ticks, passes = [0.0, 3.0, 10.0, 11.0, 20.0, 22.0, 30.0, 34.0], []      # layer: 3 s, 1 s; head: 2 s, 4 s
    real_run = ort.InferenceSession.run

    def run(sess, names, feed, *a, **kw):
        passes.append((list(names) == [LAYER_HIDDEN_OUT], feed[HIDDEN].shape))
        return real_run(sess, names, feed, *a, **kw)
    monkeypatch.setattr(ort.InferenceSession, "run", run)
    monkeypatch.setattr(time, "perf_counter", lambda: ticks.pop(0))
    assert OnnxCausalLM.part_seconds(lm, 4, reps=2) == (1.0, 2.0)
    monkeypatch.undo()
    H = lm.cfg.hidden_size
    assert passes == [(True, (1, 4, H))] * 2 + [(False, (1, 4, H))] * 2 and ticks == []
    assert OnnxCausalLM(split4).streamed_layers() == 0


def test_generate_and_chat_say_when_layers_stream(split4, capsys, monkeypatch):
    """Issue 46 item 4: a streamed target's first token can take seconds; `specbeam generate` and `specbeam chat`
    say so on stderr before it (not with -q, not when every layer is resident). Before: nothing was said."""
    import io

    from specbeam_edge.commands import cli

    place = OnnxCausalLM(split4).runner.placement
    budget = place.resident_minimum + 3 * place.layer_bytes        # 1 of 4 layers resident
    flags = ["--model", str(split4), "--max_new_tokens", "3", "--num_beams", "1"]
    line = (f"specbeam: 3 of 4 layers stream from disk each pass (budget {budget / 2**20:.2g} MB for the target's "
            f"weights; the KV cache and the runtime come on top); the first answer token can take a few seconds")
    assert cli.main(["generate", "hello", *flags, "--max_memory", f"{budget}B"]) == 0
    assert line in capsys.readouterr().err.splitlines()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n\n")))
    assert cli.main(["chat", *flags, "--max_memory", f"{budget}B"]) == 0
    err = capsys.readouterr().err
    assert line in err.splitlines() and err.index(line) < err.index(">>> ")     # before the first answer
    assert cli.main(["generate", "hello", *flags, "--max_memory", f"{budget}B", "-q"]) == 0
    assert "stream" not in capsys.readouterr().err
    assert cli.main(["generate", "hello", *flags]) == 0                            # all resident
    assert "stream" not in capsys.readouterr().err


def test_head_runs_only_on_the_rows_a_caller_reads(split4):
    """A prompt's rows before its last are read by nobody: the split layout's head skips them (a 300-token
    prompt cost 300 rows of logits over the vocabulary, time and a peak of memory), the other rows unchanged."""
    lm = OnnxCausalLM(split4)
    P = len(PROMPT)
    mask = np.tril(np.ones((P, P), bool))[None, None]
    full, _ = lm.forward(np.array([PROMPT]), np.arange(P)[None], mask, lm.empty_past())
    cut, _ = lm.forward(np.array([PROMPT]), np.arange(P)[None], mask, lm.empty_past(), head_from=P - 2)
    np.testing.assert_array_equal(cut[:, P - 2:], full[:, P - 2:])
    assert not cut[:, :P - 2].any()


def test_searches_ask_for_the_rows_they_read(split4, monkeypatch):
    """The prompt pass of exact search and of sampling asks for rows from the prompt's last token on, and the
    output stays that of the whole head (speculative == plain suites cover the rest)."""
    asked = []
    run = OnnxCausalLM.run

    def spy(self, p):
        asked.append((p.ids.shape[1], p.head_from))
        return run(self, p)
    engine = Engine(split4)
    ref = engine.generate(PROMPT, num_beams=2, max_new_tokens=4)[0]
    monkeypatch.setattr(OnnxCausalLM, "run", spy)
    for sample in (False, True):
        asked.clear()
        got = engine.generate(PROMPT, num_beams=2, max_new_tokens=4, do_sample=sample, seed=1)[0]
        assert asked[0] == (len(PROMPT), len(PROMPT) - 1) and all(h == 0 for _, h in asked[1:])
        if not sample:
            assert got.hypotheses[0].tokens == ref.hypotheses[0].tokens
            assert got.hypotheses[0].score == ref.hypotheses[0].score


def _without_resident_graph(folder, dst):
    """A copy of the split export `folder` as exports before export/resident.py were: no files.layer_resident."""
    import shutil

    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "specbeam_config.json").read_text())
    entry = cfg["files"].pop("layer_resident")
    (dst / entry["graph"]).unlink()
    (dst / entry["tables"]).unlink()
    (dst / "specbeam_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8w", "int8"])
def test_resident_layers_run_their_own_sessions_bit_for_bit(exported, tmp_path, precision):
    """A resident layer runs a session of its own with its weights as initializers (files.layer_resident,
    export/resident.py): the same outputs, bit for bit, as the one layer graph fed its weights, which an export
    without the graph still uses; the store keeps no copy of the weights onnxruntime holds. fp16 and int8w keep
    feeding them (as constants onnxruntime widens them to fp32: more memory than the plan gave them)."""
    folder = exported("llama", precision, "split", layers=4, std=0.3, seed=3)
    old = _without_resident_graph(folder, tmp_path / "old")
    new_lm, old_lm = OnnxCausalLM(folder), OnnxCausalLM(old)
    if precision in ("fp16", "int8w"):      # widened to fp32 at load as constants: they stay fed
        assert new_lm.runner.layer_sessions == {} and len(new_lm.runner.store.resident) == 4
        return
    assert sorted(new_lm.runner.layer_sessions) == [0, 1, 2, 3] and not new_lm.runner.store.resident
    assert old_lm.runner.layer_sessions == {} and len(old_lm.runner.store.resident) == 4
    for x, y in zip(run_tree(old_lm), run_tree(new_lm)):
        np.testing.assert_array_equal(x, y)
    # under a budget or a placement every layer stays fed (a session holds its layer in more than the plan counts)
    mixed = OnnxCausalLM(folder, placement=["resident", "disk", "resident", "host"])
    assert mixed.runner.layer_sessions == {} and sorted(mixed.runner.store.resident) == [0, 2]


def test_resident_graph_added_to_an_older_export(exported, tmp_path):
    """python -m export.resident FOLDER gives an export made before the resident graph existed its sessions; a
    config naming a missing graph file fails by name."""
    from export import resident

    folder = _without_resident_graph(exported("llama", "int8", "split", layers=4, std=0.3, seed=3), tmp_path / "f")
    before = run_tree(OnnxCausalLM(folder))
    assert resident.main([str(folder)]) == 0
    lm = OnnxCausalLM(folder)
    assert len(lm.runner.layer_sessions) == 4
    for x, y in zip(before, run_tree(lm)):
        np.testing.assert_array_equal(x, y)
    (folder / "layer_resident.onnx").unlink()
    with pytest.raises(ModelFolderError, match="layer_resident.onnx"):
        OnnxCausalLM(folder)


def test_a_folder_names_its_own_tree_for_a_resident_target(pair, tmp_path):
    """A model folder's `speculative` (written by fetch for a pair whose tree was measured) is the tree a request
    with default tree knobs gets when the target is resident; a knob the caller sets wins; output = plain."""
    import shutil

    target, draft = pair
    folder = tmp_path / "t"
    shutil.copytree(target, folder)
    cfg = json.loads((folder / "specbeam_config.json").read_text())
    cfg["speculative"] = {"drafter": "best_first", "budget": 6, "max_depth": 6, "max_branch_width": 1}
    (folder / "specbeam_config.json").write_text(json.dumps(cfg))
    engine = Engine(folder, draft=draft)
    got = engine.speculative_for(SpeculativeConfig())
    assert (got.drafter, got.budget, got.max_depth, got.max_branch_width, got.adaptive) == ("best_first", 6, 6, 1,
                                                                                              True)
    assert engine.speculative_for(SpeculativeConfig(adaptive=False)).adaptive is False
    assert engine.speculative_for(SpeculativeConfig(budget=24)).budget == 24         # the caller's knob
    assert Engine(target, draft=draft).speculative_for(SpeculativeConfig()) == SpeculativeConfig()
    [ref] = plain(engine, PROMPT, num_beams=1, max_new_tokens=10)
    spec = engine.generate(PROMPT, num_beams=1, max_new_tokens=10, speculative=SpeculativeConfig(adaptive=False))[0]
    assert spec.hypotheses[0].tokens == ref.hypotheses[0].tokens
    assert spec.stats.draft_tokens_proposed > 0
