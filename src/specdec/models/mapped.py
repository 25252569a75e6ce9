"""The kernel-layout cache: a quantised GGUF model stored as the CPU kernels read it, read back at load.

Why. A GGUF model used to be converted once into float32 safetensors (4x a 4-bit file's bytes on
disk) and every load read that float32 back and quantised and packed it again. An entry here holds
what quantising leaves (`quant.quantize_model`): the int8 tables padded (and packed in 16-row blocks
in AVX-512 VNNI builds), the 4-bit tables as `int4_pack` lays them out, their float32 scales, and the
few float tensors kept as the model holds them (norms, biases: float32, so a load is bit for bit
the model that quantising builds). A load maps the file and places each table: nothing is
dequantised, quantised or packed again.

Where the bytes go. The file is mapped; a table the kernels stream alone on huge pages
(`quant._alone_on_huge_pages`) is read from it into a `table_empty` buffer (a mapped file lies on
4 KiB pages, where the kernels' weight stream runs slower: quant.py module doc), and the smaller
tables are copied side by side into one shared huge-page table (`quant.gather_small_tables`), as
after quantising; scales, norms and biases are copied out of the mapping. The loaded model keeps
no mapping of the file (`_own_the_rest`). Reading int8 or 4-bit bytes costs a fraction of reading
float32 and quantising it (BENCHMARKS.md, load time and the model cache).

One entry per (model file, quantisation, kernel layout): `cache_root()/mapped/STEM-QUANT-KEY/` with
KEY a hash of the file's path, the quantisation and `layout_id()`. It holds `weights.bin` (each
tensor at an aligned offset), `config.json`, the tokenizer files and `manifest.json`, written
last (an entry without it is unfinished). The manifest records the source's size and modification
time and a hash of them (as the float32 conversion's key does), the layout, and each file's size
and a hash of its tail: an entry whose source changed, whose layout is not this build's, or whose
file was cut is rebuilt, with one line on stderr saying which and why. `used` is touched at
each load (what `specdec models --cache` shows as last used; `--prune` removes stale entries and
those unused for a while).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError
from . import build as model_build
from . import cpu_kernels
from .gguf_file import read_gguf
from .transformer import Transformer
from .cache_dir import build_lock, cache_root
from .quant import Int4Linear, Int8Embedding, Int8Linear, _alone_on_huge_pages, gather_small_tables

# Bump when what an entry stores changes meaning: the quantisers (`quantize_rows`, `quantize_int4`),
# the int8 padding or packing, `int4_pack`'s layout, or this file's format.
LAYOUT_VERSION = 1
WEIGHTS, MANIFEST, USED = "weights.bin", "manifest.json", "used"
_TAIL_BYTES = 1 << 16  # the part of each file hashed into the manifest (the size catches a cut)
_ALIGN_SMALL, _ALIGN_LARGE = 64, 4096  # offsets of tensors in weights.bin: cache lines, pages from 1 MiB
_SHOW_AFTER_S = 2.0  # a load that takes longer than this shows its progress
_READ_THREADS = 4  # at most: a warm load's reads scale with cores (`_Reader`), and a few saturate memory


def subdir() -> Path:
    return cache_root() / "mapped"


def layout_id(kernels) -> str:
    """What the stored tables' layout depends on besides the model: this file's version and the
    kernel build's int8 row padding and packing (AVX-512 VNNI builds pack 16-row blocks)."""
    return f"v{LAYOUT_VERSION}-rows{kernels.int8_row_multiple()}{'-packed' if kernels.int8_packed() else ''}"


