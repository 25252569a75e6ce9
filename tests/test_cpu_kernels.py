"""The compiled CPU kernels compute what the PyTorch paths they replace compute."""

import collections
import sys

import pytest
import torch
import torch.nn.functional as F

from specdec.models import cpu_kernels, loader
from specdec.models.quant import Int8Linear, cpu_int8_available
from specdec.models.transformer import RMSNorm

from helpers import make_tiny_hf


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels.load()
    # `make install` builds them (a compiler and ninja are installed): missing kernels are a defect
    # here, not a reason to skip, since every int8 test would then test only the fallback.
    assert built is not None, "the CPU kernels did not build"
    return built


@pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")
@pytest.mark.parametrize("out_features, in_features, bias", [(300, 64, True), (333, 100, False), (64, 520, True),
                                                            (70000, 640, False), (10, 2100, True),
                                                            (37, 8970, False), (48, 4096, True)])
def test_int8_linear_compiled_paths_equal_pytorch_path(kernels, out_features, in_features, bias):
    # The compiled product (int16 grid, padded shapes: 333 x 100, 64 x 520) and the PyTorch
    # reference (fbgemm's product of the two planes) give the same bits; 70000 x 640
    # is a head-sized table, 2100 inputs cross the 2048-input block, 8970 (an MLP's down projection,
    # padded) spans five blocks, the last one partial, and 4096 exactly two.
    g = torch.Generator().manual_seed(out_features)
    lin = Int8Linear(torch.randn(out_features, in_features, generator=g) * 0.05,
                     torch.randn(out_features, generator=g) if bias else None)
    assert lin._packed is None  # with the compiled kernels, fbgemm's packed copy is made only for the reference
    x = torch.randn(9, in_features, generator=g)
    x[2] = 0.0  # a zero row keeps a tiny scale and stays zero
    x[5] *= 1e4  # a row with a far larger range
    with torch.inference_mode():
        reference = lin.forward_rows(x).clone()
        compiled = lin(x)
        assert torch.equal(compiled, reference)  # same integers, same output formula: bit-identical
        assert torch.equal(compiled[2], lin.bias if bias else torch.zeros(out_features))
        # Row independence, the property speculative greedy decoding relies on: one row, two rows
        # and blocks of any size give the same rows.
        for i in range(len(x)):
            assert torch.equal(lin(x[i : i + 1])[0], compiled[i])
        long = torch.cat([x, torch.randn(70, in_features, generator=g)])  # a prefill-sized block
        full = lin(long)
        assert torch.equal(full[:9], compiled)
        assert torch.equal(full, lin.forward_rows(long))  # every row of the prefill's own kernel
        # Each pass size of a verify block and the splits of longer ones (up to 6 rows a pass in the
        # row-major kernel, 9 in the packed one), and a block that starts past the first row.
        for n in range(2, 20):
            assert torch.equal(lin(long[:n]), full[:n]), n
        assert torch.equal(lin(long[7:40]), full[7:40])
        for n in (32, 64):  # a server step's batch of decode rows
            assert torch.equal(lin(long[:n]), full[:n]), n
    torch.testing.assert_close(compiled, x @ lin.int8_weight().float().T * lin.weight_scale + (lin.bias if bias else 0),
                               rtol=0, atol=2e-2 * float(x.abs().max()))  # and it is x @ W.T on the grid


@pytest.mark.parametrize("out_features, in_features, bias", [(300, 64, True), (333, 100, False), (40, 2100, True),
                                                            (37, 8970, False), (4000, 1536, True)])
