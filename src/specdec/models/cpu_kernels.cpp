// specdec's CPU kernels: the small per-token steps of a decoding pass, as plain loops.
//
// Why they exist. A decoding step of Gemma 3 270M runs ~900 PyTorch ops, most on vectors of a few
// hundred floats, and each op's dispatch costs more than its arithmetic. These functions do the same math in one call each. Every function works row by row,
// so a row's result never depends on the other rows in the call (what greedy speculative decoding
// needs: a verify pass over k + 1 tokens must compute what k + 1 one-token passes compute).
// Compiled at first use by `cpu_kernels.py`; the Python paths they replace stay as the reference.

// ATen and the pybind11 Tensor type caster only: torch/extension.h adds all of libtorch's C++ API
// (autograd, nn, optim), whose headers alone were most of the build's time and compiler memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
// AVX-512 with VNNI (AMD Zen 4, Intel Ice Lake and later): Int8Linear's products run on packed
// weights, 16 outputs a 512-bit register (`packed_linear`).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define SPECDEC_VNNI 1
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr float kLevels = 63.0f;  // the activation grid of Int8Linear: integers in [-63, 63]

// The float32 data of an optional tensor (a bias), or nullptr; `keep` holds the contiguous tensor read.
inline const float* optional_data(const c10::optional<at::Tensor>& t, at::Tensor& keep) {
  if (!t.has_value()) return nullptr;
  keep = t->contiguous();
  return keep.data_ptr<float>();
}

// Outputs from this size on are fresh pages at every call: glibc's malloc serves blocks of 32 MiB
// and more by mmap and unmaps them when freed (smaller freed blocks are reused from its heap). An
// output head over a server step's rows is such a block (64 rows of a 262k vocabulary: 64 MiB),
// and touching it 4 KiB page by page costs a page fault for every page, at every step.
constexpr int64_t kHugeOutputBytes = int64_t{32} << 20;

// An empty float32 tensor shaped as x with its last dimension n (a linear layer's output). A large
// one asks for transparent huge pages before anything is written to it (where the system grants
// them on request: 2 MiB a fault instead of 4 KiB; elsewhere the request does nothing).
inline at::Tensor empty_with_last(const at::Tensor& x, int64_t n) {
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options().dtype(at::kFloat));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const int64_t bytes = out.numel() * static_cast<int64_t>(sizeof(float));
  if (bytes >= kHugeOutputBytes) {
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(out.data_ptr()) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (reinterpret_cast<uintptr_t>(out.data_ptr()) + bytes) & ~(kHuge - 1);
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
  return out;
}

// Weight tables from this size on get a mapping of their own (`table_empty`).
constexpr int64_t kHugeTableBytes = int64_t{1} << 20;

// An empty contiguous table for a model's weights. From kHugeTableBytes on it lies in its own
// anonymous mapping that starts on a 2 MiB boundary and asks for transparent huge pages before
// anything is written to it. Why: a decoding step streams every weight once, and on 4 KiB pages that
// stream crosses a page (a TLB miss and a new start for the hardware's prefetcher) every 4 KiB; on
// 2 MiB pages the same step runs faster (BENCHMARKS.md, the T-token pass cost). The mapping's length is
// rounded up to whole huge pages where that adds at most an eighth of the table (else its tail stays
// on small pages); where the system declines (no THP, "never"), these are ordinary pages.
at::Tensor table_empty(std::vector<int64_t> shape, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHugeTableBytes) {
    constexpr size_t kHuge = size_t{2} << 20, kPage = size_t{4} << 10;
    size_t length = (static_cast<size_t>(bytes) + kPage - 1) & ~(kPage - 1);
    const size_t rounded = (static_cast<size_t>(bytes) + kHuge - 1) & ~(kHuge - 1);
    if ((rounded - bytes) * 8 <= static_cast<size_t>(bytes)) length = rounded;
    const size_t reserve = length + kHuge;
    void* base = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t first = reinterpret_cast<uintptr_t>(base);
      const uintptr_t start = (first + kHuge - 1) & ~uintptr_t{kHuge - 1};
      if (start > first) munmap(base, start - first);  // the unused head and tail of the reservation
      const uintptr_t stop = start + length, last = first + reserve;
      if (last > stop) munmap(reinterpret_cast<void*>(stop), last - stop);
      void* data = reinterpret_cast<void*>(start);
      madvise(data, length, MADV_HUGEPAGE);
      return at::from_blob(data, shape, [length](void* p) { munmap(p, length); }, at::TensorOptions().dtype(dtype));
    }
  }
#endif
  return at::empty(shape, at::TensorOptions().dtype(dtype));
}

// The int16 grid of Int8Linear (see models/quant.py), one row of x at a time: s = max|x| / 63 (at
// least FLT_MIN so a zero row stays zero), high = round(x / s), low = round((x / s - high) * 126),
// and x / s ~= high + low / 126. Rounding is half to even, as torch.round. The AVX2 lanes do the same
// float operations as the scalar code (the maximum is the same in any order; division, rounding and
// the products are per element), so every value is the scalar one's.
inline float row_peak(const float* row, int64_t k) {
  float peak = 0.0f;
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 peaks = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) peaks = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(row + i)), peaks);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peaks);
  for (int j = 0; j < 8; ++j) peak = std::max(peak, lanes[j]);
#endif
  for (; i < k; ++i) peak = std::max(peak, std::fabs(row[i]));
  return peak;
}

inline float grid_scale(const float* row, int64_t k) { return std::max(row_peak(row, k) / kLevels, FLT_MIN); }

inline void grid_one(float x, float s, int& high, int& low) {
  const float y = x / s;
  const float h = std::nearbyint(y);
  high = static_cast<int>(h);
  low = static_cast<int>(std::nearbyint((y - h) * (2 * kLevels)));
}

#if defined(__AVX2__)
inline void grid_eight(const float* x, __m256 s, __m256i& high, __m256i& low) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x), s);
  const __m256 h = _mm256_round_ps(y, kNearest);
  high = _mm256_cvtps_epi32(h);
  low = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(y, h), _mm256_set1_ps(2 * kLevels)), kNearest));
}
#endif

// One row as v = 126 high + low (|v| <= 8001) in v[0..k), v[k..kp) = 0 (padding). Returns c = s / 126.
inline float row_int16(const float* row, int64_t k, int64_t kp, int16_t* v) {
  const float s = grid_scale(row, k);
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 sv = _mm256_set1_ps(s);
  const __m256i times = _mm256_set1_epi32(126);
  for (; i + 8 <= k; i += 8) {
    __m256i high, low;
    grid_eight(row + i, sv, high, low);
    const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(high, times), low);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + i),
                     _mm_packs_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1)));
  }
#endif
  for (; i < k; ++i) {
    int high, low;
    grid_one(row[i], s, high, low);
    v[i] = static_cast<int16_t>(high * 126 + low);
  }
  std::fill(v + k, v + kp, int16_t{0});
  return s / (2 * kLevels);
}

// -- Int8Linear's own matrix product ------------------------------------------------------------
//
// The two planes as one int16 per input, v = 126 high + low (|v| <= 8001): one multiply-add per
// weight instead of fbgemm's two planes of 7-bit inputs. Per input row r and output column c the
// exact integer S = sum_i w_ci v_ri gives out = float(S) * (s_r / 126) * ws_c, which is also what
// fbgemm's two exact plane sums give in `Int8Linear.forward_rows`, bit for bit.
// int32 lanes stay exact over blocks of 2048 inputs (2048 * 8001 * 127 < 2^31); blocks add in double.

constexpr int64_t kBlockK = 2048;
constexpr int64_t kBlockM = 48;  // rows of x a thread keeps hot while it streams the weights
// Up to this many rows, int8_linear widens the weights in registers (`direct_rows`) rather than once
// into a buffer: faster or equal up to this many rows, slower from about 40 on
// (docs/archive/BENCHMARKS-history.md).
constexpr int64_t kDirectRows = 32;

// The one output formula (exact integer sum -> float).
inline float int8_output(double sum, float c, float w_scale, const float* bias) {
  float o = static_cast<float>(sum) * c * w_scale;
  if (bias != nullptr) o += *bias;
  return o;
}

// Row-by-row kernels split a block's rows over the threads from this many rows on (a prefill).
// Fewer rows (decode and verify) stay on the calling thread: there a fork and join would cost
// more than the rows. Each row's result is the same either way.
constexpr int64_t kParallelRows = 64;

// x [..., k] float32 on the int16 grid: n rows of kp inputs at `v` and their c. The block starts on a
// 64-byte boundary, so every row and every 16-input step starts on a 32-byte one (kp is a multiple
// of 16): an AVX2 load of 16 inputs never straddles two cache lines. With malloc's 16-byte alignment
// half of them did, and such a load costs two, which the products of 3-9 rows (verify passes)
// showed plainly (docs/archive/BENCHMARKS-history.md).
struct GridRows {
  std::vector<int16_t> storage;
  int16_t* v = nullptr;
  std::vector<float> c;
};

inline void input_int16(const at::Tensor& x, int64_t kp, GridRows& rows) {
  const int64_t k = x.size(-1), n = x.numel() / k;
  rows.storage.resize(n * kp + 32);
  rows.v = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(rows.storage.data()) + 63) & ~uintptr_t{63});
  rows.c.resize(n);
  const float* xs = x.data_ptr<float>();
  int16_t* v = rows.v;
  float* c = rows.c.data();
  at::parallel_for(0, n, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) c[r] = row_int16(xs + r * k, k, kp, v + r * kp);
  });
}

#if defined(__AVX2__)
inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Ask for every cache line of the `bytes` weights at p (not past `end`) while the current tile is
// computed: a decoding step streams ~270 MB of int8 weights that no cache holds.
inline void prefetch_weights(const int8_t* p, int64_t bytes, const int8_t* end) {
  const int64_t room = std::min<int64_t>(bytes, end - p);
  for (int64_t b = 0; b < room; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p + b), _MM_HINT_T0);
}

// The exact sums of MT rows of v (stride kp) with 4 widened weight rows (the thread's buffer) over
// inputs [k0, k1), k1 - k0 <= kBlockK: sums[m] = the 4 columns' integers.
template <int MT>
__attribute__((always_inline)) inline void block_sums(const int16_t* w, const int16_t* v, int64_t kp, int64_t k0, int64_t k1, __m128i* sums) {
  __m256i acc[MT][4];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm256_setzero_si256();
  for (int64_t i = k0; i < k1; i += 16) {
    // Widened weights from L1 as the multiply's memory operand, each input row loaded once into a
    // register: 2 + 8 loads for 8 multiply-adds. (The empty asm keeps GCC from re-loading the
    // input rows at every use instead, 14 loads, which was clearly slower.)
    __m256i xv[MT];
    for (int m = 0; m < MT; ++m) {
      xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + m * kp + i));
      asm("" : "+x"(xv[m]));
    }
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < MT; ++m)
        acc[m][r] = _mm256_add_epi32(
            acc[m][r], _mm256_madd_epi16(xv[m], _mm256_load_si256(reinterpret_cast<const __m256i*>(w + r * kp + i))));
  }
  for (int m = 0; m < MT; ++m) {  // the 8 lanes of each column -> one integer per column
    const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[m][0], acc[m][1]),
                                        _mm256_hadd_epi32(acc[m][2], acc[m][3]));
    sums[m] = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  }
}

// Few rows (decode, verify): the exact sums of MT rows of v with NC int8 weight rows at w (stride
// kp) over inputs [k0, k1), k1 - k0 <= kBlockK, widening each 16 weights in a register once for
// all MT rows. MT x NC <= 12 accumulators + NC weights + 1 input in the 16 AVX2 registers. While it
// runs, it asks for one cache line per step of the 2 kp bytes at `ahead` (a later tile's weights,
// or nullptr): spread over the loop, the requests keep the memory busy during the multiply-adds
// instead of stalling at the start of the next tile.
template <int MT, int NC>
__attribute__((always_inline)) inline void direct_sums(const int8_t* w, const int16_t* v, int64_t kp, int64_t k0, int64_t k1,
                                                        const int8_t* ahead, int32_t (&sums)[MT][NC]) {
  __m256i acc[MT][NC];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NC; ++r) acc[m][r] = _mm256_setzero_si256();
  for (int64_t i = k0; i < k1; i += 16) {
    __m256i wr[NC];
    for (int r = 0; r < NC; ++r) wr[r] = widen(w + r * kp + i);
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + 2 * i), _MM_HINT_T0);
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + m * kp + i));
      for (int r = 0; r < NC; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv, wr[r]));
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NC; ++r) {  // 8 lanes -> one integer (exact in any order)
      const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc[m][r]), _mm256_extracti128_si256(acc[m][r], 1));
      const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
      sums[m][r] = _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
    }
}


// out[m, 0..min(NC, valid)) (row stride ldo) for MT rows by direct_sums and the scalar output formula.
template <int MT, int NC>
__attribute__((always_inline)) inline void direct_tile(const int8_t* w, const int16_t* v, int64_t kp, const float* c,
                                                        const float* ws, const float* bias, float* out, int64_t ldo,
                                                        int64_t valid, const int8_t* ahead) {
  int32_t sums[MT][NC];
  double total[MT][NC] = {};
  for (int64_t k0 = 0; k0 < kp; k0 += kBlockK) {  // one block unless K > 2048
    direct_sums<MT, NC>(w, v, kp, k0, std::min(kp, k0 + kBlockK), k0 == 0 ? ahead : nullptr, sums);
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < NC; ++r) total[m][r] += sums[m][r];
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < NC && r < valid; ++r) out[m * ldo + r] = int8_output(total[m][r], c[m], ws[r], bias ? bias + r : nullptr);
}

// Rows [m0, m1) of v against NC weight rows, in ceil(rows / 6) passes of near-equal size (5 -> 5,
// 9 -> 5 + 4): each pass widens the same weights again, so a short last pass would pay for them
// almost alone. Up to 6 rows a pass (12 accumulators for NC = 2): against 4, the products of 5 to
// 9 rows (verify passes) gain and 2-4 rows are unchanged (docs/archive/BENCHMARKS-history.md). Only the first pass asks for the weights `ahead`.
template <int NC>
inline void direct_rows(const int8_t* w, const int16_t* v, int64_t kp, int64_t m0, int64_t m1, const float* c,
                        const float* ws, const float* bias, float* out, int64_t ldo, int64_t valid, const int8_t* ahead) {
  constexpr int64_t kMaxRows = 6;
  const int64_t rows = m1 - m0, passes = (rows + kMaxRows - 1) / kMaxRows;
  int64_t m = m0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t size = (m1 - m + (passes - p) - 1) / (passes - p);
    const int16_t* vm = v + m * kp;
    float* om = out + m * ldo;
    switch (size) {
      case 6: direct_tile<6, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
      case 5: direct_tile<5, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
      case 4: direct_tile<4, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
      case 3: direct_tile<3, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
      case 2: direct_tile<2, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
      default: direct_tile<1, NC>(w, vm, kp, c + m, ws, bias, om, ldo, valid, ahead); break;
    }
    m += size;
    ahead = nullptr;
  }
}

