"""Qwen3: Qwen2 without q/k/v bias, plus a per-head RMSNorm of q and k before rope."""
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3"}


def features(cfg) -> tuple[str, dict]:
    return "qwen3", {"qk_norm": True}


def layer_tensors(w: dict, arch, prefix: str) -> dict:
    return w
