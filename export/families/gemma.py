"""Gemma 2 and Gemma 3 (text): embeddings times sqrt(hidden), (1 + weight) RMSNorms, norms after attention
and around the GeGLU MLP, attention scale query_pre_attn_scalar**-0.5, sliding-window layers interleaved
with global ones. Gemma 2: attention and final logit soft-capping. Gemma 3: q/k norms and a separate rope
base (and scaling) for the sliding layers."""
from ..hf import ExportError, rope_for

ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def features(cfg) -> tuple[str, dict]:
    name = ARCHITECTURES[next(a for a in cfg.architectures if a in ARCHITECTURES)]
    act = cfg.hidden_activation or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ExportError(f"{name}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    head_dim = int(cfg.head_dim)
    feats = dict(sandwich_norms=True, norm_offset=1.0, embed_scale=cfg.hidden_size ** 0.5,
                 activation="gelu_tanh", attn_scale=cfg.query_pre_attn_scalar ** -0.5,
                 attn_softcap=cfg.attn_logit_softcapping, final_softcap=cfg.final_logit_softcapping)
    if name == "gemma3":
        rp = cfg.rope_parameters
        feats.update(qk_norm=True, ropes={
            "global": rope_for(cfg, {**rp["full_attention"], "_layer_type": "full_attention"}, head_dim),
            "local": rope_for(cfg, {**rp["sliding_attention"], "_layer_type": "sliding_attention"}, head_dim)},
            layer_rope=tuple("local" if t == "sliding_attention" else "global" for t in cfg.layer_types))
    return name, feats


def layer_tensors(w: dict, arch, prefix: str) -> dict:
    return w
