"""The parts of a GGUF file the conversion needs: its scalar metadata and its tensors, mapped.

gguf's own `GGUFReader` builds a NumPy view for every part of every metadata value. For a 262k-token
vocabulary that is millions of small arrays, costing seconds and most of a gigabyte, all for
the tokenizer arrays, which the conversion does not read (transformers builds the tokenizer from
the file itself). This reader walks the same layout (GGUF v2/v3, little-endian) with `struct`,
steps over arrays of strings without keeping them, and maps the tensor data without copying.

Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count; the metadata as
(string key, u32 type, value); then per tensor (string name, u32 dims, u64 x dims shape, u32 ggml
type, u64 offset); the data starts at the next multiple of `general.alignment` (default 32) and
each tensor's bytes at its offset from there. A string is a u64 length and UTF-8 bytes; an array
is a u32 element type, a u64 count and the elements.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one element (8 = string and 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml types whose data is plain numbers (the rest are quantised blocks, mapped as bytes)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    data: np.ndarray  # mapped, read-only: numbers [rows..., columns] or quantised bytes [rows..., row bytes]


@dataclass(frozen=True)
class GgufFile:
    """`fields`: metadata key -> value (a Python scalar or str; an array of numbers as a mapped
    NumPy array; an array of strings or of arrays only as its length, `Skipped`)."""

    fields: dict[str, object]
    tensors: list[GgufTensor]


@dataclass(frozen=True)
class Skipped:
    count: int


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise struct.error("the file ends inside its header (truncated?)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int, mapped: np.ndarray):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise struct.error(f"unknown metadata value type {kind}")
        element, count = self.unpack("<I"), self.unpack("<Q")
        if element == _STRING:  # step over them: a vocabulary is hundreds of thousands
            for _ in range(count):
                length = self.unpack("<Q")  # (not `self.pos += self.unpack(...)`: that adds to the old pos)
                self.pos += length
            if self.pos > len(self.buf):
                raise struct.error("an array of strings runs past the end of the file")
            return Skipped(count)
        if element == _ARRAY:  # arrays of arrays: nothing the conversion reads
            for _ in range(count):
                self.value(_ARRAY, mapped)
            return Skipped(count)
        if element not in _SCALARS:
            raise struct.error(f"unsupported array element type {element}")
        dtype = np.dtype(_SCALARS[element])
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
            raise struct.error("array runs past the end of the file")
        array = mapped[self.pos : end].view(dtype)
        self.pos = end
        return array


def read_gguf(path: Path) -> GgufFile:
    """Parse `path`'s header; the tensors stay in the mapped file. Raises ModelLoadError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    if bytes(mapped[:4]) != _MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
    cur = _Cursor(memoryview(mapped))
    cur.pos = 4
    try:
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"), mapped)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    except struct.error as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: invalid general.alignment {alignment!r}")
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, raw_type, offset in infos:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{path}: tensor {name} has an unknown ggml type {raw_type}") from exc
        rows_first = tuple(reversed(dims))
        elements = math.prod(dims)
        begin = start + offset
        if raw_type in _PLAIN:
            dtype, shape = np.dtype(_PLAIN[raw_type]), rows_first
            nbytes = elements * dtype.itemsize
        else:
            if rows_first[-1] % block:
                raise ModelLoadError(f"{path}: tensor {name}: row of {rows_first[-1]} is not whole {ggml_type.name} blocks")
            dtype, shape = np.dtype(np.uint8), (*rows_first[:-1], rows_first[-1] // block * type_size)
            nbytes = elements // block * type_size
        if begin + nbytes > len(mapped):
            raise ModelLoadError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        data = mapped[begin : begin + nbytes].view(dtype).reshape(shape)
        tensors.append(GgufTensor(name, ggml_type, dims, data))
    return GgufFile(fields, tensors)


# ggml block types that hold 4 bits a weight (plus per-block scales): what `quantize="int4"` keeps.
_FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS")


def layer_weight_bits(path: Path) -> int | None:
    """4 when most of the decoder layers' matrix weights (by element count) are stored on a 4-bit
    ggml type (a Q4_K_M file: Q4_K, with some Q6_K), 8 when most are on another quantised type
    (Q5-Q8), None for float layers or a file without decoder layers. Reads the header only."""
    four = other = floats = 0
    for t in read_gguf(path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        elements = math.prod(t.shape)
        name = t.tensor_type.name
        if name in _FOUR_BIT_TYPES:
            four += elements
        elif name in ("F32", "F16", "BF16", "F64"):
            floats += elements
        else:
            other += elements
    if four + other <= floats:
        return None
    return 4 if four > other else 8
