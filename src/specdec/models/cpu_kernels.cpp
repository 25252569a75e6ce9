// specdec's CPU kernels: the small per-token steps of a decoding pass, as plain loops.
//
// Why they exist. A decoding step of Gemma 3 270M on a 2-core CPU runs ~900 PyTorch ops, most on
// vectors of a few hundred floats, and each op costs 3-40 microseconds of dispatch: more than the
// arithmetic. These functions do the same math in one call each. Every function works row by row,
// so a row's result never depends on the other rows in the call (what greedy speculative decoding
// needs: a verify pass over k + 1 tokens must compute what k + 1 one-token passes compute).
// Compiled at first use by `cpu_kernels.py`; the Python paths they replace stay as the reference.

#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>

namespace {

constexpr float kLevels = 63.0f;  // the activation grid of Int8Linear: integers in [-63, 63]

// Int8Linear's two input planes (see models/quant.py). x: [n, K] float32. block: [1 + 2n', K]
// float32 with n' >= n; row 0 (the guard) is left alone, rows 1..n get the high plane
// round(x_r / s_r) and rows n+1..2n the low plane round((x_r / s_r - high) * 126), with
// s_r = max|x_r| / 63 (at least FLT_MIN so a zero row stays zero). Returns s: [n, 1].
torch::Tensor int8_planes(torch::Tensor x, torch::Tensor block) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "int8_planes: x must be [n, K] float32");
  x = x.contiguous();
  const int64_t n = x.size(0), k = x.size(1);
  TORCH_CHECK(block.scalar_type() == torch::kFloat && block.is_contiguous() && block.size(1) == k &&
                  block.size(0) >= 1 + 2 * n,
              "int8_planes: block must be [1 + 2n, K] float32");
  auto scale = torch::empty({n, 1}, x.options());
  const float* xs = x.data_ptr<float>();
  float* high = block.data_ptr<float>() + k;
  float* low = high + n * k;
  float* ss = scale.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* row = xs + r * k;
    float peak = 0.0f;
    for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::fabs(row[i]));
    const float s = std::max(peak / kLevels, FLT_MIN);
    ss[r] = s;
    float* h = high + r * k;
    float* l = low + r * k;
    for (int64_t i = 0; i < k; ++i) {
      const float v = row[i] / s;
      const float hv = std::nearbyint(v);  // round half to even, as torch.round
      h[i] = hv;
      l[i] = std::nearbyint((v - hv) * (2 * kLevels));
    }
  }
  return scale;
}

// Int8Linear's output from the kernel's integer sums. sums: [1 + 2n', N] (row 0 is the guard's),
// scale: [n, 1] from int8_planes. out_r = (high_r + low_r / 126) * s_r (+ bias), with the sum as
// one fused multiply-add, as PyTorch's vectorised add(alpha=...) computes it.
torch::Tensor int8_combine(torch::Tensor sums, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == torch::kFloat, "int8_combine: sums must be 2-D float32");
  sums = sums.contiguous();
  const int64_t n = scale.size(0), cols = sums.size(1);
  TORCH_CHECK(sums.size(0) >= 1 + 2 * n, "int8_combine: sums has too few rows");
  auto out = torch::empty({n, cols}, sums.options());
  const float alpha = static_cast<float>(1.0 / (2 * kLevels));
  const float* hs = sums.data_ptr<float>() + cols;
  const float* ls = hs + n * cols;
  const float* ss = scale.contiguous().data_ptr<float>();
  torch::Tensor b;
  const float* bs = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    bs = b.data_ptr<float>();
  }
  float* os = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float s = ss[r];
    const float* h = hs + r * cols;
    const float* l = ls + r * cols;
    float* o = os + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = std::fma(l[c], alpha, h[c]) * s;
    if (bs != nullptr)
      for (int64_t c = 0; c < cols; ++c) o[c] += bs[c];
  }
  return out;
}

// RMSNorm over the last dimension: x_r / sqrt(mean(x_r^2) + eps) * w[r mod R], with w: [d] or
// [R, d] (R = heads + kv_heads for Gemma's per-head q/k norms over stacked heads).
// The mean of squares is summed in double. Returns a new contiguous float32 tensor shaped as x.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "rms_norm: float32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t d = x.size(-1);
  TORCH_CHECK((w.dim() == 1 || w.dim() == 2) && w.size(-1) == d, "rms_norm: w must be [d] or [R, d]");
  const int64_t rows = x.numel() / d, period = w.dim() == 1 ? 1 : w.size(0);
  auto out = torch::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xs + r * d;
    double squares = 0.0;
    for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(row[i]) * row[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(squares / d + eps));
    const float* wr = ws + (r % period) * d;
    float* o = os + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = row[i] * inv * wr[i];
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_planes", &int8_planes, "Int8Linear's per-row input planes");
  m.def("int8_combine", &int8_combine, "Int8Linear's output from its integer sums");
  m.def("rms_norm", &rms_norm, "RMSNorm with per-row-period weights");
}
