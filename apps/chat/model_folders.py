"""What the chat app knows about model folders, without Qt: the models this installation has (the shipped pairs
and the fetched models), the folders, beams and max new tokens a first start opens with, a pair's name, what a
loaded model does with a message, what drafts for given settings, and the Memory budget field's value."""
from __future__ import annotations

from pathlib import Path

from specbeam_edge import fetch
from specbeam_edge.config import GenerationConfig, ModelConfig
from specbeam_edge.commands.flags import parse_size
from specbeam_edge.text.prompting import CHAT_MAX_NEW_TOKENS, has_chat_template
from specbeam_edge.shipped import missing_message, models_root

CHAT_MODELS = ("qwen2.5-coder-1.5b", "smollm2")   # fetched chat models the app opens on, best first


def pair_name(model: str, draft: str, head: bool = False) -> str:
    """'ende (target + draft)' for a shipped pair; 'qwen + qwen-draft' for two unrelated folders; a model
    without a draft says whether its own lookahead head drafts instead (head)."""
    m = Path(model)
    base = m.parent.name if m.name == "target" else m.name
    if not draft:
        return f"{base} (no draft; own lookahead head)" if head else f"{base} (no draft)"
    d = Path(draft)
    return f"{base} ({m.name} + {d.name})" if d.parent == m.parent else f"{base} + {d.name}"


def speculation(engine, beams: int, sample: bool) -> tuple[str | None, str]:
    """What drafts for these settings: "draft", "head" (the target's own lookahead head: greedy search only,
    commands.options.configs says why) or None, and why not when None. The one state the Speculate box, the Loaded label, the
    status line and the search itself follow."""
    if engine is None:
        return None, "no model is loaded"
    if engine.draft is not None:
        return "draft", ""
    if getattr(engine.target, "ahead", None) is None:
        return None, "this model has no draft and no lookahead head"
    if sample:
        return None, "its lookahead head drafts for exact search only, not beam sampling"
    if beams > 1:
        return None, f"its lookahead head drafts for one beam only (Beams is {beams})"
    return "head", ""


def memory_budget(text: str) -> int | None:
    """The Memory budget field in bytes: empty is None (every layer resident), a bare number is MB, else a size
    with its unit (400MB, 1.5GB); ValueError says what is wrong."""
    t = text.strip()
    if not t:
        return None
    try:
        float(t)
        t += "MB"
    except ValueError:
        pass
    try:
        return parse_size(t)
    except Exception as e:            # argparse.ArgumentTypeError
        raise ValueError(f"Memory budget: {e}") from None


def model_kind(tokenizer, model: str) -> str:
    """What the loaded model does with a message, for the label under the pair's name."""
    if tokenizer.chat_template:
        return "chat model (chat template)"
    if Path(model).parent == models_root() / "ende":
        return "translator: each message is translated into German"
    fmt = tokenizer.prompt_format or "{source}"
    if fmt.rstrip().endswith("{source}"):
        return "completion: each message is continued"
    return f"fixed prompt format {fmt!r}: each message is sent on its own"


def known_models() -> list[tuple[str, str, str]]:
    """(label, model folder, draft folder) of the models this installation has: the shipped pairs that are there
    and the fetched models (`specbeam fetch NAME`, in the per-user data folder); a fetchable model that is not
    fetched yet comes with an empty folder and says how to fetch it."""
    found = []
    for pair, what in (("text", "shipped pair, continues text"), ("ende", "shipped pair, en->de")):
        root = models_root() / pair
        if (root / "target").is_dir():
            draft = root / "draft"
            found.append((f"{pair} ({what})", str(root / "target"), str(draft) if draft.is_dir() else ""))
    have = fetch.fetched()
    for name, src in fetch.SOURCES.items():
        if name in have:
            paying = fetch.default_draft(name)       # its own draft, or another fetched model (qwen 0.5B)
            if paying:
                found.append((f"{src.folder} (fetched, with its draft)", str(have[name]), paying))
                continue
            draft = fetch.draft_path(name)
            head = " with its lookahead head" if fetch.has_ahead(name) else ""
            found.append((f"{src.folder} (fetched{head}{'' if draft or head else ', no draft'})", str(have[name]),
                          ""))
            if draft:        # offered, not the default: measured slower than plain search (models/<name>/README)
                found.append((f"{src.folder} with its draft (trained here; slower than plain so far)",
                              str(have[name]), str(draft)))
        else:
            found.append((f"{name}: not fetched (run: specbeam fetch {name})", "", ""))
    return found


def explain(error: Exception, model: str, draft: str) -> str:
    """The loader's message; for a shipped pair's folder that this installation lacks, what to do instead."""
    for folder in (model, draft):
        if folder and not Path(folder).is_dir() and Path(folder).parent.parent == models_root():
            return missing_message(Path(folder)).replace("--model (and --draft)", "the Model and Draft fields")
    return str(error)


def default_folders() -> tuple[str, str]:
    """A fetched chat model when there is one (CHAT_MODELS' order; with the draft that pays for it, as
    `--model NAME` takes it), else the shipped text pair, which continues what you write. (The en->de pair
    translates each message into German; it is one Model/Draft choice away.)"""
    have = fetch.fetched()
    for name in CHAT_MODELS:
        if name in have:
            return str(have[name]), fetch.default_draft(name) or ""
    root = models_root() / "text"
    return str(root / "target"), str(root / "draft")


def default_beams(model: str) -> int:
    """Beams on a first start: a fetched chat model searches as `specbeam chat` does (its generation config's
    num_beams, greedy where it names none: beam search loops on small chat models); other models 4."""
    if model not in [str(p) for p in fetch.fetched().values()]:
        return 4
    try:
        return int(ModelConfig.load(model).generation.get("num_beams", 1))
    except Exception:
        return 1


def default_max_new(model: str) -> int:
    """Max new tokens on a first start: the engine's default for the folder (its generation config's, else 512
    for a chat model, whose code 128 cut mid-line, else 128)."""
    try:
        own = ModelConfig.load(model).generation.get("max_new_tokens")
    except Exception:
        own = None
    if isinstance(own, int) and own >= 1:
        return own
    return CHAT_MAX_NEW_TOKENS if has_chat_template(model) else GenerationConfig().max_new_tokens


def whole_layout(model: str) -> bool:
    """The folder's config says the whole layout (no layer streaming); False when it cannot be read (the
    engine then says what is wrong)."""
    try:
        return ModelConfig.load(model).layout == "whole"
    except Exception:
        return False