// out[m, col..col+valid) for MT rows of v and the 4 weight rows at w: `int8_output` of the exact
// sums, four lanes at a time (the same roundings as the scalar formula, lane by lane).
template <int MT>
__attribute__((always_inline)) inline void tile(const int16_t* w, const int16_t* v, int64_t kp, const float* c, const float* ws, const float* bias,
                 float* out, int64_t ldo, int64_t valid) {
  __m128 totals[MT];
  __m128i sums[MT];
  if (kp <= kBlockK) {  // one block: int32 -> float rounds as int32 -> double -> float does
    block_sums<MT>(w, v, kp, 0, kp, sums);
    for (int m = 0; m < MT; ++m) totals[m] = _mm_cvtepi32_ps(sums[m]);
  } else {
    __m256d acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_pd();
    for (int64_t k0 = 0; k0 < kp; k0 += kBlockK) {
      block_sums<MT>(w, v, kp, k0, std::min(kp, k0 + kBlockK), sums);
      for (int m = 0; m < MT; ++m) acc[m] = _mm256_add_pd(acc[m], _mm256_cvtepi32_pd(sums[m]));
    }
    for (int m = 0; m < MT; ++m) totals[m] = _mm256_cvtpd_ps(acc[m]);
  }
  for (int m = 0; m < MT; ++m) {
    __m128 o = _mm_mul_ps(_mm_mul_ps(totals[m], _mm_set1_ps(c[m])), _mm_loadu_ps(ws));  // ws is padded to 4
    if (valid == 4) {
      if (bias != nullptr) o = _mm_add_ps(o, _mm_loadu_ps(bias));
      _mm_storeu_ps(out + m * ldo, o);
    } else {  // the last, partial tile: the bias has no padding
      alignas(16) float lanes[4];
      _mm_store_ps(lanes, o);
      for (int64_t j = 0; j < valid; ++j) out[m * ldo + j] = bias != nullptr ? lanes[j] + bias[j] : lanes[j];
    }
  }
}
#endif

#if defined(SPECDEC_VNNI)
// -- The packed product (AVX-512 VNNI builds) --------------------------------------------------------
// Where AVX-512 VNNI is built in, Int8Linear keeps its weights in blocks of 16 output rows (`int8_pack`):
// block b holds, for each group g of 4 inputs, the 4 weights of each of its 16 rows side by side, 64
// bytes with row 16b + l at bytes 4l..4l+3, and each weight stored as the unsigned byte w + 128.
// One vpdpbusd then multiplies a whole group for 16 rows: unsigned weight bytes by 4 signed input
// bytes broadcast to every lane, summed into 16 int32 lanes, one per output. The input is the same
// int16 grid split into its two planes, high and low (both in [-63, 63]): per row and output,
//   S = sum_i w_i v_i = 126 sum_i (w_i + 128) high_i + sum_i (w_i + 128) low_i - 128 sum_i v_i,
// the same exact integer the row-major kernels compute, so the same output formula gives the same
// bits. The lanes add in int32 and may wrap in between: S itself fits (|S| < 2^31 over a block of
// 2048 inputs, above), so the wrapped arithmetic ends on it exactly.
// Why: each output's sum builds up in its own lane, so no lane is summed across at the end, and no
// weight is widened to 16 bits first. Against the row-major kernels: decode rows the same, verify
// passes and prefills faster (docs/archive/BENCHMARKS-history.md).
constexpr int64_t kPackRows = 16;
constexpr int64_t kPackedPassRows = 9;  // rows a pass: 18 sums + the weights in the 32 registers
// From this many rows on, a packed product (int8 and int4) asks for the next 16-row block's weights
// into the L2 while its first pass over the current block computes, one group's cache lines a
// group. With a few rows the multiply-adds take about as long as the block's bytes take to arrive,
// and without the requests the two ran one after the other (the hardware's prefetcher does not run
// far enough ahead of a loop that is busy computing). One row is a pure stream, which the hardware
// prefetcher serves best alone (the requests made it slower). The int8 product asks from 3 rows on
// (whole 2-row forwards were slower with the requests, although its 2-row products alone were not)
// and up to kPrefetchMaxRows8: beyond, its two vpdpbusd a row and group keep the core computing
// long enough for the hardware's own prefetch, and the requests only added work. The int4 product
// asks from 3 rows on: on weights in huge pages (`table_empty`) its 2-row products were slower with
// the requests (a stream the hardware's prefetcher serves alone, as one row), from 3 rows faster.
constexpr int64_t kPrefetchRows = 3;
constexpr int64_t kPrefetchRows8 = 3, kPrefetchMaxRows8 = 16;

// In place: a row-major [N16, KP] int8 table (N16 a multiple of 16) into the packed layout above.
at::Tensor int8_pack(at::Tensor q) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "int8_pack: q must be contiguous int8");
  const int64_t n16 = q.size(0), kp = q.size(1);
  TORCH_CHECK(n16 % kPackRows == 0 && kp % 16 == 0, "int8_pack: q must be padded to [ceil16(N), ceil16(K)]");
  int8_t* qs = q.data_ptr<int8_t>();
  at::parallel_for(0, n16 / kPackRows, 64, [&](int64_t b0, int64_t b1) {
    std::vector<int8_t> rows(kPackRows * kp);
    for (int64_t b = b0; b < b1; ++b) {
      int8_t* block = qs + b * kPackRows * kp;  // a block's rows occupy the same bytes in both layouts
      std::copy(block, block + kPackRows * kp, rows.begin());
      for (int64_t l = 0; l < kPackRows; ++l)
        for (int64_t i = 0; i < kp; ++i)
          block[(i / 4) * 64 + l * 4 + i % 4] = static_cast<int8_t>(static_cast<uint8_t>(rows[l * kp + i]) ^ 0x80);
    }
  });
  return q;
}

// Row `r` of a packed table as int8 weights (kp of them) at `row`.
inline void packed_row(const int8_t* q, int64_t kp, int64_t r, int8_t* row) {
  const int8_t* block = q + (r / kPackRows) * kPackRows * kp + (r % kPackRows) * 4;
  for (int64_t g = 0; g < kp / 4; ++g)
    for (int j = 0; j < 4; ++j) row[4 * g + j] = static_cast<int8_t>(static_cast<uint8_t>(block[g * 64 + j]) ^ 0x80);
}

// Rows `ids` (any shape, each < q's rows) of a packed table as int8 [*ids.shape, k] (`stored_rows`
// in quant.py: a tied embedding's lookups, the rows a drafter reads).
at::Tensor int8_rows(at::Tensor q, at::Tensor ids, int64_t k) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(0) % kPackRows == 0,
              "int8_rows: q must be a packed int8 table");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "int8_rows: ids must be int64");
  const int64_t kp = q.size(1);
  TORCH_CHECK(k <= kp && k > kp - 16, "int8_rows: k does not match q");
  const at::Tensor flat = ids.contiguous().view(-1);
  const int64_t* is = flat.data_ptr<int64_t>();
  const int64_t m = flat.numel();
  for (int64_t j = 0; j < m; ++j) TORCH_CHECK(is[j] >= 0 && is[j] < q.size(0), "int8_rows: id out of range");
  auto rows = at::empty({m, kp}, q.options());
  int8_t* out = rows.data_ptr<int8_t>();
  for (int64_t j = 0; j < m; ++j) packed_row(q.data_ptr<int8_t>(), kp, is[j], out + j * kp);
  auto shape = ids.sizes().vec();
  shape.push_back(k);
  return rows.narrow(1, 0, k).reshape(shape);
}

// A block's input rows for the packed product: words [kp / 4][n][2], the high then the low bytes
// of row r's inputs 4g..4g+3 (the rows of one group side by side, so a pass of rows reads them at
// fixed offsets from one pointer); c = s_r / 126; offset [n][blocks] = 128 * sum v over each
// 2048-input block, as wrapped int32.
struct PlaneRows {
  std::vector<int32_t> words;
  std::vector<float> c;
  std::vector<int32_t> offset;
  int64_t blocks = 1;
};

inline void input_planes(const at::Tensor& x, int64_t kp, PlaneRows& rows) {
  const int64_t k = x.size(-1), n = x.numel() / k, groups = kp / 4;
  rows.blocks = (kp + kBlockK - 1) / kBlockK;
  rows.words.resize(groups * n * 2);
  rows.c.resize(n);
  rows.offset.resize(n * rows.blocks);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, n, kParallelRows, [&](int64_t r0, int64_t r1) {
    std::vector<int8_t> high(kp), low(kp);  // padding inputs stay 0: they add nothing
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * k;
      const float s = grid_scale(row, k);
      int64_t i = 0;
      const __m256 sv = _mm256_set1_ps(s);
      for (; i + 8 <= k; i += 8) {
        __m256i h, l;
        grid_eight(row + i, sv, h, l);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(high.data() + i), _mm256_cvtepi32_epi8(h));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(low.data() + i), _mm256_cvtepi32_epi8(l));
      }
      for (; i < k; ++i) {
        int h, l;
        grid_one(row[i], s, h, l);
        high[i] = static_cast<int8_t>(h);
        low[i] = static_cast<int8_t>(l);
      }
      rows.c[r] = s / (2 * kLevels);
      for (int64_t blk = 0; blk < rows.blocks; ++blk) {
        int64_t sum_v = 0;
        for (int64_t j = blk * kBlockK; j < std::min(kp, (blk + 1) * kBlockK); ++j) sum_v += 126 * high[j] + low[j];
        rows.offset[r * rows.blocks + blk] = static_cast<int32_t>(static_cast<uint32_t>(128 * sum_v));
      }
      for (int64_t g = 0; g < groups; ++g) {
        std::memcpy(&rows.words[(g * n + r) * 2], high.data() + 4 * g, 4);
        std::memcpy(&rows.words[(g * n + r) * 2 + 1], low.data() + 4 * g, 4);
      }
    }
  });
}

// S of MT rows (words at `a`, `stride` int32 from one group to the next) and the 16 outputs of the
// packed block at p, over groups [g0, g1): sums[m] = 126 A_high + A_low - offset[m * blocks].
// The running sums are named variables, and up to 4 rows keep a second set for the odd groups (more
// chains in flight). The empty asm after each step pins the sums to registers: without it GCC 12
// kept up to 6 of them on the stack from 4 rows on, loaded and stored every step (its partial
// redundancy elimination, `-fno-tree-pre`, was the trigger).
#define SPECDEC_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
#define SPECDEC_STEP(m, H, L, w, at)                                                  \
  if constexpr (MT > m) {                                                            \
    H##m = _mm512_dpbusd_epi32(H##m, w, _mm512_set1_epi32((at)[2 * m]));              \
    L##m = _mm512_dpbusd_epi32(L##m, w, _mm512_set1_epi32((at)[2 * m + 1]));          \
    asm("" : "+v"(H##m), "+v"(L##m));                                                \
  }
#define SPECDEC_EVEN(m) SPECDEC_STEP(m, h, l, w, a)
#define SPECDEC_ODD(m) SPECDEC_STEP(m, h2, l2, w2, a + stride)
#define SPECDEC_SUM(m)                                                                                   \
  if constexpr (MT > m) {                                                                               \
    sums[m] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(h##m, times), l##m),                 \
                               _mm512_set1_epi32(offset[m * blocks]));                                  \
  }
template <int MT>
__attribute__((always_inline)) inline void packed_sums(const int8_t* p, const int32_t* a, int64_t stride, int64_t g0,
                                                        int64_t g1, const int32_t* offset, int64_t blocks, __m512i* sums,
                                                        const int8_t* ahead) {
  static_assert(MT >= 1 && MT <= kPackedPassRows, "packed_sums: 1 to 9 rows");
  const __m512i zero = _mm512_setzero_si512(), times = _mm512_set1_epi32(126);
#define SPECDEC_DECL(m) __m512i h##m = zero, l##m = zero;
  SPECDEC_ROWS(SPECDEC_DECL)
#undef SPECDEC_DECL
  int64_t g = g0;
  a += g0 * stride;
  if constexpr (MT <= 4) {
    __m512i h20 = zero, l20 = zero, h21 = zero, l21 = zero, h22 = zero, l22 = zero, h23 = zero, l23 = zero;
    for (; g + 2 <= g1; g += 2, a += 2 * stride) {
      if (ahead != nullptr) {  // the next block's same two groups (a cache line each)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64 + 64), _MM_HINT_T1);
      }
      const __m512i w = _mm512_loadu_si512(p + g * 64), w2 = _mm512_loadu_si512(p + g * 64 + 64);
      SPECDEC_EVEN(0) SPECDEC_EVEN(1) SPECDEC_EVEN(2) SPECDEC_EVEN(3)
      SPECDEC_ODD(0) SPECDEC_ODD(1) SPECDEC_ODD(2) SPECDEC_ODD(3)
    }
    h0 = _mm512_add_epi32(h0, h20), l0 = _mm512_add_epi32(l0, l20), h1 = _mm512_add_epi32(h1, h21), l1 = _mm512_add_epi32(l1, l21);
    h2 = _mm512_add_epi32(h2, h22), l2 = _mm512_add_epi32(l2, l22), h3 = _mm512_add_epi32(h3, h23), l3 = _mm512_add_epi32(l3, l23);
  }
  for (; g < g1; ++g, a += stride) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64), _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(p + g * 64);
    SPECDEC_ROWS(SPECDEC_EVEN)
  }
  SPECDEC_ROWS(SPECDEC_SUM)
}
#undef SPECDEC_SUM
#undef SPECDEC_EVEN
#undef SPECDEC_ODD
#undef SPECDEC_STEP
#undef SPECDEC_ROWS

// out[m, 0..valid) (row stride ldo) for MT rows against the packed block at p: the output formula of
// `int8_output`, 16 lanes at a time (the same roundings lane by lane).
template <int MT>
inline void packed_tile(const int8_t* p, const PlaneRows& rows, int64_t n, int64_t m0, int64_t groups, const float* ws,
                        const float* bias, float* out, int64_t ldo, int64_t valid, const int8_t* ahead) {
  const int32_t* a = rows.words.data() + 2 * m0;
  const int32_t* offset = rows.offset.data() + m0 * rows.blocks;
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  __m512 totals[MT];
  __m512i sums[MT];
  if (rows.blocks == 1) {  // one block: int32 -> float rounds as int32 -> double -> float does
    packed_sums<MT>(p, a, 2 * n, 0, groups, offset, 1, sums, ahead);
    for (int m = 0; m < MT; ++m) totals[m] = _mm512_cvtepi32_ps(sums[m]);
  } else {
    __m512d lo[MT], hi[MT];
    for (int m = 0; m < MT; ++m) lo[m] = hi[m] = _mm512_setzero_pd();
    for (int64_t blk = 0; blk < rows.blocks; ++blk) {
      const int64_t g0 = blk * kBlockK / 4;
      packed_sums<MT>(p, a, 2 * n, g0, std::min(groups, g0 + kBlockK / 4), offset + blk, rows.blocks, sums, ahead);
      for (int m = 0; m < MT; ++m) {
        lo[m] = _mm512_add_pd(lo[m], _mm512_cvtepi32_pd(_mm512_castsi512_si256(sums[m])));
        hi[m] = _mm512_add_pd(hi[m], _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(sums[m], 1)));
      }
    }
    for (int m = 0; m < MT; ++m)
      totals[m] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo[m])), _mm512_cvtpd_ps(hi[m]), 1);
  }
  const __m512 scales = _mm512_loadu_ps(ws);  // ws is padded to 16
  const __m512 shift = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    __m512 o = _mm512_mul_ps(_mm512_mul_ps(totals[m], _mm512_set1_ps(rows.c[m0 + m])), scales);
    if (bias != nullptr) o = _mm512_add_ps(o, shift);
    _mm512_mask_storeu_ps(out + m * ldo, mask, o);
  }
}

