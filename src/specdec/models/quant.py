"""int8 weights and per-token int8 activations for the CPU (`quantize="int8"`).

Why this shape. Decoding one token reads every weight once, so on a CPU its time is the bytes read;
Gemma 3 270M spends most of them in its 262144 x 640 output head. int8 weights read a quarter of
float32's bytes and half of bfloat16's. PyTorch's CPU kernel that reads int8 weights fastest is
fbgemm's dynamic-quantisation linear, whose time barely grows from 1 to 8 rows: exactly what a
verify pass of k + 1 tokens needs. (float32 and bfloat16 matrix products grow about linearly with
the rows on an AVX2 CPU, which would make every drafted row nearly as dear as a step of its own.)

The catch, and how it is closed. That kernel quantises its whole input with one scale, so a row's
result would depend on the other rows in the call: a verify pass over k + 1 tokens would not compute
what k + 1 one-token passes compute, and greedy speculative output would drift from plain output.
So each row is put on its own integer grid first (symmetric, scale s_r = max|x_r| / 63, values
round(x_r / s_r) in [-63, 63]), and a guard row holding -64 and 63 is added so that the kernel's
own quantisation of the block is exactly the identity: with `reduce_range` (7-bit activations,
which AVX2 CPUs need: their u8 x s8 pair-sums saturate at 16 bits with full 8-bit activations) the
range 127 over 127 levels gives scale 1 and zero point 64. The products are then exact integer sums,
rescaled per row by s_r and per output channel by the weight scale: every row's result is
bit-identical whatever else is in the call.

Two planes, one formula. The residual round((x_r / s_r - high) * 126) goes on a second plane, so
the input carries ~13 bits: x_r / s_r ~= (126 high + low) / 126. fbgemm scores both planes (weights
packed with unit scales, so each plane's sum comes back as an exact integer); the compiled kernel
`int8_linear` (cpu_kernels.cpp) puts v = 126 high + low in one int16 and needs one multiply-add per
weight instead of two. Both yield the same exact S = sum_i w_i v_i and the one output formula
float(S) * (s_r / 126) * w_scale (+ bias), so they agree bit for bit. The compiled kernel is used
wherever it is built (faster than fbgemm per layer for the few rows of a step or a verify pass and
for a prefill, and, since it prefetches each next weight tile, as fast as fbgemm for one or two rows of Gemma's
262144 x 640 output head, which saves fbgemm's packed copy of it); fbgemm is the path without it,
and the reference the tests hold it to.

Packed weights (AVX-512 VNNI). Where the kernels are built with AVX-512 VNNI, the int8 rows are
stored in blocks of 16 (cpu_kernels.cpp, `int8_pack`): one instruction then multiplies 4 inputs for
16 outputs, each output summing in its own lane, and the input goes in as its two planes again. The
sums are the same integers, so the outputs are the same bits; `stored_rows` reads rows back.

Weight tables of 1 MiB and more (int8 rows, packed 4-bit blocks) are allocated on transparent huge
pages where the system grants them (cpu_kernels.cpp, `table_empty`): a step streams every weight
once, and on 4 KiB pages that stream crossed a page boundary every 4 KiB. The smaller tables of a
quantised model lie side by side in one such table (`gather_small_tables`). Only where the bytes
lie changes, not their values.

4-bit weights (`quantize="int4"`, `Int4Linear`). Decoding a larger model reads ~1.5 GB of int8
weights a token (Qwen2.5 1.5B), so its speed is the memory's: 4 bits and two half-precision numbers
per group of 32 inputs (weight = a * q + b, q in [0, 15], the group's minimum and step, the shape of
llama.cpp's Q4_K sub-blocks) read 5/8 of int8's bytes. The decoder layers' projections take them;
the output head and the embedding stay int8 (the head chooses every token; Q4_K_M files keep it at
6 bits too). Its input goes on one int8 grid per row (s_r = max|x_r| / 127), and the output is a
fixed sequence of float operations on exact integer group sums (cpu_kernels.cpp, `int4_product`),
row by row: a row's result never depends on the other rows in the call, so greedy speculative
decoding stays exact for the 4-bit model. It runs on the compiled kernels only.

Quantisation changes the target model (plain and speculative decoding are then compared with the
same quantised target, and both are exact with respect to it). The embedding table shares the
head's int8 values and scales when the two are tied.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .layer import Layer

QUANT_MODES = ("none", "int8", "int4")
_LEVELS = 63  # activation grid per plane: integers in [-63, 63] (7-bit, see the module doc)
_linear_dynamic = torch.ops.quantized.linear_dynamic.default
_REUSED_ROWS = 64  # input blocks of up to this many rows a plane reuse one buffer (`_input_block`)


_BLOCK_ELEMENTS = 1 << 22  # float32 elements quantised at a time: 16 MiB, 6553 rows of Gemma's head


def _table_empty(shape: tuple[int, int], dtype: torch.dtype, device) -> Tensor:
    """An empty weight table: on the CPU with the compiled kernels, one that asks for transparent
    huge pages (cpu_kernels.cpp, `table_empty`: a step streams every weight, and 4 KiB pages slowed
    that stream); elsewhere torch.empty."""
    kernels = cpu_kernels.load() if torch.device(device).type == "cpu" else None
    if kernels is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return kernels.table_empty(list(shape), dtype)


def quantize_rows(weight, scratch: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: weight ~= q * scale[:, None]. Returns (q int8 [N, K], scale float32 [N]).

    Works through blocks of rows in one float32 scratch buffer (`scratch`, flat, or made here), with
    in-place ops only, so quantising the 262k-row output head needs 16 MiB of temporaries and leaves
    no freed blocks behind to swell the process (fresh temporaries per block did, by a good part of
    the model's size at peak). `weight` is a tensor, or a
    `loader.StoredTensor`, whose rows are read from disk into the buffer: a load never holds the
    float table. Each row's result depends on that row alone, so quantising parts and stacking
    them equals quantising the stacked matrix (`Int8Linear.concat`).
    """
    n, k = weight.shape
    q = _table_empty((n, k), torch.int8, weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    rows = max(1, min(n, _BLOCK_ELEMENTS // k))
    if scratch is None or scratch.numel() < rows * k or scratch.device != weight.device:
        scratch = torch.empty(rows * k, dtype=torch.float32, device=weight.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = scratch[: (stop - start) * k].view(stop - start, k)
        if isinstance(weight, Tensor):
            w.copy_(weight[start:stop])
        else:
            weight.read_into(start, w)
        # max |w| of each row. (amax and amin apart: torch.aminmax over rows is many times slower,
        # enough to dominate an int8 load; the extremes are exact either way.)
        s = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_(), out=scale[start:stop])
        s.div_(127).clamp_(min=torch.finfo(torch.float32).tiny)
        q[start:stop].copy_(w.div_(s[:, None]).round_().clamp_(-127, 127))
    return q, scale


class Int8Linear(Layer):
    """y = x @ W.T (+ b) with int8 W per output channel and x on a per-row integer grid (module doc)."""

    def __init__(self, weight, bias: Tensor | None = None):  # weight: [N, K] (see `quantize_rows`)
        super().__init__()
        self._setup(*quantize_rows(weight), bias)

    @classmethod
    def from_int8(cls, q: Tensor, scale: Tensor, bias: Tensor | None = None) -> "Int8Linear":
        """The layer with int8 rows `q` [N, K] and their scales [N] as they are."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(q, scale, bias)
        return layer

    @classmethod
    def concat(cls, parts: list["Int8Linear"]) -> "Int8Linear":
        """One layer whose output is the parts' outputs side by side (q/k/v or gate/up fused):
        the same int8 rows and scales, so the same numbers as quantising the fused float matrix."""
        bias = None if parts[0].bias is None else torch.cat([p.bias.data for p in parts])
        return cls.from_int8(torch.cat([p.int8_weight() for p in parts]),
                             torch.cat([p.weight_scale for p in parts]), bias)

    @classmethod
    def from_stored(cls, q: Tensor, scale4: Tensor, shape: tuple[int, int], row_blocks: bool,
                    bias: Tensor | None = None) -> "Int8Linear":
        """The layer over a table exactly as the compiled kernels read it (`_q`, `_scale4` and
        `_row_blocks` of a layer made here): what the kernel-layout cache (`mapped.py`) stores, so a
        load pads and packs nothing. `shape` = (N, K)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt(q, scale4, scale4[: shape[0]], shape, row_blocks, bias)
        layer._packed = None
        return layer

    def _setup(self, q: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        if not cpu_int8_available():
            raise RuntimeError("int8 linears need PyTorch's fbgemm CPU backend")
        n, k = q.shape
        kernels = cpu_kernels.load()
        # The compiled kernels read the int8 rows zero-padded to [ceil4(N), ceil16(K)] (a padded
        # input or output changes no sum), or, in builds with AVX-512 VNNI, to [ceil16(N), ceil16(K)]
        # and packed in blocks of 16 rows (cpu_kernels.cpp, `int8_pack`; read back by `stored_rows`).
        # `q` itself may be packed in place: it is this layer's from here on.
        stored, scale4, row_blocks = None, scale, False
        if kernels is not None:
            rows = kernels.int8_row_multiple()
            n_pad, k16 = -(-n // rows) * rows, -(-k // 16) * 16
            stored = q if (n_pad, k16) == (n, k) else F.pad(q, (0, k16 - k, 0, n_pad - n))
            scale4 = scale if n_pad == n else F.pad(scale, (0, n_pad - n))
            if kernels.int8_packed():
                stored, row_blocks = kernels.int8_pack(stored.contiguous()), True
        self._adopt(stored, scale4, scale, (n, k), row_blocks, bias)
        # fbgemm's kernel (weights packed with unit scales, so that its float sums are the exact
        # integers): the PyTorch path's product, packed here only where the compiled kernels are
        # missing (`_fbgemm` packs it on first use for the reference).
        self._packed = None if kernels is not None else _pack_unit_scales(q)

    def _adopt(self, stored: Tensor | None, scale4: Tensor, scale: Tensor, shape: tuple[int, int], row_blocks: bool,
               bias: Tensor | None) -> None:
        """Take the kernels' table `stored` (None without the compiled kernels), the scales padded
        as its rows (`scale4`) and as many as the outputs (`scale`)."""
        self.out_features, self.in_features = shape
        self.register_buffer("weight_scale", scale, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._q: Tensor | None = stored
        self._scale4 = scale4  # the scales, padded as the rows
        self._row_blocks = row_blocks  # whether `_q` is packed
        guard = torch.zeros(1, self.in_features)
        guard[0, 0], guard[0, -1] = -float(_LEVELS + 1), float(_LEVELS)
        self.register_buffer("_guard", guard, persistent=False)
        self._block: Tensor | None = None  # the reused input block (`_input_block`)
        self._views: dict[int, Tensor] = {}  # its leading [1 + 2n] rows, by n

    def int8_weight(self) -> Tensor:
        """The int8 values [N, K]: a view of the stored rows, or a copy where they are packed."""
        if self._q is not None and not self._row_blocks:
            return self._q[: self.out_features, : self.in_features]
        if self._q is not None:
            return self.int8_rows(torch.arange(self.out_features))
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr()

    def int8_rows(self, ids: Tensor) -> Tensor:
        """The int8 values of rows `ids` (any shape) -> [*ids.shape, K], read from those rows only."""
        if self._q is not None:
            return stored_rows(self._q, self._row_blocks, ids, self.in_features)
        return self.int8_weight()[ids]

    def as_embedding(self) -> "Int8Embedding":
        """An embedding table over this layer's int8 rows and scales as they are stored: a tied
        embedding and output head share one table."""
        if self._q is None:
            return Int8Embedding(self.int8_weight(), self.weight_scale)
        return Int8Embedding(self._q, self.weight_scale, self._row_blocks, self.in_features)

    def _fbgemm(self):
        if self._packed is None:  # the compiled path alone never needs it: made for the reference
            self._packed = _pack_unit_scales(self.int8_weight())
        return self._packed

    def _input_block(self, n: int) -> Tensor:
        """A [1 + 2n, in] input block for fbgemm: the guard row, then n rows of each plane.

        Decode and verify blocks (up to _REUSED_ROWS rows a plane) are written into one buffer kept
        between calls, grown to the largest such block seen; a longer block (a prefill) gets a fresh
        one, so a long prompt leaves no buffer of its size behind. Buffers are made outside
        inference mode so that they can be filled in and out of it; a layer is run by one thread at
        a time (the engine's and the scheduler's loops are single-threaded).
        """
        block = self._views.get(n)
        if block is not None:
            return block
        if n <= _REUSED_ROWS and self._block is not None and self._block.shape[0] >= 1 + 2 * n:
            block = self._views[n] = self._block[: 1 + 2 * n]
            return block
        with torch.inference_mode(False):
            block = torch.cat([self._guard.clone(), torch.zeros(2 * n, self.in_features)])
        if n <= _REUSED_ROWS:
            self._block, self._views = block, {n: block}  # views of a smaller buffer are dropped
        return block

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in_features]
        kernels = cpu_kernels.load()
        if kernels is not None and self._q is not None and x.dtype == torch.float32 and not x.is_cuda:
            return kernels.int8_linear(x, self._q, self._scale4, self.bias, self.out_features)
        lead = x.shape[:-1]
        out = self.forward_rows(x.reshape(-1, self.in_features).float()).view(*lead, self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def forward_rows(self, rows: Tensor) -> Tensor:  # rows: [n, in] float32 -> [n, out]
        """The PyTorch path, [n, in] float32 rows (the reference the compiled paths equal bit for bit)."""
        n = rows.shape[0]
        # Per-row grid: s_r = max|x_r| / 63 (a zero row keeps a tiny scale and stays zero).
        row_scale = rows.abs().amax(dim=1, keepdim=True).div_(_LEVELS).clamp_(min=torch.finfo(torch.float32).tiny)
        block = self._input_block(n)
        high, low = block[1 : 1 + n], block[1 + n :]
        torch.div(rows, row_scale, out=low)
        torch.round(low, out=high)
        # Second plane: the rounding residual (in [-0.5, 0.5]) on its own grid of 126 steps, so
        # x / s_r ~= high + low / 126 carries ~13 bits.
        low.sub_(high).mul_(2 * _LEVELS).round_()
        # The guard row pins the kernel's own quantisation range to [-64, 63] (scale 1, zero point
        # 64 with reduce_range): integer inputs pass through exactly, and with unit weight scales
        # each plane's sums come back as exact integers (|sum| < 2^24 for in_features <= 2097).
        sums = _linear_dynamic(block, self._fbgemm(), True)
        # S = 126 high + low exactly (in float64), then the one output formula: float(S) * c * w.
        total = sums[1 : 1 + n].double().mul_(2 * _LEVELS).add_(sums[1 + n :].double())
        out = total.float().mul_(row_scale / (2 * _LEVELS)).mul_(self.weight_scale)  # [n, N]
        return out if self.bias is None else out.add_(self.bias)

    def forward_columns(self, x: Tensor, ids: Tensor) -> Tensor | None:
        """`forward(x)[..., ids]`, bit-identical, computed from those weight rows only; None where
        the compiled kernels are unavailable (the only way then is the full product).

        x: [..., in] float32 on the CPU; ids: [m] int64 -> [..., m]. The same exact integer sums
        and the same output formula as the full product (cpu_kernels.cpp, `int8_columns`);
        tests/test_cpu_kernels.py checks the identity bit for bit.
        """
        kernels = cpu_kernels.load()
        if kernels is None or self._q is None or x.dtype != torch.float32 or x.is_cuda:
            return None
        return kernels.int8_columns(x, self._q, self._scale4, ids, self.bias, self.out_features)

    def forward_argmax(self, x: Tensor) -> Tensor | None:
        """`forward(x).argmax(-1)` (the lowest column among equal maxima), exactly, at about half
        of the full product's multiply-adds (cpu_kernels.cpp, `int8_argmax`: a bound from one
        input plane rules out the columns that cannot win); None where the packed kernels are
        unavailable. x: [n, in] float32 on the CPU -> int64 [n]."""
        kernels = cpu_kernels.load()
        if (kernels is None or self._q is None or not self._row_blocks or x.dtype != torch.float32 or x.is_cuda
                or x.dim() != 2):
            return None
        norms = self.__dict__.get("_norms")
        if norms is None or norms[0] is not self._q:  # the rows' norms, once per stored table
            norms = self.__dict__["_norms"] = (self._q, kernels.int8_norms(self._q))
        best = kernels.int8_argmax(x, self._q, self._scale4, norms[1], self.bias, self.out_features)
        odd = best < 0  # a row with a non-finite input: the full product decides (NaN wins there)
        if bool(odd.any()):
            best[odd] = self.forward(x[odd]).argmax(-1)
        return best


_INT4_GROUP = 32  # inputs sharing one step and offset (`Int4Linear`)


def quantize_int4(weight, scratch: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per group of 32 inputs of each row: weight ~= a * q + b, with b the group's minimum and a its
    step (range / 15, or the grid the weights already lie on: `_int4_steps`), both rounded to
    float16 first, and q = round((w - b) / a) clamped to [0, 15].
    Returns (q uint8 [N16, K32], a, b float16 [N16, K32 / 32]), padded to multiples of 16 rows (all
    zero) and 32 inputs (the padded inputs of the kernels' input rows are 0, so those weights add
    nothing). `weight`: a tensor or a `loader.StoredTensor`,
    read a block of rows at a time into `scratch` as in `quantize_rows`; each row stands alone."""
    n, k = weight.shape
    n16, k32 = -(-n // 16) * 16, -(-k // _INT4_GROUP) * _INT4_GROUP
    groups = k32 // _INT4_GROUP
    q = torch.zeros((n16, k32), dtype=torch.uint8)
    a = torch.zeros((n16, groups), dtype=torch.float16)
    b = torch.zeros((n16, groups), dtype=torch.float16)
    rows = max(1, min(n, _BLOCK_ELEMENTS // k32))
    if scratch is None or scratch.numel() < rows * k32:
        scratch = torch.empty(rows * k32, dtype=torch.float32)
    padded = None if k == k32 else torch.zeros(rows, k32)  # inputs padded to a whole group
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        w = scratch[: (stop - start) * k].view(stop - start, k)
        if isinstance(weight, Tensor):
            w.copy_(weight[start:stop])
        else:
            weight.read_into(start, w)
        if padded is not None:  # the last input repeated: the group's range is its real inputs'
            padded[: stop - start, :k].copy_(w)
            padded[: stop - start, k:].copy_(w[:, k - 1 :])
            w = padded[: stop - start]
        wg = w.view(stop - start, groups, _INT4_GROUP)
        low = wg.amin(dim=2)
        b16 = low.half()
        a16 = _int4_steps(wg, low).half()
        a32 = a16.float()
        step = torch.where(a32 > 0, a32, torch.ones_like(a32))
        values = wg.sub_(b16.float()[:, :, None]).div_(step[:, :, None]).round_().clamp_(0, 15)
        values.masked_fill_((a32 <= 0)[:, :, None], 0)
        q[start:stop] = values.view(stop - start, k32).to(torch.uint8)
        a[start:stop], b[start:stop] = a16, b16
    return q, a, b


def _int4_steps(wg: Tensor, low: Tensor) -> Tensor:
    """The step of each group of `wg` [rows, groups, 32] (minimum `low` [rows, groups]).

    Weights that come from a 4-bit file (a GGUF's Q4_K blocks, dequantised) already lie on a grid
    low + step * j, j in [0, 15], whose step is often finer than (max - min) / 15: the file's
    quantiser picks its step and minimum to fit the weights, not to span 15 steps. Where a group's
    weights lie on such a grid, its step is taken (the smallest distance above the minimum, or a
    half or third of it), and the 4-bit values then give back the file's weights up to the float16
    rounding of step and minimum (on a Q4_K_M file, a small fraction of the error that
    (max - min) / 15 leaves). Other groups take (max - min) / 15.
    """
    dist = wg - low[:, :, None]
    span = dist.amax(dim=2)
    # distances under a thousandth of the span are the minimum itself (the grid's levels are exact floats)
    nearest = torch.where(dist > span[:, :, None] * 1e-3, dist, torch.full_like(dist, float("inf"))).amin(dim=2)
    steps = span / 15
    found = torch.zeros_like(span, dtype=torch.bool)
    for parts in (1, 2, 3):
        step = nearest / parts
        levels = dist / step[:, :, None]
        fits = (levels.amax(dim=2) <= 15.01) & ((levels - levels.round()).abs().amax(dim=2) <= 0.01)
        fits &= torch.isfinite(step) & ~found
        steps = torch.where(fits, step, steps)
        found |= fits
    return steps


class Int4Linear(Int8Linear):
    """y = x @ W.T (+ b) with W on 4 bits in groups of 32 inputs (module doc; cpu_kernels.cpp,
    `int4_product`). It keeps Int8Linear's contract with the compiled decoder layer (`_q`, `_scale4`,
    `bias`, `out_features`): `_q` is the packed uint8 table, which the kernels tell from int8 rows by
    its dtype. Needs the compiled kernels."""

    def __init__(self, weight, bias: Tensor | None = None):  # weight: [N, K] (see `quantize_int4`)
        nn.Module.__init__(self)
        self._setup_int4(*quantize_int4(weight), weight.shape, bias)

    @classmethod
    def from_parts(cls, q: Tensor, a: Tensor, b: Tensor, shape: tuple[int, int], bias: Tensor | None = None) -> "Int4Linear":
        """The layer with the padded parts of `quantize_int4` as they are; `shape` = (N, K)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup_int4(q, a, b, shape, bias)
        return layer

    @classmethod
    def concat(cls, parts: list["Int4Linear"]) -> "Int4Linear":
        """One layer whose output is the parts' outputs side by side: the same rows (quantised row
        by row, so the same as quantising the fused float matrix)."""
        kernels = cpu_kernels.load()
        unpacked = [kernels.int4_unpack(p._q) for p in parts]
        q = torch.cat([u[0][: p.out_features] for u, p in zip(unpacked, parts)])
        a = torch.cat([u[1][: p.out_features] for u, p in zip(unpacked, parts)])
        b = torch.cat([u[2][: p.out_features] for u, p in zip(unpacked, parts)])
        n = q.shape[0]
        pad = -(-n // 16) * 16 - n
        q, a, b = F.pad(q, (0, 0, 0, pad)), F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, 0, 0, pad))
        bias = None if parts[0].bias is None else torch.cat([p.bias.data for p in parts])
        return cls.from_parts(q, a, b, (n, parts[0].in_features), bias)

    @classmethod
    def from_packed(cls, packed: Tensor, shape: tuple[int, int], bias: Tensor | None = None) -> "Int4Linear":
        """The layer over a table `int4_pack` made (what the kernel-layout cache stores, `mapped.py`)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._adopt_int4(packed, shape, bias)
        return layer

    def _setup_int4(self, q: Tensor, a: Tensor, b: Tensor, shape: tuple[int, int], bias: Tensor | None) -> None:
        kernels = cpu_kernels.load()
        if kernels is None:
            raise RuntimeError("int4 linears need the compiled CPU kernels (cpu_kernels.py)")
        self._adopt_int4(kernels.int4_pack(q, a, b), shape, bias)

    def _adopt_int4(self, packed: Tensor, shape: tuple[int, int], bias: Tensor | None) -> None:
        self.out_features, self.in_features = shape
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._q = packed
        self._scale4 = None  # the steps and offsets live in `_q`
        self._row_blocks = True
        self._packed = None

    def parts(self) -> tuple[Tensor, Tensor, Tensor]:
        """(q uint8 [N, K], a, b float16 [N, groups]): the 4-bit values, steps and offsets."""
        q, a, b = cpu_kernels.load().int4_unpack(self._q)
        n, k = self.out_features, self.in_features
        return q[:n, :k], a[:n], b[:n]

    def dequantized(self) -> Tensor:
        """The weights the layer multiplies by, float32 [N, K]."""
        q, a, b = self.parts()
        n, k = q.shape
        groups = a.shape[1]
        full = F.pad(q, (0, groups * _INT4_GROUP - k)).view(n, groups, _INT4_GROUP).float()
        return (full * a.float()[:, :, None] + b.float()[:, :, None]).view(n, -1)[:, :k]

    def int8_weight(self) -> Tensor:
        raise TypeError("an Int4Linear has no int8 weights (see `dequantized`)")

    def int8_rows(self, ids: Tensor) -> Tensor:
        raise TypeError("an Int4Linear has no int8 weights (see `dequantized`)")

    def as_embedding(self):
        raise TypeError("an Int4Linear is not an embedding table")

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in_features]
        kernels = cpu_kernels.load()
        out = kernels.int4_linear(x.float().contiguous(), self._q, self.bias, self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def forward_rows(self, rows: Tensor) -> Tensor:  # rows: [n, in] float32 -> [n, out]
        """The scalar path of the kernels (`int4_reference`), which the vector one equals bit for bit."""
        return cpu_kernels.load().int4_reference(rows.float().contiguous(), self._q, self.bias, self.out_features)

    def forward_columns(self, x: Tensor, ids: Tensor) -> None:
        return None  # chosen columns alone are not offered: callers take the full product

    def forward_argmax(self, x: Tensor) -> None:
        return None  # nor an argmax without the full product


def _pack_unit_scales(q: Tensor):
    """fbgemm's packed int8 weights [N, K] with every channel's scale 1 (the sums stay integers)."""
    ones = torch.ones(q.shape[0], dtype=torch.double)
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # PyTorch 2.13 warns that quantized tensor types are deprecated, once per process, on the
        # user's terminal; fbgemm's packed product still needs one as its input.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        packed = torch._make_per_channel_quantized_tensor(q, ones, zero, 0)
    return torch.ops.quantized.linear_prepack(packed, None)


def stored_rows(q: Tensor, row_blocks: bool, ids: Tensor, k: int) -> Tensor:
    """Rows `ids` of a stored int8 table `q` as int8 [*ids.shape, k]: `q` row-major, or packed in
    blocks of 16 rows (`row_blocks`), read by the compiled kernels that packed it (`int8_rows`)."""
    if not row_blocks:
        return q[ids, :k]
    return cpu_kernels.load().int8_rows(q, ids, k)


def linear_rows(linear: nn.Module, ids: Tensor) -> Tensor:
    """Rows `ids` of a linear layer's weight [len(ids), in], float, int8 or int4 (then dequantised)."""
    if isinstance(linear, Int4Linear):
        return linear.dequantized()[ids]
    if isinstance(linear, Int8Linear):
        return linear.int8_rows(ids).float() * linear.weight_scale[ids, None]
    return linear.weight.detach()[ids]


class Int8Embedding(Layer):
    """Embedding rows stored as int8 with a per-row scale, dequantised on lookup."""

    def __init__(self, q: Tensor, scale: Tensor, row_blocks: bool = False, dim: int | None = None):
        """q: [vocab, hidden] int8, or an Int8Linear's stored table (padded; packed where
        `row_blocks`) with the hidden size `dim`; scale: [vocab]."""
        super().__init__()
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.num_embeddings, self.embedding_dim = scale.shape[0], dim or q.shape[1]
        self.row_blocks = row_blocks

    @property
    def weight(self) -> Tensor:
        """A 1-element stand-in so `weight.device` / `weight.dtype` answer as for nn.Embedding."""
        return self.scale[:1]

    def forward(self, ids: Tensor) -> Tensor:
        return stored_rows(self.q, self.row_blocks, ids, self.embedding_dim).float() * self.scale[ids].unsqueeze(-1)


def quantize_of(model: nn.Module) -> str:
    """The `quantize` mode a loaded model runs in: "int4" when its decoder layers hold 4-bit
    linears, "int8" when its head is int8, else "none". A split target (`tensor_parallel`'s
    ParallelTarget, not a module) answers for its rank-0 shard, `.model`."""
    if not isinstance(model, nn.Module):
        model = model.model
    layers = getattr(model, "layers", None)
    scope = layers[0] if layers else model  # every layer is quantised alike
    if any(isinstance(m, Int4Linear) for m in scope.modules()):
        return "int4"
    return "int8" if isinstance(getattr(model, "lm_head", None), Int8Linear) else "none"


def cpu_int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_model(model: nn.Module, mode: str, weights: dict | None = None) -> nn.Module:
    """Replace every nn.Linear of `model` (and its embedding) by its int8 version, in place; with
    `mode="int4"` the linears of the decoder layers by their 4-bit version (the head and the
    embedding stay int8).

    The float weights come from the model itself, or from `weights` (name -> tensor or
    `loader.StoredTensor`) for a model built on the meta device: then each is read a block of rows
    at a time and only its int8 form is kept. q/k/v and gate/up are fused after quantising.
    """
    if mode == "none":
        return model
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantisation {mode!r}")
    # Tied where the head still is the embedding (a tensor-parallel rank's head is its own slice).
    tied = model.config.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    scratch = torch.empty(_BLOCK_ELEMENTS)  # one buffer for every layer's blocks (`quantize_rows`)

    def source(module: nn.Module, prefix: str, kind: str):
        """The float `kind` ("weight" or "bias") of module `prefix`: a tensor, or a StoredTensor."""
        if weights is None:
            tensor = getattr(module, kind)
            return None if tensor is None else tensor.data
        return weights.get(f"{prefix}.{kind}")

    for prefix, child in list(model.named_modules()):
        if isinstance(child, nn.Linear) and not (tied and prefix == "lm_head"):
            bias = source(child, prefix, "bias")
            if bias is not None and not isinstance(bias, Tensor):
                bias = bias.load()
            weight = source(child, prefix, "weight")
            if mode == "int4" and prefix != "lm_head":
                layer = Int4Linear.from_parts(*quantize_int4(weight, scratch), tuple(weight.shape), bias)
            else:
                layer = Int8Linear.from_int8(*quantize_rows(weight, scratch), bias)
            parent, _, name = prefix.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, layer)
    embed = source(model.embed_tokens, "embed_tokens", "weight")
    if tied:  # the head's int8 rows are the embedding table's
        model.lm_head = Int8Linear.from_int8(*quantize_rows(embed, scratch))
        model.embed_tokens = model.lm_head.as_embedding()
    else:
        model.embed_tokens = Int8Embedding(*quantize_rows(embed, scratch))
    model.fuse_projections()  # 4 int8 calls a layer instead of 7: each also quantises its input
    gather_small_tables(model)
    return model


# Tables from this size on get a mapping of their own (cpu_kernels.cpp, `kHugeTableBytes`).
_HUGE_TABLE_BYTES = 1 << 20
_HUGE_PAGE = 2 << 20


def _alone_on_huge_pages(nbytes: int) -> bool:
    """Whether `table_empty` puts a table of this size on huge pages: from 1 MiB on, in a mapping
    rounded up to whole 2 MiB pages where that adds at most an eighth. Below 2 MiB without that
    rounding (Qwen2.5 1.5B's 4-bit output projections, 1.4 MiB) the mapping holds no whole huge page,
    so the table would lie on 4 KiB pages."""
    return nbytes >= _HUGE_PAGE or (nbytes >= _HUGE_TABLE_BYTES and (_HUGE_PAGE - nbytes) * 8 <= nbytes)


_TABLE_ALIGN = 256  # bytes: each table of the shared one starts on a fresh run of cache lines


def gather_small_tables(model: nn.Module, fill=None) -> int:
    """Move the weight tables (`_q` of the int8 and 4-bit linears) that would not lie on huge pages
    of their own (`_alone_on_huge_pages`: those under 1 MiB, and those under 2 MiB that are not
    rounded up to a whole huge page) into one shared table on huge pages; returns how many moved.

    A small table is not rounded up to a whole 2 MiB page (that would waste most of it), so it stays
    on 4 KiB pages, and a model of narrow layers has many (Qwen2.5-0.5B's q/k/v and output
    projections: ~1 MiB a layer, an eighth of its weights). Laid side by side in one table they
    stream on huge pages too (where they add up to 1 MiB or more). Only where the bytes lie changes:
    each module's `_q` becomes a view of the shared table with the same values. Done right after
    quantising, before any forward has remembered a layer's tables (`Block._kernel_parts`).
    `fill(table, place)` puts a table's bytes in its place (default: a copy; the kernel-layout
    cache reads them from its file, `mapped.py`).
    """
    kernels = cpu_kernels.load()
    if kernels is None:
        return 0
    # A table another module reads too (a tied embedding reads the head's int8 rows) stays where it
    # is: moving it would leave that module a copy of its own.
    shared = {t.untyped_storage().data_ptr() for m in model.modules() if not isinstance(m, Int8Linear)
              for t in [*m.buffers(recurse=False), *vars(m).values()] if isinstance(t, Tensor)}
    small = [m for m in model.modules() if isinstance(m, Int8Linear) and m._q is not None and m._q.device.type == "cpu"
             and m._q.is_contiguous() and not _alone_on_huge_pages(m._q.numel() * m._q.element_size())
             and m._q.untyped_storage().data_ptr() not in shared]
    if len(small) < 2:
        return 0
    sizes = [-(-m._q.numel() * m._q.element_size() // _TABLE_ALIGN) * _TABLE_ALIGN for m in small]
    table = kernels.table_empty([sum(sizes)], torch.uint8)
    offset = 0
    for module, size in zip(small, sizes):
        q = module._q
        view = table[offset : offset + q.numel() * q.element_size()].view(q.dtype).view(q.shape)
        if fill is None:
            view.copy_(q)
        else:
            fill(q, view)
        module._q = view
        offset += size
    return len(small)
