"""share_threads: every session of a process on one onnxruntime thread pool gives the same answers as a pool per
session (the tests' own process keeps a pool per session: conftest), for plain and speculative search over a
split layout whose resident layers run sessions of their own, and over a whole one."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specbeam_edge import Engine, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[3, 17, 33, 8, 99, 41, 7], [250, 12, 9, 77]]
SPEC = SpeculativeConfig(drafter="best_first", budget=12, max_depth=4, adaptive=False)

RUN = """
import json, sys
from specbeam_edge import share_threads
from specbeam_edge.execution.sessions import threads_shared
assert share_threads(2) and threads_shared()
from test_threads import answers
eng, out = answers(sys.argv[1], sys.argv[2])
print(json.dumps({"out": out, "layer_sessions": len(getattr(eng.target.runner, "layer_sessions", {}))}))
"""


def answers(target, draft) -> tuple[Engine, list]:
    """The engine and its hypotheses (tokens, score) for plain and speculative search, K = 1 and 3."""
    eng = Engine(target, draft=draft, threads=2)
    out = []
    for K in (1, 3):
        for s in (None, SPEC):
            for p in PROMPTS:
                [r] = eng.generate(p, num_beams=K, max_new_tokens=12, num_return_sequences=K, speculative=s)
                out.append([[list(h.tokens), h.score] for h in r.hypotheses])
    return eng, out


@pytest.mark.parametrize("layout", ["split", "whole"])
def test_a_shared_pool_answers_as_a_pool_per_session(exported, layout):
    target = str(exported("llama", "int8", layout, std=0.3, seed=3, layers=3))
    draft = str(exported("llama", std=0.3, seed=11, layers=1))
    env = {**os.environ, "SPECBEAM_SHARED_POOL": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    p = subprocess.run([sys.executable, "-c", RUN, target, draft],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    shared = json.loads(p.stdout.strip().splitlines()[-1])
    if layout == "split":
        assert shared["layer_sessions"] == 3          # the resident layers' own sessions ran on the shared pool
    assert shared["out"] == json.loads(json.dumps(answers(target, draft)[1]))


POOL = """
import sys
from specbeam_edge import Engine
from specbeam_edge.execution.sessions import threads_shared
Engine(sys.argv[1]) if sys.argv[2] == "default" else Engine(sys.argv[1], shared_pool=False)
print(threads_shared())
"""


@pytest.mark.parametrize("how", ["default", "shared_pool=False"])
def test_an_engine_shares_one_pool_by_default_as_the_tools_do(exported, how):
    """The library runs on the tools' thread setup unless told not to (its own pools were slower)."""
    target = str(exported("llama", std=0.3, seed=3))
    env = {k: v for k, v in os.environ.items() if k != "SPECBEAM_SHARED_POOL"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-c", POOL, target, how], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-1] == str(how == "default")
