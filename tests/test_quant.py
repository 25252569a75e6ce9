"""The int8 CPU path: accuracy, row independence (what makes speculative greedy exact), fusion."""

import pytest
import torch
import torch.nn.functional as F

from specdec import Engine
from specdec.drafters import NgramDrafter
from specdec.errors import InvalidRequestError
from specdec.models import loader
from specdec.models import cpu_kernels
from specdec.models.quant import Int4Linear, Int8Linear, cpu_int8_available, quantize_int4, quantize_model

from helpers import make_tiny_hf

pytestmark = pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")


def test_int8_linear_is_close_to_float():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g) * 0.05
    b = torch.randn(300, generator=g)
    x = torch.randn(5, 64, generator=g)
    lin = Int8Linear(w, b)
    ref = x @ w.T + b
    err = (lin(x) - ref).abs().max() / ref.abs().max()
    assert err < 0.02  # int8 weights: ~0.4% per weight; activations carry ~15 bits
    # The weights really are int8: the error is not zero.
    assert (lin(x) - ref).abs().max() > 0


def test_int8_rows_do_not_depend_on_each_other():
    """A verify pass over k+1 rows must compute each row exactly as a one-row pass does."""
    g = torch.Generator().manual_seed(1)
    lin = Int8Linear(torch.randn(200, 48, generator=g))
    x = torch.randn(9, 48, generator=g)
    x[3] *= 100.0  # one row with a much larger range must not change the others
    together = lin(x)
    for i in range(len(x)):
        assert torch.equal(lin(x[i : i + 1])[0], together[i])


def test_int8_rows_read_back_as_quantised_whatever_the_layout():
    """The stored table (row-major, or packed in 16-row blocks where the kernels are built with
    AVX-512 VNNI) gives back the quantised rows, and a tied embedding reads the same rows."""
    from specdec.models.quant import quantize_rows

    g = torch.Generator().manual_seed(2)
    w = torch.randn(37, 40, generator=g)  # neither size a multiple of 16: padded rows and inputs
    q, scale = quantize_rows(w.clone())
    lin = Int8Linear.from_int8(q.clone(), scale)
    assert torch.equal(lin.int8_weight(), q)
    ids = torch.tensor([[36, 0, 17], [16, 15, 1]])
    assert torch.equal(lin.int8_rows(ids), q[ids])
    embed = lin.as_embedding()
    assert (embed.num_embeddings, embed.embedding_dim) == (37, 40)
    assert torch.equal(embed(ids), q[ids].float() * scale[ids, None])


def test_int4_quantisation_is_within_half_a_step_and_reads_back():
    """quantize_int4: each group's weights on a * q + b within half a step (plus the float16
    rounding of the offset), q in [0, 15]; the packed table gives back the same parts, and fusing
    layers equals quantising the fused matrix."""
    if cpu_kernels.load() is None:
        pytest.skip("int4 needs the compiled CPU kernels")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(37, 70, generator=g) * 0.05  # neither size a multiple: padded rows and a partial group
    w[3, :32] = 0.25  # a constant group: step 0, every q 0, the weight is the offset
    q, a, b = quantize_int4(w)
    assert q.shape == (48, 96) and a.shape == b.shape == (48, 3) and int(q.max()) <= 15
    assert not q[37:].any() and not a[37:].any() and not b[37:].any()
    lin = Int4Linear(w)
    got_q, got_a, got_b = lin.parts()
    assert torch.equal(got_q, q[:37, :70]) and torch.equal(got_a, a[:37]) and torch.equal(got_b, b[:37])
    deq = lin.dequantized()
    per_input = lambda t: t[:37].float().repeat_interleave(32, dim=1)[:, :70]  # noqa: E731
    # Half a step from rounding q; the float16 offset may sit above the minimum by its own rounding.
    bound = per_input(a) / 2 + per_input(b).abs() * 2**-10 + 1e-6
    assert ((deq - w).abs() <= bound).all()
    assert (deq - w).abs().max() > 0  # really 4 bits
    assert torch.equal(deq[3, :32], torch.full((32,), 0.25).half().float())
    fused = Int4Linear.concat([Int4Linear(w[:20]), Int4Linear(w[20:])])
    x = torch.randn(3, 70, generator=g)
    assert torch.equal(fused(x), lin(x))


