"""The laptop families (Qwen3, Llama 3.2, SmolLM2/3, Phi-3/4-mini, Gemma 2/3): export parity with PyTorch on
a prefill, a branching tree step and a step after compaction (windows shorter than the prompt), and plain beam
search == transformers `generate(num_beams=K)`."""
import json

import numpy as np
import pytest

from export import export
from family_models import FAMILIES, make_family_model
from helpers import torch_path_logits
from specbeam_edge import Engine
from specbeam_edge.model import OnnxCausalLM

PROMPT = [5, 17, 33, 8, 99, 41, 7, 250, 61]            # longer than every test window (4, 5)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 5]                 # parents index into this list (-1: the prompt's last token)
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17]
KEEP = 6                                               # compaction keeps the path prompt -> 11 -> 13 -> 16 -> 17
TOL = {"fp32": 1e-5, "fp16": 2e-3}


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """family(name, precision, layout, **model_kwargs) -> (specbeam folder, torch model), cached."""
    base = tmp_path_factory.mktemp("families")
    cache = {}

    def get(name, precision="fp32", layout="whole", **kw):
        mkey = (name, tuple(sorted(kw.items())))
        if mkey not in cache:
            src = base / f"hf_{name}_{len(cache)}"
            cache[mkey] = (src, make_family_model(src, name, **kw))
        src, model = cache[mkey]
        key = (mkey, precision, layout)
        if key not in cache:
            cache[key] = export(src, base / f"sb_{name}_{precision}_{layout}_{len(cache)}", precision=precision,
                                layout=layout, quiet=True)
        return cache[key], model
    return get


class Driver:
    """Feeds the graph by hand: a flat cache of (token, position) columns, tree masks over it, compaction by
    gathering the kept columns; key_position_ids when the graph declares it."""

    def __init__(self, folder):
        self.lm = OnnxCausalLM(folder)
        self.past = self.lm.empty_past()
        self.pos = np.zeros(0, np.int64)
        self.paths = []                              # token path of every cached column

    def step(self, parents, tokens):
        """Score new nodes; parents[j] = column index in the cache (or -(k+1) for new node k)."""
        n_past, n = len(self.pos), len(tokens)
        mask = np.zeros((n, n_past + n), bool)
        new_paths, pos = [], []
        for j, (p, t) in enumerate(zip(parents, tokens)):
            if p is None:
                anc, path, depth = [], [], 0
            elif p >= 0:
                anc, path, depth = self._ancestors(p), self.paths[p], self.pos[p] + 1
            else:
                k = -p - 1
                anc, path, depth = list(np.flatnonzero(mask[k])), new_paths[k], pos[k] + 1
            mask[j, anc] = True
            mask[j, n_past + j] = True
            new_paths.append(path + [t])
            pos.append(depth)
        pos = np.array(pos, np.int64)
        kw = {}
        if getattr(self.lm, "needs_key_positions", False):
            kw["key_positions"] = np.concatenate([self.pos, pos])[None]
        logits, self.past = self.lm.forward(np.array([tokens]), pos[None], mask[None, None], self.past, **kw)
        self.pos = np.concatenate([self.pos, pos])
        self.paths += new_paths
        return logits[0], new_paths

    def _ancestors(self, col):
        path = self.paths[col]
        return [c for c in range(len(self.paths)) if self.paths[c] == path[:len(self.paths[c])]]

    def compact(self, keep_cols):
        idx = np.array(keep_cols)
        self.past = [(k[:, :, idx], v[:, :, idx]) for k, v in self.past]
        self.pos = self.pos[idx]
        self.paths = [self.paths[c] for c in keep_cols]


def scenario(folder):
    d = Driver(folder)
    out = [d.step([None] + [-(k + 1) for k in range(len(PROMPT) - 1)], PROMPT)]
    last = len(PROMPT) - 1
    out.append(d.step([last if p < 0 else -(p + 1) for p in TREE_PARENTS], TREE_TOKENS))
    keep_path = d.paths[len(PROMPT) + KEEP]
    d.compact([c for c, p in enumerate(d.paths) if p == keep_path[:len(p)]])
    tip = len(d.paths) - 1
    out.append(d.step([tip, tip, -1], [40, 41, 42]))
    return out


def incremental_logits(model, paths, prompt_len):
    """Like transformers' generate: the prompt in one forward, then one token per forward on the cache. LongRoPE
    picks its factors per forward, so a path past original_max_position_embeddings run from scratch differs."""
    import torch

    out = []
    with torch.no_grad():
        for p in paths:
            r = model(input_ids=torch.tensor([p[:prompt_len]]), use_cache=True)
            for t in p[prompt_len:]:
                r = model(input_ids=torch.tensor([[t]]), past_key_values=r.past_key_values, use_cache=True)
            out.append(r.logits[0, -1].float().numpy())
    return np.stack(out)


def _check(folder, model, tol):
    for ours, paths in scenario(folder):
        if getattr(model.config, "rope_parameters", {}).get("rope_type") == "longrope":
            ref = incremental_logits(model, paths, min(len(PROMPT), len(paths[-1])))
        else:
            ref = torch_path_logits(model, paths)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < tol, err


@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_parity_fp32(name, family):
    _check(*family(name), TOL["fp32"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_split_layout_parity(name, family):
    folder, model = family(name, layout="split")
    _check(folder, model, TOL["fp32"])


@pytest.mark.parametrize("name", ["qwen3", "phi4mini", "gemma3"])
def test_export_parity_fp16(name, family):
    _check(*family(name, "fp16"), TOL["fp16"])