// y = Int8Linear(x) with packed weights: per block of 16 outputs, all rows in passes of near-equal
// size (up to kPackedPassRows): the block's weights stay in the core's caches while every pass
// reads them. From kPrefetchRows8 to kPrefetchMaxRows8 rows, the first pass asks for the next
// block's weights (above); otherwise the stream is left to the hardware's own prefetch.
void packed_linear(const at::Tensor& x, const at::Tensor& q, const float* ws, const float* bias, float* out, int64_t n_out) {
  const int64_t kp = q.size(1), n16 = q.size(0), groups = kp / 4, n = x.numel() / x.size(-1);
  const int64_t passes = (n + kPackedPassRows - 1) / kPackedPassRows;
  PlaneRows rows;
  input_planes(x, kp, rows);
  const int8_t* qs = q.data_ptr<int8_t>();
  at::parallel_for(0, n16 / kPackRows, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t col = b * kPackRows, valid = std::min(kPackRows, n_out - col);
      const int8_t* p = qs + col * kp;
      const bool ask = n >= kPrefetchRows8 && n <= kPrefetchMaxRows8 && col + kPackRows < n16;
      const int8_t* ahead = ask ? p + kPackRows * kp : nullptr;
      int64_t m = 0;
      for (int64_t pass = 0; pass < passes; ++pass, ahead = nullptr) {
        const int64_t size = (n - m + (passes - pass) - 1) / (passes - pass);
        const float* bcol = bias != nullptr ? bias + col : nullptr;
        float* o = out + m * n_out + col;
        switch (size) {
#define SPECDEC_CASE(S) case S: packed_tile<S>(p, rows, n, m, groups, ws + col, bcol, o, n_out, valid, ahead); break;
          SPECDEC_CASE(9) SPECDEC_CASE(8) SPECDEC_CASE(7) SPECDEC_CASE(6) SPECDEC_CASE(5)
          SPECDEC_CASE(4) SPECDEC_CASE(3) SPECDEC_CASE(2)
          default: packed_tile<1>(p, rows, n, m, groups, ws + col, bcol, o, n_out, valid, ahead); break;
#undef SPECDEC_CASE
        }
        m += size;
      }
    }
  });
}
// -- The argmax of an Int8Linear's output rows, exact, for about half of its multiply-adds ---------
//
// Greedy decoding needs only the argmax of each row of the output head (262k columns for Gemma 3:
// most of a batched step's multiply-adds once its rows make the step compute-bound). Per row and
// column S = 126 H + L with H = sum_i w_i high_i and L = sum_i w_i low_i, and |L| <= ||w|| ||low||
// (Cauchy-Schwarz). Pass 1 computes H alone, one vpdpbusd a group where the full product needs two,
// and for each block of 16 columns the most any of them can output: the output formula applied to
// 126 H + ||w|| ||low|| + 2 (the 2 covers the double's roundings), which is at least the column's
// real output because each step of the formula is monotone (the conversion to float, the products
// by c >= 0 and ws >= 0, the bias added). Pass 2 computes the exact outputs of the block with the
// highest bound, then of every block whose bound reaches the best exact output so far: a block
// below it can hold neither the maximum nor a tie of it. The exact outputs are `packed_tile`'s for
// that row, the bits of the full product, so the answer is the full output's argmax, the lowest
// column among equal maxima (as torch.argmax). Rows with a non-finite input get -1 (the caller
// takes the full product there).
constexpr int64_t kArgmaxPassRows = 16;
constexpr int64_t kArgmaxPrefetchRows = 5;

// acc[m] = sum over the groups of (w + 128) high for MT rows (words at `a`, `stride` int32 a group)
// and the 16 columns of the packed block at p. Up to 8 rows keep a second set of sums for the odd
// groups (more chains in flight). The sums are named variables pinned to registers by the empty asm
// (an array of them was kept on the stack, loaded and stored every step; see `packed_sums`).
#define SPECDEC_ROWS16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define SPECDEC_HIGH(m, H, w, at)                                          \
  if constexpr (MT > m) {                                                 \
    H##m = _mm512_dpbusd_epi32(H##m, w, _mm512_set1_epi32((at)[2 * m]));   \
    asm("" : "+v"(H##m));                                                  \
  }
#define SPECDEC_EVEN(m) SPECDEC_HIGH(m, h, w, a)
#define SPECDEC_ODD(m) if constexpr (MT <= 8) { SPECDEC_HIGH(m, e, w2, a + stride) }
template <int MT>
__attribute__((always_inline)) inline void high_sums(const int8_t* p, const int32_t* a, int64_t stride, int64_t groups,
                                                      __m512i* acc, const int8_t* ahead) {
  static_assert(MT >= 1 && MT <= 16, "high_sums: 1 to 16 rows");
  const __m512i zero = _mm512_setzero_si512();
#define SPECDEC_DECL(m) __m512i h##m = zero, e##m = zero;
  SPECDEC_ROWS16(SPECDEC_DECL)
#undef SPECDEC_DECL
  int64_t g = 0;
  if constexpr (MT <= 8) {
    for (; g + 2 <= groups; g += 2, a += 2 * stride) {
      if (ahead != nullptr) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64 + 64), _MM_HINT_T1);
      }
      const __m512i w = _mm512_loadu_si512(p + g * 64), w2 = _mm512_loadu_si512(p + g * 64 + 64);
      SPECDEC_ROWS16(SPECDEC_EVEN)
      SPECDEC_ROWS16(SPECDEC_ODD)
    }
  }
  for (; g < groups; ++g, a += stride) {
    if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead + g * 64), _MM_HINT_T1);
    const __m512i w = _mm512_loadu_si512(p + g * 64);
    SPECDEC_ROWS16(SPECDEC_EVEN)
  }
#define SPECDEC_SUM(m) if constexpr (MT > m) acc[m] = MT <= 8 ? _mm512_add_epi32(h##m, e##m) : h##m;
  SPECDEC_ROWS16(SPECDEC_SUM)
#undef SPECDEC_SUM
}
#undef SPECDEC_EVEN
#undef SPECDEC_ODD
#undef SPECDEC_HIGH
#undef SPECDEC_ROWS16

// Pass 1 for MT rows from m0 and one block: bound[m] = the highest output bound of its columns.
template <int MT>
inline void high_block(const int8_t* p, const PlaneRows& rows, int64_t n, int64_t m0, int64_t groups,
                       const int32_t* high_offset, const double* low_norm, const double* w_norm, const float* ws,
                       const float* bias, int64_t valid, float* bound, int64_t bound_stride, const int8_t* ahead) {
  __m512i acc[MT];
  high_sums<MT>(p, rows.words.data() + 2 * m0, 2 * n, groups, acc, ahead);
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  const __m512 scales = _mm512_loadu_ps(ws);
  const __m512 shift = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  const __m512d norm_lo = _mm512_loadu_pd(w_norm), norm_hi = _mm512_loadu_pd(w_norm + 8);
  const __m512d times = _mm512_set1_pd(126.0), margin = _mm512_set1_pd(2.0);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  for (int m = 0; m < MT; ++m) {
    const __m512i high = _mm512_sub_epi32(acc[m], _mm512_set1_epi32(high_offset[m0 + m]));  // H, exact
    const __m512d ln = _mm512_set1_pd(low_norm[m0 + m]);
    const __m512d lo = _mm512_add_pd(_mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(high)), times),
                                                   _mm512_mul_pd(norm_lo, ln)), margin);
    const __m512d hi = _mm512_add_pd(_mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(high, 1)), times),
                                                   _mm512_mul_pd(norm_hi, ln)), margin);
    const __m512 total = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
    __m512 o = _mm512_mul_ps(_mm512_mul_ps(total, _mm512_set1_ps(rows.c[m0 + m])), scales);
    if (bias != nullptr) o = _mm512_add_ps(o, shift);
    bound[(m0 + m) * bound_stride] = _mm512_reduce_max_ps(_mm512_mask_blend_ps(mask, none, o));
  }
}

// x [n, K] float32; q, ws, bias, n_out as for int8_linear (packed weights); w_norm [N16] float64:
// each stored row's Euclidean norm (`int8_norms`). Returns int64 [n]: each row's argmax of
// int8_linear(x, ...), or -1 for a row with a non-finite input.
at::Tensor int8_argmax(at::Tensor x, at::Tensor q, at::Tensor ws, at::Tensor w_norm, c10::optional<at::Tensor> bias,
                       int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "int8_argmax: x must be [n, K] float32");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(0) % kPackRows == 0,
              "int8_argmax: q must be a packed int8 table");
  const int64_t kp = q.size(1), n16 = q.size(0), groups = kp / 4, blocks = n16 / kPackRows;
  TORCH_CHECK(kp % 16 == 0 && n_out <= n16 && n_out > n16 - kPackRows && n_out > 0, "int8_argmax: n_out does not match q");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() == n16, "int8_argmax: ws must be [N16] float32");
  TORCH_CHECK(w_norm.scalar_type() == at::kDouble && w_norm.is_contiguous() && w_norm.numel() == n16,
              "int8_argmax: w_norm must be [N16] float64");
  // |H| < 2^31 in int32 lanes: 255 * 63 per input (unsigned weights, the offset taken off after).
  TORCH_CHECK(kp <= 65536, "int8_argmax: at most 65536 inputs");
  x = x.contiguous();
  const int64_t k = x.size(1), n = x.size(0);
  TORCH_CHECK(k <= kp && k > kp - 16, "int8_argmax: x and q differ in input size");
  at::Tensor b;
  const float* bs = optional_data(bias, b);
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  if (n == 0) return out;
  PlaneRows rows;
  input_planes(x, kp, rows);
  // Per row: whether its inputs are finite, 128 * sum high (the unsigned weights' offset) and ||low||.
  std::vector<int32_t> high_offset(n);
  std::vector<double> low_norm(n);
  std::vector<char> finite(n);
  const float* xs = x.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    bool ok = true;
    for (int64_t i = 0; i < k; ++i) ok = ok && std::isfinite(xs[r * k + i]);
    finite[r] = ok;
    int64_t sum_high = 0, sum_sq = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* hb = reinterpret_cast<const int8_t*>(&rows.words[(g * n + r) * 2]);
      const int8_t* lb = hb + 4;
      for (int j = 0; j < 4; ++j) {
        sum_high += hb[j];
        sum_sq += static_cast<int64_t>(lb[j]) * lb[j];
      }
    }
    high_offset[r] = static_cast<int32_t>(128 * sum_high);
    low_norm[r] = std::sqrt(static_cast<double>(sum_sq));
  }
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* wss = ws.data_ptr<float>();
  const double* norms = w_norm.data_ptr<double>();
  std::vector<float> bound(n * blocks);
  // Pass 1: every block, the rows in passes of near-equal size (up to 16: 16 sums + the weights).
  const int64_t passes = (n + kArgmaxPassRows - 1) / kArgmaxPassRows;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t col = blk * kPackRows, valid = std::min(kPackRows, n_out - col);
      const int8_t* p = qs + col * kp;
      const int8_t* ahead = n >= kArgmaxPrefetchRows && blk + 1 < blocks ? p + kPackRows * kp : nullptr;
      int64_t m = 0;
      for (int64_t pass = 0; pass < passes; ++pass, ahead = nullptr) {
        const int64_t size = (n - m + (passes - pass) - 1) / (passes - pass);
        const float* bcol = bs != nullptr ? bs + col : nullptr;
        float* bd = bound.data() + blk;
        switch (size) {
#define SPECDEC_CASE(S) case S: high_block<S>(p, rows, n, m, groups, high_offset.data(), low_norm.data(), norms + col, wss + col, bcol, valid, bd, blocks, ahead); break;
          SPECDEC_CASE(16) SPECDEC_CASE(15) SPECDEC_CASE(14) SPECDEC_CASE(13) SPECDEC_CASE(12) SPECDEC_CASE(11)
          SPECDEC_CASE(10) SPECDEC_CASE(9) SPECDEC_CASE(8) SPECDEC_CASE(7) SPECDEC_CASE(6) SPECDEC_CASE(5)
          SPECDEC_CASE(4) SPECDEC_CASE(3) SPECDEC_CASE(2)
          default: high_block<1>(p, rows, n, m, groups, high_offset.data(), low_norm.data(), norms + col, wss + col, bcol, valid, bd, blocks, ahead); break;
#undef SPECDEC_CASE
        }
        m += size;
      }
    }
  });
  // Pass 2, row by row: the exact outputs of the blocks that can hold the maximum.
  int64_t* os = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    alignas(64) float exact[kPackRows];
    for (int64_t r = r0; r < r1; ++r) {
      if (!finite[r]) {
        os[r] = -1;
        continue;
      }
      const float* bd = bound.data() + r * blocks;
      float best = -INFINITY;
      int64_t best_col = -1;
      auto score = [&](int64_t blk) {
        const int64_t col = blk * kPackRows, valid = std::min(kPackRows, n_out - col);
        packed_tile<1>(qs + col * kp, rows, n, r, groups, wss + col, bs != nullptr ? bs + col : nullptr, exact, kPackRows,
                       valid, nullptr);
        for (int64_t j = 0; j < valid; ++j)
          if (exact[j] > best || (exact[j] == best && col + j < best_col) || best_col < 0) {
            best = exact[j];
            best_col = col + j;
          }
      };
      const int64_t first = std::max_element(bd, bd + blocks) - bd;
      score(first);
      for (int64_t blk = 0; blk < blocks; ++blk)
        if (blk != first && bd[blk] >= best) score(blk);
      os[r] = best_col;
    }
  });
  return out;
}

// Each stored row's Euclidean norm, float64 [N16], of a packed int8 table (`int8_argmax`'s bound).
at::Tensor int8_norms(at::Tensor q) {
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(0) % kPackRows == 0,
              "int8_norms: q must be a packed int8 table");
  const int64_t n16 = q.size(0), kp = q.size(1);
  auto out = at::empty({n16}, q.options().dtype(at::kDouble));
  const int8_t* qs = q.data_ptr<int8_t>();
  double* os = out.data_ptr<double>();
  at::parallel_for(0, n16, 256, [&](int64_t r0, int64_t r1) {
    std::vector<int8_t> row(kp);
    for (int64_t r = r0; r < r1; ++r) {
      packed_row(qs, kp, r, row.data());
      int64_t sum = 0;
      for (int64_t i = 0; i < kp; ++i) sum += static_cast<int64_t>(row[i]) * row[i];
      os[r] = std::sqrt(static_cast<double>(sum));
    }
  });
  return out;
}
constexpr int64_t kRowMultiple = kPackRows;
#else
constexpr int64_t kRowMultiple = 4;
#endif

// Whether Int8Linear's weights are packed in this build (`int8_pack`), and the multiple its rows are
// padded to.
bool int8_packed() { return kRowMultiple == 16; }
int64_t int8_row_multiple() { return kRowMultiple; }

// y = Int8Linear(x): x [..., K] float32; q [N4, KP] int8 (N and K zero-padded to multiples of
// kRowMultiple and 16; packed where AVX-512 VNNI is built in); ws [N4] float32; bias [N] or none;
// n_out = N. Returns [..., N]. Every output is the formula above, so a row's result never depends on
// the other rows in the call.
at::Tensor int8_linear(at::Tensor x, at::Tensor q, at::Tensor ws, c10::optional<at::Tensor> bias,
                          int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_linear: x must be float32");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "int8_linear: q must be contiguous int8");
  const int64_t kp = q.size(1), n4 = q.size(0);
  TORCH_CHECK(kp % 16 == 0 && n4 % kRowMultiple == 0 && n_out <= n4 && n_out > n4 - kRowMultiple,
              "int8_linear: q must be padded to [ceil", kRowMultiple, "(N), ceil16(K)]");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() == n4, "int8_linear: ws must be padded as q's rows, float32");
  x = x.contiguous();
  const int64_t k = x.size(-1), n = x.numel() / k;
  TORCH_CHECK(k <= kp && k > kp - 16, "int8_linear: x and q differ in input size");
  at::Tensor b;
  const float* bs = optional_data(bias, b);
  auto out = empty_with_last(x, n_out);
  if (n == 0) return out;
#if defined(SPECDEC_VNNI)
  packed_linear(x, q, ws.data_ptr<float>(), bs, out.data_ptr<float>(), n_out);
  return out;
