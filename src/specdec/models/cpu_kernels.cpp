// specdec's CPU kernels: the small per-token steps of a decoding pass, as plain loops.
//
// Why they exist. A decoding step of Gemma 3 270M on a 2-core CPU runs ~900 PyTorch ops, most on
// vectors of a few hundred floats, and each op costs 3-40 microseconds of dispatch: more than the
// arithmetic. These functions do the same math in one call each. Every function works row by row,
// so a row's result never depends on the other rows in the call (what greedy speculative decoding
// needs: a verify pass over k + 1 tokens must compute what k + 1 one-token passes compute).
// Compiled at first use by `cpu_kernels.py`; the Python paths they replace stay as the reference.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

constexpr float kLevels = 63.0f;  // the activation grid of Int8Linear: integers in [-63, 63]

// One row's two planes (see models/quant.py): high = round(x / s), low = round((x / s - high) * 126),
// s = max|x| / 63 (at least FLT_MIN so a zero row stays zero). T: float (the planes fed to fbgemm)
// or int16_t (`int8_columns`); both hold the same integers. Returns s.
template <typename T>
inline float row_planes(const float* row, int64_t k, T* high, T* low) {
  float peak = 0.0f;
  for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::fabs(row[i]));
  const float s = std::max(peak / kLevels, FLT_MIN);
  for (int64_t i = 0; i < k; ++i) {
    const float v = row[i] / s;
    const float hv = std::nearbyint(v);  // round half to even, as torch.round
    high[i] = static_cast<T>(hv);
    low[i] = static_cast<T>(std::nearbyint((v - hv) * (2 * kLevels)));
  }
  return s;
}

// Int8Linear's two input planes. x: [..., K] float32 (n rows). block: [1 + 2n', K] float32 with
// n' >= n; row 0 (the guard) is left alone, rows 1..n get the high plane and rows n+1..2n the low
// plane of `row_planes`. Returns s: [n, 1].
torch::Tensor int8_planes(torch::Tensor x, torch::Tensor block) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "int8_planes: x must be float32");
  const int64_t k = x.size(-1), n = x.numel() / k;  // x: [..., K], read as [n, K]
  x = x.contiguous();
  TORCH_CHECK(block.scalar_type() == torch::kFloat && block.is_contiguous() && block.size(1) == k &&
                  block.size(0) >= 1 + 2 * n,
              "int8_planes: block must be [1 + 2n, K] float32");
  auto scale = torch::empty({n, 1}, x.options());
  const float* xs = x.data_ptr<float>();
  float* high = block.data_ptr<float>() + k;
  float* low = high + n * k;
  float* ss = scale.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) ss[r] = row_planes(xs + r * k, k, high + r * k, low + r * k);
  return scale;
}

// Int8Linear's output from the kernel's integer sums. sums: [1 + 2n', N] (row 0 is the guard's),
// scale: [n, 1] from int8_planes; the output is shaped as the input x [..., K] with N for K.
// out_r = (high_r + low_r / 126) * s_r (+ bias), with the sum as one fused multiply-add, as
// PyTorch's vectorised add(alpha=...) computes it.
torch::Tensor int8_combine(torch::Tensor sums, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                           torch::Tensor x) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == torch::kFloat, "int8_combine: sums must be 2-D float32");
  sums = sums.contiguous();
  const int64_t n = scale.size(0), cols = sums.size(1);
  TORCH_CHECK(sums.size(0) >= 1 + 2 * n, "int8_combine: sums has too few rows");
  TORCH_CHECK(x.numel() / x.size(-1) == n, "int8_combine: x and scale differ in rows");
  auto shape = x.sizes().vec();
  shape.back() = cols;
  auto out = torch::empty(shape, sums.options());
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

// Dot products of one int8 weight row with a row's two int16 planes: the exact integer sums.
inline void plane_dots(const int8_t* w, const int16_t* high, const int16_t* low, int64_t k, int32_t* sh,
                       int32_t* sl) {
  int64_t i = 0;
  int32_t h = 0, l = 0;
#if defined(__AVX2__)
  __m256i ah = _mm256_setzero_si256(), al = _mm256_setzero_si256();
  for (; i + 16 <= k; i += 16) {
    // 16 weights widened to int16; madd multiplies pairs and adds them into 8 int32 lanes. No lane
    // can overflow: |w| <= 127 and |plane| <= 63, so a lane stays below 2^31 up to k ~ 2^21.
    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
    ah = _mm256_add_epi32(ah, _mm256_madd_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + i))));
    al = _mm256_add_epi32(al, _mm256_madd_epi16(wv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + i))));
  }
  alignas(32) int32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), ah);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), al);
  for (int j = 0; j < 8; ++j) {
    h += lanes[j];
    l += lanes[8 + j];
  }