def test_int4_takes_the_grid_that_4_bit_weights_already_lie_on():
    """Weights dequantised from a 4-bit file lie on low + step * j per group, often with fewer than
    16 levels (j in [0, 11] here, some levels unused): quantize_int4 finds that grid, so (with a
    float16 step and minimum) the 4-bit layer holds exactly those weights, where (max - min) / 15
    would round most of them."""
    if cpu_kernels.load() is None:
        pytest.skip("int4 needs the compiled CPU kernels")
    g = torch.Generator().manual_seed(5)
    rows, groups = 40, 6
    step = (torch.rand(rows, groups, 1, generator=g) * 0.01 + 0.001).half().float()
    low = (torch.randn(rows, groups, 1, generator=g) * 0.05).half().float()
    j = torch.randint(0, 12, (rows, groups, 32), generator=g)
    j[:, :, 0] = 0  # the minimum is a level
    j[:, :, 1] = 11
    j[::2, :, 2:] = j[::2, :, 2:] // 2 * 2  # even rows: only even levels (the nearest one is 2 steps away)
    w = (j.float() * step + low).view(rows, groups * 32)
    lin = Int4Linear(w)
    assert torch.equal(lin.dequantized(), w)
    _, a, b = lin.parts()
    assert torch.equal(b.float(), low[..., 0])
    assert torch.equal(a[1::2].float(), step[1::2, :, 0])


def test_fused_projections_compute_the_same(tmp_path):
    folder, _ = make_tiny_hf(tmp_path, "qwen2")
    model, _ = loader.load(folder, torch.float32, "cpu")
    ids = torch.arange(20)[None]
    before, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    model.fuse_projections()
    after, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_small_tables_share_one_huge_page_table_and_compute_the_same(tmp_path, mode, monkeypatch):
    from specdec.models import quant

    if cpu_kernels.load() is None or not cpu_int8_available():
        pytest.skip("needs the compiled CPU kernels")
    folder, _ = make_tiny_hf(tmp_path, "qwen2")
    apart, _ = loader.load(folder, torch.float32, "cpu")
    gathered, _ = loader.load(folder, torch.float32, "cpu")
    with monkeypatch.context() as m:
        m.setattr(quant, "gather_small_tables", lambda model: 0)
        quantize_model(apart, mode)
    quantize_model(gathered, mode)
    tables = [mod._q for mod in gathered.modules() if isinstance(mod, Int8Linear)]
    small = [q for q in tables if q.numel() * q.element_size() < 1 << 20]
    assert len(small) > 2  # a tiny model's tables are all small
    # All in one table (`table_empty`'s: on huge pages from 1 MiB on, which test_cpu_kernels checks),
    # each on cache lines of its own
    # A tied head's table is the embedding's too: it stays where it is, one copy for both.
    embedding = gathered.embed_tokens.q.untyped_storage().data_ptr()
    if gathered.config.tie_embeddings:
        assert gathered.lm_head._q.untyped_storage().data_ptr() == embedding
    moved = [q for q in small if q.untyped_storage().data_ptr() != embedding]
    assert len(moved) == len(tables) - gathered.config.tie_embeddings
    assert len({q.untyped_storage().data_ptr() for q in moved}) == 1
    assert all(q.data_ptr() % 64 == 0 and q.is_contiguous() for q in moved)
    others = [mod._q for mod in apart.modules() if isinstance(mod, Int8Linear)]
    assert len({q.untyped_storage().data_ptr() for q in others}) == len(others)  # apart: each its own
    for a, b in zip(others, tables):
        assert torch.equal(a, b)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    for t in (12, 1):  # a prefill and a decoding step (the compiled decoder layer)
        x, y = apart.new_cache(1, 16), gathered.new_cache(1, 16)
        a, _ = apart(ids[:, :t], torch.arange(t)[None], x)
        b, _ = gathered(ids[:, :t], torch.arange(t)[None], y)
        assert torch.equal(a, b)
        if t == 12:
            a, _ = apart(ids[:, :1], torch.tensor([[12]]), x)
            b, _ = gathered(ids[:, :1], torch.tensor([[12]]), y)
            assert torch.equal(a, b)