#else
  GridRows grid;
  input_int16(x, kp, grid);
  const int16_t* v = grid.v;
  const float* c = grid.c.data();
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* wss = ws.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, n4 / 4, 8, [&](int64_t t0, int64_t t1) {
#if defined(__AVX2__)
    // A block of more than kDirectRows rows (a prefill) uses each weight many times: widen a 4-row
    // tile once into a buffer (32-byte aligned for the loads). Fewer rows (decode and verify) widen
    // the int8 weights in registers as they go.
    std::vector<int16_t> buffer(n > kDirectRows ? 4 * kp + 16 : 0);
    int16_t* wide = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) & ~uintptr_t{31});
#endif
    for (int64_t m0 = 0; m0 < n; m0 += kBlockM) {
      const int64_t m1 = std::min(n, m0 + kBlockM);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t col = 4 * t, valid = std::min<int64_t>(4, n_out - col);
        const int8_t* w = qs + col * kp;
        const float* bcol = bs ? bs + col : nullptr;
#if defined(__AVX2__)
        if (n <= kDirectRows) {
          // Two columns at a time; the first pass over them asks for the same two columns of the
          // tile two ahead (two tiles of multiply-adds: far enough to hide the latency).
          for (int64_t h = 0; h < 4 && h < valid; h += 2) {
            const int8_t* ahead = w + (8 + h) * kp;
            direct_rows<2>(w + h * kp, v, kp, m0, m1, c, wss + col + h, bcol ? bcol + h : nullptr,
                           os + col + h, n_out, valid - h, ahead < qs + n4 * kp ? ahead : nullptr);
          }
          continue;
        }
        // A prefill reuses each tile for up to kBlockM rows: one line two tiles ahead was faster
        // than the whole next tile.
        _mm_prefetch(reinterpret_cast<const char*>(w + 8 * kp), _MM_HINT_T0);
        for (int64_t i = 0; i < 4 * kp; i += 16)
          _mm256_store_si256(reinterpret_cast<__m256i*>(wide + i), widen(w + i));
        int64_t m = m0;
        for (; m + 2 <= m1; m += 2)
          tile<2>(wide, v + m * kp, kp, c + m, wss + col, bcol, os + m * n_out + col, n_out, valid);
        if (m < m1)
          tile<1>(wide, v + m * kp, kp, c + m, wss + col, bcol, os + m * n_out + col, n_out, valid);
#else
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t j = 0; j < valid; ++j) {
            int64_t sum = 0;
            const int16_t* vr = v + m * kp;
            for (int64_t i = 0; i < kp; ++i) sum += static_cast<int32_t>(w[j * kp + i]) * vr[i];
            os[m * n_out + col + j] = int8_output(static_cast<double>(sum), c[m], wss[col + j], bcol ? bcol + j : nullptr);
          }
#endif
      }
    }
  });
  return out;
#endif
}

// Chosen output columns of an Int8Linear, bit-identical to the same columns of its full output
// (the same exact sums, the same formula), at the cost of those weight rows only. x: [..., K]
// float32; q, ws, bias, n_out as for int8_linear; ids: [m] int64 columns < N. Returns [..., m].
// (Greedy verification screens a block's rows with it before paying for the 262k-row output head:
// see Transformer.head_columns.)
at::Tensor int8_columns(at::Tensor x, at::Tensor q, at::Tensor ws, at::Tensor ids,
                           c10::optional<at::Tensor> bias, int64_t n_out) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8_columns: x must be float32");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.size(1) % 16 == 0,
              "int8_columns: q must be contiguous padded int8");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.numel() == q.size(0), "int8_columns: ws must be [N4] float32");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "int8_columns: ids must be 1-D int64");
  x = x.contiguous();
  ids = ids.contiguous();
  const int64_t k = x.size(-1), kp = q.size(1), n = x.numel() / k, m = ids.numel();
  TORCH_CHECK(k <= kp && k > kp - 16, "int8_columns: x and q differ in input size");
  const int64_t* is = ids.data_ptr<int64_t>();
  TORCH_CHECK(n_out <= q.size(0), "int8_columns: n_out exceeds q's rows");
  for (int64_t j = 0; j < m; ++j) TORCH_CHECK(is[j] >= 0 && is[j] < n_out, "int8_columns: id out of range");
  at::Tensor b;
  const float* bs = optional_data(bias, b);
  auto out = empty_with_last(x, m);
  GridRows grid;
  input_int16(x, kp, grid);
  const int16_t* v = grid.v;
  const float* c = grid.c.data();
  const int8_t* qs = q.data_ptr<int8_t>();
  const float* wss = ws.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, m, 256, [&](int64_t j0, int64_t j1) {
#if defined(SPECDEC_VNNI)
    std::vector<int8_t> row(kp);  // the packed table's row, gathered
#endif
    for (int64_t j = j0; j < j1; ++j) {
#if defined(SPECDEC_VNNI)
      packed_row(qs, kp, is[j], row.data());
      const int8_t* w = row.data();
#else
      const int8_t* w = qs + is[j] * kp;
#endif
#if defined(__AVX2__) && !defined(SPECDEC_VNNI)
      if (j + 1 < j1) prefetch_weights(qs + is[j + 1] * kp, kp, qs + q.size(0) * kp);  // rows gathered: no stream to detect
#endif
      for (int64_t r = 0; r < n; ++r) {
        const int16_t* vr = v + r * kp;
        double sum = 0.0;
        for (int64_t k0 = 0; k0 < kp; k0 += kBlockK) {
          const int64_t k1 = std::min(kp, k0 + kBlockK);
          int32_t block = 0;
          int64_t i = k0;
#if defined(__AVX2__)
          __m256i acc = _mm256_setzero_si256();
          for (; i < k1; i += 16) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(widen(w + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr + i))));
          alignas(32) int32_t lanes[8];
          _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
          for (int l = 0; l < 8; ++l) block += lanes[l];
#endif
          for (; i < k1; ++i) block += static_cast<int32_t>(w[i]) * vr[i];
          sum += block;
        }
        os[r * m + j] = int8_output(sum, c[r], wss[is[j]], bs ? bs + is[j] : nullptr);
      }
    }
  });
  return out;
}

// -- Int4Linear's product (4-bit weights in groups of 32 inputs) ----------------------------------
//
// Decoding reads every weight once a step, so a product's time on a CPU is about its bytes: 4-bit
// weights read ~5/8 of int8's (20 bytes per 32 weights with their two half-precision numbers).
// Layout (`int4_pack`): blocks of 16 output rows; per block and group g of 32 inputs, 320 bytes:
// 4 chunks of 64 bytes (chunk u, lane l = row 16b + l, byte t: the low nibble the weight of input
// 32g + 8u + t, the high nibble that of input 32g + 8u + 4 + t), then the 16 rows' step a and then
// their offset b as float16: weight = a * q + b with q in [0, 15] (min and step of each group, as
// llama.cpp's Q4_K sub-blocks have). One 64-byte chunk then gives two vpdpbusd operands (its low and
// its high nibbles): 4 inputs for 16 outputs each, every output summing in its own lane.
// The input row goes on one int8 grid: s = max|x| / 127 (at least FLT_MIN), x_i = round(x_i / s).
// Per row and output, over the groups in order, with S_g = sum q_i x_i and X_g = sum x_i (exact
// integers, |S_g| <= 32 * 15 * 127: exact in float too):
//   A = fma(a_g, S_g, A), B = fma(b_g, X_g, B), out = (A + B) * s (+ bias).
// Every path (`int4_reference`, the AVX-512 VNNI and the AVX2 kernels) computes exactly this sequence, so a row's
// result is the same bits whatever else is in the call and whichever path runs.

constexpr int64_t kInt4Group = 32;
constexpr int64_t kInt4GroupBytes = 16 * 20;  // a group of a 16-row block: 256 nibble bytes + 2 x 16 halves

// One row on the int8 grid: v[0..k) = round(x / s), v[k..kp) = 0; sums[g] = X_g as float (exact).
// Returns s.
inline float int4_input_row(const float* row, int64_t k, int64_t kp, int8_t* v, float* sums) {
  const float s = std::max(row_peak(row, k) / 127.0f, FLT_MIN);
  int64_t i = 0;
#if defined(__AVX2__)
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 sv = _mm256_set1_ps(s);
  for (; i + 8 <= k; i += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), sv), kNearest));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(v + i), _mm_packs_epi16(w, w));
  }
#endif
  for (; i < k; ++i) v[i] = static_cast<int8_t>(std::nearbyint(row[i] / s));
  std::fill(v + k, v + kp, int8_t{0});
  for (int64_t g = 0; g < kp / kInt4Group; ++g) {
    int32_t total = 0;
    for (int64_t j = 0; j < kInt4Group; ++j) total += v[g * kInt4Group + j];
    sums[g] = static_cast<float>(total);
  }
  return s;
}

// The rows of x on the int8 grid (64-byte aligned, read as int32 words of 4), their group sums (as
// float) and scales. Row-major for the scalar path (no passes: row r's inputs at v + r * kp, its
// sums at sums + r * groups); for the vector kernel, in its passes of rows (`Int4Pass`, as
// `int4_split` cuts them): the pass of rows m0 .. m0 + size lies at v + m0 * kp as [groups][size][32]
// and its sums at sums + m0 * groups as [groups][size]. Why: a pass then reads its inputs as one
// stream beside the weights' stream, not one stream a row; with rows of many inputs (an MLP's down
// projection), read again for every block of weights, the streams a row kept the weights from
// arriving in time.
struct Int4Rows {
  std::vector<int8_t> storage;
  int8_t* v = nullptr;
  std::vector<float> sums;
  std::vector<float> s;
};

struct Int4Pass {
  int64_t m0, size;
};

// Rows m0 .. m0 + n cut into near-equal parts of at most `most` rows, appended to `parts`: part j of
// P = ceil(n / most) takes (n - done + P - j - 1) / (P - j) rows (9 at most 6 -> 5 + 4).
inline void int4_split(int64_t m0, int64_t n, int64_t most, std::vector<Int4Pass>& parts) {
  const int64_t count = (n + most - 1) / most;
  for (int64_t j = 0, done = 0; j < count; ++j) {
    const int64_t size = (n - done + (count - j) - 1) / (count - j);
    parts.push_back({m0 + done, size});
    done += size;
  }
}

inline void int4_input(const at::Tensor& x, int64_t kp, Int4Rows& rows, const std::vector<Int4Pass>& passes) {
  const int64_t k = x.size(-1), n = x.numel() / k, groups = kp / kInt4Group;
  rows.storage.resize(n * kp + 64);
  rows.v = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(rows.storage.data()) + 63) & ~uintptr_t{63});
  rows.sums.resize(n * groups);
  rows.s.resize(n);
  const float* xs = x.data_ptr<float>();
  if (passes.empty()) {
    at::parallel_for(0, n, kParallelRows, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        rows.s[r] = int4_input_row(xs + r * k, k, kp, rows.v + r * kp, rows.sums.data() + r * groups);
    });
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(passes.size()), 1, [&](int64_t j0, int64_t j1) {
    std::vector<int8_t> row(kp + 64);
    int8_t* v = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(row.data()) + 63) & ~uintptr_t{63});
    std::vector<float> sums(groups);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t m0 = passes[j].m0, size = passes[j].size;
      int8_t* pv = rows.v + m0 * kp;
      float* ps = rows.sums.data() + m0 * groups;
      for (int64_t i = 0; i < size; ++i) {
        rows.s[m0 + i] = int4_input_row(xs + (m0 + i) * k, k, kp, v, sums.data());
        for (int64_t g = 0; g < groups; ++g) {
          std::memcpy(pv + (g * size + i) * kInt4Group, v + g * kInt4Group, kInt4Group);
          ps[g * size + i] = sums[g];
        }
      }
    }
  });
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The 4-bit weight of row l (0..15) of a block, input i (0..31) of group g's 320 bytes at p.
inline int int4_weight(const uint8_t* p, int64_t l, int64_t i) {
  const int64_t u = i / 8, t = i % 4;
  const uint8_t byte = p[u * 64 + l * 4 + t];
  return (i % 8) < 4 ? (byte & 15) : (byte >> 4);
}

// Outputs [col, col + valid) of one input row against block `blk` (its groups' bytes at p), the
// formula above in scalar code: the definition the vector kernels are held to, and the path of builds
// with neither AVX-512 VNNI nor AVX2.
inline void int4_block_reference(const uint8_t* p, int64_t groups, const int8_t* v, const float* xsum, float s,
                                 const float* bias, float* out, int64_t valid) {
  for (int64_t l = 0; l < valid; ++l) {
    float a_total = 0.0f, b_total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* gp = p + g * kInt4GroupBytes;
      int32_t sum = 0;
      for (int64_t i = 0; i < kInt4Group; ++i) sum += int4_weight(gp, l, i) * v[g * kInt4Group + i];
      a_total = std::fma(half_to_float(gp + 256 + 2 * l), static_cast<float>(sum), a_total);
      b_total = std::fma(half_to_float(gp + 288 + 2 * l), xsum[g], b_total);
    }
    float o = (a_total + b_total) * s;
    if (bias != nullptr) o += bias[l];
    out[l] = o;
  }
}

#if defined(SPECDEC_VNNI)
constexpr int64_t kInt4PassRows = 6;  // rows a pass: 3 accumulators each + 8 weight operands + 2 scales

// out[m, 0..valid) (row stride ldo) for one pass of MT rows (its grid rows at v as [groups][MT][32],
// its group sums at xsum as [groups][MT], `Int4Rows`) against one 16-row block: the formula above,
// 16 outputs a register.
template <int MT>
inline void int4_tile(const uint8_t* p, int64_t groups, const int8_t* v, const float* xsum,
                      const float* s, const float* bias, float* out, int64_t ldo, int64_t valid, const uint8_t* ahead) {
  const __m512i nibble = _mm512_set1_epi8(15);
  __m512 a_total[MT], b_total[MT];
  for (int m = 0; m < MT; ++m) a_total[m] = b_total[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g, p += kInt4GroupBytes) {
    if (ahead != nullptr)  // the same group of the next block: its 5 cache lines
      for (int j = 0; j < 5; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + g * kInt4GroupBytes + 64 * j), _MM_HINT_T1);
    __m512i w[8];
    for (int u = 0; u < 4; ++u) {
      const __m512i chunk = _mm512_loadu_si512(p + 64 * u);
      w[2 * u] = _mm512_and_si512(chunk, nibble);
      w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), nibble);
    }
    const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 256)));
    const __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 288)));
    for (int m = 0; m < MT; ++m) {
      // The row's words 8g .. 8g + 7: inputs 32g + 4j .. 32g + 4j + 3 (chunk u: words 2u, 2u + 1).
      const int32_t* x = reinterpret_cast<const int32_t*>(v + (g * MT + m) * kInt4Group);
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int u = 0; u < 4; ++u) {
        even = _mm512_dpbusd_epi32(even, w[2 * u], _mm512_set1_epi32(x[2 * u]));
        odd = _mm512_dpbusd_epi32(odd, w[2 * u + 1], _mm512_set1_epi32(x[2 * u + 1]));
      }
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      a_total[m] = _mm512_fmadd_ps(a, sum, a_total[m]);
      b_total[m] = _mm512_fmadd_ps(b, _mm512_set1_ps(xsum[g * MT + m]), b_total[m]);
    }
  }
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  const __m512 shift = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    __m512 o = _mm512_mul_ps(_mm512_add_ps(a_total[m], b_total[m]), _mm512_set1_ps(s[m]));
    if (bias != nullptr) o = _mm512_add_ps(o, shift);
    _mm512_mask_storeu_ps(out + m * ldo, mask, o);
  }
}
#endif