def test_int4_linear_vector_path_equals_scalar_path_and_the_formula(kernels, out_features, in_features, bias):
    # Int4Linear: the vector kernel (AVX-512 VNNI where built) and the scalar one give the same bits,
    # row by row whatever the block, and both are the documented formula, recomputed here in float64
    # from the layer's own parts: s = max|x| / 127, x_q = round(x / s), per group of 32 inputs the
    # integers S = sum q x_q and X = sum x_q, out = s * sum_g (a_g S_g + b_g X_g) (+ bias).
    # 100 and 8970 inputs end inside a group; 333 and 37 rows inside a block of 16.
    from specdec.models.quant import Int4Linear

    g = torch.Generator().manual_seed(out_features + in_features)
    lin = Int4Linear(torch.randn(out_features, in_features, generator=g) * 0.05,
                     torch.randn(out_features, generator=g) if bias else None)
    x = torch.randn(9, in_features, generator=g)
    x[2] = 0.0
    x[5] *= 1e4
    with torch.inference_mode():
        out = lin(x)
        assert torch.equal(out, lin.forward_rows(x))
        for i in range(len(x)):
            assert torch.equal(lin(x[i : i + 1])[0], out[i])
        long = torch.cat([x, torch.randn(60, in_features, generator=g)])
        full = lin(long)
        assert torch.equal(full[:9], out)
        for n in range(2, 15):  # every pass size (up to 6 rows a pass) and splits of longer blocks
            assert torch.equal(lin(long[:n]), full[:n]), n
        assert torch.equal(lin(long[7:30]), full[7:30])
        for n in (32, 64):  # a server step's batch of decode rows
            assert torch.equal(lin(long[:n]), full[:n]), n
        assert torch.equal(full, lin.forward_rows(long))  # and the scalar path, row by row
    q, a, b = lin.parts()
    s = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    xq = torch.round(x / s).double()
    groups = a.shape[1]
    pad = groups * 32 - in_features
    wq = F.pad(q.double(), (0, pad)).view(out_features, groups, 32)
    xg = F.pad(xq, (0, pad)).view(9, groups, 32)
    sums = torch.einsum("ngi,mgi->mng", wq, xg)  # S_g, exact in float64
    xsums = xg.sum(-1)  # X_g
    formula = ((sums * a.double()).sum(-1) + xsums @ b.double().T) * s.double()
    if bias:
        formula += lin.bias.double()
    torch.testing.assert_close(out.double(), formula, rtol=1e-5, atol=1e-5 * float(formula.abs().max()))
    assert torch.equal(out[2], lin.bias if bias else torch.zeros(out_features))



def test_int4_linear_long_blocks_across_row_chunks_and_group_spans_equal_the_reference(kernels):
    # The AVX2 product cuts a long block into chunks of rows (8960 inputs: 20 rows a chunk) and each
    # block of weights into spans of 48 groups, carrying every output's float totals from span to
    # span: the bits must still be the scalar reference's, whatever the rows beside a row. 24 outputs:
    # the last block of 16 has exactly one half of 8 (bias added on a whole half).
    from specdec.models.quant import Int4Linear

    g = torch.Generator().manual_seed(11)
    lin = Int4Linear(torch.randn(24, 8960, generator=g) * 0.05, torch.randn(24, generator=g))
    x = torch.randn(45, 8960, generator=g)
    x[21] *= 1e3
    ones = torch.cat([kernels.int4_linear(x[i : i + 1], lin._q, lin.bias, 24) for i in range(len(x))])
    assert torch.equal(ones, kernels.int4_reference(x, lin._q, lin.bias, 24))
    for n in (2, 5, 20, 21, 40, 41, 45):  # within a chunk, at and past its end, two and three chunks
        assert torch.equal(kernels.int4_linear(x[:n], lin._q, lin.bias, 24), ones[:n]), n
    assert torch.equal(kernels.int4_linear(x[3:30], lin._q, lin.bias, 24), ones[3:30])

def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the huge-page tables are Linux's")
def test_weight_tables_from_1_mib_on_start_on_a_huge_page_and_are_unmapped_when_freed(kernels):
    # `table_empty`: a table of 1 MiB and more lies in its own mapping, starting on a 2 MiB boundary
    # (transparent huge pages asked for); a smaller one is an ordinary tensor. Both are contiguous
    # tables of the asked shape that hold what is written, and the weight tables of an int4 layer
    # (packed) and of quantize_rows (int8) are such tables.
    from specdec.models.quant import Int4Linear, quantize_rows

    huge = 2 << 20
    big = kernels.table_empty([1024, 1536], torch.int8)
    assert big.shape == (1024, 1536) and big.dtype == torch.int8 and big.is_contiguous()
    assert big.data_ptr() % huge == 0
    values = torch.randint(-127, 128, (1024, 1536), dtype=torch.int8)
    big.copy_(values)
    assert torch.equal(big, values)
    small = kernels.table_empty([10, 7], torch.float32)
    assert small.shape == (10, 7) and small.dtype == torch.float32 and small.is_contiguous()
    small.fill_(1.5)
    assert float(small.sum()) == 105.0
    g = torch.Generator().manual_seed(3)
    q, _ = quantize_rows(torch.randn(1024, 1536, generator=g))
    assert q.data_ptr() % huge == 0
    lin = Int4Linear(torch.randn(2048, 1536, generator=g) * 0.05)  # packed: 2048 x 960 bytes
    assert lin._q.data_ptr() % huge == 0
    # Freed tables give their memory back (the mapping is unmapped): 40 tables of 32 MiB, each
    # written and dropped in turn, leave the process at most a few of them larger.
    before = _resident_bytes()
    for _ in range(40):
        t = kernels.table_empty([32 << 20], torch.uint8)
        t.fill_(7)
        del t
    assert _resident_bytes() - before < 200 << 20


@pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")
@pytest.mark.parametrize("out_features, in_features, bias", [(3000, 640, False), (500, 40, True), (257, 100, False)])
def test_int8_columns_are_bit_identical_to_the_full_output(kernels, out_features, in_features, bias):
    # What greedy screening relies on: a column scored alone equals that column of the full product.
    # (640: the vector loop; 40 and 100: its scalar tail too.)
    g = torch.Generator().manual_seed(in_features)
    lin = Int8Linear(torch.randn(out_features, in_features, generator=g) * 0.05,
                     torch.randn(out_features, generator=g) if bias else None)
    x = torch.randn(2, 4, in_features, generator=g) * 3
    x[0, 1] = 0.0
    x[1, 2] *= 1e4
    ids = torch.randperm(out_features, generator=g)[:200].sort().values
    with torch.inference_mode():
        full = lin(x)
        columns = lin.forward_columns(x, ids)
        assert columns.shape == (2, 4, len(ids))
        assert torch.equal(columns, full[..., ids])
        assert torch.equal(lin.forward_columns(x[1, 3], ids[:1]), full[1, 3, ids[:1]])  # one row, one column
    with pytest.raises(RuntimeError, match="out of range"):
        lin.forward_columns(x, torch.tensor([out_features]))


@pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")
@pytest.mark.parametrize("out_features, in_features, bias", [(5000, 640, False), (333, 100, True), (40, 2100, False),
                                                            (17, 16, True)])
