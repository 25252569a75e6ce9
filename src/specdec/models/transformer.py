"""One decoder-only Transformer for the Gemma 3, Llama, Mistral, Qwen2 and Qwen3 families.

The families differ only in a handful of switches, all held by `ModelConfig`:

| switch                | Gemma 3            | Llama / Mistral | Qwen2        | Qwen3        |
|-----------------------|--------------------|-----------------|--------------|--------------|
| RMSNorm scale         | (1 + w)            | w               | w            | w            |
| extra norms           | after attn and MLP | -               | -            | -            |
| q/k norm per head     | yes                | -               | -            | yes          |
| q/k/v bias            | -                  | -               | yes          | -            |
| activation            | gelu (tanh)        | silu            | silu         | silu         |
| embedding scale       | sqrt(hidden)       | 1               | 1            | 1            |
| local (sliding) layers| 5 of every 6       | Mistral: maybe  | -            | -            |
| rope theta            | per layer type     | one             | one          | one          |

`forward(tokens, positions, cache, mask)` scores any number of new tokens per sequence at
explicit positions: one token for a plain step, the last token plus k drafts for verification,
or a whole token tree with a tree mask. New keys and values go into the cache slots right after
each row's current length, and the row's length moves past them; the engine rolls back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .kv_cache import KVCache
from .layer import Layer
from .quant import Int8Linear


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer: base theta and optional frequency scaling."""

    theta: float
    scaling: tuple[tuple[str, float], ...] = ()  # HF rope_scaling dict as sorted items, () = none

    def inv_freq(self, head_dim: int) -> Tensor:  # [head_dim // 2], float64, on the default device
        """Computed on the CPU and then moved to the default device: on the meta device (a model
        skeleton) this arithmetic would run PyTorch's Python decompositions, whose first use
        imports ~800 modules (~75 MB resident for the life of the process)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        cfg = dict(self.scaling)
        kind = cfg.get("rope_type", cfg.get("type", "default"))
        if kind == "linear":
            # Position interpolation: positions are divided by the factor.
            inv = inv / cfg["factor"]
        elif kind == "llama3":
            # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
            # between blended smoothly by wavelength.
            factor = cfg["factor"]
            low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
            old_ctx = cfg["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            smooth = (old_ctx / wavelen - low) / (high - low)
            blended = (1 - smooth) * inv / factor + smooth * inv
            inv = torch.where(wavelen > old_ctx / low, inv / factor, inv)
            middle = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
            inv = torch.where(middle, blended, inv)
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling type {kind!r}")
        return inv.to(torch.get_default_device())


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "gemma3" | "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    layer_rope: tuple[RopeSpec, ...]  # one per layer
    layer_window: tuple[int | None, ...]  # sliding window per layer, None = global attention
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w): 1.0 for Gemma
    sandwich_norms: bool = False  # Gemma 3: extra norms after attention and after the MLP
    qk_norm: bool = False
    qkv_bias: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float = 1.0
    tie_embeddings: bool = False
    query_scale: float = 0.0  # attention score scale; 0 means head_dim ** -0.5
    final_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def score_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5


def inference_constant(owner: nn.Module, name: str, sources: tuple[Tensor, ...], compute) -> Tensor:
    """`compute()`, remembered on `owner` under inference mode while `sources` are unchanged.

    Decoding runs a layer's small derived tensors (norm scales) hundreds of times a token, and on a
    CPU every op costs microseconds of dispatch; outside inference mode (training) it recomputes so
    gradients flow. A source replaced (another tensor object) or changed in place (its version
    counter moved) recomputes it; inference tensors have no version counter, so for them only a
    replacement does. The check is kept to identities and counters: it runs ~100 times a step.
    """
    if not torch.is_inference_mode_enabled():
        return compute()
    memo = owner.__dict__.get(name)
    if memo is not None:
        held, versions, value = memo
        if all(a is b for a, b in zip(held, sources)) and versions == _versions(sources):
            return value
    value = compute()
    owner.__dict__[name] = (sources, _versions(sources), value)
    return value


def _versions(tensors: tuple[Tensor, ...]) -> tuple[int, ...]:
    return tuple(-1 if t.is_inference() else t._version for t in tensors)


# How many parameters, buffers and submodules any nn.Module has registered (set as an attribute or
# registered by name) in this process, counted by PyTorch's global registration hooks. While it has
# not moved, no module anywhere has been given another weight or submodule, so a block's remembered
# kernel arguments still name its current ones (`Block._kernel_parts`). The hooks are process-wide,
# so they are installed only when a block first takes the compiled kernels, not at import.
_registrations = [0]
_counting: list[bool] = []


def _count_registration(*_) -> None:
    _registrations[0] += 1


def registrations() -> int:
    """The registration count, installing the counting hooks on first use."""
    if not _counting:
        nn.modules.module.register_module_module_registration_hook(_count_registration)
        nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        nn.modules.module.register_module_buffer_registration_hook(_count_registration)
        _counting.append(True)
    return _registrations[0]


class RMSNorm(Layer):
    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def scale(self) -> Tensor:
        """The float32 factor (offset + w)."""
        w = self.weight
        return inference_constant(self, "_scale", (w,), lambda: w.float() + self.offset if self.offset else w.float())

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the activation dtype: the mean of squares is where
        # bfloat16 would lose the most.
        # x / sqrt(mean(x^2) + eps) * (offset + w), as one fused op.
        kernels = compiled_kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, self.scale(), self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.scale(), self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)


def compiled_kernels(x: Tensor):
    """The compiled CPU kernels (`cpu_kernels`) where they apply to `x`: float32 on the CPU, under
    inference mode (training needs autograd's ops). None otherwise, or where they are not built."""
    if x.dtype != torch.float32 or x.is_cuda or not torch.is_inference_mode_enabled():
        return None
    return cpu_kernels.load()


# The cache dtypes the compiled kernels write and read (`rope_write`, `attention`): float16 is
# read as the float32 of the same value.
KERNEL_CACHE_DTYPES = (torch.float32, torch.float16)

# A model whose layers the compiled kernels run whole (`Block._kernel_parts`: the quantised CPU
# models) takes them for every block. Otherwise, blocks of up to this many new tokens (decode steps,
# verify passes) take the compiled row-by-row attention; longer ones (prefills) PyTorch's SDPA,
# which blocks its queries and is faster there.
ROW_ATTENTION_MAX_T = 32


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """Final-logit soft-capping where a config has it (Gemma 2/3): cap * tanh(logits / cap)."""
    return torch.tanh(logits / cap) * cap if cap else logits


def rope_tables(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [batch, 1, T, head_dim], for `rotate` (computed once a pass)."""
    angles = positions[:, None, :, None].float() * inv_freq  # [b, 1, T, d/2]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, half-split layout (pairs are (i, i + d/2)), as HF stores the weights:
    x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1).

    x: [batch, heads, T, head_dim]; cos, sin: [batch, 1, T, head_dim] from `rope_tables`
    """
    xf = x if x.dtype == torch.float32 else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class Attention(Layer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scale = cfg.score_scale
        self.qkv_proj: nn.Module | None = None  # set by `fuse`: one projection instead of three

    def fuse(self) -> None:
        """Replace q/k/v by one projection over the concatenated weights (same math, one call)."""
        self.qkv_proj = _fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [batch, T, hidden] -> queries and keys side by side [batch, T, heads + kv_heads, d] and
        values [batch, T, kv_heads, d]: q and k then take their norm and rotation in one op each."""
        b, t, _ = x.shape
        if self.qkv_proj is None:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        else:
            qkv = self.qkv_proj(x)
        qk, v = qkv.view(b, t, -1, self.head_dim).split((self.heads + self.kv_heads, self.kv_heads), dim=2)
        return qk, v

    def qk_scale(self) -> Tensor:
        """The q and k norms' factors stacked per head: [heads + kv_heads, head_dim]."""
        return inference_constant(
            self, "_qk_scale", (self.q_norm.weight, self.k_norm.weight),
            lambda: torch.cat((self.q_norm.scale().expand(self.heads, -1), self.k_norm.scale().expand(self.kv_heads, -1))),
        )

    def forward(
        self,
        x: Tensor,  # [batch, T, hidden]
        cos: Tensor,  # [batch, 1, T, head_dim] from `rope_tables`
        sin: Tensor,
        cache: KVCache,
        layer: int,
        slots: Tensor,  # [batch, T] where the new keys go
        visible: Tensor,  # [batch, 1, T, S] bool: which of the first S slots each query sees
        keep: int | None = None,  # attend for the last `keep` rows only (all rows' keys are cached)
        plan: QueryBlocks | None = None,  # `query_blocks(visible)` where the caller has it
    ) -> Tensor:
        b, t, _ = x.shape
        qk, v = self.project(x)
        kernels = compiled_kernels(qk) if cache.keys[layer].dtype in KERNEL_CACHE_DTYPES else None
        if self.qk_norm and kernels is not None:
            qk = kernels.rms_norm(qk, self.qk_scale(), self.q_norm.eps)  # row r uses head r mod (heads + kv)
        elif self.qk_norm:
            # Per head: the same RMSNorm as q_norm / k_norm, over all q and k heads at once.
            dtype = qk.dtype
            qk = (F.rms_norm(qk.float(), (self.head_dim,), None, self.q_norm.eps) * self.qk_scale()).to(dtype)
        if kernels is not None:
            # One call: q and k rotated, k and v written to their cache slots.
            q = kernels.rope_write(qk, v, cos, sin, cache.keys[layer], cache.values[layer], slots)
        else:
            qk = rotate(qk.transpose(1, 2), cos, sin)  # [b, heads + kv_heads, T, d]
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            cache.write(layer, k, v.transpose(1, 2), slots)
        if keep is not None:
            q, visible, t, plan = q[:, :, t - keep :], visible[:, :, t - keep :], keep, None
        if kernels is not None and t <= ROW_ATTENTION_MAX_T:
            # Decode and verify blocks: each query row by itself, so a verify row is bit-identical to
            # the one-token step it stands for (cpu_kernels.cpp, `attention`), and faster than SDPA
            # for these few rows.
            out = kernels.attention(q, cache.keys[layer], cache.values[layer], visible, self.scale)
            return self.o_proj(out)
        span = visible.shape[-1]
        # A float16 cache under float32 queries (the CPU default, `kv_cache.resolve_kv_dtype`) is read
        # as float32: SDPA takes one dtype, and the widening is exact.
        keys, values = cache.keys[layer][:, :, :span], cache.values[layer][:, :, :span]
        out = blocked_attention(q, keys.to(q.dtype), values.to(q.dtype),
                                plan or query_blocks(visible, q.dtype), self.scale, self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


ATTENTION_QUERY_BLOCK = 128  # query rows per SDPA call of a long block (a prefill)


class QueryBlocks(NamedTuple):
    """A long block's SDPA plan for one visibility mask: its query rows, ATTENTION_QUERY_BLOCK at a
    time, each with the key slots [lo, hi) that its rows can see at all and their additive mask."""

    rows: list[slice]
    spans: list[tuple[int, int]]
    masks: list[Tensor]  # [b, 1, rows, hi - lo] float: 0 where visible, -inf elsewhere


def query_blocks(visible: Tensor, dtype: torch.dtype) -> QueryBlocks:
    """The plan of `blocked_attention` for `visible` [b, 1, T, S] bool. It depends on the mask
    only, so a forward makes it once per mask and all its layers with that mask share it (remade
    layer by layer, it was a visible part of a long prefill)."""
    t = visible.shape[2]
    if t <= ATTENTION_QUERY_BLOCK:
        return QueryBlocks([slice(0, t)], [(0, visible.shape[3])], [additive_mask(visible, dtype)])
    seen = visible.any(dim=0)[0]  # [T, S]: a slot any sequence's row sees
    plan = QueryBlocks([], [], [])
    for start in range(0, t, ATTENTION_QUERY_BLOCK):
        rows = slice(start, min(t, start + ATTENTION_QUERY_BLOCK))
        cols = seen[rows].any(dim=0).nonzero()
        lo, hi = (int(cols[0]), int(cols[-1]) + 1) if len(cols) else (0, seen.shape[1])
        plan.rows.append(rows)
        plan.spans.append((lo, hi))
        plan.masks.append(additive_mask(visible[:, :, rows, lo:hi], dtype))
    return plan


def blocked_attention(q: Tensor, keys: Tensor, values: Tensor, plan: QueryBlocks, scale: float, gqa: bool) -> Tensor:
    """SDPA of a long block of queries, ATTENTION_QUERY_BLOCK rows at a time, each over only the key
    slots its rows can see at all (`plan`, from `query_blocks`).

    q: [b, H, T, d]; keys, values: [b, KV, S, d] -> [b, H, T, d]. A causal prefill then skips the
    keys after each block, and a sliding-window layer also the keys before its window, so a long
    prefill spends much less time in attention (docs/archive/BENCHMARKS-history.md).
    Leaving out slots that no row of the block sees changes no softmax, only the order of float
    sums, so the output agrees with one SDPA call to rounding.
    """
    outs = [
        F.scaled_dot_product_attention(q[:, :, rows], keys[:, :, lo:hi], values[:, :, lo:hi], attn_mask=mask,
                                       scale=scale, enable_gqa=gqa)
        for rows, (lo, hi), mask in zip(plan.rows, plan.spans, plan.masks)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one SDPA applies (0 where visible, -inf elsewhere).

    The same scores and softmax (SDPA adds exactly this for a boolean mask), but given a float mask
    PyTorch's CPU kernel skips its own conversion, a noticeable part of a prefill block's attention
    (docs/archive/BENCHMARKS-history.md).
    """
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


class MLP(Layer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"
        self.gate_up_proj: nn.Module | None = None  # set by `fuse`

    def fuse(self) -> None:
        """Replace gate and up by one projection over the concatenated weights."""
        self.gate_up_proj = _fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate_up = self.gate_up_proj(x)
            kernels = compiled_kernels(gate_up)
            if kernels is not None:
                return self.down_proj(kernels.gated_activation(gate_up, self.gelu))
            gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


def _fused_linear(*parts: nn.Module) -> nn.Module:
    """One linear layer whose output is the parts' outputs side by side (nn.Linear, or a layer
    type with its own `concat`, such as `quant.Int8Linear`)."""
    concat = getattr(type(parts[0]), "concat", None)
    if concat is not None:
        return concat(list(parts))
    weight = torch.cat([p.weight.data for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    if fused.bias is not None:
        fused.bias.data = torch.cat([p.bias.data for p in parts])
    return fused


class Block(Layer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            # Gemma 3 names: post_attention_layernorm follows attention, the MLP has its own pair.
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, cos, sin, cache, layer, slots, visible, keep: int | None = None, plan=None):
        """x [batch, T, hidden] -> [batch, T, hidden], or the last `keep` rows only: every row's key
        and value still go to the cache, but only those rows attend and pass through the MLP.
        `plan`: `visible`'s `query_blocks` where the caller made it (long blocks)."""
        kernels = compiled_kernels(x)
        parts = None if kernels is None else self._kernel_parts(cache.keys[layer])
        if parts is not None:
            # Every block, a decode step, a verify pass or a prefill of any length, in one compiled
            # call that works row by row: a row's bits never depend on the block it is in, so a prompt
            # prefilled in chunks or after a cached prefix goes on exactly as one prefilled whole (the
            # SDPA path below rounds differently by block shape). `keep`: every row's key and value
            # go to the cache, only the last rows attend and pass the MLP, each as it would in the
            # whole block.
            return kernels.decoder_layer(x, *parts, cos, sin, cache.keys[layer], cache.values[layer], slots, visible,
                                         keep or 0)
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, slots, visible, keep, plan)
        if keep is not None:
            x = x[:, x.shape[1] - keep :]
        if self.sandwich:
            x, h = residual_norm(x, attn, self.post_attention_layernorm, self.pre_feedforward_layernorm)
            return residual_norm(x, self.mlp(h), self.post_feedforward_layernorm, None)[0]
        x, h = residual_norm(x, attn, None, self.post_attention_layernorm)
        return x + self.mlp(h)

    def _kernel_parts(self, cache_keys: Tensor) -> tuple | None:
        """The arguments of `cpu_kernels.decoder_layer` after x (its weights in its `LayerPart`
        order, sizes, eps, qk eps, score scale, GELU or SiLU), or None where this block's forward
        would not take the compiled kernels all the way (unfused projections, a cache of another
        dtype): there the modules run one by one as usual.

        Remembered while this block holds the same modules, they hold the same weight tensors and
        the norms' weights have not changed in place (version counters): the projections' values
        may change in place, as the kernel reads them as they are. The check reads the module
        dicts directly: nn.Module's attribute lookup, repeated for every argument of every layer,
        was a visible share of a small model's step.

        While no module in the process has registered a weight or submodule since (`_registrations`)
        and the norms' weights have the same version counters, the memo stands without walking the
        modules again: reading them was a visible share of a one-token forward
        (docs/archive/BENCHMARKS-history.md). A change made around the registration (`module.__dict__`, `del`)
        is not seen by that check.
        """
        if cache_keys.dtype not in KERNEL_CACHE_DTYPES:
            return None
        memo = self.__dict__.get("_kernel_memo")
        count = registrations()
        if memo is not None and memo[3] == count and memo[1] == _versions(memo[4]):
            return memo[2]
        modules, norm_weights = self._kernel_key()
        versions = _versions(norm_weights)
        parts = None if memo is None else memo[2]
        if (memo is None or len(memo[0]) != len(modules) or not all(a is b for a, b in zip(memo[0], modules))
                or memo[1] != versions):
            parts = self._make_kernel_parts()
        self.__dict__["_kernel_memo"] = (modules, versions, parts, count, norm_weights)
        return parts

    def _make_kernel_parts(self) -> tuple | None:
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(map(_compiled_projection, projections)):
            return None
        weights = [self.input_layernorm.scale(), attn.qk_scale() if attn.qk_norm else None]
        if self.sandwich:
            weights += [self.post_attention_layernorm.scale(), self.pre_feedforward_layernorm.scale(),
                        self.post_feedforward_layernorm.scale()]
        else:
            weights += [None, self.post_attention_layernorm.scale(), None]
        for proj in projections:
            weights += [proj._q, proj._scale4, proj.bias] if isinstance(proj, Int8Linear) else [proj.weight, None, proj.bias]
        sizes = [attn.heads, attn.kv_heads, attn.head_dim] + [proj.out_features for proj in projections]
        qk_eps = attn.q_norm.eps if attn.qk_norm else 0.0
        return weights, sizes, self.input_layernorm.eps, qk_eps, attn.scale, mlp.gelu

    def _kernel_key(self) -> tuple[list, tuple[Tensor, ...]]:
        """What `_kernel_parts`'s memo depends on, read through the module dicts: this block's norm
        and projection modules with the tensors they multiply by, and the norms' weights apart
        (their scales are copies, so an in-place change must be seen by its version counter)."""
        mods = self._modules
        attn, mlp = mods["self_attn"], mods["mlp"]
        norms = [mods[n] for n in ("input_layernorm", "post_attention_layernorm") + self._sandwich_names]
        if attn.__dict__["qk_norm"]:
            norms += [attn._modules["q_norm"], attn._modules["k_norm"]]
        norm_weights = tuple(m._parameters["weight"] for m in norms)
        modules = norms + list(norm_weights)
        for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
            proj = owner._modules.get(name)
            modules += [proj, _projection_weight(proj)]
        return modules, norm_weights

    @property
    def _sandwich_names(self) -> tuple[str, ...]:
        return ("pre_feedforward_layernorm", "post_feedforward_layernorm") if self.__dict__["sandwich"] else ()


def _projection_weight(proj: nn.Module | None) -> Tensor | None:
    """The tensor a projection multiplies by (int8 rows or float weight), read without nn.Module's
    attribute lookup."""
    if isinstance(proj, Int8Linear):
        return proj.__dict__.get("_q")
    return proj._parameters.get("weight") if isinstance(proj, nn.Linear) else None


def _compiled_projection(proj: nn.Module | None) -> bool:
    """Whether `proj` computes through the compiled kernels' `project` exactly as its forward does."""
    if isinstance(proj, Int8Linear):
        return proj._q is not None
    return type(proj) is nn.Linear and proj.weight.dtype == torch.float32


def residual_norm(x: Tensor, y: Tensor, norm_y: RMSNorm | None, norm_out: RMSNorm | None):
    """x + norm_y(y) (x + y without norm_y), and norm_out of that sum (None without norm_out):
    a block's residual step and the next sublayer's input, one compiled call where it applies."""
    kernels = compiled_kernels(x) if y.dtype == torch.float32 else None
    if kernels is not None:
        eps = (norm_y or norm_out).eps
        out = kernels.residual_norm(x, y, None if norm_y is None else norm_y.scale(),
                                    None if norm_out is None else norm_out.scale(), eps)
        return out[0], (out[1] if norm_out is not None else None)
    x = x + (y if norm_y is None else norm_y(y))
    return x, (None if norm_out is None else norm_out(x))


class Transformer(Layer):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # One table of inverse frequencies per distinct rope spec (Gemma 3 has two).
        self._rope_specs = sorted(set(cfg.layer_rope), key=repr)
        self._rope_of_layer = [self._rope_specs.index(r) for r in cfg.layer_rope]
        for i, spec in enumerate(self._rope_specs):
            self.register_buffer(f"inv_freq_{i}", spec.inv_freq(cfg.head_dim).float(), persistent=False)

    def fuse_projections(self) -> "Transformer":
        """Fuse q/k/v and gate/up into single projections (fewer, larger matrix products).

        Used before int8 quantisation, where each call also pays for quantising its input.
        """
        for block in self.layers:
            block.self_attn.fuse()
            block.mlp.fuse()
        return self

    def new_cache(self, batch: int, capacity: int, device=None, dtype=None) -> KVCache:
        """A cache for the kv heads this model's attention holds: all of them, or a tensor-parallel
        rank's share (`tensor_parallel.split_model`)."""
        p = self.embed_tokens.weight
        cfg = self.config
        kv_heads = self.layers[0].self_attn.kv_heads if len(self.layers) else cfg.num_kv_heads
        return KVCache(cfg.num_layers, batch, kv_heads, cfg.head_dim, capacity, dtype or p.dtype, device or p.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [batch, T] new token ids
        positions: Tensor,  # [batch, T] their positions in the sequence (rope and window)
        cache: KVCache,
        mask: Tensor | None = None,  # [batch, T, T] bool among the new tokens; None = causal
        last_n: int | None = None,  # compute logits for the last n new tokens only
        need_hidden: bool = True,  # False: `hidden` holds the last n rows only (with 0 < last_n < T)
    ) -> tuple[Tensor, Tensor]:
        """Returns (logits [batch, n, vocab] float32, hidden [batch, T, hidden]) with n = last_n or T.

        `hidden` is the final-normed hidden state (what the output head reads), for learned drafters.
        `last_n=0` skips the output head: a caller that needs logits at chosen positions only (the
        batch scheduler, whose padded rows need none at their padding) applies `head` to them.

        With 0 < last_n < T (a prefill), the last layer computes the last n rows by themselves: the
        earlier rows' keys and values still enter the cache, but only those rows attend and pass the
        MLP. A caller that needs no other row's hidden state (`need_hidden=False`: plain decoding and
        the lookup drafters) skips the rest of the last layer, a part of a long prefill; one that does
        (a learned drafter) also gets every row computed as usual. Either way the logits, and the
        last n rows of `hidden`, come from that same computation, so the first token does not depend
        on the drafter (a rounding difference between the two ways could flip a near-tie).
        """
        cfg = self.config
        b, t = tokens.shape
        device = tokens.device
        cache.check_room(t)
        start = cache.lengths  # [batch]
        slots = start[:, None] + torch.arange(t, device=device)  # [batch, T]
        cache.positions.scatter_(1, slots, positions)
        span = int(start.max()) + t
        visible_full, visible_local = self._visibility(start, positions, cache, mask, span, t)

        x = self.embed_tokens(tokens)
        if cfg.embed_scale != 1.0:
            # Cast the scale to the activation dtype first, as the reference implementations do.
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        rope = [rope_tables(positions, getattr(self, f"inv_freq_{i}")) for i in range(len(self._rope_specs))]
        split = last_n is not None and 0 < last_n < t
        earlier = None  # with `split` and need_hidden: the last layer's output for the other rows
        plans = {}  # window -> the SDPA plan of a long block's mask, made once for all its layers
        # A plan is SDPA's alone: a block the compiled kernel runs whole needs none (a layer that
        # does not take it makes its own, `Attention.forward`), nor does a short block's row attention.
        uses_sdpa = compiled_kernels(x) is None or (
            t > ROW_ATTENTION_MAX_T and self.layers[0]._kernel_parts(cache.keys[0]) is None)
        for layer, block in enumerate(self.layers):
            cos, sin = rope[self._rope_of_layer[layer]]
            window = cfg.layer_window[layer]
            visible = visible_full if window is None else visible_local[window]
            if uses_sdpa and window not in plans:
                plans[window] = query_blocks(visible, x.dtype)
            plan = plans.get(window)
            if split and layer == len(self.layers) - 1:
                if need_hidden:
                    earlier = block(x, cos, sin, cache, layer, slots, visible, plan=plan)[:, : t - last_n]
                x = block(x, cos, sin, cache, layer, slots, visible, keep=last_n)
            else:
                x = block(x, cos, sin, cache, layer, slots, visible, plan=plan)
        cache.lengths += t
        hidden = self.norm(x)
        if last_n == 0:  # no head call at all: an int8 head would still score its guard row
            return hidden.new_empty(b, 0, cfg.vocab_size, dtype=torch.float32), hidden
        head_in = hidden if last_n is None else hidden[:, hidden.shape[1] - last_n :]  # (split: all of it)
        logits = self.head(head_in)
        if earlier is not None:
            hidden = torch.cat((self.norm(earlier), hidden), dim=1)
        return logits, hidden

    def head(self, hidden: Tensor) -> Tensor:
        """Final-normed hidden states [..., hidden] -> float32 logits [..., vocab] (soft-capped if set)."""
        return soft_cap(self.lm_head(hidden).float(), self.config.final_logit_softcap)

    def head_columns(self, hidden: Tensor, ids: Tensor) -> Tensor | None:
        """`head(hidden)[..., ids]`, bit for bit, at the cost of those rows of the output head; None
        where this model has no such exact path (a float head, whose matrix product may round a
        column differently inside a different product, or a soft-capped one).

        hidden: [..., hidden]; ids: [m] int64 -> float32 [..., m]. What greedy verification can
        screen its rows with (`verify.first_proven_rejection`): a row where some screened token
        beats the draft token is a certain rejection, without the full 262k-column product.
        """
        if not isinstance(self.lm_head, Int8Linear) or self.config.final_logit_softcap:
            return None
        return self.lm_head.forward_columns(hidden, ids)

    def head_argmax(self, hidden: Tensor) -> Tensor | None:
        """`head(hidden).argmax(-1)` (ties to the lowest id), exactly, without the full product:
        int64 [m] for hidden [m, hidden]; None where this model has no such path (a float head, a
        soft-capped one, whose rounding could tie two columns that differ, or no packed kernels).
        What greedy decoding reads of the head (`Int8Linear.forward_argmax`)."""
        if not isinstance(self.lm_head, Int8Linear) or self.config.final_logit_softcap:
            return None
        return self.lm_head.forward_argmax(hidden)

    def _visibility(self, start, positions, cache, mask, span, t):
        """Which cache slots each new query may attend to.

        A slot before the row's start is visible (it holds accepted context); a slot in the new
        block is visible per `mask` (causal by default, a tree mask for token trees); later slots
        are stale. Local layers also need `query position - slot position < window`.
        Returns the global mask [b, 1, T, span] and a dict window -> local mask.
        """
        device = positions.device
        slot = torch.arange(span, device=device)[None, None, :]  # [1, 1, S]
        rel = slot - start[:, None, None]  # [b, 1, S] index into the new block
        past = rel < 0
        in_block = (rel >= 0) & (rel < t)
        if mask is None:
            block_ok = rel <= torch.arange(t, device=device)[None, :, None]  # [b, T, S]
        else:
            block_ok = mask.gather(2, rel.clamp(0, t - 1).expand(-1, t, -1))
        visible = past | (in_block & block_ok)  # [b, T, S]
        local = {}
        for window in {w for w in self.config.layer_window if w is not None}:
            distance = positions[:, :, None] - cache.positions[:, None, :span]  # [b, T, S]
            local[window] = (visible & (distance < window))[:, None]
        return visible[:, None], local