#if !defined(SPECDEC_VNNI) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDEC_INT4_AVX2 1
constexpr int64_t kInt4PassRows = 6;  // rows a pass: 6 int16 sums + 6 totals, 1 weight operand, 2 constants
// A chunk of rows (`int4_product_avx2`) holds at most this many bytes of inputs on the grid: it stays
// in the core's L2 (512 KiB on Zen 2 and 3) while every block of weights goes past it.
constexpr int64_t kInt4ChunkBytes = int64_t{192} << 10;
// A span of groups: a block's weights over this many groups (48 x 320 bytes, 15 KiB) stay in the L1
// for all passes of a chunk (the whole block of an MLP's down projection, 8960 inputs, is 90 KiB).
constexpr int64_t kInt4SpanGroups = 48;

// The same tile on AVX2 without VNNI (Zen 2 and 3, Intel before Ice Lake): 8 outputs a 256-bit
// register, one half of the 16-row block after the other (a half is 32 bytes of each 64-byte chunk),
// over groups g0 .. g1 of the block at p. vpmaddubsw multiplies a weight in [0, 15] by an input in
// [-127, 127] and adds neighbours into int16 (|.| <= 3810); a group's 8 such products per output add
// up within int16 (<= 30480), so one vpmaddwd by ones gives S_g exactly, as vpdpbusd does: the same
// integers, then the same float sequence. The totals A and B of row m, half h carry over from one
// span of groups to the next at acc + 32 m + 16 h (A, then B: 8 floats each), so a product cut into
// spans adds each output's terms in group order as one loop would.
//
// Half h of group gp's int16 sums for MT rows (row m's inputs at x + 8 m), low nibbles for all rows,
// then high ones: one weight operand at a time.
template <int MT>
__attribute__((always_inline)) inline void int4_half_sums(const uint8_t* gp, int h, const int32_t* x, __m256i* sums) {
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int m = 0; m < MT; ++m) sums[m] = _mm256_setzero_si256();
  for (int u = 0; u < 4; ++u) {
    const __m256i chunk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + 64 * u + 32 * h));
    const __m256i low = _mm256_and_si256(chunk, nibble);
    for (int m = 0; m < MT; ++m) {
      sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(low, _mm256_set1_epi32(x[8 * m + 2 * u])));
      // Keep the sum in its register here: else GCC reorders the (associative) integer adds to
      // compute all of a group's products first and spills most of them (the loop ran ~1.5x slower).
      asm("" : "+x"(sums[m]));
    }
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(chunk, 4), nibble);
    for (int m = 0; m < MT; ++m) {
      sums[m] = _mm256_add_epi16(sums[m], _mm256_maddubs_epi16(high, _mm256_set1_epi32(x[8 * m + 2 * u + 1])));
      asm("" : "+x"(sums[m]));
    }
  }
}

// 1-2 rows (a decode step, the draft's positions): the product waits on memory, not on the multiply
// units. Both halves of a group go in one sweep, B's fma beside A's, so every line of the block is
// used as it arrives; a sweep of one half after the other left the memory idle while the second ran
// over lines already in the L1. Each output's terms still add in group order.
template <int MT>
inline void int4_tile_few(const uint8_t* p, int64_t g0, int64_t g1, const int8_t* v, const float* xsum, float* acc,
                          int halves, const uint8_t* ahead) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total[2][MT], b_total[2][MT];
  for (int h = 0; h < halves; ++h)
    for (int m = 0; m < MT; ++m) {
      total[h][m] = _mm256_loadu_ps(acc + 32 * m + 16 * h);
      b_total[h][m] = _mm256_loadu_ps(acc + 32 * m + 16 * h + 8);
    }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = p + g * kInt4GroupBytes;
    if (ahead != nullptr)  // the same group of the next block: its 5 cache lines
      for (int j = 0; j < 5; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + g * kInt4GroupBytes + 64 * j), _MM_HINT_T1);
    const int32_t* x = reinterpret_cast<const int32_t*>(v + g * MT * kInt4Group);
    for (int h = 0; h < halves; ++h) {
      __m256i sums[MT];
      int4_half_sums<MT>(gp, h, x, sums);
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 256 + 16 * h)));
      const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 288 + 16 * h)));
      for (int m = 0; m < MT; ++m) {
        total[h][m] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[m], ones)), total[h][m]);
        b_total[h][m] = _mm256_fmadd_ps(b, _mm256_set1_ps(xsum[g * MT + m]), b_total[h][m]);
      }
    }
  }
  for (int h = 0; h < halves; ++h)
    for (int m = 0; m < MT; ++m) {
      _mm256_storeu_ps(acc + 32 * m + 16 * h, total[h][m]);
      _mm256_storeu_ps(acc + 32 * m + 16 * h + 8, b_total[h][m]);
    }
}

// 3-6 rows: the multiply units are the limit. One half after the other, so A's loop has the
// registers for 6 rows, and B in a loop of its own after A's (the same fma chain per output).
template <int MT>
inline void int4_tile(const uint8_t* p, int64_t g0, int64_t g1, const int8_t* v, const float* xsum, float* acc,
                      int halves, const uint8_t* ahead) {
  static_assert(MT >= 3, "int4_tile: 1-2 rows take int4_tile_few");
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < halves; ++h) {
    __m256 total[MT];
    for (int m = 0; m < MT; ++m) total[m] = _mm256_loadu_ps(acc + 32 * m + 16 * h);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* gp = p + g * kInt4GroupBytes;
      if (h == 0 && ahead != nullptr)  // the same group of the next block: its 5 cache lines
        for (int j = 0; j < 5; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + g * kInt4GroupBytes + 64 * j), _MM_HINT_T1);
      __m256i sums[MT];
      int4_half_sums<MT>(gp, h, reinterpret_cast<const int32_t*>(v + g * MT * kInt4Group), sums);
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 256 + 16 * h)));
      for (int m = 0; m < MT; ++m)
        total[m] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[m], ones)), total[m]);
    }
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(acc + 32 * m + 16 * h, total[m]);
  }
  // B of both halves at once: 2 MT independent chains keep the two FMA pipes busy.
  __m256 b_total[2 * MT];
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) b_total[2 * m + h] = _mm256_loadu_ps(acc + 32 * m + 16 * h + 8);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = p + g * kInt4GroupBytes + 288;
    const __m256 b0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp)));
    const __m256 b1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gp + 16)));
    for (int m = 0; m < MT; ++m) {
      const __m256 xs = _mm256_set1_ps(xsum[g * MT + m]);
      b_total[2 * m] = _mm256_fmadd_ps(b0, xs, b_total[2 * m]);
      b_total[2 * m + 1] = _mm256_fmadd_ps(b1, xs, b_total[2 * m + 1]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc + 32 * m + 16 * h + 8, b_total[2 * m + h]);
}

// The passes of n rows: chunks of at most kInt4ChunkBytes of inputs (at least one pass), each cut
// into passes of at most kInt4PassRows rows; `chunks` gets each chunk's first pass, then the end.
inline std::vector<Int4Pass> int4_avx2_passes(int64_t n, int64_t kp, std::vector<int64_t>& chunks) {
  const int64_t chunk_rows = std::max<int64_t>(kInt4PassRows, kInt4ChunkBytes / kp / kInt4PassRows * kInt4PassRows);
  std::vector<Int4Pass> rows_of_chunks, passes;
  int4_split(0, n, chunk_rows, rows_of_chunks);
  for (const Int4Pass& c : rows_of_chunks) {
    chunks.push_back(static_cast<int64_t>(passes.size()));
    int4_split(c.m0, c.size, kInt4PassRows, passes);
  }
  chunks.push_back(static_cast<int64_t>(passes.size()));
  return passes;
}

// One chunk's passes (c0 .. c1 of `passes`) against one 16-row block at p: every span of groups,
// every pass; then out = (A + B) * s (+ bias) for its rows from the carried totals.
inline void int4_block_avx2(const uint8_t* p, const uint8_t* ahead, int64_t groups, int64_t kp, const Int4Rows& rows,
                            const Int4Pass* c0, const Int4Pass* c1, const float* bias, float* out, int64_t ldo,
                            int64_t valid, std::vector<float>& acc) {
  const int64_t first = c0->m0, n = (c1 - 1)->m0 + (c1 - 1)->size - first;
  const int halves = valid > 8 ? 2 : 1;
  acc.assign(32 * n, 0.0f);
  for (int64_t g0 = 0; g0 < groups; g0 += kInt4SpanGroups) {
    const int64_t g1 = std::min(groups, g0 + kInt4SpanGroups);
    const uint8_t* ask = ahead;  // the next block's lines, during the first pass (any number of rows)
    for (const Int4Pass* pass = c0; pass < c1; ++pass, ask = nullptr) {
      const int8_t* vm = rows.v + pass->m0 * kp;
      const float* xm = rows.sums.data() + pass->m0 * groups;
      float* am = acc.data() + 32 * (pass->m0 - first);
      switch (pass->size) {
#define SPECDEC_CASE(S) case S: int4_tile<S>(p, g0, g1, vm, xm, am, halves, ask); break;
        SPECDEC_CASE(6) SPECDEC_CASE(5) SPECDEC_CASE(4) SPECDEC_CASE(3)
        case 2: int4_tile_few<2>(p, g0, g1, vm, xm, am, halves, ask); break;
        default: int4_tile_few<1>(p, g0, g1, vm, xm, am, halves, ask); break;
#undef SPECDEC_CASE
      }
    }
  }
  for (int64_t m = 0; m < n; ++m) {
    const float* am = acc.data() + 32 * m;
    const __m256 s = _mm256_set1_ps(rows.s[first + m]);
    float* row = out + (first + m) * ldo;
    for (int h = 0; h < halves; ++h) {
      const __m256 o = _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(am + 16 * h), _mm256_loadu_ps(am + 16 * h + 8)), s);
      if (valid >= 8 * h + 8) {  // a whole half: 8 outputs in one store (bias: one add, as the scalar one)
        _mm256_storeu_ps(row + 8 * h, bias != nullptr ? _mm256_add_ps(o, _mm256_loadu_ps(bias + 8 * h)) : o);
        continue;
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, o);
      for (int64_t l = 8 * h; l < valid; ++l) row[l] = bias != nullptr ? lanes[l - 8 * h] + bias[l] : lanes[l - 8 * h];
    }
  }
}

// The AVX2 product: each thread takes a range of 16-row blocks; for each chunk of rows in turn it
// runs every block of its range, so the chunk's grid is read from the L2 by every block. Why: with
// all rows a block, a prefill's grid (512 rows of 8960 inputs: 4.5 MB) came from the L3 for each one.
inline void int4_product_avx2(const uint8_t* qs, int64_t blocks, int64_t groups, int64_t kp, int64_t n_out,
                              const float* bs, float* os, const Int4Rows& rows, const std::vector<Int4Pass>& passes,
                              const std::vector<int64_t>& chunks) {
  const int64_t block_bytes = groups * kInt4GroupBytes;
  at::parallel_for(0, blocks, 2, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc;
    for (size_t c = 0; c + 1 < chunks.size(); ++c) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t col = blk * 16;
        const uint8_t* p = qs + blk * block_bytes;
        int4_block_avx2(p, blk + 1 < blocks ? p + block_bytes : nullptr, groups, kp, rows, passes.data() + chunks[c],
                        passes.data() + chunks[c + 1], bs != nullptr ? bs + col : nullptr, os + col, n_out,
                        std::min<int64_t>(16, n_out - col), acc);
      }
    }
  });
}
#endif

// y = Int4Linear(x), through the vector kernel where built in (`vector`), else the scalar one.
// x [..., K] float32; q [N16, groups * 20] uint8 in the packed layout (N16 = ceil16(N), groups =
// ceil32(K) / 32); bias [N] or none; n_out = N. Returns [..., N].
at::Tensor int4_product(at::Tensor x, const at::Tensor& q, const c10::optional<at::Tensor>& bias, int64_t n_out, bool vector) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_linear: x must be float32");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.is_contiguous() && q.size(0) % 16 == 0 &&
                  q.size(1) % 20 == 0, "int4_linear: q must be a packed uint8 table");
  const int64_t groups = q.size(1) / 20, kp = groups * kInt4Group;
  TORCH_CHECK(n_out <= q.size(0) && n_out > q.size(0) - 16, "int4_linear: n_out does not match q");
  x = x.contiguous();
  const int64_t k = x.size(-1), n = x.numel() / k;
  TORCH_CHECK(k <= kp && k > kp - kInt4Group, "int4_linear: x and q differ in input size");
  at::Tensor b;
  const float* bs = optional_data(bias, b);
  TORCH_CHECK(bs == nullptr || b.numel() == n_out, "int4_linear: bias must have n_out values");
  auto out = empty_with_last(x, n_out);
  if (n == 0) return out;
  Int4Rows rows;
  std::vector<Int4Pass> passes;
  const uint8_t* qs = q.data_ptr<uint8_t>();
  float* os = out.data_ptr<float>();
#if defined(SPECDEC_INT4_AVX2)
  if (vector) {
    std::vector<int64_t> chunks;
    passes = int4_avx2_passes(n, kp, chunks);
    int4_input(x, kp, rows, passes);
    int4_product_avx2(qs, q.size(0) / 16, groups, kp, n_out, bs, os, rows, passes, chunks);
    return out;
  }
#elif defined(SPECDEC_VNNI)
  if (vector) int4_split(0, n, kInt4PassRows, passes);
#endif
  int4_input(x, kp, rows, passes);
  const int64_t block_bytes = groups * kInt4GroupBytes;
  at::parallel_for(0, q.size(0) / 16, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t col = blk * 16, valid = std::min<int64_t>(16, n_out - col);
      const uint8_t* p = qs + blk * block_bytes;
      const float* bcol = bs != nullptr ? bs + col : nullptr;
#if defined(SPECDEC_VNNI)
      if (vector) {
        // All rows in passes of near-equal size (9 -> 5 + 4): the block's bytes stay in the core's
        // caches for the later passes.
        const uint8_t* ahead = n >= kPrefetchRows && blk + 1 < q.size(0) / 16 ? p + block_bytes : nullptr;
        for (const Int4Pass& pass : passes) {
          const int8_t* vm = rows.v + pass.m0 * kp;
          const float* xm = rows.sums.data() + pass.m0 * groups;
          const float* sm = rows.s.data() + pass.m0;
          float* o = os + pass.m0 * n_out + col;
          switch (pass.size) {
#define SPECDEC_CASE(S) case S: int4_tile<S>(p, groups, vm, xm, sm, bcol, o, n_out, valid, ahead); break;
            SPECDEC_CASE(6) SPECDEC_CASE(5) SPECDEC_CASE(4) SPECDEC_CASE(3) SPECDEC_CASE(2)
            default: int4_tile<1>(p, groups, vm, xm, sm, bcol, o, n_out, valid, ahead); break;
#undef SPECDEC_CASE
          }
          ahead = nullptr;
        }
        continue;
      }
#endif
      for (int64_t m = 0; m < n; ++m)
        int4_block_reference(p, groups, rows.v + m * kp, rows.sums.data() + m * groups, rows.s[m], bcol,
                             os + m * n_out + col, valid);
    }
  });
  return out;
}

