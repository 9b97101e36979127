"""Llama (incl. Llama 3.2: tied embeddings, llama3 rope; SmolLM2), Qwen2 (q/k/v bias) and Mistral."""
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def features(cfg) -> tuple[str, dict]:
    name = ARCHITECTURES.get(cfg.architectures[0], cfg.model_type)
    feats = {}
    if name == "qwen2":
        feats["qkv_bias"] = True            # Qwen2 always has q/k/v biases (no attention_bias field)
    if name == "mistral" and cfg.sliding_window:
        # Mistral has no layer_types: a window applies to every layer
        feats.update(layer_sliding=(True,) * cfg.num_hidden_layers, sliding_window=int(cfg.sliding_window))
    return name, feats


def layer_tensors(w: dict, arch, prefix: str) -> dict:
    return w
