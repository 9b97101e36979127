"""One small module per model family: which transformers config fields become which graph features
(`features`), and how the family's checkpoint tensors map onto the shared decoder layer (`layer_tensors`).
The graph itself is built once, in export/graph.py."""
from __future__ import annotations

from . import gemma, llama, phi3, qwen3, smollm3

_MODULES = (llama, qwen3, smollm3, phi3, gemma)


def supported() -> list[str]:
    return [a for m in _MODULES for a in m.ARCHITECTURES]


def family_for(architectures: list[str]):
    """The module for the first architecture of the config that a family module declares (None if none)."""
    return next((m for a in architectures for m in _MODULES if a in m.ARCHITECTURES), None)


def family_for_name(name: str):
    return next(m for m in _MODULES if name in m.ARCHITECTURES.values())
