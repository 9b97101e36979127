"""Configuration: the model folder's facts, and the frozen, validated search settings users pass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import folder_files as check
from .contract import CONFIG_FILE, FORMAT_VERSION, LAYOUTS, OUTPUT_KINDS, read_json_object
from .folder_files import ModelFolderError, few, inside, short  # noqa: F401  (imported from here too)


def _int(value, name: str, low: int | None = None, high: int | None = None) -> int:
    """An integer setting (bool is not one) within [low, high]; the message names the setting."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def _float(value, name: str) -> float:
    """A finite real setting: nan or inf would pass every range check below and silently corrupt scores."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


MASK_VALUE_MAX = -1e4   # the largest mask value that still hides a position (exp(-1e4) underflows to 0 in fp32)
_MODEL_INTS = {"vocab_size": 1, "hidden_size": 1, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1,
               "head_dim": 1, "context_length": 2}


def _model_fields(raw: dict, path: Path) -> dict:
    """The typed fields of specbeam_config.json; a wrong value names the file, the key and the value."""
    def bad(key, want):
        return ModelFolderError(f"{path}: {key} must be {want}, got {short(raw[key])}; re-export the model")

    out = {}
    for key, low in _MODEL_INTS.items():
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise bad(key, f"an integer >= {low}")
        out[key] = v
    for key in ("bos_token_id", "pad_token_id"):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise bad(key, "a token id (integer >= 0) or null")
    eos = raw.get("eos_token_ids") or []
    if not isinstance(eos, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in eos):
        raise bad("eos_token_ids", "a list of token ids")
    mv = raw["mask_value"]
    if isinstance(mv, bool) or not isinstance(mv, (int, float)) or not math.isfinite(mv):
        raise bad("mask_value", "a finite number")
    if mv > MASK_VALUE_MAX:
        # the tree mask adds it to the scores of hidden positions: 0 (or -1) would let every node see every other
        raise bad("mask_value", f"a large negative number (<= {MASK_VALUE_MAX:g}; the exporter writes float32's "
                  f"minimum, -3.4028235e+38)")
    for key in ("files", "generation"):
        if key in raw and not isinstance(raw[key], dict):
            raise bad(key, "a JSON object")
    for key in ("family", "layout", "precision"):
        if not isinstance(raw[key], str):
            raise bad(key, "a string")
    if out["num_heads"] % out["num_kv_heads"]:
        raise bad("num_kv_heads", f"a divisor of num_heads ({out['num_heads']})")
    return out


def _output_kind(kind, folder) -> str:
    if kind not in OUTPUT_KINDS:
        raise ModelFolderError(f"{folder}: specbeam_config.json 'output' is {kind!r}, not one of {OUTPUT_KINDS}")
    return kind


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
        path = folder / CONFIG_FILE
        if not path.is_file():
            raise ModelFolderError(f"{folder}: no specbeam_config.json; export the model with `python -m export`")
        raw = read_json_object(path, ModelFolderError)
        if raw.get("format_version") != FORMAT_VERSION:
            raise ModelFolderError(f"{path}: format_version {raw.get('format_version')!r}, this runtime reads "
                                   f"{FORMAT_VERSION}; re-export the model")
        try:
            ints = _model_fields(raw, path)
            cfg = cls(folder=folder, family=raw["family"], **ints,
                      bos_token_id=raw.get("bos_token_id"), eos_token_ids=tuple(raw.get("eos_token_ids") or ()),
                      pad_token_id=raw.get("pad_token_id"), layout=raw["layout"], precision=raw["precision"],
                      output=_output_kind(raw.get("output", "logits"), folder), mask_value=float(raw["mask_value"]),
                      files=raw["files"],
                      generation=raw.get("generation", {}), raw=raw)
        except KeyError as e:
            raise ModelFolderError(f"{path}: missing key {e}") from None
        if cfg.layout not in LAYOUTS:
            raise ModelFolderError(f"{path}: unknown layout {cfg.layout!r}")
        keys = check.check_file_names(cfg.files, path)
        _check_tree(raw.get("speculative"), path)
        _check_head_tokens(raw.get("head_tokens"), cfg.vocab_size, path)
        try:
            if cfg.layout == "split":
                check.check_layer_count(cfg, path)
            needed = cls._needed_files(cfg)
        except KeyError as e:
            raise ModelFolderError(f"{path}: missing key files.{e.args[0]}; re-export the model") from None
        for name in needed + [f"{n}.data" for n in needed if (folder / f"{n}.data").exists()]:
            inside(folder, name, keys.get(name), path)
        check.check_graph_sums(cfg.files.get("sha256"), folder, path)
        missing = [n for n in needed if not (folder / n).is_file()]
        if missing:
            raise ModelFolderError(f"{folder}: missing file(s) {few(missing)}")
        if (folder / "tokenizer_config.json").is_file():      # read later by the tokenizer: fail here, named
            read_json_object(inside(folder, "tokenizer_config.json"), ModelFolderError)
        if cfg.layout == "split":
            check.check_manifest(cfg.files.get("layer_manifest"), path)
            check.check_checksums(cfg.files.get("layer_sha256"), cfg.num_layers, path)
            if "embed_table" in cfg.files:
                check.check_embed_table(cfg, path)
        return cfg

    @staticmethod
    def _needed_files(cfg: "ModelConfig") -> list[str]:
        if cfg.layout == "whole":
            needed = [cfg.files["model"]]
        else:      # the embedding: a mapped table (weights/embed.bin) or, in older exports, a graph
            table = cfg.files.get("embed_table")
            embed = table["file"] if isinstance(table, dict) and "file" in table else cfg.files["embed"]
            needed = [embed, cfg.files["layer"], cfg.files["head"]]
            for key in ("scale_file", "offset_file"):      # an int8 table's block scales; a GGUF blocks table's
                if isinstance(table, dict) and isinstance(table.get(key), str):
                    needed.append(table[key])
            resident = cfg.files.get("layer_resident")     # the resident layers' graph (export/resident.py)
            if resident is not None:
                if not (isinstance(resident, dict) and {"graph", "tables", "tables_manifest"} <= resident.keys()):
                    raise ModelFolderError("files.layer_resident must be {graph, tables, tables_manifest}; "
                                           "write it again with python -m export.resident FOLDER")
                needed += [resident["graph"], resident["tables"]]
        needed += [cfg.files["layer_weights"].format(i=i) for i in range(cfg.num_layers)] if cfg.layout == "split" else []
        needed.append("tokenizer.json")
        return needed


def _check_tree(tree, path: Path) -> None:
    """`speculative` (the folder's own draft tree, written by fetch): SpeculativeConfig's fields with valid
    values; an unknown key raised a TypeError deep in the Engine."""
    if tree is None:
        return
    if not isinstance(tree, dict):
        raise ModelFolderError(f"{path}: speculative must be a JSON object of tree settings, got {short(tree)}; "
                               f"fix or remove it")
    known = [f.name for f in fields(SpeculativeConfig)]
    unknown = [k for k in tree if k not in known]
    if unknown:
        raise ModelFolderError(f"{path}: speculative.{unknown[0][:40]} is not a tree setting (known: "
                               f"{few(known, len(known))}); remove it")
    try:
        SpeculativeConfig(**tree)
    except ValueError as e:
        raise ModelFolderError(f"{path}: speculative: {str(e)[:120]}; fix or remove it") from None


def head_width(cfg) -> int:
    """How many tokens a model's head scores (cfg: its ModelConfig): a cut head's count (`head_tokens`: export
    --head_tokens, or a checkpoint's lm_head.token_ids), else every token. A top-k head's k stays within it."""
    cut = cfg.raw.get("head_tokens")
    return cut["count"] if isinstance(cut, dict) else cfg.vocab_size


def check_full_head(cfg) -> None:
    """A target's head scores every token: a cut head (`head_tokens`) could never produce the others, and gave
    silent garbage as a target (the fetched 0.5B, cut to 65,536 ids, answered in another language than its 1.5B).
    A draft only, unless the folder says it may run as a target (`head_tokens.target`)."""
    width = head_width(cfg)
    if width < cfg.vocab_size and cfg.raw["head_tokens"].get("target") is not True:
        raise ModelFolderError(f"{cfg.folder}: its head scores {width} of its {cfg.vocab_size} tokens (a cut head: "
                               f"export --head_tokens), so it is a draft only; pass it as --draft beside its full "
                               f"model (or set head_tokens.target to true in its specbeam_config.json)")


def _check_head_tokens(cut, vocab_size: int, path: Path) -> None:
    """`head_tokens` (a head over fewer ids than the vocabulary): {count: 1..vocab_size, target: optional bool}."""
    if cut is None:
        return
    count = cut.get("count") if isinstance(cut, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= vocab_size or \
            not isinstance(cut.get("target", False), bool):
        raise ModelFolderError(f"{path}: head_tokens must be {{count: 1 to {vocab_size}, target: true or false}}, "
                               f"got {short(cut)}; re-export the model")


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
    no_repeat_ngram_size: int = 0                         # transformers' NoRepeatNGramLogitsProcessor (0: off)
    repetition_penalty: float = 1.0                       # transformers' RepetitionPenaltyLogitsProcessor (1: off)

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        _int(self.num_beams, "num_beams", 1)
        _int(self.max_new_tokens, "max_new_tokens", 1)
        _int(self.min_new_tokens, "min_new_tokens", 0, self.max_new_tokens)
        _float(self.length_penalty, "length_penalty")
        if not (self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        _int(self.num_return_sequences, "num_return_sequences")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(f"num_return_sequences ({self.num_return_sequences}) must be between 1 and "
                             f"num_beams ({self.num_beams})")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be True or False, got {self.do_sample!r}")
        if _float(self.temperature, "temperature") <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < _float(self.top_p, "top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _int(self.top_k, "top_k", 0)
        _int(self.no_repeat_ngram_size, "no_repeat_ngram_size", 0)
        if _float(self.repetition_penalty, "repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if (self.no_repeat_ngram_size or self.repetition_penalty != 1.0) and self.do_sample:
            raise ValueError("no_repeat_ngram_size and repetition_penalty are for beam search and greedy decoding, "
                             "not do_sample=True")
        if self.seed is not None:
            _int(self.seed, "seed", 0)
        eos = self.eos_token_id
        if eos is not None:
            for t in (eos if isinstance(eos, tuple) else (eos,)):
                _int(t, "eos_token_id", 0)

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "GenerationConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ValueError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        base = {k: v for k, v in d.items() if k in names}
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


DRAFTERS = ("beam", "best_first", "sample", "lookup", "ahead")
# Draft nodes per target pass by default. 80, not 48: at K = 4 the default width is 16 nodes a level, so 48 nodes
# gave three levels (at most 4 steps per pass) and the shipped pair 2.37 steps; 80 gives five levels and 2.61
# (100 held-out lines, identical output). K = 1 and 2 are bound by max_depth, not by the budget, below 80
# (4 x 6 and 8 x 6 nodes), so they draw the same trees. docs/HISTORY.md "The default budget".
DEFAULT_BUDGET = 80
# The tools' min_path_prob for a lookahead head (drafter 'ahead'): a guess joins the tree only while the head gives
# its path at least this. SmolLM2-135M, 24 prompts x 128 tokens (bench/README): the chain on every pass gave 1.73
# tokens a pass but 1.08x plain (rows are not free: 4 rows cost 1.28x one row in that run), 0.1: 1.64 tokens, 1.16x.
AHEAD_MIN_PATH_PROB = 0.1
# Bounds of a tree, for what the engine can use: budget "auto" never drafts past 1,024 nodes (where its measured
# cost curve stops), and 64 levels are more than twice the deepest tree measured to pay (24, STREAMED_TREE); each
# level is a draft pass. The shipped en->de pair at the bounds, K=4, 32 tokens: 10.6 s (best_first 19 s) against
# 98 s for 4,096 nodes x 16 levels; a folder's tree of 100,000 x 100,000 gave no answer in 60 s.
MAX_BUDGET = 1024
MAX_DEPTH = 64


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Tree knobs. `budget`: draft nodes per target pass (shared by the requests of a batch: each drafts
    max(num_beams, budget // requests in the pass)); `max_depth`: tree levels below each beam;
    `max_branch_width`: children per expanded node; `min_path_prob`: grow below a drafted node only while the
    draft's probability of the path from its beam stays at least this (the draft's confidence decides the depth,
    as in SpecExec and EAGLE-2; 0: every level up to max_depth); `drafter`: 'beam' (draft beam search, AtSpeed),
    'best_first' (cumulative draft log-prob with per-depth decay, SpecExec), 'sample' (draft beam
    sampling, the only drafter whose trees may be verified with the p/q rule of do_sample=True), or
    'lookup' (prompt lookup: n-gram continuations from the prompt and the beam itself; no draft model), or
    'ahead' (the target's own lookahead head, export/ahead.py: up to max_branch_width guesses of the token after
    each beam's next one and the head's chain below the first to max_depth levels, verified in the next pass,
    min_path_prob applied to the head's own probabilities; no draft model);
    `with_lookup`: 'beam' and 'best_first' also put prompt-lookup spans into the same tree, the budget split
    between the two by their measured acceptance (draft.MergedDrafter).
    `draft_width`: nodes per level of the 'beam' drafter (default max(K, max_branch_width, min(4K, budget // 2)):
    wide, shallow trees for K > 1; draft.default_width) and draft samples per level of 'sample'.
    Sampling knobs (DSBD): `draft_width` (default max(num_beams, max_branch_width)),
    `width_threshold` t (level width = largest k with P(#accepted >= k) >= t; 0 keeps num_beams),
    `min_num_beams` (width floor), `single_sequence` (keep one sequence between passes: the memory-saving
    mode).
    `adaptive` (exact beam search): measure seconds per beam step with and without the tree and speculate only
    while it pays, with a probe of the other choice now and then to keep the comparison current. The output is
    the same either way, so a draft that does not pay on this machine costs a few probes instead of every pass.
    On by default, as in the CLIs and apps (`--always_speculate` there, adaptive=False here: draft on every pass,
    e.g. to measure the tree itself)."""
    drafter: str = "beam"
    budget: int | str = DEFAULT_BUDGET  # or "auto": the largest tree whose measured pass cost stays within auto_slack
    auto_slack: float = 1.6         # x the cost of a pass over the beams alone
    max_depth: int = 6
    max_branch_width: int = 4
    min_path_prob: float = 0.0
    draft_width: int | None = None
    decay_factor: float = 0.95
    width_threshold: float = 0.0
    min_num_beams: int = 1
    single_sequence: bool = False
    adaptive: bool = True
    with_lookup: bool = False

    def __post_init__(self):
        if not 0 <= _float(self.width_threshold, "width_threshold") < 1:
            raise ValueError(f"width_threshold must be in [0, 1), got {self.width_threshold}")
        _int(self.min_num_beams, "min_num_beams", 1)
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.budget != "auto":
            try:
                _int(self.budget, "budget", 1, MAX_BUDGET)
            except ValueError:
                raise ValueError(f"budget must be an integer in [1, {MAX_BUDGET}] (draft nodes a pass) or 'auto', "
                                 f"got {short(self.budget)}") from None
        if _float(self.auto_slack, "auto_slack") < 1:
            raise ValueError(f"auto_slack must be >= 1, got {self.auto_slack}")
        _int(self.max_depth, "max_depth", 1, MAX_DEPTH)
        _int(self.max_branch_width, "max_branch_width", 1)
        if not 0 <= _float(self.min_path_prob, "min_path_prob") < 1:
            raise ValueError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")
        if self.draft_width is not None:
            _int(self.draft_width, "draft_width", 1)
        if self.with_lookup is True and self.drafter not in ("beam", "best_first"):
            raise ValueError(f"with_lookup merges prompt lookup into a draft model's tree: drafter 'beam' or "
                             f"'best_first', not {self.drafter!r}")
        if not 0 < _float(self.decay_factor, "decay_factor") <= 1:
            raise ValueError(f"decay_factor must be in (0, 1], got {self.decay_factor}")
        for name in ("single_sequence", "adaptive", "with_lookup"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def min_log_prob(self) -> float:
        """log(min_path_prob): a drafted path below it is not grown (-inf: no threshold)."""
        return math.log(self.min_path_prob) if self.min_path_prob > 0 else -math.inf

    def check_against(self, num_beams: int):
        if self.budget != "auto" and self.budget < num_beams:
            over = f"; a tree holds at most {MAX_BUDGET} nodes: search without a draft (speculative=None, " \
                f"--no_draft) for more beams" if num_beams > MAX_BUDGET else ""
            raise ValueError(f"budget ({self.budget}) must be >= num_beams ({num_beams}): every beam needs a node"
                             f"{over}")
        if self.draft_width is not None and self.draft_width < num_beams:
            raise ValueError(f"draft_width ({self.draft_width}) must be >= num_beams ({num_beams})")


# The tree of a target that streams layers (a pass costs one read of them whatever the tree), taken when a request
# leaves every tree knob at its default (Engine.speculative_for). K=1: best-first, narrow (2 children a node: a draft
# level's cost grows with its rows), up to 24 levels deep but only below nodes the draft gives a path probability of
# 5% or more (min_path_prob): deep where the draft is sure, no levels spent where it is not; 96 nodes at most (4 a
# draft level). Qwen2.5-Coder-1.5B streamed under 1/4 of its weights with the 0.5B drafting, prompts 0-7 / 8-15
# x 64 tokens, arms alternated in one engine: 7.90 / 7.66 tok/s (10.9 / 9.9 tokens a pass) against the earlier depth
# 16, no floor, 64 nodes: 6.76 / 7.13 (9.5 / 9.5); a 10% floor 7.65 tok/s but 9.5 tokens a pass; depth 32 or 128
# nodes no better (docs/HISTORY.md "A streamed target's greedy tree")
STREAMED_TREE = dict(drafter="best_first", budget=96, max_depth=24, max_branch_width=2, min_path_prob=0.05)
# beam search (num_beams > 1) keeps a level only when it holds all K next beams, so a pass gives 3-4 steps, not 10:
# levels past that only cost drafting, and each beam needs its alternatives. Depth 6 with 3 children a node gave
# 3.49 against the deep tree's 2.10 tok/s at K=4 in the same setting (depth 8 / 3: 3.35; depth 4, 4 children or a
# 128-node budget no better; a path-probability floor or prompt lookup no better either); as large as fits under the
# disk read (auto_slack 1.15: the tree's compute up to the read's time, the head a little more)
STREAMED_BEAM_TREE = dict(drafter="best_first", budget="auto", auto_slack=1.15, max_depth=6, max_branch_width=3)


def streamed_tree(num_beams: int) -> dict:
    """The tree settings of a request on a target that streams layers (above)."""
    return STREAMED_TREE if num_beams <= 1 else STREAMED_BEAM_TREE
