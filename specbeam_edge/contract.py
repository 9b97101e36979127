"""The model-folder contract: the names and versions that `export/` writes and the runtime reads (DESIGN sections
3-4). One copy, imported by both sides: the exporter imports this module (and no other runtime module); the
runtime never imports the exporter. No numpy, no onnxruntime: the standard library only, so an export needs nothing
of the runtime's dependencies to read it. Both sides read the folder's files the same way: `read_json_object` (a
JSON object file, damaged or missing ones as the caller's error) and `file_sha256` (tokenizer.json's checksum).

Name builders take a layer number, or the string "{i}" for the templates that specbeam_config.json `io` lists.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT_VERSION = 1                      # specbeam_config.json `format_version`: the one this runtime reads
CONFIG_FILE = "specbeam_config.json"
LAYOUTS = ("whole", "split")
# the tree mask's value at hidden positions as the exporter writes it (`mask_value`): float32's minimum, the
# same float as float(numpy.finfo(numpy.float32).min)
MASK_VALUE = -3.4028234663852886e+38

# decoder graph inputs every pass gives (DESIGN section 4)
TOKEN_INPUTS = ("input_ids", "position_ids", "attention_mask")
KEY_POSITIONS = "key_position_ids"      # optional: [batch, n_past + n_new], the position of every key column
SOURCE_MASK = "encoder_attention_mask"  # encoder-decoder static input: [batch, src_len], 0 = padding

# the split layout's graphs (DESIGN section 5): embed (input_ids -> hidden), one layer graph run per layer with
# that layer's weights bound, and the head (hidden -> head outputs)
HIDDEN = "hidden"
LAYER_PAST = ("past_key", "past_value")
LAYER_PRESENT = ("present_key", "present_value")
LAYER_HIDDEN_OUT = "hidden_out"

# the encoder graph of an encoder-decoder folder
ENCODER_INPUTS = ("input_ids", "attention_mask")
ENCODER_HIDDEN = "encoder_hidden_states"

# head outputs (`output` in specbeam_config.json): logits, the log-softmax top-k with k a run-time input, or both
OUTPUT_KINDS = ("logits", "topk", "both")
LOGITS = "logits"
TOPK_INPUT = "topk"
TOPK_OUTPUTS = ["topk_logprobs", "topk_ids"]
# a lookahead head (export/ahead.py, config `ahead`): per node, its guesses of the token after the node's best next
# token, then a chain of one guess a level below the first (log-probs, ids [batch, n_new, guesses + depth - 1]);
# computed only in passes that set its input
AHEAD_OUTPUTS = ["ahead_logprobs", "ahead_ids"]
AHEAD_INPUT = "ahead_on"     # bool [1]: run the head in this pass (an If node: plain passes skip its cost)
# a whole graph's head runs on the rows from this one on (int64 [1], default 0: an input with an initializer; the
# rows before it come back empty): a prompt's rows before its last are read by nobody, and scoring them cost a
# sixth of a 135M model's multiply-adds a prompt row
HEAD_FROM = "head_from"
# bool [1], default false (an input with an initializer), in graphs whose attention is in double: true runs this
# pass's attention in fp32 (onnxruntime's fused op: a 5,600-token prompt 2.7x faster). Not layout-exact, so the
# runtime sets it only for a prompt's unread rows, run alone in chunks that every mode lays out alike
PROMPT_ATTENTION = "prompt_attention"
AHEAD_FORM = 3               # of the head in the graph (config `ahead.form`): fetch attaches it again on a change
                             # (3: the chain levels, config `ahead.depth`)


def past_names(i: int | str) -> tuple[str, str]:
    """Layer i's past self-attention key and value inputs (whole layout and encoder-decoder decoders)."""
    return f"past_key_values.{i}.key", f"past_key_values.{i}.value"


def present_names(i: int | str) -> tuple[str, str]:
    """Layer i's present key and value outputs: past and new concatenated (`present: concat`)."""
    return f"present.{i}.key", f"present.{i}.value"


def cross_names(i: int | str) -> tuple[str, str]:
    """Decoder layer i's cross-attention key and value: encoder outputs, decoder static inputs."""
    return f"cross_key.{i}", f"cross_value.{i}"


def all_cross_names(layers: int) -> list[str]:
    """Every decoder layer's cross K/V names in order (key, value of layer 0, then layer 1, ...)."""
    return [n for i in range(layers) for n in cross_names(i)]


def static_inputs(layers: int) -> list[str]:
    """An encoder-decoder decoder's `static_inputs`: the source mask, then every layer's cross K/V."""
    return [SOURCE_MASK, *all_cross_names(layers)]


def head_io(output: str) -> tuple[list[str], list[str]]:
    """(extra inputs, head outputs) of a graph whose head is `output`: 'logits' (a row per node), 'topk' (the
    log-softmax top-k, k a run-time input) or 'both' (either, chosen per run by the outputs asked for: a draft that
    speculative sampling reads in full and exact search through its top-k)."""
    return ([TOPK_INPUT] if output != "logits" else [],
            (TOPK_OUTPUTS if output != "logits" else []) + ([LOGITS] if output != "topk" else []))


def graph_io(output: str, *, key_positions: bool = False, encoder_decoder: bool = False,
             head_from: bool = False, prompt_attention: bool = False) -> dict:
    """specbeam_config.json `io`: the (whole-layout) graph's input and output names, per-layer names as "{i}"
    templates; an encoder-decoder adds its source mask and cross K/V inputs and its encoder graph's I/O."""
    head_in, head_out = head_io(output)
    inputs = [*TOKEN_INPUTS, *([KEY_POSITIONS] if key_positions else []),
              *([SOURCE_MASK, *cross_names("{i}")] if encoder_decoder else []), *past_names("{i}"), *head_in,
              *([HEAD_FROM] if head_from else []), *([PROMPT_ATTENTION] if prompt_attention else [])]
    io = {"inputs": inputs, "outputs": head_out + list(present_names("{i}"))}
    if encoder_decoder:
        io.update(encoder_inputs=list(ENCODER_INPUTS), encoder_outputs=[ENCODER_HIDDEN, *cross_names("{i}")])
    return io


def probe_source(n: int, eos: int) -> list[int]:
    """A source of n ordinary token ids ending in EOS: the exporter fingerprints a shared-encoder draft's cross
    K/V on it, and the runtime uses it for load-time checks and cost measurements."""
    return [3 + i % 13 for i in range(n - 1)] + [eos]


def read_json_object(path: Path, error: type[Exception], default: dict | None = None, fix: str = "") -> dict:
    """A JSON object file of a model folder (`default` when the file is absent and a default is given); a damaged,
    unreadable or non-object file raises `error` with one line naming the file (and `fix`, the remedy)."""
    path = Path(path)
    if default is not None and not path.is_file():
        return default
    hint = f"; {fix}" if fix else ""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e}){hint}") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: must hold a JSON object ({{...}}), found a {type(data).__name__}")
    return data


def write_json_object(path: Path, data: dict) -> None:
    """Replace a model folder's JSON file whole: written beside it, then renamed over it (an interruption or a full
    disk leaves the old file and no temporary one)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def graph_sha256(folder: Path, graph: str) -> dict[str, str]:
    """`files.sha256` of a whole-layout graph: {file name: SHA-256} of the graph and of its tensors' file
    (`<graph>.data`, written beside it past protobuf's 2 GB)."""
    names = [graph] + ([f"{graph}.data"] if (Path(folder) / f"{graph}.data").is_file() else [])
    return {name: file_sha256(Path(folder) / name) for name in names}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB blocks (tokenizer.json as exported; a fetched GGUF; a model's files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
