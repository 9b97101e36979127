"""SmolLM3: Llama layers, some without rope (NoPE: `no_rope_layers[i] == 0`)."""
ARCHITECTURES = {"SmolLM3ForCausalLM": "smollm3"}


def features(cfg) -> tuple[str, dict]:
    n = cfg.num_hidden_layers
    feats = {"layer_rope": tuple("global" if cfg.no_rope_layers[i] else None for i in range(n))}
    if not cfg.use_sliding_window:
        # the attention layers read the window only when use_sliding_window is set, whatever layer_types says
        feats.update(layer_sliding=(False,) * n, sliding_window=None)
    return "smollm3", feats


def layer_tensors(w: dict, arch, prefix: str) -> dict:
    return w
