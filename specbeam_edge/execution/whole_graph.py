"""The whole layout's runner: one onnxruntime graph holding every layer and the head, run once a pass."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ModelConfig, ModelFolderError
from ..contract import AHEAD_INPUT, AHEAD_OUTPUTS, CONFIG_FILE, HEAD_FROM, KEY_POSITIONS, TOKEN_INPUTS, past_names, present_names
from .integrity import verify
from .pass_input import PassInput
from .runner import Runner, rows_back
from .sessions import _session, check_io, declares, run_bound


def _graph_layers(sess, cfg: ModelConfig, folder: Path) -> int:
    """num_layers, once the whole graph declares as many layers' past inputs: checked before a list per layer
    is built (a config's count of a million took seconds and wrote a 100 MB error)."""
    head, tail = past_names("{i}")[0].split("{i}")
    held = sum(1 for i in sess.get_inputs() if i.name.startswith(head) and i.name.endswith(tail))
    if held != cfg.num_layers:
        raise ModelFolderError(f"{folder / CONFIG_FILE}: num_layers is {cfg.num_layers}, but "
                               f"{cfg.files['model']} has {held} layers; set it to the model's layer count or "
                               f"re-export the model")
    return held


class WholeGraph(Runner):
    """One graph for every layer and the head (files.model), checked against its SHA-256 and its declared I/O."""

    def __init__(self, folder: Path, cfg: ModelConfig, *, threads, providers, spin: bool, arena: bool | None,
                 head_io: tuple[list, list], ahead: bool, static_inputs: list[str],
                 kv_resident: bool | None):
        """head_io: the head's (inputs, outputs) (contract.head_io); ahead: the config names a lookahead head."""
        self.arena = arena is not False          # nothing streams: the arena unless the caller says no
        verify(folder, cfg.files.get("sha256"))      # a damaged graph fails by name, not as wrong text
        self.sess = sess = _session(folder / cfg.files["model"], threads, providers, spin, self.arena)
        layers = _graph_layers(sess, cfg, folder)
        self.past_names = [past_names(i) for i in range(layers)]
        self.present_flat = [n for i in range(layers) for n in present_names(i)]
        self.needs_key_positions = declares(sess, KEY_POSITIONS)
        # a graph whose head the config does not name (an attach killed between its two renames) runs with the
        # head off
        self.ahead_input = bool(ahead) or declares(sess, AHEAD_INPUT)
        head_inputs, all_heads = head_io
        want_in = {*TOKEN_INPUTS, *[n for p in self.past_names for n in p],
                   *([KEY_POSITIONS] if self.needs_key_positions else []), *static_inputs,
                   *([AHEAD_INPUT] if self.ahead_input else [])}
        check_io(sess, want_in | set(head_inputs), {*all_heads, *self.present_flat,
                                                    *(AHEAD_OUTPUTS if ahead else [])}, cfg.files["model"])
        self._settle(sess, self.past_names[0][0], cfg, folder, kv_resident)
        self._optional(sess)    # HEAD_FROM: 0 (every row) unless fed; older exports lack it

    def run(self, p: PassInput, mask: np.ndarray, head_feed: dict, names: list[str], min_rows: int = 1):
        """One run of the graph; its head on the rows from p.head_from on where it takes that input (at least
        min_rows of them: the model's row floor holds for the head's MatMul too)."""
        feed = {"input_ids": p.ids, "position_ids": p.pos, "attention_mask": mask, **head_feed, **(p.static or {}),
                **self.optional_feed(p)}
        if p.key_positions is not None:
            feed[KEY_POSITIONS] = p.key_positions
        skip = max(min(int(p.head_from), p.ids.shape[1] - max(min_rows, 1)), 0) if self.head_rows else 0
        if self.head_rows:
            feed[HEAD_FROM] = np.array([skip], np.int64)
        for (kn, vn), (k, v) in zip(self.past_names, p.past):
            feed[kn], feed[vn] = k, v
        if self.kv_resident:
            outs = run_bound(self.sess, feed, names, self.present_flat, self.kv_device, self.runs[0])
        else:
            outs = self.sess.run(names + self.present_flat, feed, self.runs[0])
        n = len(names)
        presents = [(outs[n + 2 * i], outs[n + 2 * i + 1]) for i in range(len(self.past_names))]
        return rows_back(outs[:n], skip), presents