// Which int4 kernel this build runs: what a test holds to the machine's flags (a build without a
// vector path on a CPU that has one is a slow default, not an error, and would otherwise go unseen).
std::string int4_path() {
#if defined(SPECDEC_VNNI)
  return "avx512-vnni";
#elif defined(SPECDEC_INT4_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

at::Tensor int4_linear(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias, int64_t n_out) {
  return int4_product(std::move(x), q, bias, n_out, true);
}

// The scalar path whatever the build: what tests hold the vector kernel to, bit for bit.
at::Tensor int4_reference(at::Tensor x, at::Tensor q, c10::optional<at::Tensor> bias, int64_t n_out) {
  return int4_product(std::move(x), q, bias, n_out, false);
}

// The packed layout from row-major parts: q [N16, KP] uint8 values in [0, 15] (KP a multiple of 32,
// N16 of 16), a and b [N16, KP / 32] float16. Returns [N16, KP / 32 * 20] uint8.
at::Tensor int4_pack(at::Tensor q, at::Tensor a, at::Tensor b) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 2 && q.size(0) % 16 == 0 && q.size(1) % kInt4Group == 0,
              "int4_pack: q must be uint8 [ceil16(N), ceil32(K)]");
  const int64_t n16 = q.size(0), groups = q.size(1) / kInt4Group;
  TORCH_CHECK(a.scalar_type() == at::kHalf && b.scalar_type() == at::kHalf && a.sizes() == b.sizes() &&
                  a.size(0) == n16 && a.size(1) == groups, "int4_pack: a and b must be float16 [N16, KP / 32]");
  q = q.contiguous();
  a = a.contiguous();
  b = b.contiguous();
  auto packed = table_empty({n16, groups * 20}, at::kByte);
  const uint8_t* qs = q.data_ptr<uint8_t>();
  const uint8_t* as = reinterpret_cast<const uint8_t*>(a.data_ptr<at::Half>());
  const uint8_t* bs = reinterpret_cast<const uint8_t*>(b.data_ptr<at::Half>());
  uint8_t* ps = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n16 / 16, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* p = ps + (blk * groups + g) * kInt4GroupBytes;
        for (int64_t l = 0; l < 16; ++l) {
          const int64_t r = blk * 16 + l;
          const uint8_t* w = qs + r * groups * kInt4Group + g * kInt4Group;
          for (int64_t u = 0; u < 4; ++u)
            for (int64_t t = 0; t < 4; ++t)
              p[u * 64 + l * 4 + t] = static_cast<uint8_t>((w[8 * u + t] & 15) | ((w[8 * u + 4 + t] & 15) << 4));
          std::memcpy(p + 256 + 2 * l, as + 2 * (r * groups + g), 2);
          std::memcpy(p + 288 + 2 * l, bs + 2 * (r * groups + g), 2);
        }
      }
  });
  return packed;
}

// The row-major parts (q, a, b) of a packed table, as `int4_pack` took them.
std::vector<at::Tensor> int4_unpack(at::Tensor packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(0) % 16 == 0 && packed.size(1) % 20 == 0, "int4_unpack: not a packed table");
  const int64_t n16 = packed.size(0), groups = packed.size(1) / 20;
  auto q = at::empty({n16, groups * kInt4Group}, packed.options());
  auto a = at::empty({n16, groups}, packed.options().dtype(at::kHalf));
  auto b = at::empty({n16, groups}, packed.options().dtype(at::kHalf));
  const uint8_t* ps = packed.data_ptr<uint8_t>();
  uint8_t* qs = q.data_ptr<uint8_t>();
  uint8_t* as = reinterpret_cast<uint8_t*>(a.data_ptr<at::Half>());
  uint8_t* bs = reinterpret_cast<uint8_t*>(b.data_ptr<at::Half>());
  for (int64_t r = 0; r < n16; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = ps + ((r / 16) * groups + g) * kInt4GroupBytes;
      const int64_t l = r % 16;
      for (int64_t i = 0; i < kInt4Group; ++i) qs[r * groups * kInt4Group + g * kInt4Group + i] = static_cast<uint8_t>(int4_weight(p, l, i));
      std::memcpy(as + 2 * (r * groups + g), p + 256 + 2 * l, 2);
      std::memcpy(bs + 2 * (r * groups + g), p + 288 + 2 * l, 2);
    }
  return {q, a, b};
}

// One row of RMSNorm: out = x / sqrt(mean(x^2) + eps) * w, the mean of squares summed in double
// (on AVX2 in 8 running sums of 4 doubles a 32-element step, added in a fixed order at the end;
// in double the order changes the sum by ~1e-16 relative, far below what the float result keeps).
inline void rms_norm_row(const float* x, const float* w, float* out, int64_t d, double eps) {
  double squares = 0.0;
  int64_t i = 0;
#if defined(__AVX2__)
  if (d >= 32) {
    __m256d acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_pd();
    for (; i + 32 <= d; i += 32)
      for (int j = 0; j < 8; ++j) {
        const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4 * j));
        acc[j] = _mm256_fmadd_pd(v, v, acc[j]);
      }
    for (int j = 1; j < 8; ++j) acc[0] = _mm256_add_pd(acc[0], acc[j]);
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, acc[0]);
    squares = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
#endif
  for (; i < d; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(squares / d + eps));
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

// RMSNorm over the last dimension: x_r / sqrt(mean(x_r^2) + eps) * w[r mod R], with w: [d] or
// [R, d] (R = heads + kv_heads for Gemma's per-head q/k norms over stacked heads).
// Returns a new contiguous float32 tensor shaped as x.
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t d = x.size(-1);
  TORCH_CHECK((w.dim() == 1 || w.dim() == 2) && w.size(-1) == d, "rms_norm: w must be [d] or [R, d]");
  const int64_t rows = x.numel() / d, period = w.dim() == 1 ? 1 : w.size(0);
  auto out = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* ws = w.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xs + r * d, ws + (r % period) * d, os + r * d, d, eps);
  });
  return out;
}

// The residual step of a decoder block: x + norm_y(y) (or x + y without w_y), and, with w_out,
// the RMSNorm of that sum (the next sublayer's input). x, y: [..., d]. Returns [sum] or [sum, normed].
std::vector<at::Tensor> residual_norm(at::Tensor x, at::Tensor y, c10::optional<at::Tensor> w_y,
                                         c10::optional<at::Tensor> w_out, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "residual_norm: float32 only");
  x = x.contiguous();
  y = y.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(y.numel() == x.numel(), "residual_norm: x and y differ in size");
  at::Tensor wy, wo;
  if (w_y.has_value()) wy = w_y->contiguous();
  if (w_out.has_value()) wo = w_out->contiguous();
  auto sum = at::empty_like(x);
  at::Tensor normed = w_out.has_value() ? at::empty_like(x) : at::Tensor();
  const float* xs = x.data_ptr<float>();
  const float* ys = y.data_ptr<float>();
  float* ss = sum.data_ptr<float>();
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(d);
    for (int64_t r = r0; r < r1; ++r) {
      const float* add = ys + r * d;
      if (w_y.has_value()) {
        rms_norm_row(add, wy.data_ptr<float>(), scratch.data(), d, eps);
        add = scratch.data();
      }
      float* o = ss + r * d;
      for (int64_t i = 0; i < d; ++i) o[i] = xs[r * d + i] + add[i];
      if (w_out.has_value()) rms_norm_row(o, wo.data_ptr<float>(), normed.data_ptr<float>() + r * d, d, eps);
    }
  });
  if (w_out.has_value()) return {sum, normed};
  return {sum};
}

// exp(x) by the Cephes single-precision polynomial, 8 lanes at a time on AVX2 (`exp_lanes`); the
// scalar `exp_lane` runs the same operations on one value, so a value's result never depends on
// its lane. x is clamped to [-87, 88]: below, exp(-87) ~ 1.6e-38 stands for anything smaller;
// above, exp(88) ~ 1.7e38 for anything larger (no overflow to inf, so the exponent field below
// takes 2^fx directly, fx in [-126, 127]).
inline float exp_lane(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float fx = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  x = std::fma(fx, -0.693359375f, x);
  x = std::fma(fx, 2.12194440e-4f, x);
  float y = 1.9875691500e-4f;
  y = std::fma(y, x, 1.3981999507e-3f);
  y = std::fma(y, x, 8.3334519073e-3f);
  y = std::fma(y, x, 4.1665795894e-2f);
  y = std::fma(y, x, 1.6666665459e-1f);
  y = std::fma(y, x, 5.0000001201e-1f);
  y = std::fma(y, x * x, x) + 1.0f;
  return std::ldexp(y, static_cast<int>(fx));
}

#if defined(__AVX2__)
inline __m256 exp_lanes(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  v = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), v);
  v = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), v);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(v, v), v), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// GELU with the tanh approximation, 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3),
// written as g / (1 + exp(-2 z)) (the same function: 1 + tanh(z) = 2 / (1 + exp(-2 z))), which
// needs one exp and keeps its accuracy where tanh(z) is near -1. PyTorch's tanh was a large share
// of a prefill's non-matrix time.
inline float gelu_tanh_lane(float g) {
  const float u = g + 0.044715f * (g * g * g);
  return g / (1.0f + exp_lane(-1.5957691216057308f * u));
}

// The gated MLP's activation: act(gate) * up from the fused gate/up projection [..., 2I] (gate
// first), act = GELU with the tanh approximation (our own, above, row by row, 8 lanes at a time)
// or SiLU (PyTorch's), so that the split, the activation and the product cost one call from Python.
at::Tensor gated_activation(at::Tensor gate_up, bool gelu_tanh) {
  const int64_t width = gate_up.size(-1) / 2;
  if (!gelu_tanh || gate_up.scalar_type() != at::kFloat) {
    auto gate = gate_up.narrow(-1, 0, width), up = gate_up.narrow(-1, width, width);
    return (gelu_tanh ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(up);
  }
  gate_up = gate_up.contiguous();
  auto out = empty_with_last(gate_up, width);
  const int64_t rows = gate_up.numel() / (2 * width);
  const float* gs = gate_up.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, rows, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gs + r * 2 * width;
      const float* u = g + width;
      float* o = os + r * width;
      int64_t i = 0;
#if defined(__AVX2__)
      const __m256 a = _mm256_set1_ps(0.044715f), b = _mm256_set1_ps(-1.5957691216057308f), one = _mm256_set1_ps(1.0f);
      for (; i + 8 <= width; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 uu = _mm256_add_ps(gv, _mm256_mul_ps(a, _mm256_mul_ps(_mm256_mul_ps(gv, gv), gv)));
        const __m256 act = _mm256_div_ps(gv, _mm256_add_ps(one, exp_lanes(_mm256_mul_ps(b, uu))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < width; ++i) o[i] = gelu_tanh_lane(g[i]) * u[i];
    }
  });
  return out;
}

// -- cache element types ------------------------------------------------------------------------
//
// The key/value cache holds float32 or float16 elements (`KVCache`'s dtype). A float16 element is
// read as the float32 of the same value (the conversion is exact), so the attention over a float16
// cache computes, bit for bit, what it computes over a float32 cache holding those values; a
// float32 result is stored as the nearest float16 (ties to even, as F16C and c10::Half round).
inline float cache_load(const float* x) { return *x; }
inline float cache_load(const at::Half* x) { return static_cast<float>(*x); }
inline void cache_store(float v, float* x) { *x = v; }
inline void cache_store(float v, at::Half* x) { *x = at::Half(v); }
#if defined(__AVX2__)
inline __m256 cache_load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 cache_load8(const at::Half* x) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
#else
  alignas(32) float f[8];
  for (int l = 0; l < 8; ++l) f[l] = static_cast<float>(x[l]);
  return _mm256_load_ps(f);
#endif
}
#endif

// Rotary embedding of the new queries and keys, and the keys and values written into the cache.
// qk: [b, T, H + KV, d] (queries then keys, per token); v: [b, T, KV, d]; cos, sin: [b, 1, T, d]
// (`rope_tables`); cache_k, cache_v: [b, KV, capacity, d] float32 or float16 (any strides, last
// dimension contiguous);
// slots: [b, T] int64. The rotation is x * cos + rotate_half(x) * sin with rotate_half(x) =
// (-x2, x1), the same products and sum as `transformer.rotate`. Returns the rotated queries
// [b, H, T, d]; the rotated keys and the values go to their slots.
template <typename T>
at::Tensor rope_write_into(at::Tensor qk, at::Tensor v, at::Tensor cos, at::Tensor sin,
                           const at::Tensor& cache_k, const at::Tensor& cache_v, at::Tensor slots) {
  qk = qk.contiguous();
  v = v.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.to(at::kLong).contiguous();
  const int64_t b = qk.size(0), t = qk.size(1), all_heads = qk.size(2), d = qk.size(3);
  const int64_t kv_heads = cache_k.size(1), heads = all_heads - kv_heads, half = d / 2;
  auto q = at::empty({b, heads, t, d}, qk.options());
  const float* xs = qk.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qs = q.data_ptr<float>();
  T* ks = cache_k.data_ptr<T>();
  T* cvs = cache_v.data_ptr<T>();
  // The slots first: a check must not throw inside a parallel region.
  for (int64_t r = 0; r < b * t; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < cache_k.size(2), "rope_write: slot out of range");
  at::parallel_for(0, b * t, kParallelRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // r = bi * t + ti, the row of token ti of sequence bi
      const int64_t bi = r / t, ti = r % t;
      const float* c = cs + r * d;
      const float* s = sn + r * d;
      const int64_t at = slot[r];
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = xs + (r * all_heads + h) * d;
        float* o = qs + ((bi * heads + h) * t + ti) * d;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
          o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
      }
      // Keys: the same rotation in float32, then stored in the cache's type.
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* x = xs + (r * all_heads + heads + h) * d;
        T* o = ks + bi * cache_k.stride(0) + h * cache_k.stride(1) + at * cache_k.stride(2);
        for (int64_t i = 0; i < half; ++i) {
          cache_store(x[i] * c[i] + (-x[i + half]) * s[i], o + i);
          cache_store(x[i + half] * c[i + half] + x[i] * s[i + half], o + i + half);
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* x = vs + (r * kv_heads + h) * d;
        T* o = cvs + bi * cache_v.stride(0) + h * cache_v.stride(1) + at * cache_v.stride(2);
        for (int64_t i = 0; i < d; ++i) cache_store(x[i], o + i);
      }
    }
  });
  return q;
}

at::Tensor rope_write(at::Tensor qk, at::Tensor v, at::Tensor cos, at::Tensor sin,
                      at::Tensor cache_k, at::Tensor cache_v, at::Tensor slots) {
  TORCH_CHECK(qk.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "rope_write: float32 inputs only");
  TORCH_CHECK(cache_k.scalar_type() == cache_v.scalar_type() &&
                  (cache_k.scalar_type() == at::kFloat || cache_k.scalar_type() == at::kHalf),
              "rope_write: the cache must be float32 or float16, keys and values alike");
  TORCH_CHECK(cache_k.stride(3) == 1 && cache_v.stride(3) == 1, "rope_write: cache rows must be contiguous");
  if (cache_k.scalar_type() == at::kHalf) return rope_write_into<at::Half>(qk, v, cos, sin, cache_k, cache_v, slots);
  return rope_write_into<float>(qk, v, cos, sin, cache_k, cache_v, slots);
}

// -- greedy choice ------------------------------------------------------------------------------
//
// The argmax of each row of x [n, V] float32, as torch.argmax gives it: the lowest index among
// equal maxima, and the first NaN where a row has one (torch orders NaN above every number).
// Two passes over the row, 8 lanes at a time: its maximum (max is exact, so its order does not
// matter), then the first index holding it. torch's is several times slower, over a large
// vocabulary's logits at every decoding step.
at::Tensor argmax_rows(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0, "argmax_rows: x must be [n, V] float32, V > 0");
  x = x.contiguous();
  const int64_t n = x.size(0), v = x.size(1);
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xs + r * v;
      float best = row[0];
      bool nan = false;
      int64_t i = 0;
#if defined(__AVX2__)
      if (v >= 32) {
        __m256 m[4], bad = _mm256_setzero_ps();
        for (int j = 0; j < 4; ++j) m[j] = _mm256_set1_ps(row[0]);
        for (; i + 32 <= v; i += 32)
          for (int j = 0; j < 4; ++j) {
            const __m256 a = _mm256_loadu_ps(row + i + 8 * j);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            m[j] = _mm256_max_ps(a, m[j]);  // a NaN lane keeps m (the second operand)
          }
        nan = _mm256_movemask_ps(bad) != 0;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
        for (int j = 0; j < 8; ++j) best = std::max(best, lanes[j]);
      }