#endif
  for (; i < k; ++i) {
    h += static_cast<int32_t>(w[i]) * high[i];
    l += static_cast<int32_t>(w[i]) * low[i];
  }
  *sh = h;
  *sl = l;
}

// Chosen output columns of an Int8Linear, bit-identical to the same columns of its full output.
// x: [..., K] float32 (n rows); q: [N, K] int8 weights; ws: [N] their scales; ids: [m] int64 columns;
// bias: [N] or none. Returns [..., m].
//
// Why it is exact. The full path feeds the planes of `row_planes` to fbgemm, whose integer sums
// are exact, and fbgemm's float output of a sum is float(sum) * ws[c] (its input scale is exactly 1);
// `int8_combine` then computes fma(low, 1/126, high) * s (+ bias). Here the same integer sums are
// taken from the int8 rows directly and go through the same float operations in the same order.
// (Used to screen a verify pass's rows against a few thousand candidate tokens before paying for
// the 262k-row output head: see Transformer.head_columns.)
torch::Tensor int8_columns(torch::Tensor x, torch::Tensor q, torch::Tensor ws, torch::Tensor ids,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "int8_columns: x must be float32");
  TORCH_CHECK(q.scalar_type() == torch::kChar && q.dim() == 2 && q.is_contiguous(), "int8_columns: q must be contiguous [N, K] int8");
  TORCH_CHECK(ws.scalar_type() == torch::kFloat && ws.is_contiguous() && ws.numel() == q.size(0), "int8_columns: ws must be [N] float32");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "int8_columns: ids must be 1-D int64");
  x = x.contiguous();
  ids = ids.contiguous();
  const int64_t k = x.size(-1), n = x.numel() / k, m = ids.numel(), cols = q.size(0);
  TORCH_CHECK(q.size(1) == k, "int8_columns: x and q differ in input size");
  const int64_t* is = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < m; ++j) TORCH_CHECK(is[j] >= 0 && is[j] < cols, "int8_columns: id out of range");
  torch::Tensor b;
  const float* bs = nullptr;
  if (bias.has_value()) {
    b = bias->contiguous();
    bs = b.data_ptr<float>();
  }
  auto shape = x.sizes().vec();
  shape.back() = m;
  auto out = torch::empty(shape, x.options());
  std::vector<int16_t> planes(2 * n * k);  // row r: high at 2r, low at 2r + 1
  std::vector<float> scale(n);
  const float* xs = x.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    scale[r] = row_planes(xs + r * k, k, planes.data() + 2 * r * k, planes.data() + (2 * r + 1) * k);
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* wss = ws.data_ptr<float>();
  const float alpha = static_cast<float>(1.0 / (2 * kLevels));
  float* os = out.data_ptr<float>();
  at::parallel_for(0, m, 256, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int8_t* w = qs + is[j] * k;
      const float wsj = wss[is[j]];
      for (int64_t r = 0; r < n; ++r) {
        int32_t sh, sl;
        plane_dots(w, planes.data() + 2 * r * k, planes.data() + (2 * r + 1) * k, k, &sh, &sl);
        const float high = static_cast<float>(sh) * wsj;
        const float low = static_cast<float>(sl) * wsj;
        float o = std::fma(low, alpha, high) * scale[r];
        if (bs != nullptr) o += bs[is[j]];
        os[r * m + j] = o;
      }
    }
  });
  return out;
}

// One row of RMSNorm: out = x / sqrt(mean(x^2) + eps) * w, the mean of squares summed in double.
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t d, double eps) {
  double squares = 0.0;
  for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(squares / d + eps));
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

// RMSNorm over the last dimension: x_r / sqrt(mean(x_r^2) + eps) * w[r mod R], with w: [d] or
// [R, d] (R = heads + kv_heads for Gemma's per-head q/k norms over stacked heads).
// Returns a new contiguous float32 tensor shaped as x.
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
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(xs + r * d, ws + (r % period) * d, os + r * d, d, eps);
  return out;
}

