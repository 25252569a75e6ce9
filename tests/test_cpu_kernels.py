"""The compiled CPU kernels compute what the PyTorch paths they replace compute."""

import pytest
import torch
import torch.nn.functional as F

from specdec.models import cpu_kernels, loader
from specdec.models.quant import Int8Linear, cpu_int8_available
from specdec.models.transformer import RMSNorm


@pytest.fixture(scope="module")
def kernels():
    built = cpu_kernels.load()
    # `make install` builds them (a compiler and ninja are installed): missing kernels are a defect
    # here, not a reason to skip, since every int8 test would then test only the fallback.
    assert built is not None, "the CPU kernels did not build"
    return built


@pytest.mark.skipif(not cpu_int8_available(), reason="needs PyTorch's fbgemm CPU backend")
@pytest.mark.parametrize("out_features, in_features, bias", [(300, 64, True), (333, 100, False), (64, 520, True)])
def test_int8_linear_compiled_equals_pytorch_path(kernels, out_features, in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    lin = Int8Linear(torch.randn(out_features, in_features, generator=g) * 0.05,
                     torch.randn(out_features, generator=g) if bias else None)
    x = torch.randn(9, in_features, generator=g)
    x[2] = 0.0  # a zero row keeps a tiny scale and stays zero
    x[5] *= 1e4  # a row with a far larger range
    with torch.inference_mode():
        reference = lin.forward_rows(x).clone()
        compiled = lin.forward_rows_compiled(x, kernels)
        assert torch.equal(compiled, reference)  # same integers, same fused rescaling: bit-identical
        assert torch.equal(compiled[2], lin.bias if bias else torch.zeros(out_features))
        # Row independence, the property speculative greedy decoding relies on.
        for i in range(len(x)):
            assert torch.equal(lin.forward_rows_compiled(x[i : i + 1], kernels)[0], compiled[i])
        # A long (prefill-sized) block gets a fresh buffer and the same rows.
        long = torch.cat([x, torch.randn(70, in_features, generator=g)])
        assert torch.equal(lin.forward_rows_compiled(long, kernels)[:9], compiled)


def test_int8_planes_are_the_documented_integers(kernels):
    x = torch.tensor([[0.5, -1.0, 0.26, 0.0]])
    block = torch.full((3, 4), 7.0)
    scale = kernels.int8_planes(x, block)
    s = 1.0 / 63
    assert scale.item() == pytest.approx(s)
    assert block[0].tolist() == [7.0] * 4  # the guard row is left alone
    v = x[0] / scale[0]
    assert torch.equal(block[1], torch.round(v))
    assert torch.equal(block[2], torch.round((v - torch.round(v)) * 126))
    assert block[1:].abs().max() <= 63


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


def test_model_uses_kernels_under_inference_only_and_matches(kernels, tmp_path, monkeypatch):
    folder, _ = __import__("conftest").make_tiny_hf(tmp_path, "gemma3")
    model, _ = loader.load(folder, torch.float32, "cpu")
    ids = torch.arange(20)[None]
    calls = []

    class Counting:  # the real kernels, counting the norms they run
        def rms_norm(self, *args):
            calls.append(1)
            return kernels.rms_norm(*args)

    monkeypatch.setattr(cpu_kernels, "load", lambda: Counting())
    compiled, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    layers = model.config.num_layers
    assert len(calls) == 5 * layers + 1  # 4 sandwich norms and the q/k norm a layer, the final norm
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    reference, _ = model(ids, torch.arange(20)[None], model.new_cache(1, 32))
    torch.testing.assert_close(compiled, reference, atol=1e-4, rtol=1e-4)
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
