"""The `lm` command's model: a new decoder-only Llama or M2M100 encoder-decoder of the flags' shape, or an --init
model (a draft cut from it with --init_layers; --freeze_encoder keeps its target's encoder), the --teacher, the
AdamW optimizer, and the forward passes that return the scored positions' logits only.
"""
from __future__ import annotations

import math
import sys


def scored_logits(model, x, keep):
    """Logits of the scored positions only: the LM head and the loss skip the English side (about half the
    tokens), which is most of a small model's head and softmax cost. x [B, T]; keep bool [B*T] -> [N, V]."""
    hidden = model.model(input_ids=x).last_hidden_state            # [B, T, H], after the final norm
    return model.lm_head(hidden.flatten(0, 1)[keep])


def encdec_logits(model, src, src_mask, dec, keep):
    """Logits of the scored decoder positions of an encoder-decoder: src/src_mask [B, S], dec [B, L], keep bool
    [B*L] -> [N, V]."""
    hidden = model.model(input_ids=src, attention_mask=src_mask, decoder_input_ids=dec).last_hidden_state
    return model.lm_head(hidden.flatten(0, 1)[keep])


def load_pretrained(folder, arch: str):
    """An HF folder of this architecture (llama: decoder-only, m2m100: encoder-decoder), fp32."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM, M2M100ForConditionalGeneration

    kind = AutoConfig.from_pretrained(folder).model_type
    want = {"llama": "llama", "m2m100": "m2m_100"}[arch]
    if kind != want:
        raise SystemExit(f"{folder} holds a {kind} model; --arch {arch} needs a {want} folder")
    cls = M2M100ForConditionalGeneration if arch == "m2m100" else LlamaForCausalLM
    return cls.from_pretrained(folder, torch_dtype=torch.float32)


def load_init(args):
    """The --init model; with --init_layers, a draft cut from it: its embedding, these (decoder) layers, final
    norm and head (an encoder-decoder keeps its whole encoder: it runs once per request)."""
    arch = getattr(args, "arch", "llama")
    model = load_pretrained(args.init, arch)
    if not args.init_layers:
        return model
    stack = model.model.decoder if arch == "m2m100" else model.model
    n = len(stack.layers)
    keep = layer_list(args.init_layers)
    if not keep or any(not 0 <= i < n for i in keep) or len(set(keep)) != len(keep):
        raise SystemExit(f"--init_layers {args.init_layers}: distinct layer numbers separated by commas; "
                         f"{args.init} has {'decoder ' if arch == 'm2m100' else ''}layers 0..{n - 1}")
    return cut_layers(model, keep, arch)


def cut_layers(model, keep: list[int], arch: str = "llama"):
    """The model with only the (decoder) layers `keep`, renumbered, its config saying so (a draft cut from a
    target)."""
    import torch

    stack = model.model.decoder if arch == "m2m100" else model.model
    stack.layers = torch.nn.ModuleList(stack.layers[i] for i in keep)
    for j, layer in enumerate(stack.layers):
        layer.self_attn.layer_idx = j
        if arch == "m2m100":
            layer.encoder_attn.layer_idx = j
    if arch == "m2m100":
        model.config.decoder_layers = len(keep)
    else:
        model.config.num_hidden_layers = len(keep)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = [model.config.layer_types[i] for i in keep]
    return model


def layer_list(spec: str) -> list[int]:
    """--init_layers as numbers ([] when it is not a comma-separated list of integers)."""
    try:
        return [int(i) for i in spec.split(",")]
    except ValueError:
        return []


def share_target_encoder(model, args) -> None:
    """--freeze_encoder: a draft that shares its target's encoder output. The encoder, the shared embedding (tied
    to the head) and each kept decoder layer's cross-attention K/V projections stay the --init model's, and the
    config records which target layer each decoder layer came from (export: `target_cross_layers`; composed
    when --init is itself such a draft). Without it, an --init draft that shared its target's encoder trains an
    encoder of its own from now on, so it must not declare the target's (the export would drop it)."""
    from export.encdec import TARGET_CROSS_KEY

    prev = getattr(model.config, TARGET_CROSS_KEY, None)
    if not args.freeze_encoder:
        if prev is not None:
            delattr(model.config, TARGET_CROSS_KEY)
            print(f"note: the --init model shared its target's encoder ({TARGET_CROSS_KEY}); without "
                  f"--freeze_encoder this run trains its own", file=sys.stderr)
        return
    if args.arch != "m2m100" or not args.init:
        raise SystemExit("--freeze_encoder keeps an encoder-decoder's encoder from its --init model: pass --arch "
                         "m2m100 and --init")
    for p in [*model.model.shared.parameters(), *model.model.encoder.parameters()]:
        p.requires_grad_(False)
    for layer in model.model.decoder.layers:
        for p in [*layer.encoder_attn.k_proj.parameters(), *layer.encoder_attn.v_proj.parameters()]:
            p.requires_grad_(False)
    keep = layer_list(args.init_layers) if args.init_layers else list(range(len(model.model.decoder.layers)))
    setattr(model.config, TARGET_CROSS_KEY, keep if prev is None else [prev[i] for i in keep])


def build_model(args, vocab_size: int, sep: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.init_layers and not args.init:
        raise SystemExit("--init_layers cuts layers out of the --init model: pass --init too")
    if args.init:
        return load_init(args)
    if getattr(args, "arch", "llama") == "m2m100":
        from transformers import M2M100Config, M2M100ForConditionalGeneration

        # pad: the separator token, which an encoder-decoder never sees (EOS doubles as the decoder-only models'
        # pad, but an encoder masks its padding and M2M100's positions skip pad tokens: the pad id must be a row
        # of its position table, so a small id); the decoder starts from EOS, as fairseq's models do
        cfg = M2M100Config(vocab_size=vocab_size, d_model=args.hidden, encoder_layers=args.layers,
                           decoder_layers=args.layers, encoder_attention_heads=args.heads,
                           decoder_attention_heads=args.heads, encoder_ffn_dim=4 * args.hidden,
                           decoder_ffn_dim=4 * args.hidden, max_position_embeddings=512, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                           decoder_layerdrop=0.0, activation_function="relu", scale_embedding=True,
                           pad_token_id=sep, bos_token_id=0, eos_token_id=0, decoder_start_token_id=0,
                           tie_word_embeddings=True)
        return M2M100ForConditionalGeneration(cfg)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=int(math.ceil(8 * args.hidden / 3 / 16) * 16),
                      max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def setup_model(args, vocab_size: int, sep: int):
    """The model to train (its KV cache off), and the --teacher in eval mode (None without one)."""
    import torch

    model = build_model(args, vocab_size, sep)
    model.config.use_cache = False
    if args.bf16 and not any(getattr(torch.cpu, f, lambda: True)() for f in ("_is_avx512_bf16_supported",
                                                                             "_is_amx_tile_supported")):
        print("warning: --bf16 on a CPU without AVX512-BF16 or AMX runs slower than fp32", file=sys.stderr)
    if args.freeze_encoder or args.arch == "m2m100":
        share_target_encoder(model, args)
    teacher = None
    if args.teacher:
        teacher = load_pretrained(args.teacher, args.arch).eval()
    return model, teacher


def make_optimizer(model, args):
    """AdamW over the trainable parameters: weight decay on matrices and embeddings, none on norms and biases."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95))