def source_stamp(path: Path) -> dict:
    """The source file as the entry remembers it: its path, size, modification time and their hash."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror})") from exc
    resolved = str(path.resolve())
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return {"path": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "hash": key}


def entry_dir(path: Path, quantize: str, layout: str) -> Path:
    key = hashlib.sha256(f"{path.resolve()}|{quantize}|{layout}".encode()).hexdigest()[:16]
    return subdir() / f"{path.stem}-{quantize}-{key}"


def _tail_hash(file: Path, size: int) -> str:
    with open(file, "rb") as f:
        f.seek(max(0, size - _TAIL_BYTES))
        return hashlib.sha256(f.read(_TAIL_BYTES)).hexdigest()[:16]


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def stale_reason(folder: Path, manifest: dict | None, stamp: dict | None, layout: str | None) -> str | None:
    """Why the entry in `folder` cannot be used as it is (None: it can). `stamp` / `layout`: the
    source's and this build's now (None: not checked; `specdec models --cache` without the kernels)."""
    if manifest is None:
        return "its manifest is missing or unreadable"
    source = manifest.get("source", {})
    if stamp is not None and source.get("hash") != stamp["hash"]:
        if not Path(source.get("path", "")).exists():
            return "its source file is gone"
        return (f"its source changed (size {source.get('size')} -> {stamp['size']} bytes)"
                if source.get("size") != stamp["size"] else "its source changed (modified since)")
    if layout is not None and manifest.get("layout") != layout:
        return f"its kernel layout {manifest.get('layout')} is not this build's {layout}"
    for name, expected in manifest.get("files", {}).items():
        file = folder / name
        size = file.stat().st_size if file.is_file() else -1
        if size != expected["size"]:
            return f"{name} is cut ({max(size, 0)} of {expected['size']} bytes)"
        if _tail_hash(file, size) != expected["tail"]:
            return f"{name} is not what was written (its hash differs)"
    return None


# --------------------------------------------------------------------------------------------
# Progress


class Progress:
    """A counter on stderr for work that may take a while: silent for its first `_SHOW_AFTER_S`
    seconds, then one line rewritten in place on a terminal, or a line per tenth elsewhere (a
    server's log)."""

    def __init__(self, what: str, total: int, unit: str = "MB", scale: float = 1e-6):
        self.what, self.total, self.unit, self.scale = what, total, unit, scale
        self.start, self.shown, self.tenth = time.monotonic(), False, -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if time.monotonic() - self.start < _SHOW_AFTER_S and not self.shown:
            return
        tenth = 10 * done // max(1, self.total)
        if not self.tty and tenth == self.tenth:
            return
        self.tenth, self.shown = tenth, True
        text = f"specdec: {self.what}: {done * self.scale:,.0f}/{self.total * self.scale:,.0f} {self.unit}"
        print(("\r" + text) if self.tty else text, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            self(self.total)
            if self.tty:
                print(file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Writing an entry


def _module_tensors(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """(modules: prefix -> how to rebuild it, tensors: stored name -> tensor) of a quantised model."""
    modules, tensors = {}, {}
    head = getattr(model, "lm_head", None)
    for prefix, module in model.named_modules():
        if isinstance(module, Int4Linear):
            modules[prefix] = {"kind": "int4", "shape": [module.out_features, module.in_features]}
            tensors[f"{prefix}.q"] = module._q
        elif isinstance(module, Int8Linear):
            modules[prefix] = {"kind": "int8", "shape": [module.out_features, module.in_features],
                               "row_blocks": module._row_blocks}
            tensors[f"{prefix}.q"], tensors[f"{prefix}.scale"] = module._q, module._scale4
        elif isinstance(module, Int8Embedding):
            if isinstance(head, Int8Linear) and module.q.untyped_storage().data_ptr() == head._q.untyped_storage().data_ptr():
                modules[prefix] = {"kind": "tied"}  # the head's rows (`Int8Linear.as_embedding`)
                continue
            modules[prefix] = {"kind": "embedding", "dim": module.embedding_dim, "row_blocks": module.row_blocks}
            tensors[f"{prefix}.q"], tensors[f"{prefix}.scale"] = module.q, module.scale
        else:
            continue
        if getattr(module, "bias", None) is not None:
            modules[prefix]["bias"] = True
            tensors[f"{prefix}.bias"] = module.bias.data
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in modules:
            tensors[f"param.{name}"] = param.data
    return modules, tensors


def _write_weights(file: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write every tensor at an aligned offset; returns name -> {dtype, shape, offset}."""
    index, offset = {}, 0
    with open(file, "wb") as f:
        for name, tensor in tensors.items():
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            align = _ALIGN_LARGE if data.nbytes >= 1 << 20 else _ALIGN_SMALL
            pad = -offset % align
            f.write(b"\0" * pad)
            offset += pad
            index[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                           "offset": offset}
            f.write(memoryview(data))
            offset += data.nbytes
    return index


def build(path: Path, folder: Path, quantize: str, layout: str, stamp: dict, progress=None) -> None:
    """Quantise `path` straight from its GGUF tensors (no float32 file) and write the entry."""
    gguf = read_gguf(path)
    raw = model_build._gguf_config(gguf)
    cfg = model_build.config_from_hf(raw)
    count = [0]
    total = len(gguf.tensors)
    if progress is None:  # no caller's counter (a server): our own, on stderr, after the first seconds
        counter = Progress(f"quantising {path.name} once into the cache", total, "tensors", 1)
        report = lambda done, total: counter(done)  # noqa: E731
    else:
        report, counter = progress, None

    def read_one():
        report(count[0], total)
        count[0] += 1

    state = model_build.gguf_sources(gguf, raw, read_one)
    model = model_build.build_model(cfg, state, torch.float32, "cpu", quantize)
    report(total, total)
    if counter is not None:
        counter.close()
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        modules, tensors = _module_tensors(model)
        index = _write_weights(tmp / WEIGHTS, tensors)
        del model, tensors, state, gguf
        model_build.release_freed_memory()
        (tmp / "config.json").write_text(json.dumps(raw, indent=1))
        print(f"specdec: reading the tokenizer of {path.name} (once)", file=sys.stderr, flush=True)
        model_build._gguf_tokenizer(path, tmp, raw["model_type"])
        size = (tmp / WEIGHTS).stat().st_size
        manifest = {"format": 1, "layout": layout, "quantize": quantize, "source": stamp, "modules": modules,
                    "tensors": index, "files": {WEIGHTS: {"size": size, "tail": _tail_hash(tmp / WEIGHTS, size)}},
                    "created": time.time()}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        (tmp / USED).touch()
        old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure(path: Path, quantize: str, progress=None) -> Path | None:
    """The entry for GGUF `path` under `quantize` ("int8" / "int4"), built or rebuilt if need be;
    None where there are no compiled kernels to lay tables out for (the float32 path then serves)."""
    kernels = cpu_kernels.load()
    if kernels is None or quantize not in ("int8", "int4"):
        return None
    layout = layout_id(kernels)
    stamp = source_stamp(path)
    folder = entry_dir(path, quantize, layout)
    if stale_reason(folder, read_manifest(folder), stamp, layout) is None:
        return folder
    with build_lock(folder):
        manifest = read_manifest(folder)
        reason = stale_reason(folder, manifest, stamp, layout)
        if reason is None:  # another process built it meanwhile
            return folder
        if manifest is not None or folder.exists():
            print(f"specdec: rebuilding the cached {quantize} model {folder.name}: {reason}", file=sys.stderr, flush=True)
        build(path, folder, quantize, layout, stamp, progress)
    return folder


# --------------------------------------------------------------------------------------------
# Loading an entry


def is_entry(folder: Path) -> bool:
    return (folder / MANIFEST).is_file() and (folder / WEIGHTS).is_file()


def _mapped_tensors(folder: Path, manifest: dict):
    """name -> a tensor viewing the mapped weights.bin (copy-on-write: the file is never written)."""
    with open(folder / WEIGHTS, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    whole = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, entry in manifest["tensors"].items():
        dtype = getattr(torch, entry["dtype"])
        nbytes = math.prod(entry["shape"]) * torch.empty((), dtype=dtype).element_size()
        start = entry["offset"]
        if start + nbytes > whole.numel():
            raise ModelLoadError(f"{folder / WEIGHTS}: tensor {name} runs past the end of the file (cut?)")
        out[name] = whole[start : start + nbytes].view(dtype).view(entry["shape"])
    return out  # (each view holds the mapping open; it closes with the last of them)


class _Reader:
    """Reads tables' bytes from weights.bin into their buffers on a few threads, 64 MiB a piece.

    Why threads: a warm load's reads are mostly the kernel's work of faulting in fresh huge pages and
    copying the page cache into them, one core's worth per reading thread, and nothing uses a table
    before the load ends (`finish`), so the pieces may land in any order. A cold file reads from
    the disk the same way. Pieces are small enough that the progress counter moves."""

    PIECE = 64 << 20

    def __init__(self, path: Path, offsets: dict, progress: Progress):
        self.fd = os.open(path, os.O_RDONLY)
        self.offsets, self.progress, self.done = offsets, progress, 0
        self.lock = threading.Lock()
        # The cores this process may use; where there is no affinity call (macOS), the machine's.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        threads = max(1, min(_READ_THREADS, cores or 1))
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="specdec-load")
        self.pending = []

    def __call__(self, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Put `table`'s bytes (a view of the mapping) into `out`, which is returned at once: its
        bytes are there after `finish`."""
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        offset = self.offsets[id(table)]
        for start in range(0, len(view), self.PIECE):
            self.pending.append(self.pool.submit(self._piece, view[start : start + self.PIECE], offset + start))
        return out

    def _piece(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], offset + got)
            if n <= 0:
                raise ModelLoadError("the cache entry's weights.bin ends inside a table (cut?)")
            got += n
        with self.lock:
            self.done += got
            self.progress(self.done)

    def finish(self) -> None:
        """Wait for every read; the first that failed raises here."""
        for future in self.pending:
            future.result()

    def close(self) -> None:
        """Drop the reads not begun, wait for those under way, close the file."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _place(table: torch.Tensor, read, kernels) -> torch.Tensor:
    """Weight table `table` (a view of the mapped file) in memory the kernels stream well: a table
    that lies alone on huge pages is read from the file into its own `table_empty` buffer; a smaller
    one stays a view of the mapping until `gather_small_tables` reads it, beside the others, into
    one huge-page table. Reading into those buffers beat copying out of the mapping several times
    over (its 4 KiB pages fault in one by one; BENCHMARKS.md, load time and the model cache)."""
    if not _alone_on_huge_pages(table.numel() * table.element_size()):
        return table
    return read(table, kernels.table_empty(list(table.shape), table.dtype))


def _rebuilt_module(kind: dict, prefix: str, get, place, head):
    bias = get(f"{prefix}.bias").clone() if kind.get("bias") else None
    if kind["kind"] == "int4":
        return Int4Linear.from_packed(place(get(f"{prefix}.q")), tuple(kind["shape"]), bias)
    if kind["kind"] == "int8":
        return Int8Linear.from_stored(place(get(f"{prefix}.q")), get(f"{prefix}.scale").clone(),
                                      tuple(kind["shape"]), kind["row_blocks"], bias)
    if kind["kind"] == "tied":
        return head.as_embedding()
    return Int8Embedding(place(get(f"{prefix}.q")), get(f"{prefix}.scale").clone(), kind["row_blocks"], kind["dim"])


def _assemble(model: nn.Module, manifest: dict, mapped: dict, place, dtype: torch.dtype) -> None:
    """Put the entry's layers and float tensors into the skeleton `model`, in place."""
    modules = manifest["modules"]
    for prefix in sorted(modules, key=lambda p: modules[p]["kind"] == "tied"):  # a tied embedding after its head
        parent, _, name = prefix.rpartition(".")
        layer = _rebuilt_module(modules[prefix], prefix, mapped.__getitem__, place, getattr(model, "lm_head", None))
        setattr(model.get_submodule(parent) if parent else model, name, layer)
    params = {n.removeprefix("param."): t.to(dtype, copy=True) if t.is_floating_point() else t.clone()
              for n, t in mapped.items() if n.startswith("param.")}
    model.load_state_dict(params, strict=False, assign=True)
    # What fusing removed (q/k/v, gate/up) is still a meta module of the skeleton: drop it.
    for prefix, module in list(model.named_modules()):
        if prefix and prefix not in modules and any(p.is_meta for p in module.parameters(recurse=False)):
            parent, _, name = prefix.rpartition(".")
            delattr(model.get_submodule(parent) if parent else model, name)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ModelLoadError(f"the cache entry lacks {leftover[0]} (and {len(leftover) - 1} more); rebuild it")
    for i, spec in enumerate(model._rope_specs):  # non-persistent buffers made on meta
        setattr(model, f"inv_freq_{i}", spec.inv_freq(model.config.head_dim).float())


def _own_the_rest(model: nn.Module, offsets: dict, read) -> None:
    """Read into memory of their own the tables still viewing the mapping (those
    `gather_small_tables` leaves where they are: a small table a tied embedding shares, a lone small
    one), so that the model keeps no mapping of the file: a file cut while it is mapped would kill
    the process (SIGBUS) at its next read."""
    head = getattr(model, "lm_head", None)
    tied = [m for m in model.modules() if isinstance(m, Int8Embedding) and isinstance(head, Int8Linear) and m.q is head._q]
    for module in model.modules():
        if isinstance(module, Int8Linear) and id(module._q) in offsets:
            module._q = read(module._q, torch.empty(module._q.shape, dtype=module._q.dtype))
    for module in model.modules():
        if any(module is m for m in tied):
            module.q = head._q
        elif isinstance(module, Int8Embedding) and id(module.q) in offsets:
            module.q = read(module.q, torch.empty(module.q.shape, dtype=module.q.dtype))


def load_entry(folder: Path, dtype: torch.dtype, device) -> Transformer:
    """The model of entry `folder`, its tables placed for the kernels (module doc)."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ModelLoadError(f"{folder}: not a readable cache entry (no {MANIFEST})")
    kernels = cpu_kernels.load()
    if kernels is None or manifest.get("layout") != layout_id(kernels):
        raise ModelLoadError(f"{folder}: laid out for other CPU kernels; load its source instead")
    with model_build._skeleton():
        model = Transformer(model_build.read_config(folder))
    mapped = _mapped_tensors(folder, manifest)
    offsets = {id(mapped[n]): entry["offset"] for n, entry in manifest["tensors"].items()}
    table_bytes = sum(t.numel() * t.element_size() for n, t in mapped.items() if n.endswith(".q"))
    progress = Progress(f"loading {folder.name}", table_bytes)
    read = _Reader(folder / WEIGHTS, offsets, progress)
    try:
        _assemble(model, manifest, mapped, lambda t: _place(t, read, kernels), dtype)
        gather_small_tables(model, read)
        _own_the_rest(model, offsets, read)
        read.finish()
    except ModelLoadError as exc:
        raise ModelLoadError(f"{folder}: {exc}") from exc
    finally:
        read.close()
    del mapped, offsets
    progress.close()
    with contextlib.suppress(OSError):
        (folder / USED).touch()
    model = model.to(device).eval()
    # Which entry, and which build of it, the model is: what a draft model keys what it keeps in its
    # entry by (`drafters/draft_cache.py`).
    model.cache_entry = f"{folder.name}@{manifest.get('created')}"
    return model


# --------------------------------------------------------------------------------------------
# Listing and pruning (`specdec models --cache [--prune]`)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _last_used(folder: Path) -> float:
    for name in (USED, MANIFEST, "DONE"):
        with contextlib.suppress(OSError):
            return (folder / name).stat().st_mtime
    return folder.stat().st_mtime


_BUILDING_S = 3600  # a build's folder untouched this long is a leftover (its process died)


def _unfinished(folder: Path) -> str | None:
    """None for an entry; for a build's folder (`.tmp-PID`, `.old-PID`): "building" while it is
    fresh, else "stale: unfinished (...)"."""
    if ".tmp" not in folder.name and ".old-" not in folder.name:
        return None
    if time.time() - folder.stat().st_mtime < _BUILDING_S:
        return "building"
    return "stale: unfinished (a build that did not end)"


def cache_entries() -> list[dict]:
    """Every model entry under the cache: kernel-layout entries (`mapped/`) and float32 conversions
    (`gguf/`), each {kind, name, path, source, quantize, bytes, last_used, status}; status "ok" or
    why it is stale. Not the compiled kernels, nor the assembled preset files (`models/`)."""
    kernels = cpu_kernels.load()
    layout = layout_id(kernels) if kernels is not None else None
    rows = []
    for folder in sorted(subdir().glob("*")) if subdir().is_dir() else []:
        if not folder.is_dir():
            continue
        manifest = read_manifest(folder)
        source = (manifest or {}).get("source", {}).get("path")
        stamp = source_stamp(Path(source)) if source and Path(source).is_file() else {"hash": None}
        status = _unfinished(folder)
        if status is None:
            reason = stale_reason(folder, manifest, stamp, layout)
            status = "ok" if reason is None else f"stale: {reason}"
        rows.append({"kind": "kernel layout", "name": folder.name, "path": str(folder), "source": source,
                     "quantize": (manifest or {}).get("quantize"), "bytes": _folder_bytes(folder),
                     "last_used": _last_used(folder), "status": status})
    converted = cache_root() / "gguf"
    for folder in sorted(converted.glob("*")) if converted.is_dir() else []:
        if not folder.is_dir():
            continue
        source = None
        with contextlib.suppress(OSError, ValueError):
            source = json.loads((folder / "source.json").read_text())["path"]
        status = _unfinished(folder)
        if status is not None:
            pass
        elif not (folder / "DONE").exists():
            status = "stale: unfinished (a conversion that did not end)"
        elif source is not None and not Path(source).is_file():
            status = "stale: its source file is gone"
        else:
            status = "ok"
        rows.append({"kind": "float32 conversion", "name": folder.name, "path": str(folder), "source": source,
                     "quantize": "none", "bytes": _folder_bytes(folder), "last_used": _last_used(folder),
                     "status": status})
    return rows


def prune(unused_days: float) -> list[dict]:
    """Remove the stale entries and those unused for `unused_days` days; returns what went."""
    cutoff = time.time() - unused_days * 86400
    gone = [row for row in cache_entries()
            if row["status"] != "building" and (row["status"] != "ok" or row["last_used"] < cutoff)]
    for row in gone:
        shutil.rmtree(row["path"], ignore_errors=True)
        Path(row["path"] + ".lock").unlink(missing_ok=True)
    return gone
