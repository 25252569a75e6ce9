"""A preallocated key/value cache written at explicit slots.

Layout per layer: keys and values `[batch, kv_heads, capacity, head_dim]`. Each batch row has its
own fill length (`lengths[b]`) and each slot remembers the position (`positions[b, s]`) that was
written into it, which is what the sliding-window layers need: a query at position `t` may see a
slot at position `s` when `t - s < window`. Every layer keeps all slots (no ring buffer), so the
window is applied in the mask and is correct at every length, also after a rollback across the
window boundary.

Rollback is the whole point of this design (as in gpt-fast): the engine writes the verify block at
slots `[length, length + T)`, and keeping only the accepted prefix is `truncate`, which just moves
the length; stale slots beyond it are never read and are overwritten later. A token tree verified
in one pass is kept by `compact(indices)`, which moves the accepted nodes' slots into a contiguous
run first.

A finished row's filled slots can be copied out (`export_row`, a `KVPrefix`) and later copied
into another row (`import_row`): that is what prefix caching keeps. Because slots carry their
positions and every layer keeps every slot, a copied prefix of n tokens is exactly the state a
prefill of those n tokens leaves, sliding-window layers included.

Only the engine decides what to keep; the model only writes and reads.

On the CPU the big tables are anonymous memory the system commits page by page as slots are
written (`lazy_zeros`), so a server's cache sized for the model's whole context costs memory only
for the tokens its rows hold.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InvalidRequestError


# The cache's element type: "auto" is float16 under a float32 model on the CPU (llama.cpp's default
# KV type too): a 16-row server step reads each row's keys and values once per layer, as many bytes
# as the weights in float32, and the compiled attention converts float16 as it loads (exactly, so a
# row's result still depends only on its own slots: batched rows stay equal to a row alone, and a
# verify pass to its one-token steps). float32 keeps the model's own numbers.
KV_DTYPES = ("auto", "float32", "float16")


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The cache dtype for `kv_dtype` (one of KV_DTYPES) under a model computing in `model_dtype`."""
    if kv_dtype == "auto":
        on_cpu = torch.device(device).type == "cpu"
        return torch.float16 if on_cpu and model_dtype == torch.float32 else model_dtype
    return {"float32": torch.float32, "float16": torch.float16}[kv_dtype]


# Below this size a table is plain `torch.zeros` (a mapping of its own would only waste a page).
LAZY_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A zero tensor of `shape`; on the CPU and from LAZY_BYTES on, in an anonymous mapping of its
    own, whose pages read as zero and take memory only once written (`torch.zeros` writes, so
    commits, every byte at once). The tensor holds the mapping; the mapping goes with it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


@dataclass(frozen=True)
class KVPrefix:
    """The first `length` slots of one cache row, copied out (`KVCache.export_row`)."""

    keys: list[Tensor]  # per layer [kv_heads, length, head_dim]
    values: list[Tensor]  # per layer [kv_heads, length, head_dim]
    positions: Tensor  # [length]

    @property
    def length(self) -> int:
        return self.positions.shape[0]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.values = [lazy_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.positions = lazy_zeros((batch, capacity), torch.long, device)  # [batch, capacity]
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]
        self.capacity = capacity

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def slot_bytes(self) -> int:
        """What one slot of every row takes once written: keys, values and positions."""
        tables = self.keys + self.values + [self.positions]
        return sum(t.numel() * t.element_size() for t in tables) // self.capacity

    def length(self, row: int = 0) -> int:
        return int(self.lengths[row])

    def check_room(self, new_tokens: int) -> None:
        if int(self.lengths.max()) + new_tokens > self.capacity:
            raise InvalidRequestError(
                f"sequence of {int(self.lengths.max()) + new_tokens} tokens exceeds the cache capacity "
                f"of {self.capacity} tokens"
            )

    def write(self, layer: int, key: Tensor, value: Tensor, slots: Tensor) -> None:
        """Store one layer's new keys and values.

        key, value: [batch, kv_heads, T, head_dim]; slots: [batch, T] slot indices to write.
        An indexed assignment touches the written slots only (`scatter_` on the CPU walks, and so
        commits, the whole table at every call).
        """
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]  # [batch, 1]
        self.keys[layer][rows, :, slots] = key.transpose(1, 2).to(self.keys[layer].dtype)  # [batch, T, kv_heads, hd]
        self.values[layer][rows, :, slots] = value.transpose(1, 2).to(self.values[layer].dtype)

    def truncate(self, length: int | Tensor, row: int | None = None) -> None:
        """Roll back to `length` tokens (for one row, or every row when `row` is None)."""
        if row is None:
            self.lengths.copy_(torch.as_tensor(length, device=self.lengths.device).expand_as(self.lengths))
        else:
            self.lengths[row] = int(length)

    def rows(self, stop: int, start: int = 0) -> "KVCache":
        """A view of rows `[start, stop)` sharing this cache's storage (for continuous batching).

        Writes, length moves and truncations through the view land in this cache, so a scheduler
        can run `forward` over just the rows in use.
        """
        view = KVCache.__new__(KVCache)
        view.keys = [k[start:stop] for k in self.keys]
        view.values = [v[start:stop] for v in self.values]
        view.positions = self.positions[start:stop]
        view.lengths = self.lengths[start:stop]
        view.capacity = self.capacity
        return view

    def move_row(self, src: int, dst: int) -> None:
        """Copy row `src`'s filled slots (keys, values, positions, length) into row `dst`."""
        n = int(self.lengths[src])
        for store in (self.keys, self.values):
            for layer_cache in store:
                layer_cache[dst, :, :n] = layer_cache[src, :, :n]
        self.positions[dst, :n] = self.positions[src, :n]
        self.lengths[dst] = n

    def export_row(self, row: int, length: int) -> KVPrefix:
        """A copy of row `row`'s first `length` slots (keys, values, positions)."""
        if not 0 <= length <= int(self.lengths[row]):
            raise ValueError(f"row {row} holds {int(self.lengths[row])} slots, not {length}")
        return KVPrefix([k[row, :, :length].clone() for k in self.keys],
                        [v[row, :, :length].clone() for v in self.values],
                        self.positions[row, :length].clone())

    def import_row(self, prefix: KVPrefix, row: int, length: int | None = None) -> None:
        """Make row `row` hold the first `length` slots of `prefix` (all of it by default), and only
        those: its length becomes `length`."""
        n = prefix.length if length is None else length
        if not 0 <= n <= prefix.length or n > self.capacity:
            raise ValueError(f"cannot take {n} slots of a {prefix.length}-slot prefix into a "
                             f"{self.capacity}-slot row")
        for store, saved in ((self.keys, prefix.keys), (self.values, prefix.values)):
            for layer_cache, layer_saved in zip(store, saved):
                layer_cache[row, :, :n] = layer_saved[:, :n]
        self.positions[row, :n] = prefix.positions[:n]
        self.lengths[row] = n

    def compact(self, indices: list[int], start: int, row: int = 0) -> None:
        """Keep the slots `start + i` for i in `indices` (an accepted tree path), packed at `start`.

        The kept slots must be in increasing order; afterwards the row's length is
        `start + len(indices)`. Their stored positions move with them.
        """
        src = torch.tensor([start + i for i in indices], dtype=torch.long, device=self.lengths.device)
        dst = torch.arange(start, start + len(indices), device=self.lengths.device)
        for store in (self.keys, self.values):
            for layer_cache in store:
                layer_cache[row, :, dst] = layer_cache[row, :, src]
        self.positions[row, dst] = self.positions[row, src]
        self.lengths[row] = start + len(indices)