@pytest.mark.parametrize("family, mode", [("gemma3", "int8"), ("llama", "int8"), ("gemma3", "int4"), ("llama", "int4")])
def test_int8_model_close_and_speculative_greedy_identical(tmp_path, family, mode):
    if mode == "int4" and cpu_kernels.load() is None:
        pytest.skip("int4 needs the compiled CPU kernels")
    folder, _ = make_tiny_hf(tmp_path, family)
    ref, _ = loader.load(folder, torch.float32, "cpu")
    model, _ = loader.load(folder, torch.float32, "cpu")
    quantize_model(model, mode)
    if mode == "int4":  # the decoder layers' projections on 4 bits, the head on int8
        assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
        assert type(model.lm_head) is Int8Linear
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(24)[None]
    a, _ = ref(ids, pos, ref.new_cache(1, 32))
    b, _ = model(ids, pos, model.new_cache(1, 32))
    top_agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    # Random tiny weights have close logits, so 4 bits flip more of the top choices; the logits as
    # a whole stay close (a wrong product would be far off).
    assert top_agree > (0.9 if mode == "int8" else 0.6)
    assert F.cosine_similarity(a.flatten(), b.flatten(), dim=0) > (0.999 if mode == "int8" else 0.95)
    plain = Engine(model, None)
    spec = Engine(model, None, drafter=NgramDrafter(), num_speculative_tokens=5)
    full_head = Engine(model, None, drafter=NgramDrafter(), num_speculative_tokens=5, screen_verify=False)
    assert spec.screen_verify and not full_head.screen_verify
    # Count the rows the output head scores in verify passes (its full product or, for greedy
    # rows, its argmax), to see the screen cut some.
    head_rows = []
    model_head, model_argmax = model.head, model.head_argmax
    model.head = lambda hidden: head_rows.append(hidden.shape[0]) or model_head(hidden)

    def counting_argmax(hidden):  # counted where it answers (without an exact argmax kernel, e.g.
        best = model_argmax(hidden)  # an AVX2 build, the caller falls back to `head`, counted there)
        if best is not None:
            head_rows.append(hidden.shape[0])
        return best

    model.head_argmax = counting_argmax
    screened = 0
    for seed in range(3):
        prompt = torch.randint(0, 20, (10,), generator=torch.Generator().manual_seed(seed)).tolist() * 2
        x = plain.generate(prompt_ids=prompt, max_new_tokens=40)
        head_rows.clear()
        y = spec.generate(prompt_ids=prompt, max_new_tokens=40)
        steps = [s for s in y.steps if s.kind != "prefill"]
        assert len(head_rows) == 1 + len(steps)  # the prefill's row, then one head call a step
        screened += sum(n < s.drafted + 1 for n, s in zip(head_rows[1:], steps))
        z = full_head.generate(prompt_ids=prompt, max_new_tokens=40)
        # (The two speculative runs may draft differently: the cost rule prices a screened
        # verify pass lower. Their outputs are the plain one all the same.)
        assert x.token_ids == y.token_ids == z.token_ids
    assert screened, "the screen never cut a verify pass short"


@pytest.mark.parametrize("family, mode", [("gemma3", "int8"), ("llama", "int8"), ("gemma3", "int4"), ("qwen2", "int4")])
def test_int8_verify_rows_are_the_one_token_steps_bit_for_bit(tmp_path, family, mode):
    # With the compiled kernels every step of a pass is row by row (int8 products on per-row grids,
    # norms, rotation, attention of a short block), so scoring k + 1 tokens in one pass gives
    # exactly the logits of k + 1 one-token steps: greedy speculation at int8 is then exact, not
    # merely close. (Without the kernels, SDPA blocks its queries and may round a row differently.)
    from specdec.models import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("needs the compiled CPU kernels")
    folder, _ = make_tiny_hf(tmp_path, family)
    model, _ = loader.load(folder, torch.float32, "cpu")
    quantize_model(model, mode)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    prompt, block = ids[:, :22], ids[:, 22:]
    one = model.new_cache(1, 40)
    model(prompt, torch.arange(22)[None], one)
    steps = [model(block[:, i : i + 1], torch.tensor([[22 + i]]), one)[0][0, 0] for i in range(8)]
    many = model.new_cache(1, 40)
    model(prompt, torch.arange(22)[None], many)
    logits, _ = model(block, torch.arange(22, 30)[None], many)
    for i in range(8):
        assert torch.equal(logits[0, i], steps[i])


def test_bad_quantize_values():
    with pytest.raises(InvalidRequestError, match="quantize"):
        Engine.load("default", quantize="int3")
    with pytest.raises(ValueError):
        quantize_model(torch.nn.Linear(2, 2), "int3")


def test_tables_between_1_and_2_mib_that_hold_no_whole_huge_page_join_the_shared_table():
    # Qwen2.5 1.5B's 4-bit output projection (1536 x 1536: 1,474,560 bytes) is not rounded up to a
    # 2 MiB page by `table_empty` (that would add more than an eighth), so alone it lies on 4 KiB
    # pages: it joins the shared table. Its fused q/k/v projection (2048 x 1536: 1,966,080 bytes) is
    # rounded up and keeps its own table. The products are the same bits either way.
    from specdec.models import quant

    if cpu_kernels.load() is None:
        pytest.skip("int4 needs the compiled CPU kernels")
    assert not quant._alone_on_huge_pages(1_474_560) and quant._alone_on_huge_pages(1_966_080)
    assert not quant._alone_on_huge_pages((1 << 20) - 1) and quant._alone_on_huge_pages(2 << 20)
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(*(Int4Linear(torch.randn(n, 1536, generator=g) * 0.05) for n in (1536, 2048, 1536)))
    before = [m._q for m in model]
    x = torch.randn(5, 1536, generator=g)
    expected = [m(x) for m in model]
    assert quant.gather_small_tables(model) == 2
    o1, qkv, o2 = (m._q for m in model)
    assert o1.untyped_storage().data_ptr() == o2.untyped_storage().data_ptr() != before[0].untyped_storage().data_ptr()
    assert qkv is before[1]
    assert all(torch.equal(m(x), e) for m, e in zip(model, expected))
