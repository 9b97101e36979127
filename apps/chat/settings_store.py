"""The chat window's settings remembered between runs with QSettings (the platform's usual place, or the file
`--settings` names): the model folders, the memory budget, the decoding settings, the window's geometry and its
splitter. A damaged value is replaced by its default and named at start-up; it never stops the app."""
from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

from specbeam_edge.config import DEFAULT_BUDGET

from .model_folders import default_beams, default_folders, default_max_new, memory_budget


class CheckedSettings:
    """The settings, read with every value checked: one that is not a number, out of range or not true/false is
    replaced by its default (or the nearest allowed value) and named in `bad`."""

    def __init__(self, settings: QSettings):
        self.s, self.bad = settings, []

    def number(self, key, default, widget, cast=int):
        raw = self.s.value(key, default)
        lo, hi = widget.minimum(), widget.maximum()
        try:
            value = cast(raw)
            if value != value:                   # NaN
                raise ValueError
        except (TypeError, ValueError, OverflowError):
            self.bad.append(f"{key}={_shown(raw)} is not a number (using {default})")
            return default
        if not lo <= value <= hi:
            near = min(max(value, lo), hi)
            self.bad.append(f"{key}={_shown(raw)} is outside {lo}..{hi} (using {near})")
            return near
        return value

    def flag(self, key, default):
        raw = self.s.value(key, default)
        if isinstance(raw, bool) or str(raw).lower() in ("true", "false"):
            return _bool(raw)
        self.bad.append(f"{key}={_shown(raw)} is not true or false (using {str(default).lower()})")
        return default


class SavedSettings:
    """ChatWindow's settings persistence (a mixin over the settings column's widgets, the window's geometry and its
    splitter)."""

    def _restore_settings(self):
        """Every value is checked: one that is not a number or out of range is replaced by its default (or the
        nearest allowed value) and named in `notices`; a damaged settings file never stops the app."""
        checked = CheckedSettings(self.settings)
        self._restore_folders(checked)
        self._restore_decoding(checked)
        s, bad = checked.s, checked.bad
        if isinstance(s.value("geometry"), QByteArray):
            self.restoreGeometry(s.value("geometry"))
        if isinstance(s.value("splitter"), QByteArray):
            self.split.restoreState(s.value("splitter"))
        if bad:
            where = s.fileName()
            self.notices.append(f"Settings ({where}): " + "; ".join(bad) + ".")

    def _restore_folders(self, checked: CheckedSettings):
        """The Model and Draft folders and the Memory budget."""
        s, bad = checked.s, checked.bad
        # earlier versions kept the folders in the conversation database: carry them over once
        model, draft = default_folders()
        self.model_edit.setText(str(s.value("model", self.store.get("model") or model)))
        self.draft_edit.setText(str(s.value("draft", self.store.get("draft", draft))))
        budget = str(s.value("max_memory", "") or "")
        try:
            memory_budget(budget)
        except ValueError:
            bad.append(f"max_memory={_shown(budget)} is not a size (using none: every layer resident)")
            budget = ""
        self.memory.setText(budget)

    def _restore_decoding(self, checked: CheckedSettings):
        """Mode, beams, tree budget, max new tokens, temperature, highlight and Speculate (a first start's beams
        and max new tokens are the model folder's)."""
        s, bad, number, flag = checked.s, checked.bad, checked.number, checked.flag
        mode = s.value("mode", 0)
        if str(mode) not in ("0", "1"):
            bad.append(f"mode={_shown(mode)} is not 0 or 1 (using 0)")
            mode = 0
        self.mode.setCurrentIndex(int(mode))
        self.beams.setValue(number("beams", 4 if s.contains("beams") else default_beams(self.model_edit.text()),
                                   self.beams))
        self.budget.setValue(number("budget", DEFAULT_BUDGET, self.budget))
        self.max_new.setValue(number("max_new_tokens", 128 if s.contains("max_new_tokens")
                                     else default_max_new(self.model_edit.text()), self.max_new))
        self.temperature.setValue(number("temperature", 1.0, self.temperature, float))
        self.highlight.setChecked(flag("highlight", True))
        self.want_speculate = flag("speculate", True)
        self.speculate.setChecked(self.want_speculate)
        self._mode_changed(self.mode.currentIndex())

    def save_settings(self):
        s = self.settings
        for key, value in (("mode", self.mode.currentIndex()), ("beams", self.beams.value()),
                           ("budget", self.budget.value()), ("max_new_tokens", self.max_new.value()),
                           ("temperature", self.temperature.value()), ("highlight", self.highlight.isChecked()),
                           ("speculate", self.want_speculate), ("max_memory", self.memory.text().strip()),
                           ("geometry", self.saveGeometry()),
                           ("splitter", self.split.saveState())):
            s.setValue(key, value)
        s.sync()


def _shown(value) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bool(value) -> bool:
    """QSettings' INI files give booleans back as the strings 'true'/'false'."""
    return value if isinstance(value, bool) else str(value).lower() == "true"