#endif
      for (; i < v; ++i) {
        nan = nan || std::isnan(row[i]);
        best = std::max(best, row[i]);
      }
      int64_t at = 0;
      if (nan || std::isnan(best)) {
        while (!std::isnan(row[at])) ++at;
      } else {
        i = 0;
#if defined(__AVX2__)
        const __m256 target = _mm256_set1_ps(best);
        for (; i + 8 <= v; i += 8) {
          const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
          if (hits != 0) break;
        }
#endif
        while (row[i] != best) ++i;  // the block holding the first maximum, or the scalar tail
        at = i;
      }
      os[r] = at;
    }
  });
  return out;
}

// -- attention for a few queries ---------------------------------------------------------------
//
// softmax(q k^T * scale) v over the visible cache slots: decode and verify blocks, and every block
// of a model whose layers the kernels run whole (prefills too: `decoder_layer`). Each query
// row's result is computed in an order fixed by the slots it sees alone: the slots are cut into
// chunks of kChunk at fixed indices, each chunk gives (its max m_c, sum l_c of exp(score - m_c), and
// acc_c = the exp-weighted sum of its values), and the chunks merge in index order. So a query's
// result depends only on its own row and the slots it sees, never on the other queries in the call:
// a verify pass over k + 1 tokens computes what k + 1 one-token passes compute, bit for bit.
// (PyTorch's SDPA blocks its queries, so a row's rounding depended on the block.)
//
// Several query rows share one work item (up to kRowsPerItem rows of a chunk, all the heads that
// read one key head): their scores are taken together over the union of the slots any of them sees,
// so each key row is loaded once for all of them. A slot a row does not see gets probability 0
// there, and adding 0 * v leaves its sums as they were, bit for bit (cache values are finite): the
// row's result is what its own slots alone give.

// 64 slots a chunk: a 300-slot context gives 5 work items per key head for a one-token step, which
// two threads share 3 : 2; 128-slot chunks would give 2 : 1, with the last chunk short.
constexpr int64_t kChunk = 64;
constexpr int64_t kRowsPerItem = 4;
// Blocks of at least this many row groups (61+ rows: prefills) take one work item per row group,
// which merges its own chunks; shorter ones (decode, verify) share each chunk among the threads.
// Both give every row the same bits; the long block's per-chunk partials stay in the item's buffer
// (for 2,048 rows of Gemma 3 270M they were 270 MB a layer through memory).
constexpr int64_t kRowGroupsApart = 16;

// The dot products of N query vectors (N = 1, 2, 4 or 6) with one key row over d inputs. Each dot runs
// two 8-lane chains of fused multiply-adds, one over the even 8-input blocks (0-7, 16-23, ...), one
// over the odd ones, over the first d - d % 8 inputs; the chains add lane by lane, the lanes then
// add as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), and the last d % 8 inputs follow one product
// and one add at a time. out[h] = q[h] . k. Every dot takes the same operations in the same order
// whatever the others are, so a score never depends on which queries share the call. Six dots keep
// 12 chains in flight, more than the two FMA units' latency needs (8 of them); four only just did.
// The key row is read once, front to back, for all of them: its 64-byte lines stream in order,
// which keeps a cold key cache (one layer's keys are evicted by the weights that stream between
// two of its passes) at the memory's speed. Two key rows a call, read interleaved, ran faster from
// the cache and slower from memory (docs/archive/BENCHMARKS-history.md).
template <int N, typename KT>
inline void scores_tile(const float* const* q, const KT* k, int64_t d, float* out) {
  static_assert(N == 1 || N == 2 || N == 4 || N == 6, "scores_tile: 1, 2, 4 or 6 queries");
  const int64_t d8 = d - d % 8, d16 = d - d % 16;
#if defined(__AVX2__)
  __m256 even[N], odd[N];
  for (int h = 0; h < N; ++h) even[h] = odd[h] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d16; i += 16) {
    const __m256 x0 = cache_load8(k + i), x1 = cache_load8(k + i + 8);
    for (int h = 0; h < N; ++h) {
      even[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i), x0, even[h]);
      odd[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + i + 8), x1, odd[h]);
    }
  }
  if (d8 > d16) {
    const __m256 x0 = cache_load8(k + d16);
    for (int h = 0; h < N; ++h) even[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q[h] + d16), x0, even[h]);
  }
  __m256 c[N];
  for (int h = 0; h < N; ++h) c[h] = _mm256_add_ps(even[h], odd[h]);
  // hadd adds neighbouring lanes within each 128-bit half: after two rounds lane h of the low half
  // holds (0 + 1) + (2 + 3) of dot h, of the high half (4 + 5) + (6 + 7); the halves then add. The
  // last one or two dots take the same two rounds (the second pairing their sums with themselves).
  if constexpr (N >= 4) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(c[0], c[1]), _mm256_hadd_ps(c[2], c[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
  if constexpr (N % 4 != 0) {
    constexpr int a = N - N % 4, b = N - 1;
    const __m256 w = _mm256_hadd_ps(c[a], c[b]);
    const __m256 x = _mm256_hadd_ps(w, w);
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    if constexpr (N % 4 == 2)
      _mm_storel_pi(reinterpret_cast<__m64*>(out + a), r);
    else
      _mm_store_ss(out + a, r);
  }
#else
  for (int h = 0; h < N; ++h) {
    float even[8] = {0, 0, 0, 0, 0, 0, 0, 0}, odd[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < d8; i += 8)
      for (int l = 0; l < 8; ++l) {
        float& acc = i % 16 == 0 ? even[l] : odd[l];
        acc = std::fma(q[h][i + l], cache_load(k + i + l), acc);
      }
    float c[8];
    for (int l = 0; l < 8; ++l) c[l] = even[l] + odd[l];
    out[h] = ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]));
  }
#endif
  for (int h = 0; h < N; ++h)
    for (int64_t i = d8; i < d; ++i) out[h] += q[h][i] * cache_load(k + i);
}

// out[i] = exp(x[i] - m[i]) for i < n (n rounded up to 8 may be written), by `exp_lanes` /
// `exp_lane`: one slot's scores of n queries, each shifted by its own query's max.
inline void exp_shifted(const float* x, const float* m, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(m + i))));
#endif
  for (; i < n; ++i) out[i] = exp_lane(x[i] - m[i]);
}

// acc[0..d) += p * v[0..d), elementwise in one fused multiply-add each; v a float row or a
// float16 cache row (widened exactly).
template <typename VT>
inline void axpy(float p, const VT* v, float* acc, int64_t d) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, cache_load8(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < d; ++i) acc[i] = std::fma(p, cache_load(v + i), acc[i]);
}

// For H heads that read the same value rows (rows `stride` apart): acc[h][0..d) = sum over the n
// slots, in order, of p[j * p_stride + h] * v_j (slot j's probabilities lie side by side, one per
// head), each element by fused multiply-adds from zero: what n calls of `axpy` give, with the sums
// kept in registers 16 elements of H heads at a time. So each value row is read once for the H
// heads, not once per head: a chunk's values (128 KB for Gemma 3) do not fit in the first-level
// cache, and reading them once per head was the larger part of a verify row's attention. Six heads
// keep 12 chains in flight where the FMA units' latency needs 8. The block width changes no
// element's sequence of operations, so no bit.
template <int H, typename VT>
inline void weighted_sum_heads(const float* p, int64_t p_stride, const int64_t* slots, int64_t n, const VT* v,
                               int64_t stride, float* const* acc, int64_t d) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 16 <= d; i += 16) {
    __m256 sum[H][2];
    for (int h = 0; h < H; ++h) sum[h][0] = sum[h][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const VT* row = v + slots[j] * stride + i;
      const __m256 v0 = cache_load8(row), v1 = cache_load8(row + 8);
      const float* pj = p + j * p_stride;
      for (int h = 0; h < H; ++h) {
        const __m256 pv = _mm256_broadcast_ss(pj + h);
        sum[h][0] = _mm256_fmadd_ps(pv, v0, sum[h][0]);
        sum[h][1] = _mm256_fmadd_ps(pv, v1, sum[h][1]);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm256_storeu_ps(acc[h] + i, sum[h][0]);
      _mm256_storeu_ps(acc[h] + i + 8, sum[h][1]);
    }
  }
#endif
  if (i < d)
    for (int h = 0; h < H; ++h) {
      std::fill(acc[h] + i, acc[h] + d, 0.0f);
      for (int64_t j = 0; j < n; ++j) axpy(p[j * p_stride + h], v + slots[j] * stride + i, acc[h] + i, d - i);
    }
}

// One (query row, head)'s result from its chunks' (max m[c], sum of exps l[c], exp-weighted values
// acc[c * d, (c + 1) * d)), merged in index order into o[0, d): every path merges with this one
// sequence of operations. A chunk with m = -inf adds nothing and its acc is never read.
inline void merge_chunks(const float* m, const float* l, const float* acc, int64_t chunks, int64_t d, float* o) {
  float top = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, m[c]);
  std::fill(o, o + d, 0.0f);
  if (top == -INFINITY) return;  // sees no slot at all (not a real query)
  float total = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (m[c] == -INFINITY) continue;
    const float w = std::exp(m[c] - top);
    total += l[c] * w;
    axpy(w, acc + c * d, o, d);
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) o[i] *= inv;
}

// One chunk's softmax pieces for the nq queries of a work item, over tables of n slot lines `width`
// floats wide (query i at lane i of each line; width 4 when nq <= 4, else a multiple of 8; the
// lanes past nq hold finite values and results never read). Scales the scores by sc in place; m[i]
// = query i's max over the slots it sees (`sees(j, i)`, asked only when not all_seen), -inf where
// it sees none; probs = exp(score - m[i]) there and 0 elsewhere; l[i] = the sum of its
// probabilities, slot after slot in order. The max is exact in any order and exp works lane by
// lane, so those run across whole vectors of the table (two lines a vector when width is 4); each
// lane's sum keeps the slots' order. So every query gets the operations it would get alone.
template <typename Sees>
inline void chunk_softmax(float* scores, float* probs, int64_t n, int64_t nq, int64_t width, float sc, bool all_seen,
                          Sees sees, float* m, float* l) {
  const int64_t cells = n * width, lanes = width == 4 ? 4 : (nq + 7) / 8 * 8;
  std::fill(m, m + width, -INFINITY);
  std::fill(l, l + width, 0.0f);
  if (all_seen) {
    int64_t c = 0;
#if defined(__AVX2__)
    const __m256 scv = _mm256_set1_ps(sc);
    // max(v, m) is m unless m < v, as std::max(m, v)
    if (width == 4) {  // lane e holds query e % 4
      __m256 mv = _mm256_set1_ps(-INFINITY);
      for (; c + 8 <= cells; c += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(scores + c), scv);
        _mm256_storeu_ps(scores + c, v);
        mv = _mm256_max_ps(v, mv);
      }
      alignas(32) float lane[8];
      _mm256_store_ps(lane, mv);
      for (int e = 0; e < 8; ++e) m[e % 4] = std::max(m[e % 4], lane[e]);
    } else {
      for (; c < cells; c += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(scores + c), scv);
        _mm256_storeu_ps(scores + c, v);
        _mm256_storeu_ps(m + c % width, _mm256_max_ps(v, _mm256_loadu_ps(m + c % width)));
      }
    }
#endif
    for (; c < cells; ++c) {
      scores[c] *= sc;
      m[c % width] = std::max(m[c % width], scores[c]);
    }
  } else {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < nq; ++i) {
        float& x = scores[j * width + i];
        x *= sc;
        if (sees(j, i)) m[i] = std::max(m[i], x);
      }
  }
  if (width == 4) {
    int64_t c = 0;
#if defined(__AVX2__)
    const __m256 shift = _mm256_setr_ps(m[0], m[1], m[2], m[3], m[0], m[1], m[2], m[3]);
    for (; c + 8 <= cells; c += 8)
      _mm256_storeu_ps(probs + c, exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(scores + c), shift)));
#endif
    for (; c < cells; ++c) probs[c] = exp_lane(scores[c] - m[c % 4]);
  } else {
    for (int64_t j = 0; j < n; ++j) exp_shifted(scores + j * width, m, lanes, probs + j * width);
  }
  if (!all_seen)  // a slot a query does not see gets 0 (all of them where m = -inf)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < nq; ++i)
        if (!sees(j, i)) probs[j * width + i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float* pj = probs + j * width;
    int64_t i = 0;
#if defined(__AVX2__)
    if (width == 4) {
      _mm_storeu_ps(l, _mm_add_ps(_mm_loadu_ps(l), _mm_loadu_ps(pj)));
      i = 4;
    }
    for (; i < lanes; i += 8) _mm256_storeu_ps(l + i, _mm256_add_ps(_mm256_loadu_ps(l + i), _mm256_loadu_ps(pj + i)));
#endif
    for (; i < nq; ++i) l[i] += pj[i];
  }
}

