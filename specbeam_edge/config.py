"""Configuration: the model folder's facts, and the frozen, validated search settings users pass."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

FORMAT_VERSION = 1


class ModelFolderError(ValueError):
    """A model folder that cannot be used; the message names the folder and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    folder: Path
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    layout: str
    precision: str
    output: str
    mask_value: float
    files: dict
    generation: dict
    raw: dict = field(repr=False)

    @classmethod
    def load(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelFolderError(f"model folder {folder} does not exist")
        path = folder / "specbeam_config.json"
        if not path.is_file():
            raise ModelFolderError(f"{folder}: no specbeam_config.json; export the model with `python -m export`")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelFolderError(f"{path}: not valid JSON ({e})") from None
        if raw.get("format_version") != FORMAT_VERSION:
            raise ModelFolderError(f"{path}: format_version {raw.get('format_version')!r}, this runtime reads "
                                   f"{FORMAT_VERSION}; re-export the model")
        try:
            cfg = cls(folder=folder, family=raw["family"], vocab_size=int(raw["vocab_size"]),
                      hidden_size=int(raw["hidden_size"]), num_layers=int(raw["num_layers"]),
                      num_heads=int(raw["num_heads"]), num_kv_heads=int(raw["num_kv_heads"]),
                      head_dim=int(raw["head_dim"]), context_length=int(raw["context_length"]),
                      bos_token_id=raw.get("bos_token_id"), eos_token_ids=tuple(raw.get("eos_token_ids") or ()),
                      pad_token_id=raw.get("pad_token_id"), layout=raw["layout"], precision=raw["precision"],
                      output=raw.get("output", "logits"), mask_value=float(raw["mask_value"]), files=raw["files"],
                      generation=raw.get("generation", {}), raw=raw)
        except KeyError as e:
            raise ModelFolderError(f"{path}: missing key {e}") from None
        if cfg.layout not in ("whole", "split"):
            raise ModelFolderError(f"{path}: unknown layout {cfg.layout!r}")
        needed = [cfg.files["model"]] if cfg.layout == "whole" else [cfg.files[k] for k in ("embed", "layer", "head")]
        needed += [cfg.files["layer_weights"].format(i=i) for i in range(cfg.num_layers)] if cfg.layout == "split" else []
        needed.append("tokenizer.json")
        missing = [n for n in needed if not (folder / n).is_file()]
        if missing:
            raise ModelFolderError(f"{folder}: missing file(s) {', '.join(missing)}")
        return cfg


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Search settings with Hugging Face names and semantics (transformers `generate`)."""
    num_beams: int = 4
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None   # None: the model's own EOS ids

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise ValueError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) must be between 1 and "
                             f"num_beams ({self.num_beams})")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "GenerationConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        base = {k: v for k, v in d.items() if k in names}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


DRAFTERS = ("beam", "best_first", "sample", "lookup")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Tree knobs. `budget`: draft nodes per target pass; `max_depth`: tree levels below each beam;
    `max_branch_width`: children per expanded node; `drafter`: 'beam' (draft beam search, AtSpeed),
    'best_first' (cumulative draft log-prob with per-depth decay, SpecExec), 'sample' (draft beam
    sampling, the only drafter whose trees may be verified with the p/q rule of do_sample=True), or
    'lookup' (prompt lookup: n-gram continuations from the prompt and the beam itself; no draft model).
    Sampling knobs (DSBD): `draft_width` draft samples per level (default max(num_beams, max_branch_width)),
    `width_threshold` t (level width = largest k with P(#accepted >= k) >= t; 0 keeps num_beams),
    `min_num_beams` (width floor), `single_sequence` (keep one sequence between passes: the memory-saving
    mode).
    `adaptive` (exact beam search): measure seconds per beam step with and without the tree and speculate only
    while it pays, with a probe of the other choice now and then to keep the comparison current. The output is
    the same either way, so a draft that does not pay on this machine costs a few probes instead of every pass."""
    drafter: str = "beam"
    budget: int | str = 48          # or "auto": the largest tree whose measured pass cost stays within auto_slack
    auto_slack: float = 1.6         # x the cost of a pass over the beams alone
    max_depth: int = 6
    max_branch_width: int = 4
    draft_width: int | None = None
    decay_factor: float = 0.95
    width_threshold: float = 0.0
    min_num_beams: int = 1
    single_sequence: bool = False
    adaptive: bool = False

    def __post_init__(self):
        if not 0 <= self.width_threshold < 1:
            raise ValueError(f"width_threshold must be in [0, 1), got {self.width_threshold}")
        if self.min_num_beams < 1:
            raise ValueError(f"min_num_beams must be >= 1, got {self.min_num_beams}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.budget != "auto" and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"budget must be an integer >= 1 or 'auto', got {self.budget!r}")
        if self.auto_slack < 1:
            raise ValueError(f"auto_slack must be >= 1, got {self.auto_slack}")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.max_branch_width < 1:
            raise ValueError(f"max_branch_width must be >= 1, got {self.max_branch_width}")
        if self.draft_width is not None and self.draft_width < 1:
            raise ValueError(f"draft_width must be >= 1, got {self.draft_width}")
        if not 0 < self.decay_factor <= 1:
            raise ValueError(f"decay_factor must be in (0, 1], got {self.decay_factor}")

    def check_against(self, num_beams: int):
        if self.budget != "auto" and self.budget < num_beams:
            raise ValueError(f"budget ({self.budget}) must be >= num_beams ({num_beams}): every beam needs a node")
        if self.draft_width is not None and self.draft_width < num_beams:
            raise ValueError(f"draft_width ({self.draft_width}) must be >= num_beams ({num_beams})")
