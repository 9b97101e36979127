"""Where the shipped model pairs (models/ende, models/text) are found.

They live in the repository's models/ folder (~92 MB with their recipes), which a source checkout and an
editable install (`pip install -e .`) see beside this package. A regular install (`pip install .`) does not
carry them: point SPECBEAM_MODELS at a models/ folder, or pass model folders with --model/--draft.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .config import ModelFolderError

ENV = "SPECBEAM_MODELS"
PAIRS = ("ende", "text")
_BESIDE = Path(__file__).resolve().parent.parent / "models"


def models_root() -> Path:
    """$SPECBEAM_MODELS if set, else models/ beside the package (which a regular install does not have)."""
    return Path(os.environ[ENV]).expanduser() if os.environ.get(ENV) else _BESIDE


def shipped_asset(rel: str) -> Path | None:
    """A folder of trained files under models/ that `specbeam fetch` attaches (rel: "smollm2/ahead"): from the
    checkout's models/ (or $SPECBEAM_MODELS), else from the copy a regular install carries as package data
    (specbeam_models); None when neither has it."""
    for root in (models_root(), _installed_models()):
        if root is not None and (root / rel).is_dir():
            return root / rel
    return None


def _installed_models() -> Path | None:
    """The installed specbeam_models folder (a regular install's package data), or None."""
    try:
        spec = importlib.util.find_spec("specbeam_models")
    except (ImportError, ValueError):
        return None
    places = list(spec.submodule_search_locations or []) if spec else []
    return Path(places[0]) if places else None


def shipped(pair: str, role: str = "target") -> Path:
    """The folder of a shipped pair's target or draft; a clear error when the shipped pairs are not there."""
    if pair not in PAIRS or role not in ("target", "draft"):
        raise ValueError(f"no shipped model {pair}/{role}: the pairs are {', '.join(PAIRS)} (target or draft)")
    folder = models_root() / pair / role
    if not folder.is_dir():
        raise ModelFolderError(missing_message(folder))
    return folder


def missing_message(folder: Path) -> str:
    where = (f"{ENV}={os.environ[ENV]}" if os.environ.get(ENV) else
             "this installation (a regular `pip install .` does not include the ~92 MB models/ folder)")
    return (f"the shipped model folder {folder} is not in {where}: pass your model folders with --model "
            f"(and --draft), or set {ENV} to the repository's models/ folder (it holds the pairs "
            f"{', '.join(PAIRS)}, each with target/ and draft/)")