// q: [b, H, T, d] float32; cache_k, cache_v: [b, KVH, capacity, d] float32 or float16 (rows
// contiguous, both of one type); visible:
// [b, 1, T, S] bool over the first S slots; scale: the score factor. Query head h reads kv head
// h / (H / KVH). Returns [b, T, H * d], the layout the output projection reads.
template <typename T>
at::Tensor attention_over(at::Tensor q, const at::Tensor& cache_k, const at::Tensor& cache_v, at::Tensor visible,
                          double scale) {
  q = q.contiguous();
  visible = visible.contiguous();
  const int64_t b = q.size(0), heads = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t kv_heads = cache_k.size(1), span = visible.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && span <= cache_k.size(2) && visible.size(2) == t && visible.size(0) == b &&
                  cache_k.size(3) == d, "attention: shapes do not fit");
  const bool* vis = visible.data_ptr<bool>();
  // Only the chunks that hold a slot some row sees get work items (a sliding-window layer sees 512
  // of a long context's slots: the others would leave one thread idle). The chunks keep their
  // fixed slot boundaries, so a row's result is what scoring every chunk gives: a chunk it sees
  // nothing of adds nothing to the merge.
  int64_t lo = span, hi = -1;
  for (int64_t r = 0; r < b * t; ++r) {
    const bool* row = vis + r * span;
    int64_t s0 = 0, s1 = span - 1;
    while (s0 < lo && !row[s0]) ++s0;
    lo = std::min(lo, s0);
    while (s1 > hi && !row[s1]) --s1;
    hi = std::max(hi, s1);
  }
  const int64_t group = heads / kv_heads, first = lo / kChunk, chunks = hi < lo ? 0 : hi / kChunk - first + 1;
  // The block's rows in near-equal groups of at most kRowsPerItem (9 -> 3 + 3 + 3).
  const int64_t row_groups = (t + kRowsPerItem - 1) / kRowsPerItem;
  auto out = at::empty({b, t, heads * d}, q.options());
  const float* qs = q.data_ptr<float>();
  const T* ks = cache_k.data_ptr<T>();
  const T* vs = cache_v.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  const int64_t k_stride = cache_k.stride(2), v_stride = cache_v.stride(2);
  // One chunk of one row group (rows [r0, r1) of batch row bi, the heads that read kv head kv):
  // its (max, sum of exps, exp-weighted values) for each query vector i, written at part(i) of
  // pm, pl and pacc (pacc in d-float entries).
  auto score_chunk = [&](int64_t bi, int64_t kv, int64_t c, int64_t r0, int64_t r1, float* pm, float* pl, float* pacc,
                         auto part) {
    // The scores and probabilities are tables of one line per slot, the item's queries side by side
    // in a line `width` floats wide (`chunk_softmax`; a score tile writes up to 1 past the last
    // query).
    const int64_t most = kRowsPerItem * group;  // query vectors an item scores
    static thread_local std::vector<float> scores, probs, ms, ls;
    static thread_local std::vector<int64_t> seen;
    static thread_local std::vector<const float*> qv;
    const size_t line = (most + 1 + 7) / 8 * 8;  // the widest line an item can need
    scores.resize(std::max(scores.size(), kChunk * line));
    probs.resize(std::max(probs.size(), kChunk * line));
    ms.resize(std::max(ms.size(), line));
    ls.resize(std::max(ls.size(), line));
    seen.resize(kChunk);
    qv.resize(std::max<size_t>(qv.size(), most + 1));
    const int64_t s0 = (first + c) * kChunk, s1 = std::min(span, s0 + kChunk);
    const T* kbase = ks + bi * cache_k.stride(0) + kv * cache_k.stride(1);
    const T* vbase = vs + bi * cache_v.stride(0) + kv * cache_v.stride(1);
    const bool* block_vis = vis + bi * t * span;
    const int64_t nq = (r1 - r0) * group, width = nq <= 4 ? 4 : (nq + 1 + 7) / 8 * 8;
    // The slots any of the rows sees, in order. Mostly every row sees the whole chunk (all but the
    // last chunks of a causal block): then no slot needs a look of its own, here or below.
    bool all_seen = true;
    for (int64_t r = r0; r < r1 && all_seen; ++r)
      all_seen = std::memchr(block_vis + r * span + s0, 0, s1 - s0) == nullptr;
    int64_t n = 0;
    if (all_seen)
      for (int64_t s = s0; s < s1; ++s) seen[n++] = s;
    else
      for (int64_t s = s0; s < s1; ++s)
        for (int64_t r = r0; r < r1; ++r)
          if (block_vis[r * span + s]) {
            seen[n++] = s;
            break;
          }
    if (n == 0) {  // none of the rows sees this chunk (a causal prefill's later chunks): the merge skips it
      for (int64_t i = 0; i < nq; ++i) {
        pm[part(i)] = -INFINITY;
        pl[part(i)] = 0.0f;
      }
      return;
    }
    // Query vector i = (row r0 + i / group, head kv * group + i % group); padded by repeating the
    // last, for the last tile (the pads' scores are not read).
    for (int64_t i = 0; i < nq; ++i)
      qv[i] = qs + ((bi * heads + kv * group + i % group) * t + r0 + i / group) * d;
    qv[nq] = qv[nq - 1];
    // Scores, one slot at a time, six queries a tile (the last ones 1, 2 or 4).
    for (int64_t j = 0; j < n; ++j) {
      const T* krow = kbase + seen[j] * k_stride;
#if defined(__AVX2__)
      // Ask for the slot's value row now: the weighted sums below read the rows 16 elements at a
      // time, a pattern the hardware prefetcher does not follow from memory.
      const char* vrow = reinterpret_cast<const char*>(vbase + seen[j] * v_stride);
      for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) _mm_prefetch(vrow + byte, _MM_HINT_T1);
#endif
      float* sj = scores.data() + j * width;
      for (int64_t i = 0; i < nq;) {
        const int64_t left = nq - i;  // 7 and 8 as 4 + 4 (6 + 1 left a lone dot's chains waiting)
        if (left == 1) {
          scores_tile<1>(qv.data() + i, krow, d, sj + i);
          i += 1;
        } else if (left == 2) {
          scores_tile<2>(qv.data() + i, krow, d, sj + i);
          i += 2;
        } else if (left <= 4 || left == 7 || left == 8) {  // 3 padded to 4
          scores_tile<4>(qv.data() + i, krow, d, sj + i);
          i += 4;
        } else {  // 5 padded to 6
          scores_tile<6>(qv.data() + i, krow, d, sj + i);
          i += 6;
        }
      }
    }
    float* const m = ms.data();
    float* const l = ls.data();
    chunk_softmax(scores.data(), probs.data(), n, nq, width, sc, all_seen,
                  [&](int64_t j, int64_t i) { return block_vis[(r0 + i / group) * span + seen[j]]; }, m, l);
    for (int64_t i = 0; i < nq; ++i) {
      pm[part(i)] = m[i];
      pl[part(i)] = l[i];
    }
    // The exp-weighted values, six queries (then four, two, one) per pass over the value rows.
    float* acc[6];
    auto weigh = [&](auto heads_now, int64_t i0) {
      constexpr int H = decltype(heads_now)::value;
      for (int h = 0; h < H; ++h) acc[h] = pacc + part(i0 + h) * d;
      weighted_sum_heads<H>(probs.data() + i0, width, seen.data(), n, vbase, v_stride, acc, d);
    };
    int64_t i = 0;
    for (; i + 6 <= nq; i += 6) weigh(std::integral_constant<int, 6>{}, i);
    for (; i + 4 <= nq; i += 4) weigh(std::integral_constant<int, 4>{}, i);
    for (; i + 2 <= nq; i += 2) weigh(std::integral_constant<int, 2>{}, i);
    if (i < nq) weigh(std::integral_constant<int, 1>{}, i);
  };
  float* os = out.data_ptr<float>();
  auto out_row = [&](int64_t bi, int64_t row, int64_t head) { return os + (bi * t + row) * heads * d + head * d; };
  if (row_groups >= kRowGroupsApart) {
    // A long block (a prefill): work items are (batch row, kv head, row group), each scoring its
    // chunks in order into its own buffers and merging them at once, so the partial results of a
    // whole block never go through memory. The rows' arithmetic is the same as below, bit for bit.
    // Row groups are handed out from both ends alternately (0, last, 1, last - 1, ...): under a
    // causal mask the later rows see more slots, and each thread's share of the range then holds
    // early and late rows alike.
    at::parallel_for(0, b * kv_heads * row_groups, 1, [&](int64_t i0, int64_t i1) {
      static thread_local std::vector<float> local;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t turn = item % row_groups, kv = (item / row_groups) % kv_heads, bi = item / (row_groups * kv_heads);
        const int64_t rg = turn % 2 == 0 ? turn / 2 : row_groups - 1 - turn / 2;
        const int64_t r0 = rg * t / row_groups, r1 = (rg + 1) * t / row_groups, nq = (r1 - r0) * group;
        if (local.size() < static_cast<size_t>(nq * chunks * (d + 2))) local.resize(nq * chunks * (d + 2));
        float* pm = local.data();
        float* pl = pm + nq * chunks;
        float* pacc = pl + nq * chunks;
        for (int64_t c = 0; c < chunks; ++c)
          score_chunk(bi, kv, c, r0, r1, pm, pl, pacc, [&](int64_t i) { return i * chunks + c; });
        for (int64_t i = 0; i < nq; ++i)
          merge_chunks(pm + i * chunks, pl + i * chunks, pacc + i * chunks * d, chunks, d,
                       out_row(bi, r0 + i / group, kv * group + i % group));
      }
    });
    return out;
  }
  // Decode and verify blocks: work items are (batch row, kv head, chunk, row group), so that a
  // one-token step's chunks are shared among the threads. The row groups of one chunk follow each
  // other, so its keys and values (128 KB for Gemma 3) come from memory once and from the core's
  // cache for the other rows of a verify block. Per (query row, head, chunk): max, sum of exps, and
  // the exp-weighted values, merged after. Every entry is written by its work item, so the buffers
  // need no zeroing. They are the calling thread's, kept from call to call: a 16-row step's are
  // ~0.5 MB, which a fresh allocation took from the system (and faulted in page by page) at every
  // layer.
  const int64_t parts = b * t * heads * chunks;
  static thread_local std::vector<float> part_buffer;
  if (part_buffer.size() < static_cast<size_t>(parts * (d + 2))) part_buffer.resize(parts * (d + 2));
  float* const part_m = part_buffer.data();
  float* const part_l = part_m + parts;
  float* const part_acc = part_l + parts;
  at::parallel_for(0, b * kv_heads * chunks * row_groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t rg = item % row_groups, c = (item / row_groups) % chunks,
                    kv = (item / (row_groups * chunks)) % kv_heads, bi = item / (row_groups * chunks * kv_heads);
      const int64_t r0 = rg * t / row_groups, r1 = (rg + 1) * t / row_groups;
      // Query vector i's (row, head, chunk) entry in the partial results.
      score_chunk(bi, kv, c, r0, r1, part_m, part_l, part_acc,
                  [&](int64_t i) { return ((bi * t + r0 + i / group) * heads + kv * group + i % group) * chunks + c; });
    }
  });
  // Merge each (query row, head)'s chunks in index order.
  at::parallel_for(0, b * t * heads, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      merge_chunks(part_m + r * chunks, part_l + r * chunks, part_acc + r * chunks * d, chunks, d,
                   out_row(r / (heads * t), (r / heads) % t, r % heads));
  });
  return out;
}

at::Tensor attention(at::Tensor q, at::Tensor cache_k, at::Tensor cache_v, at::Tensor visible, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attention: float32 queries only");
  TORCH_CHECK(cache_k.scalar_type() == cache_v.scalar_type() &&
                  (cache_k.scalar_type() == at::kFloat || cache_k.scalar_type() == at::kHalf),
              "attention: the cache must be float32 or float16, keys and values alike");
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.dim() == 4, "attention: visible must be [b, 1, T, S] bool");
  TORCH_CHECK(cache_k.stride(3) == 1 && cache_v.stride(3) == 1, "attention: cache rows must be contiguous");
  if (cache_k.scalar_type() == at::kHalf) return attention_over<at::Half>(q, cache_k, cache_v, visible, scale);
  return attention_over<float>(q, cache_k, cache_v, visible, scale);
}

// -- one decoder layer of a decode or verify block -----------------------------------------------

// A projection as the model's module computes it: int8 weights (q [N4, KP] with their scales ws)
// through int8_linear, packed 4-bit ones (uint8, no ws) through int4_linear, float ones through
// at::linear (what F.linear calls).
at::Tensor project(const at::Tensor& x, const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& ws,
                   const c10::optional<at::Tensor>& bias, int64_t n_out) {
  if (w->scalar_type() == at::kChar) return int8_linear(x, *w, *ws, bias, n_out);
  if (w->scalar_type() == at::kByte) return int4_linear(x, *w, bias, n_out);
  return at::linear(x, *w, bias);
}

// The weights of `decoder_layer`, in this order (None where a model has no such part).
enum LayerPart {
  kInNorm,     // input norm's scale [h]
  kQkNorm,     // q and k norms' scales stacked per head [H + KV, d], or None
  kAttnNorm,   // the attention output's norm (Gemma's sandwich), or None
  kFfInNorm,   // the norm of the residual sum, the MLP's input
  kFfNorm,     // the MLP output's norm (sandwich), or None: then the block adds the MLP output as is
  kQkv, kQkvScale, kQkvBias,  // fused q/k/v projection: weights (int8 or float), int8 scales, bias
  kO, kOScale, kOBias,
  kGateUp, kGateUpScale, kGateUpBias,
  kDown, kDownScale, kDownBias,
  kLayerParts
};

// Block.forward on its compiled path, in one call: the same kernels in the same order on the same
// tensors, so the same bits, without ~100 Python-level steps a layer (attribute lookups, module
// calls, views), a visible share of a small model's int8 step.
// x: [b, T, h] float32, a block of any length; sizes: heads, kv_heads, head_dim and the four
// projections' output sizes; eps, qk_eps, scale (attention's score factor); gelu_tanh; keep: 0, or
// the last rows that go past the cache write (a prefill's last layer: [b, keep, h] out).
at::Tensor decoder_layer(at::Tensor x, std::vector<c10::optional<at::Tensor>> p, std::vector<int64_t> sizes,
                         double eps, double qk_eps, double scale, bool gelu_tanh, at::Tensor cos, at::Tensor sin,
                         at::Tensor cache_k, at::Tensor cache_v, at::Tensor slots, at::Tensor visible, int64_t keep) {
  TORCH_CHECK(p.size() == kLayerParts && sizes.size() == 7, "decoder_layer: wrong number of parts");
  const int64_t heads = sizes[0], kv_heads = sizes[1], d = sizes[2];
  const int64_t b = x.size(0), t = x.size(1);
  const at::Tensor h = rms_norm(x, *p[kInNorm], eps);
  const auto parts = project(h, p[kQkv], p[kQkvScale], p[kQkvBias], sizes[3]).view({b, t, -1, d}).split_with_sizes({heads + kv_heads, kv_heads}, 2);
  const at::Tensor qk = p[kQkNorm].has_value() ? rms_norm(parts[0], *p[kQkNorm], qk_eps) : parts[0];
  at::Tensor q = rope_write(qk, parts[1], cos, sin, cache_k, cache_v, slots);
  if (keep > 0 && keep < t) {
    // Every row's key and value are in the cache; only the last `keep` rows go on. Each kernel
    // computes a row by itself, so they are the bits the whole block gives them.
    q = q.narrow(2, t - keep, keep);
    visible = visible.narrow(2, t - keep, keep);
    x = x.narrow(1, t - keep, keep).contiguous();
  }
  const at::Tensor attn = project(attention(q, cache_k, cache_v, visible, scale), p[kO], p[kOScale], p[kOBias], sizes[4]);
  const auto mid = residual_norm(x, attn, p[kAttnNorm], p[kFfInNorm], eps);
  const at::Tensor up = project(mid[1], p[kGateUp], p[kGateUpScale], p[kGateUpBias], sizes[5]);
  const at::Tensor mlp = project(gated_activation(up, gelu_tanh), p[kDown], p[kDownScale], p[kDownBias], sizes[6]);
  if (p[kFfNorm].has_value()) return residual_norm(mid[0], mlp, p[kFfNorm], c10::nullopt, eps)[0];
  return mid[0] + mlp;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "Int8Linear's matrix product on the int16 input grid");
  m.def("int8_columns", &int8_columns, "chosen output columns of an Int8Linear, bit-identical to its full output");
  m.def("int8_packed", &int8_packed, "whether Int8Linear's weights are packed in 16-row blocks in this build");
  m.def("int8_row_multiple", &int8_row_multiple, "the multiple Int8Linear's rows are padded to in this build");
#if defined(SPECDEC_VNNI)
  m.def("int8_pack", &int8_pack, "a padded row-major int8 table into the packed layout, in place");
  m.def("int8_rows", &int8_rows, "rows of a packed int8 table, as int8");
  m.def("int8_argmax", &int8_argmax, "the argmax of each row of an Int8Linear's output, exact, without the full product");
  m.def("int8_norms", &int8_norms, "the Euclidean norm of each row of a packed int8 table");
#endif
  m.def("table_empty", &table_empty, "an empty weight table, on transparent huge pages from 1 MiB on");
  m.def("int4_linear", &int4_linear, "Int4Linear's product: 4-bit weights in groups of 32, int8 input grid");
  m.def("int4_path", &int4_path, "which int4 kernel this build runs: avx512-vnni, avx2 or scalar");
  m.def("int4_reference", &int4_reference, "Int4Linear's product by the scalar path, whatever the build");
  m.def("int4_pack", &int4_pack, "row-major 4-bit values and their float16 steps and offsets into the packed layout");
  m.def("int4_unpack", &int4_unpack, "a packed 4-bit table back into its row-major parts");
  m.def("rms_norm", &rms_norm, "RMSNorm with per-row-period weights");
  m.def("residual_norm", &residual_norm, "x + norm(y), and the norm of that sum");
  m.def("gated_activation", &gated_activation, "act(gate) * up from a fused gate/up projection");
  m.def("argmax_rows", &argmax_rows, "the argmax of each row, as torch.argmax (lowest index, NaN first)");
  m.def("attention", &attention, "softmax attention of a few queries over the visible cache slots, row by row");
  m.def("rope_write", &rope_write, "rotary embedding of q and k; k and v written to the cache");
  m.def("decoder_layer", &decoder_layer, "one decoder layer of a block, the last `keep` rows out (0: all; Block.forward's compiled path)");
}
