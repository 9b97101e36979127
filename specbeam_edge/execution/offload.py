"""Layer streaming for the split layout (DESIGN section 5; SpecExec-style offloading).

Each decoder layer's weights live in `weights/layer_{i}.bin`. A placement plan puts every layer either
`resident` (loaded once), `host` (kept in host memory, copied into a streaming buffer per pass: the path a
GPU provider uses), or `disk` (read from the file per pass, its page-cache pages dropped after the read, so
the memory budget really holds). Streamed layers go through two buffers: while layer i computes, a
background thread loads the next streamed layer into the other buffer.

Integrity: each layer file's SHA-256 (files.layer_sha256 in specbeam_config.json) is verified once per file,
the first time it is read (at load for resident and host layers, on its first stream for disk layers), and
every streamed read checks the file by cheap means: a regular file (opened non-blocking, so a FIFO put in its
place cannot hang the loader), of the identity (device, inode, size, mtime, ctime) it had when its hash was
checked; a changed identity (bytes rewritten in place, another file renamed over it) is hashed again. A
corrupted, replaced or removed file fails with its name instead of giving fluent wrong text. The embedding table
(TableRows) is checked the same way through integrity.verify_open, its block scales at load. Threads: a lock
guards the prefetch bookkeeping; one forward pass at a time owns the two stream buffers (OnnxCausalLM serialises
its streamed passes).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import ModelFolderError
from ..embedding_form import DEFAULTS, block_values, side_keys, unpack4
from .integrity import verify_open

PLACES = ("resident", "host", "disk")


@dataclass
class OffloadStats:
    passes: int = 0
    bytes_moved: int = 0
    wait_seconds: float = 0.0      # time the compute waited for a layer load (transfer not hidden)
    load_seconds: float = 0.0      # time spent loading in the background thread
    compute_seconds: float = 0.0

    def per_pass(self) -> dict:
        n = max(1, self.passes)
        return {"passes": self.passes, "bytes_moved_per_pass": self.bytes_moved // n,
                "load_ms_per_pass": round(1e3 * self.load_seconds / n, 3),
                "wait_ms_per_pass": round(1e3 * self.wait_seconds / n, 3),
                "compute_ms_per_pass": round(1e3 * self.compute_seconds / n, 3)}


def layer_nbytes(manifest: list[dict]) -> int:
    """Bytes of one layer's weight file that the manifest uses (its tensors' extent)."""
    return max(m["offset"] + int(np.prod(m["shape"])) * np.dtype(m["dtype"]).itemsize for m in manifest)


@dataclass(frozen=True)
class Placement:
    places: tuple[str, ...]
    layer_bytes: int
    resident_minimum: int

    def count(self, place: str) -> int:
        return sum(p == place for p in self.places)


def plan(num_layers: int, layer_bytes: int, fixed_bytes: int, max_memory: int | None,
         host_memory: int | None = 0, places: list[str] | None = None) -> Placement:
    """Resident layers first (as many as fit in max_memory after the embeddings/head and, if anything is
    streamed, two layer buffers), then host layers up to host_memory (None = unlimited), then disk."""
    if places is not None:
        bad = [p for p in places if p not in PLACES]
        if bad or len(places) != num_layers:
            raise ValueError(f"placement must list {num_layers} of {PLACES}, got {places}")
        streamed = any(p != "resident" for p in places)
        minimum = fixed_bytes + (2 * layer_bytes if streamed else 0)
        return Placement(tuple(places), layer_bytes, minimum)
    minimum = fixed_bytes + 2 * layer_bytes
    if max_memory is None or max_memory >= fixed_bytes + num_layers * layer_bytes:
        return Placement(("resident",) * num_layers, layer_bytes, fixed_bytes)
    if max_memory < minimum:
        raise ValueError(f"max_memory {max_memory / 2**20:.1f} MiB is below the resident minimum "
                         f"{minimum / 2**20:.1f} MiB (embeddings and head {fixed_bytes / 2**20:.1f} MiB + two "
                         f"layer buffers of {layer_bytes / 2**20:.1f} MiB)")
    n_res = min(num_layers - 1, (max_memory - minimum) // layer_bytes)
    n_host = num_layers - n_res if host_memory is None else min(num_layers - n_res, host_memory // layer_bytes)
    places = ["resident"] * n_res + ["host"] * n_host + ["disk"] * (num_layers - n_res - n_host)
    return Placement(tuple(places), layer_bytes, minimum)


PAGE = 4096
SWAP_WAIT = 0.5      # seconds a read waits for a model file missing while `export --overwrite` swaps folders


def open_through_swap(path: Path, flags: int) -> int:
    """os.open(path, flags), waiting out a folder swap: `export --overwrite` renames the old folder aside and then
    the new one in, and a streaming reader that opened in between (milliseconds on an overlay file system) stopped;
    now it reads the new file, which its SHA-256 check accepts only if it holds the same weights. A file still
    missing after SWAP_WAIT raises FileNotFoundError."""
    deadline = time.monotonic() + SWAP_WAIT
    while True:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def open_regular(path: Path, flags: int, what: str) -> tuple[int, os.stat_result]:
    """(fd, its stat): `path` opened for a read through a folder swap (open_through_swap), non-blocking so a FIFO put
    in its place cannot hang the loader, and refused in one line naming `what` unless it is a regular file."""
    try:
        fd = open_through_swap(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | flags)
    except FileNotFoundError:
        raise ModelFolderError(f"{path}: the {what} was removed while the model was in use; restore it or load the "
                               f"model again") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ModelFolderError(f"{path}: not a regular file any more (a FIFO, device or folder was put in its place); "
                               f"restore the {what} or re-export the model")
    return fd, st


def _aligned(nbytes: int) -> np.ndarray:
    """A uint8 buffer of nbytes rounded up to whole pages, starting on a page boundary."""
    n = -(-nbytes // PAGE) * PAGE
    raw = np.empty(n + PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start:start + n]


class LayerStore:
    """Serves each layer's weights as {name: array}; streams non-resident layers through two buffers."""

    def __init__(self, folder: Path, pattern: str, manifest: list[dict], placement: Placement, device: str = "cpu",
                 checksums: list[str] | None = None):
        """device 'cuda': resident layers become device OrtValues once; streamed layers are copied to the
        device by the background thread (the host->device transfer overlaps the previous layer's compute).
        checksums: hex SHA-256 per layer file (default: files.layer_sha256 of the folder's config; exports
        older than the checksums have none and are checked for size only)."""
        self.manifest, self.placement, self.device = manifest, placement, device
        self.nbytes = layer_nbytes(manifest)
        self.paths = [folder / pattern.format(i=i) for i in range(len(placement.places))]
        self.checksums = checksums if checksums is not None else _config_checksums(folder)
        self.unverified = set(range(len(self.paths))) if self.checksums else set()
        self.identity: dict[int, tuple] = {}      # layer -> _identity of its file when its hash was checked
        for p in self.paths:
            if not p.is_file():
                raise ModelFolderError(f"{p}: layer weight file is missing")
            if p.stat().st_size < self.nbytes:
                raise ModelFolderError(f"{p}: truncated ({p.stat().st_size} bytes, the manifest needs {self.nbytes})")
        self.lock = threading.Lock()      # pending and stats: the compute thread and the loader both touch them
        self.stats = OffloadStats()
        self.direct = hasattr(os, "O_DIRECT")      # all buffers below are page-aligned (see _read)
        self.resident, self.host = {}, {}
        for i, place in enumerate(placement.places):
            if place == "resident":
                self.resident[i] = self._to_device(self._views(self._read(i, _aligned(self.nbytes))))
            elif place == "host":
                self.host[i] = self._read(i, _aligned(self.nbytes))
        self.streamed = [i for i, p in enumerate(placement.places) if p != "resident"]
        self.buffers = [_aligned(self.nbytes) for _ in range(2 if self.streamed else 0)]
        self.buffer_views = [self._views(b) for b in self.buffers]
        self.slot = {i: k % 2 for k, i in enumerate(self.streamed)}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="specbeam-stream") if self.streamed else None
        self.pending: dict[int, object] = {}

    def _to_device(self, views: dict[str, np.ndarray]) -> dict:
        if self.device == "cpu":
            return views
        import onnxruntime as ort

        return {k: ort.OrtValue.ortvalue_from_numpy(v, self.device, 0) for k, v in views.items()}

    def _views(self, buf: np.ndarray) -> dict[str, np.ndarray]:
        return {m["name"]: np.frombuffer(buf, dtype=m["dtype"], count=int(np.prod(m["shape"])),
                                         offset=m["offset"]).reshape(m["shape"]) for m in self.manifest}

    def _read(self, i: int, buf: np.ndarray) -> np.ndarray:
        """Read layer i into buf: O_DIRECT where the file system allows it (page-aligned buffers of whole
        pages; the device writes into the buffer, no page cache is filled and no CPU copies it), else a
        buffered read whose page-cache pages are dropped afterwards; either way the budget holds."""
        if self.direct:
            try:
                return self._read_with(i, buf, os.O_DIRECT)
            except OSError:
                self.direct = False                      # e.g. tmpfs refuses O_DIRECT: buffered from now on
        return self._read_with(i, buf, 0)

    def _verify(self, i: int, buf: np.ndarray) -> None:
        """Check layer i against its checksum the first time it is read (once per file: cheap)."""
        if i not in self.unverified:
            return
        digest = hashlib.sha256(memoryview(buf)[:self.nbytes]).hexdigest()
        if digest != self.checksums[i]:
            raise ModelFolderError(f"{self.paths[i]}: SHA-256 {digest[:12]}... does not match the manifest "
                                   f"({self.checksums[i][:12]}...): the file is corrupted or changed since export; "
                                   f"restore it or re-export the model")
        self.unverified.discard(i)

    def _open(self, i: int, flags: int) -> tuple[int, os.stat_result]:
        """Layer i's file opened for a read (open_regular); a file whose identity changed since its hash was checked
        is checked again (`_verify`)."""
        fd, st = open_regular(self.paths[i], flags, "layer file")
        if self.checksums and self.identity.get(i) != _identity(st):
            self.unverified.add(i)
        return fd, st

    def _read_with(self, i: int, buf: np.ndarray, flags: int) -> np.ndarray:
        fd, st = self._open(i, flags)
        try:
            size = st.st_size
            if size < self.nbytes or (self.checksums and size != self.nbytes):
                raise ModelFolderError(f"{self.paths[i]}: {size} bytes, the manifest needs {self.nbytes} (the file "
                                       f"was truncated or replaced after loading); restore it or re-export the model")
            view, off, chunk = memoryview(buf), 0, 8 << 20
            while off < self.nbytes:
                n = os.preadv(fd, [view[off:off + chunk]], off)
                if n <= 0 or (flags and n % PAGE and off + n < self.nbytes):   # O_DIRECT: short only at the end
                    raise ModelFolderError(f"{self.paths[i]}: read failed at byte {off} (file truncated?)")
                off += n
            if not flags and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # release the page cache: budget holds
            if i in self.unverified:
                self._verify(i, buf)
                self.identity[i] = _identity(st)
        finally:
            os.close(fd)
        return buf

    def _load(self, i: int) -> tuple[dict, float]:
        t0 = time.perf_counter()
        buf = self.buffers[self.slot[i]]
        if i in self.host:
            np.copyto(buf, self.host[i])
        else:
            self._read(i, buf)
        views = self.buffer_views[self.slot[i]]
        if self.device != "cpu":
            views = self._to_device(views)
        return views, time.perf_counter() - t0

    def read_seconds(self, reps: int = 2) -> float:
        """Measured seconds to read one streamed layer the way a pass does (the first streamed layer, into a
        scratch buffer; the fastest of `reps`, so a first read's verification is not counted); 0 when nothing
        streams. A host-memory layer times its copy."""
        if not self.streamed:
            return 0.0
        i, buf, best = self.streamed[0], _aligned(self.nbytes), float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(buf, self.host[i]) if i in self.host else self._read(i, buf)
            best = min(best, time.perf_counter() - t0)
        return best

    def release(self, i: int) -> None:
        """Let go of resident layer i's weights (a session of its own holds them: OnnxCausalLM)."""
        del self.resident[i]

    def prefetch(self, i: int) -> None:
        """Start loading streamed layer i (if it is one) in the background."""
        with self.lock:
            if i in self.slot and i not in self.pending:
                self.pending[i] = self.pool.submit(self._load, i)

    def get(self, i: int) -> dict[str, np.ndarray]:
        if i in self.resident:
            return self.resident[i]
        t0 = time.perf_counter()
        self.prefetch(i)
        with self.lock:
            future = self.pending.pop(i)
        views, seconds = future.result()
        with self.lock:
            self.stats.wait_seconds += time.perf_counter() - t0
            self.stats.load_seconds += seconds      # counted when used: a load started for the next pass
            self.stats.bytes_moved += self.nbytes   # belongs to that pass
        return views


