"""Tiny random-weight models of the laptop families (Qwen3, Llama 3.2, SmolLM2/3, Phi-3/4-mini, Gemma 2/3),
built locally from transformers' config classes: each exercises its family's features at test size; and the
export parity check (our graph's logits == PyTorch's on a prefill, a tree step and a step after compaction)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from helpers import VOCAB, save_random, torch_path_logits
from specbeam_edge.execution.model import OnnxCausalLM

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            rms_norm_eps=1e-5)

# name: (config class, model class, config kwargs)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    # Llama 3.2: tied embeddings and llama3 rope scaling (original length small so the scaling bites)
    "llama3.2": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                             tie_word_embeddings=True)),
    # Phi-4-mini: partial rotary 0.75, LongRoPE with a tiny pretraining length so trees cross it
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                                                        original_max_position_embeddings=12,
                                                        rope_scaling=LONGROPE, max_position_embeddings=64)),
    # Phi-3-mini: full rotary, no scaling, a window on every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "sliding_attention",
                                                                         "full_attention"],
        query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
}


def make_family_model(folder: Path, name: str, *, seed: int = 0, std: float = 0.08, eos=0, **overrides):
    """Save a random-weight model of family `name` (fp32 safetensors) plus tokenizer; returns the torch model."""
    import torch
    import transformers as tf

    cfg_cls, model_cls, kw = FAMILIES[name]
    torch.manual_seed(seed)
    cfg = getattr(tf, cfg_cls)(**{**BASE, **kw, "eos_token_id": eos, **overrides})
    cfg.architectures = [model_cls]
    return save_random(getattr(tf, model_cls)(cfg), folder, std=std, eos=eos)


PROMPT = [5, 17, 33, 8, 99, 41, 7, 250, 61]            # longer than every test window (4, 5)
TREE_PARENTS = [-1, -1, 0, 0, 1, 2, 5]                 # parents index into this list (-1: the prompt's last token)
TREE_TOKENS = [11, 12, 13, 14, 15, 16, 17]
KEEP = 6                                               # compaction keeps the path prompt -> 11 -> 13 -> 16 -> 17


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


def check_parity(folder, model, tol):
    """Our graph's logits == the torch model's on a prefill, a branching tree step and a step after compaction
    (relative to the largest logit)."""
    for ours, paths in scenario(folder):
        ref = torch_path_logits(model, paths)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < tol, err