// The residual step of a decoder block: x + norm_y(y) (or x + y without w_y), and, with w_out,
// the RMSNorm of that sum (the next sublayer's input). x, y: [..., d]. Returns [sum] or [sum, normed].
std::vector<torch::Tensor> residual_norm(torch::Tensor x, torch::Tensor y, c10::optional<torch::Tensor> w_y,
                                         c10::optional<torch::Tensor> w_out, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && y.scalar_type() == torch::kFloat, "residual_norm: float32 only");
  x = x.contiguous();
  y = y.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(y.numel() == x.numel(), "residual_norm: x and y differ in size");
  torch::Tensor wy, wo;
  if (w_y.has_value()) wy = w_y->contiguous();
  if (w_out.has_value()) wo = w_out->contiguous();
  auto sum = torch::empty_like(x);
  torch::Tensor normed = w_out.has_value() ? torch::empty_like(x) : torch::Tensor();
  std::vector<float> scratch(d);
  const float* xs = x.data_ptr<float>();
  const float* ys = y.data_ptr<float>();
  float* ss = sum.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* add = ys + r * d;
    if (w_y.has_value()) {
      rms_norm_row(add, wy.data_ptr<float>(), scratch.data(), d, eps);
      add = scratch.data();
    }
    float* o = ss + r * d;
    for (int64_t i = 0; i < d; ++i) o[i] = xs[r * d + i] + add[i];
    if (w_out.has_value()) rms_norm_row(o, wo.data_ptr<float>(), normed.data_ptr<float>() + r * d, d, eps);
  }
  if (w_out.has_value()) return {sum, normed};
  return {sum};
}

// The gated MLP's activation: act(gate) * up from the fused gate/up projection [..., 2I] (gate
// first), act = GELU with the tanh approximation or SiLU: PyTorch's own vectorised kernels, called
// from here so that the split, the activation and the product cost one call from Python.
torch::Tensor gated_activation(torch::Tensor gate_up, bool gelu_tanh) {
  const int64_t width = gate_up.size(-1) / 2;
  auto gate = gate_up.narrow(-1, 0, width), up = gate_up.narrow(-1, width, width);
  return (gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(up);
}

// Rotary embedding of the new queries and keys, and the keys and values written into the cache.
// qk: [b, T, H + KV, d] (queries then keys, per token); v: [b, T, KV, d]; cos, sin: [b, 1, T, d]
// (`rope_tables`); cache_k, cache_v: [b, KV, capacity, d] (any strides, last dimension contiguous);
// slots: [b, T] int64. The rotation is x * cos + rotate_half(x) * sin with rotate_half(x) =
// (-x2, x1), the same products and sum as `transformer.rotate`. Returns the rotated queries
// [b, H, T, d]; the rotated keys and the values go to their slots.
torch::Tensor rope_write(torch::Tensor qk, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                         torch::Tensor cache_k, torch::Tensor cache_v, torch::Tensor slots) {
  TORCH_CHECK(qk.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat &&
                  cache_k.scalar_type() == torch::kFloat && cache_v.scalar_type() == torch::kFloat,
              "rope_write: float32 only");
  TORCH_CHECK(cache_k.stride(3) == 1 && cache_v.stride(3) == 1, "rope_write: cache rows must be contiguous");
  qk = qk.contiguous();
  v = v.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.to(torch::kLong).contiguous();
  const int64_t b = qk.size(0), t = qk.size(1), all_heads = qk.size(2), d = qk.size(3);
  const int64_t kv_heads = cache_k.size(1), heads = all_heads - kv_heads, half = d / 2;
  auto q = torch::empty({b, heads, t, d}, qk.options());
  const float* xs = qk.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qs = q.data_ptr<float>();
  float* ks = cache_k.data_ptr<float>();
  float* cvs = cache_v.data_ptr<float>();
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t ti = 0; ti < t; ++ti) {
      const float* c = cs + (bi * t + ti) * d;
      const float* s = sn + (bi * t + ti) * d;
      const int64_t at = slot[bi * t + ti];
      TORCH_CHECK(at >= 0 && at < cache_k.size(2), "rope_write: slot out of range");
      for (int64_t h = 0; h < all_heads; ++h) {
        const float* x = xs + ((bi * t + ti) * all_heads + h) * d;
        float* o = h < heads ? qs + ((bi * heads + h) * t + ti) * d
                             : ks + bi * cache_k.stride(0) + (h - heads) * cache_k.stride(1) + at * cache_k.stride(2);
        for (int64_t i = 0; i < half; ++i) {
          o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
          o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* x = vs + ((bi * t + ti) * kv_heads + h) * d;
        float* o = cvs + bi * cache_v.stride(0) + h * cache_v.stride(1) + at * cache_v.stride(2);
        std::copy(x, x + d, o);
      }
    }
  }
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_planes", &int8_planes, "Int8Linear's per-row input planes");
  m.def("int8_combine", &int8_combine, "Int8Linear's output from its integer sums");
  m.def("int8_columns", &int8_columns, "chosen output columns of an Int8Linear, bit-identical to its full output");
  m.def("rms_norm", &rms_norm, "RMSNorm with per-row-period weights");
  m.def("residual_norm", &residual_norm, "x + norm(y), and the norm of that sum");
  m.def("gated_activation", &gated_activation, "act(gate) * up from a fused gate/up projection");
  m.def("rope_write", &rope_write, "rotary embedding of q and k; k and v written to the cache");
}