class TableRows:
    """A table file of fixed-size rows (the split layout's embedding, weights/embed.bin) read a row at a time: the
    process maps nothing, so rows it has read do not stay in its memory. A mapped table kept every page a pass
    touched (and the kernel maps up to 16 pages around a fault), so a streamed model's RSS grew with every tree of
    drafted tokens it embedded, outside its budget (docs/HISTORY.md "Arenas under a budget"). The page cache
    still keeps recent rows, as it keeps any file."""

    def __init__(self, path: Path, dtype: str, shape: tuple[int, int], scales: np.ndarray | None = None,
                 bits: int = 8, zero: int = 0, offsets: np.ndarray | None = None, sha256: str | None = None):
        """scales: for an int8 table, or one in a GGUF's own blocks (uint8 codes), fp32 [rows, blocks]: one scale
        per block of a row's values; a value is (code - zero) x its block's scale (+ its block's offset: offsets
        [rows, blocks]), in fp32, as gguf-py dequantizes. bits 4: two codes a byte, a block's first half in the
        low nibbles (export/split.py). sha256: the table file's, as the export recorded it (files.embed_table;
        older exports have none): checked here, and on a read whenever the file's identity changed since."""
        self.path, self.dtype, self.shape = Path(path), np.dtype(dtype), tuple(shape)
        self.bits, self.zero, self.scales, self.offsets = bits, zero, scales, offsets
        self.row_bytes = self.shape[1] * self.dtype.itemsize * bits // 8
        self.sha256, self.identity = sha256, None      # identity: _identity of the version last checked
        os.close(self._open())

    def _open(self) -> int:
        """The table file opened for a read (open_regular); a version other than the one last checked is checked
        against its SHA-256 (integrity.verify_open: rows reordered in place or another table renamed over it gave
        fluent garbage)."""
        fd, st = open_regular(self.path, 0, "embedding table")
        try:
            if self.sha256 and _identity(st) != self.identity:
                self.identity = _identity(verify_open(self.path, fd, self.sha256))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (any shape of ints within the table), shape ids.shape + (columns,); each distinct
        row read once."""
        ids = np.asarray(ids)
        uniq, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        rows = np.empty((len(uniq), self.row_bytes // self.dtype.itemsize), self.dtype)
        with open(self._open(), "rb", buffering=0) as f:
            for k, i in enumerate(uniq.tolist()):
                f.seek(i * self.row_bytes)
                if f.readinto(memoryview(rows[k]).cast("B")) != self.row_bytes:
                    raise ModelFolderError(f"{self.path}: short read at row {i} (the table was truncated after "
                                           f"loading); restore it or re-export the model")
        if self.scales is not None:
            s = self.scales[uniq]
            codes = rows.reshape(len(uniq), s.shape[1], -1)
            if self.bits == 4:
                codes = unpack4(codes)
            rows = block_values(codes, s, self.zero, None if self.offsets is None else self.offsets[uniq])
        return rows[inverse].reshape(ids.shape + (self.shape[1],))


def embedding_table(folder: Path, table: dict, rows: int) -> TableRows:
    """files.embed_table's table (its entry checked by folder_files.check_embed_table; its forms: embedding_form.py):
    the block scales and offsets it names read whole, each checked first against the SHA-256 the export recorded
    (scale_sha256, offset_sha256), and the table file, read by row, against its own (sha256). Exports older than a
    field go unchecked by it."""
    def blockwise(what):
        key, digest = side_keys(what)
        if key not in table:
            return None
        file, want = Path(folder) / table[key], table.get(digest)
        with open(file, "rb", buffering=0) as f:
            if want:
                verify_open(file, f.fileno(), want)
                f.seek(0)
            return np.fromfile(f, np.float32).reshape(rows, -1)
    return TableRows(Path(folder) / table["file"], table["dtype"], tuple(table["shape"]), blockwise("scale"),
                     table.get("bits", DEFAULTS["bits"]), table.get("zero", DEFAULTS["zero"]), blockwise("offset"),
                     table.get("sha256"))


def _identity(st: os.stat_result) -> tuple:
    """What a file's version is known by without reading it."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _config_checksums(folder: Path) -> list[str] | None:
    """files.layer_sha256 of a model folder (validated by ModelConfig.load), or None for older exports."""
    try:
        return json.loads((folder / "specbeam_config.json").read_text())["files"].get("layer_sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