def test_int8_argmax_is_the_full_outputs_argmax(kernels, out_features, in_features, bias):
    # What greedy decoding reads of the head: the argmax of each row, ties to the lowest column, for
    # 1 to 40 rows (the kernel's passes of up to 16 rows, 1 and 2 of them), where the bound of the
    # first pass is loose (rows of tiny residuals, of an outlier) or the top columns tie exactly.
    if not kernels.int8_packed():
        pytest.skip("the argmax runs on the packed (AVX-512 VNNI) weights only")
    g = torch.Generator().manual_seed(out_features)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[out_features // 2] = w[3]  # the same column twice: exact ties
    w[out_features - 1] = w[0]
    lin = Int8Linear(w, torch.randn(out_features, generator=g) if bias else None)
    with torch.inference_mode():
        for n in (1, 2, 5, 16, 17, 40):
            x = torch.randn(n, in_features, generator=g) * torch.rand(n, 1, generator=g) * 4
            x[0] = 0.0  # every column equal (or the bias alone): the lowest id wins
            if n > 2:
                x[1, 0] = 1e4  # one huge input: the other inputs' grid is coarse
                x[2] = torch.round(x[2] * 8) / 8  # on a coarse grid: a zero second plane
            full = lin(x)
            assert torch.equal(lin.forward_argmax(x), full.argmax(-1)), n
            # Rows whose best column is tied with a later copy of it.
            tied = w[3].repeat(n, 1) * (1 + torch.rand(n, 1, generator=g))
            assert torch.equal(lin.forward_argmax(tied), lin(tied).argmax(-1)), n
        odd = torch.randn(3, in_features, generator=g)
        odd[0, 1], odd[2, 0] = float("nan"), float("inf")  # non-finite rows: as the full product's argmax
        assert torch.equal(lin.forward_argmax(odd), lin(odd).argmax(-1))


@pytest.mark.parametrize("period", [1, 5])
def test_rms_norm_matches_pytorch(kernels, period):
    g = torch.Generator().manual_seed(period)
    x = torch.randn(2, 3, period, 256, generator=g) * 3
    w = torch.randn(period, 256, generator=g)
    eps = 1e-6
    expected = F.rms_norm(x, (256,), None, eps) * w
    got = kernels.rms_norm(x, w if period > 1 else w[0], eps)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-6)
    # A non-contiguous view is read as its values.
    wide = torch.randn(4, 2 * 256, generator=g)
    torch.testing.assert_close(kernels.rms_norm(wide[:, ::2], w[0], eps), F.rms_norm(wide[:, ::2], (256,), w[0], eps),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("heads, kv_heads, d, t", [(4, 1, 256, 1), (4, 1, 256, 9), (4, 2, 40, 5), (2, 2, 64, 3),
                                                 (3, 1, 36, 4),  # an odd head per key head; d % 8 inputs
                                                 (4, 1, 256, 100), (3, 1, 36, 64),  # prefills: an item per row group
                                                 # groups of 5, 6 and 7 heads: six-query score tiles, a
                                                 # last tile padded from 1, 3 or 5 queries
                                                 (5, 1, 40, 3), (12, 2, 128, 5), (7, 1, 24, 70)])
def test_attention_matches_sdpa_and_each_row_stands_alone(kernels, heads, kv_heads, d, t):
    # Two batch rows of different lengths over a 300-slot cache (three chunks), causal within the
    # block and a sliding window on the second row: the masks the model builds.
    g = torch.Generator().manual_seed(t * d)
    cap = 320
    keys = torch.randn(2, kv_heads, cap, d, generator=g)
    values = torch.randn(2, kv_heads, cap, d, generator=g)
    q = torch.randn(2, heads, t, d, generator=g)
    span = 300
    start = torch.tensor([span - t, span - t - 40])
    rel = torch.arange(span)[None, None, :] - start[:, None, None]
    visible = (rel < 0) | ((rel < t) & (rel <= torch.arange(t)[None, :, None]))  # [2, T, S]
    visible[1] &= (start[1] + torch.arange(t))[:, None] - torch.arange(span)[None, :] < 200  # a window
    visible = visible[:, None]
    scale = d**-0.5
    out = kernels.attention(q, keys, values, visible, scale)  # [2, T, heads * d]
    reference = F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=visible,
                                               scale=scale, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(out, reference.transpose(1, 2).reshape(2, t, heads * d), atol=2e-6, rtol=1e-5)
    # Row independence, bit for bit: a query alone (its own row of the mask) gives its row of the
    # block, whatever the other queries (what makes a verify row equal its one-token step).
    for b in range(2):
        for i in range(t):
            alone = kernels.attention(q[b : b + 1, :, i : i + 1], keys[b : b + 1], values[b : b + 1],
                                      visible[b : b + 1, :, i : i + 1], scale)
            assert torch.equal(alone[0, 0], out[b, i])


def _attention_case(g, heads, kv_heads, d, t, dtype):
    """Two batch rows over a 300-slot span of a 320-slot cache in `dtype`, causal within the block,
    the second row shorter and windowed: q, keys, values, visible, scale."""
    cap, span = 320, 300
    keys = torch.randn(2, kv_heads, cap, d, generator=g).to(dtype)
    values = torch.randn(2, kv_heads, cap, d, generator=g).to(dtype)
    q = torch.randn(2, heads, t, d, generator=g)
    start = torch.tensor([span - t, span - t - 40])
    rel = torch.arange(span)[None, None, :] - start[:, None, None]
    visible = (rel < 0) | ((rel < t) & (rel <= torch.arange(t)[None, :, None]))
    visible[1] &= (start[1] + torch.arange(t))[:, None] - torch.arange(span)[None, :] < 200
    return q, keys, values, visible[:, None], d**-0.5


@pytest.mark.parametrize("heads, kv_heads, d, t", [(4, 1, 256, 1), (4, 1, 256, 9), (4, 2, 40, 5), (3, 1, 36, 4),
                                                 (4, 2, 40, 90)])
def test_attention_over_a_float16_cache_is_the_float32_attention_of_its_values(kernels, heads, kv_heads, d, t):
    # A float16 cache is read as the float32 of each element (exact), so the result is, bit for bit,
    # the attention over a float32 cache holding the same values; and each query row still stands
    # alone. 40 and 36 inputs leave a tail of d % 16 and d % 8 that the vector loads do not cover.
    g = torch.Generator().manual_seed(3 * t + d)
    q, keys, values, visible, scale = _attention_case(g, heads, kv_heads, d, t, torch.float16)
    out = kernels.attention(q, keys, values, visible, scale)
    assert torch.equal(out, kernels.attention(q, keys.float(), values.float(), visible, scale))
    for b in range(2):
        for i in range(t):
            alone = kernels.attention(q[b : b + 1, :, i : i + 1], keys[b : b + 1], values[b : b + 1],
                                      visible[b : b + 1, :, i : i + 1], scale)
            assert torch.equal(alone[0, 0], out[b, i])
    # Keys and values of different types are refused, not misread.
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernels.attention(q, keys, values.float(), visible, scale)


def test_rope_write_into_a_float16_cache_stores_the_nearest_float16(kernels):
    # The rotated keys and the values go into a float16 cache as the nearest float16 of what a
    # float32 cache receives (torch's own rounding); the queries are the same.
    g = torch.Generator().manual_seed(11)
    b, t, heads, kv, d, cap = 2, 3, 4, 2, 40, 16
    qk = torch.randn(b, t, heads + kv, d, generator=g) * 30
    v = torch.randn(b, t, kv, d, generator=g) * 30
    angles = torch.randn(b, 1, t, d // 2, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([[4, 5, 6], [0, 9, 2]])
    k32, v32 = torch.zeros(b, kv, cap, d), torch.zeros(b, kv, cap, d)
    k16, v16 = torch.zeros(b, kv, cap, d, dtype=torch.float16), torch.zeros(b, kv, cap, d, dtype=torch.float16)
    q32 = kernels.rope_write(qk, v, cos, sin, k32, v32, slots)
    q16 = kernels.rope_write(qk, v, cos, sin, k16, v16, slots)
    assert torch.equal(q16, q32)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
    assert k16.abs().sum() > 0 and v16[1, :, 9].abs().sum() > 0  # the slots were written


def test_model_uses_kernels_under_inference_only_and_matches(kernels, tmp_path, monkeypatch):
    folder, _ = make_tiny_hf(tmp_path, "gemma3")
    model, _ = loader.load(folder, torch.float32, "cpu")
    ids = torch.arange(20)[None]
    calls = collections.Counter()

    class Counting:  # the real kernels, counting the calls
        def __getattr__(self, name):
            def call(*args):
                calls[name] += 1
                return getattr(kernels, name)(*args)
            return call

    monkeypatch.setattr(cpu_kernels, "load", lambda: Counting())
    model.fuse_projections()
    compiled, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    layers = model.config.num_layers
    # 20 new tokens is a short block (decode, verify): each layer in one call, then the final norm.
    assert calls == {"decoder_layer": layers, "rms_norm": 1}
    calls.clear()
    long_ids = torch.arange(40)[None]
    compiled_long, _ = model(long_ids, torch.arange(40)[None], model.new_cache(1, 48))
    # A long block (a prefill) the same way: every block of a model whose layers the kernels run
    # whole, so a row's bits never depend on the block it is in (chunked prefill, cached prefixes).
    assert calls == {"decoder_layer": layers, "rms_norm": 1}
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    reference, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=1e-4)
    reference_long, _ = model(long_ids, torch.arange(40)[None], model.new_cache(1, 48))
    torch.testing.assert_close(compiled_long, reference_long, atol=1e-4, rtol=1e-4)
    # Training keeps autograd's ops (the kernels have no backward).
    norm = RMSNorm(8, 1e-6, 1.0)
    x = torch.randn(3, 8, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("SPECDEC_CPU_KERNELS")
        cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None


def test_block_kernels_match_pytorch_ops(kernels):
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    w1, w2 = torch.randn(64, generator=g), torch.randn(64, generator=g)
    total, normed = kernels.residual_norm(x, y, w1, w2, 1e-6)
    expect_total = x + F.rms_norm(y, (64,), w1, 1e-6)
    torch.testing.assert_close(total, expect_total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(normed, F.rms_norm(expect_total, (64,), w2, 1e-6), atol=1e-5, rtol=1e-5)
    (plain_sum,) = kernels.residual_norm(x, y, None, None, 1e-6)
    assert torch.equal(plain_sum, x + y)

    gate_up = torch.randn(4, 2 * 48, generator=g) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gated_activation(gate_up, True), F.gelu(gate, approximate="tanh") * up,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.gated_activation(gate_up, False), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_own_gelu_tanh_is_accurate_and_the_same_in_every_lane(kernels):
    # The kernel's own GELU (g / (1 + exp(-2z)), z = sqrt(2/pi) (g + 0.044715 g^3)) against the
    # float64 formula, over the range activations take, on a width that is no multiple of 8 so the
    # scalar tail is tested too.
    x = torch.linspace(-6, 6, 8 * 1001 + 5)
    gate_up = torch.cat([x, torch.full_like(x, 2.0)])[None]
    ours = kernels.gated_activation(gate_up, True)[0].double()
    ref = 2.0 * F.gelu(x.double(), approximate="tanh")
    assert (ours - ref).abs().max() < 2e-6
    big = ref.abs() > 1e-3
    assert ((ours - ref).abs()[big] / ref.abs()[big]).max() < 4e-6  # float32: exp of an argument up to ~20
    # A value's result does not depend on where in the row it sits (vector lanes and scalar tail).
    for width in (13, 8, 3):
        same = kernels.gated_activation(torch.cat([torch.full((2, width), -0.8125), torch.ones(2, width)], dim=1), True)
        assert torch.equal(same, torch.full_like(same, float(same[0, 0])))


def test_rope_write_matches_rotate_and_cache_write(kernels):
    from specdec.models.kv_cache import KVCache
    from specdec.models.transformer import rope_tables, rotate

    g = torch.Generator().manual_seed(8)
    b, t, heads, kv_heads, d = 2, 3, 4, 2, 16
    qkv = torch.randn(b, t, heads + 2 * kv_heads, d, generator=g)
    qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :]  # strided, as `project` gives
    positions = torch.tensor([[5, 6, 7], [2, 3, 4]])
    cos, sin = rope_tables(positions, 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    slots = torch.tensor([[5, 6, 7], [2, 3, 4]])
    reference, compiled = (KVCache(1, b, kv_heads, d, 10, torch.float32, "cpu") for _ in range(2))
    rotated = rotate(qk.transpose(1, 2), cos, sin)
    reference.write(0, rotated[:, heads:], v.transpose(1, 2), slots)
    q = kernels.rope_write(qk, v, cos, sin, compiled.keys[0], compiled.values[0], slots)
    assert torch.equal(q, rotated[:, :heads])  # the same products and sums: bit-identical
    assert torch.equal(compiled.keys[0], reference.keys[0])
    assert torch.equal(compiled.values[0], reference.values[0])


def test_argmax_rows_is_torch_argmax(kernels):
    # Random rows of several widths (vector blocks, scalar tails), ties to the lowest index, a
    # maximum in the tail, +-0, infinities and NaN: the same index as torch.argmax, row by row.
    g = torch.Generator().manual_seed(3)
    for width in (1, 7, 8, 31, 32, 33, 1000, 262_147):
        x = torch.randn(5, width, generator=g)
        assert torch.equal(kernels.argmax_rows(x), x.argmax(-1)), width
    x = torch.zeros(8, 70)
    x[0, [5, 40]] = 3.0  # a tie: the lower index
    x[1, 69] = 1.0  # in the scalar tail
    x[2, :] = -1.0
    x[2, [3, 50]] = -0.0  # -0.0 and +0.0 tie
    x[2, 60] = 0.0
    x[3, 10] = float("inf")
    x[3, 20] = float("inf")
    x[4, 30] = float("nan")
    x[4, 50] = float("nan")
    x[5, 0] = float("nan")
    x[6, 65] = float("nan")
    x[6, 1] = float("inf")
    x[7, :] = float("-inf")
    assert kernels.argmax_rows(x).tolist() == x.argmax(-1).tolist()


def test_greedy_tokens_match_torch_argmax():
    from specdec.sampling import greedy_tokens

    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(4))
    assert greedy_tokens(x) == x.argmax(-1).tolist()
    assert greedy_tokens(x.double()) == x.argmax(-1).tolist()  # the PyTorch path


def test_a_build_lock_left_by_a_killed_process_does_not_block_the_next_load():
    """PyTorch's extension builder marks a build in progress with a `lock` file and waits, with no
    time limit, until it is gone; a process killed while compiling leaves it behind. The next load
    removes it (under specdec's own lock, which the system releases when its holder dies) and goes
    on, in a fresh process as a user's next run would."""
    import subprocess
    import sys

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    leftover = cpu_kernels.build_dir() / "lock"
    leftover.touch()
    code = "import sys; from specdec.models import cpu_kernels; sys.exit(0 if cpu_kernels.load() is not None else 1)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not leftover.exists()


def test_builds_for_different_cpus_live_in_different_folders(monkeypatch):
    """-march=native builds for the machine at hand: a build made on a CPU with AVX-512 would die
    with SIGILL on one without. A cache folder shared between machines keeps one build per CPU."""
    here = cpu_kernels.cpu_signature()
    assert here  # /proc/cpuinfo's model and flags on Linux, the platform's names elsewhere
    first = cpu_kernels.build_dir()
    assert cpu_kernels.build_dir() == first  # stable on one machine
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: here.replace("avx2", "").replace("flags=", "flags=x "))
    assert cpu_kernels.build_dir() != first


def test_the_int4_kernel_is_a_vector_one_where_the_cpu_has_one(kernels):
    """On an AVX2 machine without VNNI every int4 product once ran the scalar reference (the 4-bit
    Qwen pair's default, ~10-100x slower): the build's int4 path follows the CPU's flags."""
    flags = set(cpu_kernels.cpu_fields().get("flags", "").split())
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags
    expected = "avx512-vnni" if vnni else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"
    assert kernels.int4_path() == expected


def test_an_avx2_build_computes_the_same_bits_as_this_build(kernels, tmp_path):
    """The kernels built for AVX2 alone (row-major int8 tables, the AVX2 int4 tile) give the same
    bits as this machine's build (with AVX-512 VNNI: packed int8, the VNNI int4 tile; on an AVX2
    machine the same paths), so the path of CPUs without VNNI is tested on one that has it. One
    extra compile (~40 s)."""
    import torch.nn.functional as F
    from torch.utils import cpp_extension

    from specdec.models.quant import quantize_int4, quantize_rows

    if "avx2" not in cpu_kernels.cpu_fields().get("flags", "").split():
        pytest.skip("needs a CPU with AVX2")
    avx2 = cpp_extension.load(name="specdec_cpu_kernels_avx2", sources=[str(cpu_kernels.SOURCE)],
                              extra_cflags=["-O3", "-march=haswell", "-ffp-contract=off", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], build_directory=str(tmp_path), verbose=False)
    assert not avx2.int8_packed() and avx2.int4_path() == "avx2"
    g = torch.Generator().manual_seed(7)
    for n, k in [(333, 100), (37, 8970), (64, 2100)]:
        w = torch.randn(n, k, generator=g) * 0.05
        bias = torch.randn(n, generator=g)
        x = torch.randn(11, k, generator=g)
        x[3] *= 1e3
        q, a, b = quantize_int4(w)
        packed = kernels.int4_pack(q, a, b)
        assert torch.equal(avx2.int4_pack(q, a, b), packed)
        assert torch.equal(avx2.int4_linear(x, packed, bias, n), kernels.int4_linear(x, packed, bias, n))
        q8, s8 = quantize_rows(w.clone())

        def stored(build):  # each build's own int8 layout
            n_pad, k16 = -(-n // build.int8_row_multiple()) * build.int8_row_multiple(), -(-k // 16) * 16
            table = F.pad(q8, (0, k16 - k, 0, n_pad - n)).contiguous()
            return (build.int8_pack(table) if build.int8_packed() else table), F.pad(s8, (0, n_pad - n))

        assert torch.equal(avx2.int8_linear(x, *stored(avx2), bias, n), kernels.int8_linear(x, *stored(kernels), bias, n))
    # The row attention over float32 and float16 caches (F16C conversions on both builds).
    for dtype in (torch.float32, torch.float16):
        for heads, kv_heads, d, t in [(4, 1, 256, 1), (4, 1, 256, 9), (3, 1, 36, 4)]:
            case = _attention_case(g, heads, kv_heads, d, t, dtype)
            assert torch.equal(avx2.attention(*case), kernels.attention(*case))
