"""The SmolLM2 draft in torch (`Draft`: the target's frozen embedding, some of its layers, a head over a subset of
the vocabulary) and its files: the shipped weights written from a checkpoint (`write_weights`, the `save` step) and
a saved draft read back as a starting point (`_saved_draft`).
"""
from __future__ import annotations

import json
from pathlib import Path

from models.smollm2 import recipe


class Draft:
    """The draft in torch: the target's embedding (frozen), `layers` of its decoder layers, its final norm, and a
    head over `token_ids` (rows of the tied embedding to start with)."""

    def __init__(self, target, layers: list[int], token_ids: list[int]):
        import torch

        from models.train_model import cut_layers

        model = cut_layers(target, layers)
        model.model.embed_tokens.weight.requires_grad_(False)
        self.model = model
        self.token_ids = torch.tensor(token_ids, dtype=torch.long)
        self.head = torch.nn.Linear(model.config.hidden_size, len(token_ids), bias=False)
        with torch.no_grad():
            self.head.weight.copy_(model.model.embed_tokens.weight[self.token_ids])
        self.index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
        self.index[self.token_ids] = torch.arange(len(token_ids))

    def parameters(self):
        return [p for p in list(self.model.model.parameters()) + list(self.head.parameters()) if p.requires_grad]

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "head": self.head.state_dict()}

    def load(self, state: dict, head_tokens: list[int] | None = None) -> None:
        """Weights from a checkpoint's or a saved draft's state; `head_tokens`: the tokens of its head rows when
        they are a subset of this head's (the other rows keep their embedding rows)."""
        import torch

        missing = set(self.model.load_state_dict(state["model"], strict=False).missing_keys)
        if missing - {"model.embed_tokens.weight", "lm_head.weight"}:     # a saved draft has no embedding
            raise KeyError(f"draft weights missing: {sorted(missing)}")
        if head_tokens is None or list(head_tokens) == self.token_ids.tolist():
            self.head.load_state_dict(state["head"])
            return
        rows = self.index[torch.tensor(head_tokens)]
        if (rows < 0).any():
            raise KeyError("the saved head has tokens this head lacks")
        with torch.no_grad():
            self.head.weight[rows] = state["head"]["weight"].to(self.head.weight.dtype)

    def logits(self, x, attention_mask, rows):
        """Head logits [N, S] of the selected flat positions `rows`."""
        hidden = self.model.model(input_ids=x, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden.flatten(0, 1)[rows])


def _saved_draft(folder: Path) -> dict:
    """A draft written by `save` (e.g. the shipped one) as a starting point: its layers, final norm, head and head
    token ids; the embedding is the target's (frozen, not stored), taken from the target as always."""
    from safetensors.torch import load_file

    w = load_file(str(folder / "draft.safetensors"))
    log = json.loads((folder / "train_log.json").read_text())
    token_ids = w.pop("lm_head.token_ids").tolist()
    head = {"weight": w.pop("lm_head.weight").float()}
    model = {k: v.float() for k, v in w.items()}
    return {"draft": {"model": model, "head": head}, "token_ids": token_ids,
            "layers": ",".join(str(i) for i in log["layers_from_target"])}


def write_weights(state: dict, out: Path) -> dict:
    """out/draft.safetensors from a checkpoint's state (fp16; no embedding); returns the arrays written."""
    import numpy as np
    import torch

    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.float16).numpy() for k, v in state["draft"]["model"].items()
               if k != "model.embed_tokens.weight" and v.is_floating_point()}
    weights["lm_head.weight"] = state["draft"]["head"]["weight"].to(torch.float16).numpy()
    weights["lm_head.token_ids"] = np.asarray(state["token_ids"], np.int64)
    recipe.save_weights(weights, out / "draft.safetensors")
    return weights


def save(args) -> None:
    """The shipped draft from the checkpoint: config.json (a 2-layer Llama of the target's shape) and
    draft.safetensors (fp16: its layers, final norm, the subset head and its token ids; NOT the embedding, which is
    the target's and is taken from the fetched target when `specbeam fetch smollm2` builds the draft)."""
    import torch

    work, out = Path(args.work), Path(args.out)
    state = torch.load(work / "ckpt.pt", weights_only=False)
    weights = write_weights(state, out)
    from export.gguf_input import _load
    from specbeam_edge import fetch

    target, _ = _load(fetch.gguf_path("smollm2"), quiet=True)
    cfg = target.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):     # the latter: where the GGUF was, on this machine
        cfg.pop(key, None)
    layers = [int(i) for i in state["layers"].split(",")]
    cfg.update(num_hidden_layers=len(layers), tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if cfg.get("layer_types"):
        cfg["layer_types"] = [cfg["layer_types"][i] for i in layers]
    recipe.write_json(out / "config.json", cfg, default=str)
    log = recipe.read_log(work / "train_log.jsonl")
    recipe.write_json(out / "train_log.json", {"layers_from_target": layers, "head_tokens": len(state["token_ids"]),
                                               "steps": state["step"], "log": log})
    print(f"{out}: {sum(v.nbytes for v in weights.values()) / 1e6:.1f} MB of weights")
