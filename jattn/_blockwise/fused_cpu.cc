// jattn's fused CPU attention: forward, tangent, forward+tangent and backward as XLA FFI custom calls
// (jattn/_blockwise/fused_cpu.py builds and loads them).
//
// Dimension key as in jattn/_core.py. q (B, T, D), k (B, S, D), v (B, S, E) float32, contiguous,
// any leading dimensions flattened to B; results out (B, T, E), lse (B, T) and the row max logit
// (B, T), float32. Query row t (position q_offset + t) sees key s (position kv_offset + s) where
//   s < length  and  q_offset + t - left <= kv_offset + s <= q_offset + t + right,
// an interval of keys a row: full attention, causal (right = 0), a sliding window; an unbounded
// side is any value >= 2^62. Per-example masks (jattn/_blockwise/fused_rows.py) cut each row's interval to its
// bounds lo <= s < hi ((R, T) int32, R = B or 1), and with document ids a key within them counts only
// where its id (kv_ids (R, S)) is the row's (q_ids (R, T)): padding lengths and packed documents.
//
// Forward: one task per (B row, block of `block_q` query rows), taken from a shared counter by
// `threads` std::threads, last query blocks first (the costliest under a causal mask). A task walks
// the key blocks of `block_kv` keys (a multiple of 64) that its rows' intervals touch, with the
// online softmax in the core's cache between the two products:
//   s = (scale q) kᵀ,  m' = max(m, rowmax s),  p = e^(s - m'),  l = l e^(m - m') + rowsum p,
//   acc = acc e^(m - m') + p v,  and at the end  out = acc / l,  lse = m + log l.
// Keys outside a row's interval get p = 0 (never scored); a row with none gives out 0 and lse and
// max -inf. A NaN score makes its row's l, out and lse NaN (and its max logit NaN); a NaN value
// reaches the rows whose keys include it (a key of the computed span that a row does not see weighs
// p = 0, and 0·NaN is NaN, as in a dense product; keys no row of a micro-kernel call sees are skipped).
//
// The vector layer (`V`, chosen at build time): AVX-512F (16 lanes), AVX2 + FMA (8 lanes), ARM NEON
// (4 lanes), or scalar (-DJATTN_SCALAR, or any other CPU). Everything below is written once over it.
// The products are the file's own: a R x (NV lanes-wide
// vectors) micro-kernel over B operands packed once into zero-padded panels of W = NV x lanes columns (kᵀ
// as panels of W keys, v as panels of W values), so the micro-kernel never masks; scratch is padded to
// whole panels and sits on 64-byte boundaries.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"

#if defined(JATTN_SCALAR)
#define JATTN_LAYER_SCALAR 1
#elif defined(__AVX512F__)
#define JATTN_LAYER_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define JATTN_LAYER_AVX2 1
#include <immintrin.h>
#elif defined(__ARM_NEON)
#define JATTN_LAYER_NEON 1
#include <arm_neon.h>
#else
#define JATTN_LAYER_SCALAR 1
#endif

namespace ffi = xla::ffi;

namespace {

// ---- The vector layer: L float lanes, the micro-kernel's R rows x NV vectors, and the operations used below.
// max(a, b) and min(a, b) may return either operand where one is NaN, except max(c, x) and min(c, x) for a
// constant c, which keep a NaN x (x86: the second operand; NEON and scalar: NaN wins or the second). maxn(a, b)
// and top(x) keep every NaN (a running max over scores: a NaN score must reach its row's max, found on AVX2,
// where max(NaN lane, -inf padding) dropped it and a row of NaN scores came out as a row without keys).
#if defined(JATTN_LAYER_AVX512)
struct V {
  using T = __m512;
  static constexpr int L = 16, NV = 4, R = 6;
  static constexpr const char* name = "avx512";
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T maxn(T a, T b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), max(a, b), add(a, b)); }
  static T min(T a, T b) { return _mm512_min_ps(a, b); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T ldexp(T p, T n) { return _mm512_scalef_ps(p, n); }  // p 2^n rounded once, n integral
  static float sum(T x) { return _mm512_reduce_add_ps(x); }
  static float top(T x) {
    return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(x);
  }
};
#elif defined(JATTN_LAYER_AVX2)
struct V {
  using T = __m256;
  static constexpr int L = 8, NV = 2, R = 6;  // 16 registers: 12 accumulators, 2 of B, 1 of A
  static constexpr const char* name = "avx2";
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T maxn(T a, T b) { return _mm256_blendv_ps(max(a, b), add(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
  static T min(T a, T b) { return _mm256_min_ps(a, b); }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static T ldexp(T p, T n) {  // p 2^n for n integral in [-150, 0] (as 2^(n + 126) 2^-126: one rounding)
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127 + 126));
    return mul(mul(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23))), set1(0x1p-126f));
  }
  static float sum(T x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  static float top(T x) {
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))) return std::numeric_limits<float>::quiet_NaN();
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
};
#elif defined(JATTN_LAYER_NEON)
struct V {
  using T = float32x4_t;
  static constexpr int L = 4, NV = 4, R = 6;
  static constexpr const char* name = "neon";
  static T zero() { return vdupq_n_f32(0.f); }
  static T set1(float x) { return vdupq_n_f32(x); }
  static T load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, T x) { vst1q_f32(p, x); }
  static T fma(T a, T b, T c) { return vfmaq_f32(c, a, b); }
  static T add(T a, T b) { return vaddq_f32(a, b); }
  static T sub(T a, T b) { return vsubq_f32(a, b); }
  static T mul(T a, T b) { return vmulq_f32(a, b); }
  static T max(T a, T b) { return vmaxq_f32(a, b); }
  static T maxn(T a, T b) { return vmaxq_f32(a, b); }  // FMAX: NaN if either is NaN (FMAXV in top too)
  static T min(T a, T b) { return vminq_f32(a, b); }
  static T round(T x) { return vrndnq_f32(x); }
  static T ldexp(T p, T n) {  // as AVX2's
    const float32x4_t e = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127 + 126)), 23));
    return mul(mul(p, e), set1(0x1p-126f));
  }
  static float sum(T x) { return vaddvq_f32(x); }
  static float top(T x) { return vmaxvq_f32(x); }
};
#else
struct V {
  using T = float;
  static constexpr int L = 1, NV = 4, R = 4;
  static constexpr const char* name = "scalar";
  static T zero() { return 0.f; }
  static T set1(float x) { return x; }
  static T load(const float* p) { return *p; }
  static void store(float* p, T x) { *p = x; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T max(T a, T b) { return a > b ? a : b; }
  static T maxn(T a, T b) { return a != a || b != b ? a + b : max(a, b); }
  static T min(T a, T b) { return a < b ? a : b; }
  static T round(T x) { return std::nearbyint(x); }
  static T ldexp(T p, T n) { return std::isnan(n) ? n : std::ldexp(p, static_cast<int>(n)); }
  static float sum(T x) { return x; }
  static float top(T x) { return x; }
};
#endif

using vf = V::T;
constexpr int L = V::L, NV = V::NV, R = V::R;
constexpr int64_t W = int64_t{NV} * L;  // the columns of a panel
static_assert(64 % W == 0, "a panel's width divides 64 (key blocks and padded lengths are multiples of 64)");
constexpr float kInf = std::numeric_limits<float>::infinity();

// A vector kept in a container (alignment attributes stay with the struct).
struct alignas(64) Lanes {
  vf x;
};

// n <= L floats from p as a vector, `fill` in the other lanes; and the first n lanes of x stored at p.
inline vf load_n(const float* p, int64_t n, float fill) {
  if (n == L) return V::load(p);
  alignas(64) float buf[L];
  std::fill(buf, buf + L, fill);
  std::memcpy(buf, p, n * sizeof(float));
  return V::load(buf);
}
inline void store_n(float* p, int64_t n, vf x) {
  if (n == L) return V::store(p, x);
  alignas(64) float buf[L];
  V::store(buf, x);
  std::memcpy(p, buf, n * sizeof(float));
}

// e^x for x <= 0: 2^n e^r with n = round(x log2 e) and r = x - n ln 2 in [-ln2/2, ln2/2] (ln 2 as one float: r's
// error n 1.9e-9 is below half an ulp of e^x for n >= -30, and a term below 2^-30 of a row's max of 1 is lost in
// its sum anyway); e^r by a degree-6 polynomial fitted to relative error 2e-9 on that interval (Horner, six FMAs;
// against float64: 0.9 ulp on [-1, 0], 1.5 on [-20, 0], 4.5 near e^-87); 2^n applied with one rounding
// (V::ldexp), so that a result below 2^-126 rounds once, as a subnormal; -inf gives 0, NaN stays NaN.
inline vf exp_le0(vf x) {
  x = V::max(V::set1(-104.f), x);
  const vf n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  const vf r = V::fma(n, V::set1(-0.693147182464599609375f), x);
  vf p = V::set1(1.3843622291460633e-3f);
  p = V::fma(p, r, V::set1(8.37415549904108e-3f));
  p = V::fma(p, r, V::set1(4.166800156235695e-2f));
  p = V::fma(p, r, V::set1(1.6666431725025177e-1f));
  p = V::fma(p, r, V::set1(4.999999403953552e-1f));
  p = V::fma(p, r, V::set1(1.f));
  p = V::fma(p, r, V::set1(1.f));
  return V::ldexp(p, n);
}

// row[0:n] = e^(row - m), returning the row's sum; m = -inf (no key yet, none here) sets it to 0.
inline float exp_sum(float* row, int64_t n, float m) {
  if (m == -kInf) {
    std::fill(row, row + n, 0.f);
    return 0.f;
  }
  const vf vm = V::set1(m);
  vf vsum = V::zero();
  for (int64_t j = 0; j < n; j += L) {
    const int64_t w = std::min<int64_t>(L, n - j);
    const vf e = exp_le0(V::sub(load_n(row + j, w, -kInf), vm));  // e^-inf = 0 past the row
    store_n(row + j, w, e);
    vsum = V::add(vsum, e);
  }
  return V::sum(vsum);
}

// The max of row[0:n] and m.
inline float row_max(const float* row, int64_t n, float m) {
  vf vmax = V::set1(m);
  for (int64_t j = 0; j < n; j += L) vmax = V::maxn(vmax, load_n(row + j, std::min<int64_t>(L, n - j), -kInf));
  return V::top(vmax);
}

// p[0:n] = e^(row - m) (row overwritten with p), drow[0:n] *= p; returns (rowsum p, rowsum p∘drow). m = -inf
// (no key yet) gives zeros.
inline std::pair<float, float> exp_times(float* row, float* drow, int64_t n, float m) {
  if (m == -kInf) {
    std::fill(row, row + n, 0.f), std::fill(drow, drow + n, 0.f);
    return {0.f, 0.f};
  }
  const vf vm = V::set1(m);
  vf vsum = V::zero(), vc = V::zero();
  for (int64_t j = 0; j < n; j += L) {
    const int64_t w = std::min<int64_t>(L, n - j);
    const vf p = exp_le0(V::sub(load_n(row + j, w, -kInf), vm));
    const vf pds = V::mul(p, load_n(drow + j, w, 0.f));
    store_n(row + j, w, p), store_n(drow + j, w, pds);
    vsum = V::add(vsum, p), vc = V::add(vc, pds);
  }
  return {V::sum(vsum), V::sum(vc)};
}

// C[R' x W] (+)= A[R' x K] B[K x W]: A's element (r, k) at A[r lda + k ak] (ak = 1: rows lda apart; lda = 1:
// Aᵀ stored), B a panel (rows W apart), C rows ldc apart. The block of C stays in R' NV registers while A
// streams (broadcast) and B streams; with vmax, each row's running max (per lane) over its first `live`
// vectors of C.
template <int Rr>
void ukernel(int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, float* C, int64_t ldc,
             bool accumulate, Lanes* vmax, int live) {
  vf c[Rr][NV];
  if (accumulate) {
    for (int r = 0; r < Rr; ++r)
      for (int j = 0; j < NV; ++j) c[r][j] = V::load(C + r * ldc + j * L);
  } else {
    for (int r = 0; r < Rr; ++r)
      for (int j = 0; j < NV; ++j) c[r][j] = V::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = V::load(B + k * W + j * L);
    for (int r = 0; r < Rr; ++r) {
      const vf a = V::set1(A[r * lda + k * ak]);
      for (int j = 0; j < NV; ++j) c[r][j] = V::fma(a, b[j], c[r][j]);
    }
  }
  for (int r = 0; r < Rr; ++r)
    for (int j = 0; j < NV; ++j) V::store(C + r * ldc + j * L, c[r][j]);
  if (vmax)
    for (int r = 0; r < Rr; ++r)
      for (int j = 0; j < live; ++j) vmax[r].x = V::maxn(vmax[r].x, c[r][j]);
}

// The micro-kernel for the last `rows` (< R) rows of A.
template <int Rr>
void ukernel_tail(int64_t rows, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, float* C,
                  int64_t ldc, bool accumulate, Lanes* vmax, int live) {
  if constexpr (Rr > 0) {
    if (rows == Rr) return ukernel<Rr>(K, A, lda, ak, B, C, ldc, accumulate, vmax, live);
    ukernel_tail<Rr - 1>(rows, K, A, lda, ak, B, C, ldc, accumulate, vmax, live);
  }
}

// The micro-kernel on `rows` (1 to R) rows.
inline void micro(int64_t rows, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, float* C,
                  int64_t ldc, bool accumulate, Lanes* vmax, int live) {
  if (rows == R) return ukernel<R>(K, A, lda, ak, B, C, ldc, accumulate, vmax, live);
  ukernel_tail<R - 1>(rows, K, A, lda, ak, B, C, ldc, accumulate, vmax, live);
}

// Each row's keys [a, z) within a tile (its other keys weigh 0): a product over a tile's keys computes, for each
// R rows of a micro-kernel call, only the keys between the first a and the last z of those rows.
struct Spans {
  const int64_t* a;
  const int64_t* z;

  // The keys [first a, last z) of rows [i, i + rows).
  std::pair<int64_t, int64_t> of(int64_t i, int64_t rows) const {
    int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
    for (int64_t r = i; r < i + rows; ++r)
      if (a[r] < z[r]) lo = std::min(lo, a[r]), hi = std::max(hi, z[r]);
    return {lo, hi};
  }
};

// C[M x N] (+)= A[M x K] B[K x N] a panel of B at a time (panel p at B + p pstride, rows W apart), R rows of
// A a micro-kernel call (the panel stays in L1 meanwhile); C is written up to N rounded to W. With vmax,
// each row's max over the vectors of C wholly below column N. With spans (N a tile's keys), a panel no row of
// a call needs is skipped: those columns of C are left as they were.
void gemm_panels(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B,
                 int64_t pstride, float* C, int64_t ldc, bool accumulate, Lanes* vmax = nullptr,
                 const Spans* spans = nullptr) {
  for (int64_t j = 0; j < N; j += W) {
    const int live = static_cast<int>(std::min<int64_t>(NV, (N - j) / L));
    const float* b = B + (j / W) * pstride;
    for (int64_t i = 0; i < M; i += R) {
      const int64_t rows = std::min<int64_t>(R, M - i);
      if (spans) {
        const auto [first, last] = spans->of(i, rows);
        if (j >= last || j + W <= first) continue;
      }
      micro(rows, K, A + i * lda, lda, ak, b, C + i * ldc + j, ldc, accumulate, vmax ? vmax + i : nullptr, live);
    }
  }
}

// C (+)= A B in chunks of kDepth along K, each over all of C's rows: a chunk of a panel of B stays in L1 while
// the rows of A stream past it. With spans (K a tile's keys, A zero outside each row's span), each R rows take
// only the depth between their first and last key, and C accumulates.
constexpr int64_t kDepth = 128;
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, int64_t ak, const float* B, int64_t pstride,
          float* C, int64_t ldc, bool accumulate, const Spans* spans = nullptr) {
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, K - k0);
    if (!spans) {
      gemm_panels(M, N, depth, A + k0 * ak, lda, ak, B + k0 * W, pstride, C, ldc, accumulate || k0 > 0);
      continue;
    }
    for (int64_t i = 0; i < M; i += R) {
      const int64_t rows = std::min<int64_t>(R, M - i);
      const auto [first, last] = spans->of(i, rows);
      const int64_t from = std::max(k0, first), to = std::min(k0 + depth, last);
      for (int64_t j = 0; from < to && j < N; j += W)
        micro(rows, to - from, A + i * lda + from * ak, lda, ak, B + (j / W) * pstride + from * W, C + i * ldc + j, ldc,
              true, nullptr, 0);
    }
  }
}

// The rows x cols matrix x (rows ld apart) transposed, as panels of W of its rows: out[p][c][0:W] =
// x[p W : p W + W][c], zero past `rows`, for the `padded` rows (a multiple of W) of the panels (kᵀ, vᵀ).
void pack_transposed(const float* x, int64_t rows, int64_t cols, int64_t ld, int64_t padded, float* out) {
  for (int64_t p = 0; p < padded; p += W) {
    float* panel = out + p * cols;
    for (int64_t w = 0; w < W; ++w) {
      const bool real = p + w < rows;
      for (int64_t c = 0; c < cols; ++c) panel[c * W + w] = real ? x[(p + w) * ld + c] : 0.f;
    }
  }
}

// The rows x cols matrix x (rows ld apart) as panels of W of its columns: out[p][r][0:W] = x[r][p W : p W + W],
// zero past `cols` and past `rows` up to `padded` rows (v, d out, the scaled q, k as B of a product).
void pack_columns(const float* x, int64_t rows, int64_t cols, int64_t ld, int64_t padded, float* out) {
  for (int64_t p = 0; p < cols; p += W) {
    float* panel = out + p * padded;
    const int64_t n = std::min(W, cols - p);
    for (int64_t r = 0; r < padded; ++r) {
      float* dst = panel + r * W;
      if (r < rows) std::copy(x + r * ld + p, x + r * ld + p + n, dst);
      std::fill(dst + (r < rows ? n : 0), dst + W, 0.f);
    }
  }
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Scratch memory kept between calls: fresh pages fault in and the OS zeroes them, which cost ~5% of a full forward
// (B=4 N=8 T=2048) before scratch was reused. Up to kKeep bytes of freed blocks are kept; a request takes the
// smallest kept block that fits.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool;  // never destroyed: kernels may run while the process exits
    return *pool;
  }
  // A block of at least `bytes` (a multiple of 64); from 2 MiB on a 2 MiB boundary, with the kernel asked for
  // huge pages (Linux: fresh scratch is paged in 512 times fewer faults). Returns the block and its size.
  std::pair<float*, size_t> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto best = kept_.end();
      for (auto it = kept_.begin(); it != kept_.end(); ++it)
        if (it->second >= bytes && (best == kept_.end() || it->second < best->second)) best = it;
      if (best != kept_.end()) {
        const auto block = *best;
        kept_.erase(best), held_ -= block.second;
        return block;
      }
    }
    constexpr size_t kHuge = size_t{1} << 21;
    const size_t align = bytes >= kHuge ? kHuge : 64, size = (bytes + align - 1) / align * align;
    float* data = static_cast<float*>(std::aligned_alloc(align, size));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (align == kHuge) madvise(data, size, MADV_HUGEPAGE);
#endif
    return {data, size};
  }
  void give(float* data, size_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (held_ + size <= kKeep) return kept_.emplace_back(data, size), void(held_ += size);
    }
    std::free(data);
  }

 private:
  static constexpr size_t kKeep = size_t{256} << 20;
  std::mutex mu_;
  std::vector<std::pair<float*, size_t>> kept_;
  size_t held_ = 0;
};

// Scratch of n floats on a 64-byte boundary (whole cache lines: no vector load or store splits one), from the pool.
struct Scratch {
  explicit Scratch(int64_t n) {
    std::tie(data, size) = Pool::get().take((n * sizeof(float) + 63) / 64 * 64);
  }
  ~Scratch() { Pool::get().give(data, size); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float& operator[](int64_t i) { return data[i]; }
  float* data;
  size_t size;
};

template <typename Work>
void run(int threads, const Work& work) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

// q (B, T, D), k (B / G, S, D), v (B / G, S, E) with any leading dimensions flattened, read from the buffers:
// grouped query heads, G rows of q (b G to b G + G - 1) a row of k and v (b); and what every kernel derives from
// them: the keys below `length` (at most S), padded to 64 (Sp), D and E padded to whole panels (Dp, Ep), the
// query blocks of a B row, and the threads that get a task.
struct Dims {
  int64_t B = 1, Bk = 1, G = 1, T = 0, S = 0, D = 0, E = 0, length = 0, Sp = 0, Dp = 0, Ep = 0, blocks = 0;
  int n = 1;
};

// The dimensions of q, k, v and the blocks checked; an error names what disagrees.
ffi::Error dims_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, int64_t length,
                   int64_t block_q, int64_t block_kv, int64_t threads, int64_t group, Dims& d) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 2 || kd.size() != rank || vd.size() != rank) return ffi::Error::InvalidArgument("q, k, v: ranks differ");
  d.T = qd[rank - 2], d.D = qd[rank - 1], d.S = kd[rank - 2], d.E = vd[rank - 1], d.G = group;
  for (size_t a = 0; a + 2 < rank; ++a) {
    if (vd[a] != kd[a]) return ffi::Error::InvalidArgument("k, v: leading dimensions differ");
    d.B *= qd[a], d.Bk *= kd[a];
  }
  if (group < 1 || d.Bk * group != d.B)
    return ffi::Error::InvalidArgument("fused attention: q's rows are not `group` times k's and v's");
  if (kd[rank - 1] != d.D || vd[rank - 2] != d.S || block_kv % 64 || block_q < 1 || threads < 1)
    return ffi::Error::InvalidArgument("fused attention: inconsistent shapes or blocks");
  d.length = std::min(length, d.S), d.Sp = round_up(d.length, 64), d.blocks = (d.T + block_q - 1) / block_q;
  d.Dp = round_up(d.D, W), d.Ep = round_up(d.E, W);
  d.n = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(d.B * d.blocks, 1)));
  return ffi::Error::Success();
}

// Per-example masks: each query row's key bounds lo, hi (R, T) and, with segment ids, the rows' and the keys'
// document ids q_ids (R, T), kv_ids (R, S); R = B, or 1 where every row of B shares them.
struct RowMask {
  const int32_t *lo = nullptr, *hi = nullptr, *qid = nullptr, *kid = nullptr;
  int64_t T = 0, S = 0, lo_rows = 1, qid_rows = 1, kid_rows = 1;
  bool bounds = false, ids = false;

  // Keys [l, h) of query row t of B row b, cut to its bounds.
  void cut(int64_t b, int64_t t, int64_t& l, int64_t& h) const {
    if (!bounds) return;
    const int64_t at = (lo_rows == 1 ? 0 : b) * T + t;
    l = std::max<int64_t>(l, lo[at]), h = std::min<int64_t>(h, hi[at]);
  }

  // Keys [a, z) of a tile row from key c0 (query row t of B row b): -inf where the key's document is not the row's.
  void other_documents(int64_t b, int64_t t, float* row, int64_t a, int64_t z, int64_t c0) const {
    if (!ids) return;
    const int32_t id = qid[(qid_rows == 1 ? 0 : b) * T + t];
    const int32_t* keys = kid + (kid_rows == 1 ? 0 : b) * S + c0;
    for (int64_t j = a; j < z; ++j)
      if (keys[j] != id) row[j] = -kInf;
  }
};

// The row mask of a call: `mode` 0 (none: the operands are unread), 1 (bounds), 2 (bounds and document ids);
// an error names a shape that does not fit q (B, T) and k (B, S).
ffi::Error row_mask_of(ffi::Buffer<ffi::S32>& lo, ffi::Buffer<ffi::S32>& hi, ffi::Buffer<ffi::S32>& qid,
                       ffi::Buffer<ffi::S32>& kid, int64_t mode, const Dims& d, RowMask& rm) {
  rm.bounds = mode >= 1, rm.ids = mode >= 2, rm.T = d.T;
  if (!rm.bounds) return ffi::Error::Success();
  const auto ld = lo.dimensions(), hd = hi.dimensions(), qd = qid.dimensions(), kd = kid.dimensions();
  const auto rows_ok = [&](int64_t r) { return r == 1 || r == d.B; };
  if (ld.size() != 2 || hd.size() != 2 || ld[0] != hd[0] || ld[1] != d.T || hd[1] != d.T || !rows_ok(ld[0]))
    return ffi::Error::InvalidArgument("fused attention: row bounds lo, hi must be (B|1, T) int32");
  rm.lo = lo.typed_data(), rm.hi = hi.typed_data(), rm.lo_rows = ld[0];
  if (!rm.ids) return ffi::Error::Success();
  if (qd.size() != 2 || kd.size() != 2 || qd[1] != d.T || kd[1] < d.length || !rows_ok(qd[0]) || !rows_ok(kd[0]))
    return ffi::Error::InvalidArgument("fused attention: document ids must be q_ids (B|1, T), kv_ids (B|1, S) int32");
  rm.qid = qid.typed_data(), rm.kid = kid.typed_data(), rm.qid_rows = qd[0], rm.kid_rows = kd[0], rm.S = kd[1];
  return ffi::Error::Success();
}

// Each row of k and v as the products read them, packed by the kernel's threads: kᵀ as panels of W keys (Sp x D a
// row), v as panels of W values (Ep/W panels of Sp x W a row), or v itself where E is one whole panel (its rows are
// then the panel's rows: the products read no key past `length`).
struct Keys {
  Keys(const Dims& d, const float* k, const float* v)
      : kt(d.Bk * d.Sp * d.D), vc(d.E == W ? 0 : d.Bk * d.Sp * d.Ep), v(v), S(d.S), Sp(d.Sp), D(d.D), E(d.E), Ep(d.Ep) {
    std::atomic<int64_t> next{0};
    run(d.n, [&] {
      for (int64_t b; (b = next.fetch_add(1)) < d.Bk;) {
        pack_transposed(k + b * d.S * d.D, d.length, d.D, d.D, d.Sp, kt.data + b * d.Sp * d.D);
        if (d.E != W) pack_columns(v + b * d.S * d.E, d.length, d.E, d.E, d.Sp, vc.data + b * d.Sp * d.Ep);
      }
    });
  }
  // kᵀ's panels of row b from key c0 (panels D x W, D W apart), and v's (rows W apart, panels `vstride` apart).
  const float* kt_at(int64_t b, int64_t c0) const { return kt.data + (b * Sp + c0) * D; }
  const float* v_at(int64_t b, int64_t c0) const {
    return E == W ? v + (b * S + c0) * E : vc.data + b * Sp * Ep + c0 * W;
  }
  int64_t vstride() const { return Sp * W; }

  Scratch kt, vc;
  const float* v;
  int64_t S, Sp, D, E, Ep;
};

// Each of `rows` query rows from r0 of B row b: its keys [lo, hi) as key indices (below `length`, cut by the row
// mask); returns the keys any row sees, [first, last) (first >= last: none).
std::pair<int64_t, int64_t> intervals(int64_t b, int64_t r0, int64_t rows, int64_t q_offset, int64_t kv_offset,
                                      int64_t left, int64_t right, int64_t length, const RowMask& rm, int64_t* lo,
                                      int64_t* hi) {
  int64_t first = length, last = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = q_offset + r0 + i - kv_offset;  // the row's position among the keys' indices
    lo[i] = std::max<int64_t>(0, left >= (int64_t{1} << 62) ? 0 : at - left);
    hi[i] = std::min<int64_t>(length, right >= (int64_t{1} << 62) ? length : at + right + 1);
    rm.cut(b, r0 + i, lo[i], hi[i]);
    if (lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  }
  return {first, last};
}

// n values of q from q + offset, times scale, into qs (and of dq into dqs, where given).
inline void scaled(const float* q, const float* dq, int64_t offset, int64_t n, float scale, float* qs, float* dqs) {
  for (int64_t i = 0; i < n; ++i) qs[i] = q[offset + i] * scale;
  if (dq)
    for (int64_t i = 0; i < n; ++i) dqs[i] = dq[offset + i] * scale;
}

// Keys [a, z) of a tile row of `cols` (clamped to the tile) for a row with keys [lo, hi) from key c0.
inline std::pair<int64_t, int64_t> kept(int64_t lo, int64_t hi, int64_t c0, int64_t cols) {
  const int64_t a = std::clamp<int64_t>(lo - c0, 0, cols);
  return {a, std::clamp<int64_t>(hi - c0, a, cols)};
}

// Each row's keys [a, z) of the tile of `cols` keys from c0 (kept), into a and z; a row whose lse (where given) is
// -inf has none.
inline void tile_spans(int64_t rows, const int64_t* lo, const int64_t* hi, int64_t c0, int64_t cols, const float* lse,
                       int64_t* a, int64_t* z) {
  for (int64_t i = 0; i < rows; ++i) {
    std::tie(a[i], z[i]) = kept(lo[i], hi[i], c0, cols);
    if (lse && lse[i] == -kInf) a[i] = z[i] = 0;
  }
}

// One row's new running max over a tile: keys [a, z) of its `cols`, from the product's per-lane max (vmax, over
// the tile's whole vectors) where the row sees the whole tile, the tile is whole vectors and no key of it was
// masked after the product (`exact`: no document ids), else from the row.
inline float moved_max(const float* row, int64_t a, int64_t z, int64_t cols, vf vmax, float m, bool exact) {
  if (exact && a == 0 && z == cols && cols % L == 0) return V::top(V::maxn(V::set1(m), vmax));
  return a < z ? row_max(row + a, z - a, m) : m;
}

// rows x E of acc (rows ld apart) times each row's factor r[i], where it is not 1.
inline void rescale(float* acc, int64_t rows, int64_t E, int64_t ld, const float* r) {
  for (int64_t i = 0; i < rows; ++i) {
    if (r[i] == 1.f) continue;  // the row's max did not move
    for (int64_t e = 0; e < E; ++e) acc[i * ld + e] *= r[i];
  }
}

// One task's online softmax over `rows` query rows (at most Bq), a tile of at most Bc keys at a time: the scores'
// tile s (rows Bc apart), each row's running max m and sum l, the accumulator acc (rows Ep apart). Keys are cut into
// splits (SPLIT_KV in fused_cpu.py) whose online softmaxes are merged into a Total in key order; every kernel that
// computes a row walks the same tiles and splits (multiples of Bc and of the split from key 0) with these same
// functions, so a row's bits depend on its own keys alone.
struct Online {
  Online(int64_t Bq, int64_t Bc, int64_t Ep)
      : s(Bq * Bc), acc(Bq * Ep), m(Bq), l(Bq), r(Bq), vmax(Bq), ka(Bq), kz(Bq), Bc(Bc), Ep(Ep) {}
  void reset(int64_t rows) {
    std::fill(m.begin(), m.begin() + rows, -kInf), std::fill(l.begin(), l.begin() + rows, 0.f);
    std::fill(acc.data, acc.data + rows * Ep, 0.f);
  }
  // The tile of `cols` keys from key c0: kᵀ's panels ktb (D x W each, D W apart), v's vb (rows W apart, panels
  // vstride apart); each row's keys [lo, hi) (key indices); hide(i, row, a, z) sets hidden keys of row i to -inf;
  // exact: no key is hidden after the product (the product's per-lane max is the row's).
  template <typename Hide>
  void tile(int64_t rows, int64_t cols, int64_t c0, int64_t D, int64_t E, const float* qs, const float* ktb,
            const float* vb, int64_t vstride, const int64_t* lo, const int64_t* hi, bool exact, const Hide& hide) {
    const Spans spans{ka.data(), kz.data()};
    for (int64_t i = 0; i < rows; ++i) vmax[i].x = V::set1(-kInf);
    tile_spans(rows, lo, hi, c0, cols, nullptr, ka.data(), kz.data());
    gemm_panels(rows, cols, D, qs, D, 1, ktb, D * W, s.data, Bc, false, vmax.data(), &spans);
    for (int64_t i = 0; i < rows; ++i) {
      float* row = s.data + i * Bc;
      const int64_t a = ka[i], z = kz[i];
      hide(i, row, a, z);
      const float m_old = m[i];
      m[i] = moved_max(row, a, z, cols, vmax[i].x, m_old, exact);
      std::fill(row, row + a, 0.f), std::fill(row + z, row + cols, 0.f);  // keys outside the row's weigh 0
      r[i] = m[i] == -kInf ? 1.f : std::exp(m_old - m[i]);
      l[i] = l[i] * r[i] + (a < z ? exp_sum(row + a, z - a, m[i]) : 0.f);
    }
    rescale(acc.data, rows, E, Ep, r.data());
    gemm(rows, E, cols, s.data, Bc, 1, vb, vstride, acc.data, Ep, true, &spans);
  }

  Scratch s, acc;
  std::vector<float> m, l, r;
  std::vector<Lanes> vmax;  // each row's max over the tile, from the first product
  std::vector<int64_t> ka, kz;  // a tile's keys of each row, [ka, kz)
  int64_t Bc, Ep;
};

// The factors (a, b) that bring a row's total with max M and a split of it with max m to their common max, and
// that max: every sum of the online softmax merges as X = X a + x b.
inline std::tuple<float, float, float> merge_factors(float M, float m) {
  const float top = std::max(M, m);
  return {M == -kInf ? 0.f : std::exp(M - top), std::exp(m - top), top};
}

// Merges one split of a row (its max m, sum l, accumulator acc of E values) into the row's total (M, L, ACC); a
// split without keys (m = -inf) leaves it as it is.
inline void merge_split(float m, float l, const float* acc, int64_t E, float& M, float& L, float* ACC) {
  if (m == -kInf) return;
  const auto [a, b, top] = merge_factors(M, m);
  for (int64_t e = 0; e < E; ++e) ACC[e] = ACC[e] * a + acc[e] * b;
  L = L * a + l * b, M = top;
}

// A task's rows' totals over their splits (rows Ep apart), and their results: out = ACC / L, lse = M + log L, the
// max logit M (NaN where L is).
struct Total {
  Total(int64_t Bq, int64_t Ep) : acc(Bq * Ep), m(Bq), l(Bq), Ep(Ep) {}
  void reset(int64_t rows) {
    std::fill(m.begin(), m.begin() + rows, -kInf), std::fill(l.begin(), l.begin() + rows, 0.f);
    std::fill(acc.data, acc.data + rows * Ep, 0.f);
  }
  void merge(const Online& on, int64_t rows, int64_t E) {
    for (int64_t i = 0; i < rows; ++i) merge_split(on.m[i], on.l[i], on.acc.data + i * Ep, E, m[i], l[i], acc.data + i * Ep);
  }
  // Row i's output (E values at out), lse and max logit (where given).
  void finish(int64_t i, int64_t E, float* out, float* lse, float* top) const {
    const float inv = l[i] == 0.f ? 0.f : 1.f / l[i];
    for (int64_t e = 0; e < E; ++e) out[e] = acc.data[i * Ep + e] * inv;
    *lse = l[i] == 0.f ? -kInf : m[i] + std::log(l[i]);
    if (top) *top = std::isnan(l[i]) ? l[i] : m[i];
  }

  Scratch acc;
  std::vector<float> m, l;
  int64_t Ep;
};

// The splits of keys [first, last) and the tiles of a split: both at multiples of their size from key 0.
inline int64_t split_start(int64_t first, int64_t split) { return first / split * split; }
inline int64_t tile_start(int64_t s0, int64_t first, int64_t Bc) { return std::max(s0, first / Bc * Bc); }

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lo_b, ffi::Buffer<ffi::S32> hi_b, ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> mx,
                   int64_t length, int64_t q_offset, int64_t kv_offset, int64_t left, int64_t right, float scale,
                   int64_t block_q, int64_t block_kv, int64_t threads, int64_t row_mask, int64_t group, int64_t split) {
  Dims d;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, group, d); e.failure()) return e;
  if (split < block_kv || split % block_kv) return ffi::Error::InvalidArgument("fused attention: split % block_kv");
  RowMask rm;
  if (ffi::Error e = row_mask_of(lo_b, hi_b, q_ids, kv_ids, row_mask, d, rm); e.failure()) return e;
  const int64_t T = d.T, D = d.D, E = d.E, Ep = d.Ep, blocks = d.blocks, Bq = block_q, Bc = block_kv;
  const float* qp = q.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data(), *mp = mx->typed_data();
  const Keys keys(d, k.typed_data(), v.typed_data());

  std::atomic<int64_t> next{0};
  run(d.n, [&] {
    Online on(Bq, Bc, Ep);
    Total total(Bq, Ep);
    Scratch qs(Bq * D);
    std::vector<int64_t> lo(Bq), hi(Bq);  // each row's keys, [lo, hi)
    for (int64_t task; (task = next.fetch_add(1)) < d.B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      scaled(qp, nullptr, (b * T + r0) * D, rows * D, scale, qs.data, nullptr);  // the scale folded into q
      const auto [first, last] = intervals(b, r0, rows, q_offset, kv_offset, left, right, d.length, rm, lo.data(), hi.data());
      total.reset(rows);
      for (int64_t s0 = split_start(first, split); s0 < last; s0 += split) {
        on.reset(rows);
        for (int64_t c0 = tile_start(s0, first, Bc); c0 < std::min(s0 + split, last); c0 += Bc)
          on.tile(rows, std::min(Bc, last - c0), c0, D, E, qs.data, keys.kt_at(b / d.G, c0), keys.v_at(b / d.G, c0),
                  keys.vstride(), lo.data(), hi.data(), !rm.ids,
                  [&](int64_t i, float* row, int64_t a, int64_t z) { rm.other_documents(b, r0 + i, row, a, z, c0); });
        total.merge(on, rows, E);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        total.finish(i, E, op + t * E, lp + t, mp + t);
      }
    }
  });
  return ffi::Error::Success();
}

// One tile's scores and their tangent, from q and dq rows (already scaled) and the panels of kᵀ and dkᵀ at its
// first key: s = q kᵀ (each row's max into vmax, where given) and dx = dq kᵀ + q dkᵀ.
void tangent_products(int64_t rows, int64_t cols, int64_t D, const float* qs, const float* dqs, const float* ktb,
                      const float* dktb, float* s, float* ds, int64_t Bc, Lanes* vmax, const Spans& spans) {
  gemm_panels(rows, cols, D, qs, D, 1, ktb, D * W, s, Bc, false, vmax, &spans);
  gemm_panels(rows, cols, D, dqs, D, 1, ktb, D * W, ds, Bc, false, nullptr, &spans);
  gemm_panels(rows, cols, D, qs, D, 1, dktb, D * W, ds, Bc, true, nullptr, &spans);
}

// One tile row with its lse known: p = e^(s - lse) (clamped at 1; NaN stays NaN) over s, and p∘drow over drow,
// on keys [a, z), 0 elsewhere; with delta (the backward), p∘(drow - delta) instead. Returns rowsum of what
// drow holds.
inline float known_row(float* row, float* drow, int64_t a, int64_t z, int64_t cols, float lse, float delta = 0.f) {
  std::fill(row, row + a, 0.f), std::fill(row + z, row + cols, 0.f);
  std::fill(drow, drow + a, 0.f), std::fill(drow + z, drow + cols, 0.f);
  const vf vl = V::set1(lse), vd = V::set1(delta);
  vf vc = V::zero();
  for (int64_t j = a; j < z; j += L) {
    const int64_t w = std::min<int64_t>(L, z - j);
    const vf p = exp_le0(V::min(V::zero(), V::sub(load_n(row + j, w, -kInf), vl)));  // 0 past the row
    const vf pd = V::mul(p, V::sub(load_n(drow + j, w, 0.f), vd));
    store_n(row + j, w, p), store_n(drow + j, w, pd);
    vc = V::add(vc, pd);
  }
  return V::sum(vc);
}

// The tangent (forward mode) with the lse known, for tangents dq, dk, dv of q, k, v: per tile
//   p = e^(s - lse),  dx = (dq kᵀ + q dkᵀ)·scale,  A += p dv + (p∘dx) v,  c += rowsum(p∘dx),
// and per row  d lse = c,  d out = A - c·out;  a row with lse -inf (no key) gives 0. Same tasks,
// intervals and products as Forward; kᵀ, dkᵀ, v and dv packed once per B row.
ffi::Error Tangent(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> dq,
                   ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv, ffi::Buffer<ffi::F32> out,
                   ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> lo_b, ffi::Buffer<ffi::S32> hi_b, ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids, ffi::ResultBuffer<ffi::F32> d_out,
                   ffi::ResultBuffer<ffi::F32> d_lse,
                   int64_t length, int64_t q_offset, int64_t kv_offset, int64_t left, int64_t right, float scale,
                   int64_t block_q, int64_t block_kv, int64_t threads, int64_t row_mask, int64_t group) {
  Dims d;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, group, d); e.failure()) return e;
  RowMask rm;
  if (ffi::Error e = row_mask_of(lo_b, hi_b, q_ids, kv_ids, row_mask, d, rm); e.failure()) return e;
  const int64_t T = d.T, D = d.D, E = d.E, Ep = d.Ep, blocks = d.blocks, Bq = block_q, Bc = block_kv;
  const float *qp = q.typed_data(), *dqp = dq.typed_data(), *op = out.typed_data(), *lp = lse.typed_data();
  float *dop = d_out->typed_data(), *dlp = d_lse->typed_data();
  const Keys keys(d, k.typed_data(), v.typed_data()), dkeys(d, dk.typed_data(), dv.typed_data());

  std::atomic<int64_t> next{0};
  run(d.n, [&] {
    Scratch s(Bq * Bc), ds(Bq * Bc), acc(Bq * Ep), qs(Bq * D), dqs(Bq * D);
    std::vector<float> c(Bq);
    std::vector<int64_t> lo(Bq), hi(Bq), ka(Bq), kz(Bq);
    const Spans spans{ka.data(), kz.data()};
    for (int64_t task; (task = next.fetch_add(1)) < d.B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      scaled(qp, dqp, (b * T + r0) * D, rows * D, scale, qs.data, dqs.data);
      const auto [first, last] = intervals(b, r0, rows, q_offset, kv_offset, left, right, d.length, rm, lo.data(), hi.data());
      std::fill(c.begin(), c.begin() + rows, 0.f);
      std::fill(acc.data, acc.data + rows * Ep, 0.f);
      for (int64_t c0 = first / 64 * 64; c0 < last; c0 += Bc) {
        const int64_t cols = std::min(Bc, last - c0);
        const int64_t kb = b / d.G;  // the row of k and v
        tile_spans(rows, lo.data(), hi.data(), c0, cols, lp + b * T + r0, ka.data(), kz.data());  // lse -inf: no key
        tangent_products(rows, cols, D, qs.data, dqs.data, keys.kt_at(kb, c0), dkeys.kt_at(kb, c0), s.data, ds.data, Bc, nullptr,
                         spans);
        for (int64_t i = 0; i < rows; ++i) {
          rm.other_documents(b, r0 + i, s.data + i * Bc, ka[i], kz[i], c0);
          c[i] += known_row(s.data + i * Bc, ds.data + i * Bc, ka[i], kz[i], cols, lp[b * T + r0 + i]);
        }
        gemm(rows, E, cols, s.data, Bc, 1, dkeys.v_at(kb, c0), keys.vstride(), acc.data, Ep, true, &spans);
        gemm(rows, E, cols, ds.data, Bc, 1, keys.v_at(kb, c0), keys.vstride(), acc.data, Ep, true, &spans);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        const bool none = lp[t] == -kInf;
        dlp[t] = none ? 0.f : c[i];
        for (int64_t e = 0; e < E; ++e) dop[t * E + e] = none ? 0.f : acc[i * Ep + e] - c[i] * op[t * E + e];
      }
    }
  });
  return ffi::Error::Success();
}

// One row's online softmax over a tile of the one-pass jvp: keys [a, z) of the tile's `cols` kept, the running
// max m moved (moved_max), p and p∘dx formed, l and c (rowsum p∘dx) rescaled and summed; returns the rescale of
// the row's accumulators (1: unmoved).
inline float online_row(float* row, float* drow, int64_t a, int64_t z, int64_t cols, vf vmax, bool exact, float& m,
                        float& l, float& c) {
  const float m_old = m;
  m = moved_max(row, a, z, cols, vmax, m_old, exact);
  std::fill(row, row + a, 0.f), std::fill(row + z, row + cols, 0.f);
  std::fill(drow, drow + a, 0.f), std::fill(drow + z, drow + cols, 0.f);
  const auto [sum, dsum] = a < z ? exp_times(row + a, drow + a, z - a, m) : std::pair<float, float>{0.f, 0.f};
  const float rescale = m == -kInf ? 1.f : std::exp(m_old - m);
  l = l * rescale + sum;
  c = c * rescale + dsum;
  return rescale;
}

// The forward and its tangent in one pass (forward mode without a second sweep): per tile
//   s = (scale q) kᵀ,  dx = (scale dq) kᵀ + (scale q) dkᵀ,  m' = max(m, rowmax s),  p = e^(s - m'),
//   l = l r + rowsum p,  c = c r + rowsum(p∘dx),  acc = acc r + p v,  A = A r + p dv + (p∘dx) v  (r = e^(m - m')),
// and per row  out = acc / l,  lse = m + log l,  d lse = c / l,  d out = A / l - d lse·out; a row with no
// key gives out, d out, d lse 0 and lse, max -inf. Same tasks, intervals and products as Forward.
ffi::Error ForwardTangent(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::F32> dq, ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv, ffi::Buffer<ffi::S32> lo_b, ffi::Buffer<ffi::S32> hi_b, ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                          ffi::ResultBuffer<ffi::F32> mx, ffi::ResultBuffer<ffi::F32> d_out,
                          ffi::ResultBuffer<ffi::F32> d_lse, int64_t length, int64_t q_offset, int64_t kv_offset,
                          int64_t left, int64_t right, float scale, int64_t block_q, int64_t block_kv,
                          int64_t threads, int64_t row_mask, int64_t group, int64_t split) {
  Dims d;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, group, d); e.failure()) return e;
  RowMask rm;
  if (ffi::Error e = row_mask_of(lo_b, hi_b, q_ids, kv_ids, row_mask, d, rm); e.failure()) return e;
  if (split < block_kv || split % block_kv) return ffi::Error::InvalidArgument("fused attention: split % block_kv");
  const int64_t T = d.T, D = d.D, E = d.E, Ep = d.Ep, blocks = d.blocks, Bq = block_q, Bc = block_kv;
  const float *qp = q.typed_data(), *dqp = dq.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data(), *mp = mx->typed_data();
  float *dop = d_out->typed_data(), *dlp = d_lse->typed_data();
  const Keys keys(d, k.typed_data(), v.typed_data()), dkeys(d, dk.typed_data(), dv.typed_data());

  std::atomic<int64_t> next{0};
  run(d.n, [&] {
    Scratch s(Bq * Bc), ds(Bq * Bc), acc(Bq * Ep), A(Bq * Ep), qs(Bq * D), dqs(Bq * D), ACC(Bq * Ep), AT(Bq * Ep);
    std::vector<float> m(Bq), l(Bq), c(Bq), r(Bq), M(Bq), L(Bq), C(Bq);  // a split's sums, and the row's (capitals)
    std::vector<Lanes> vmax(Bq);
    std::vector<int64_t> lo(Bq), hi(Bq), ka(Bq), kz(Bq);
    const Spans spans{ka.data(), kz.data()};
    for (int64_t task; (task = next.fetch_add(1)) < d.B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      scaled(qp, dqp, (b * T + r0) * D, rows * D, scale, qs.data, dqs.data);
      const auto [first, last] = intervals(b, r0, rows, q_offset, kv_offset, left, right, d.length, rm, lo.data(), hi.data());
      std::fill(M.begin(), M.begin() + rows, -kInf);
      std::fill(L.begin(), L.begin() + rows, 0.f), std::fill(C.begin(), C.begin() + rows, 0.f);
      std::fill(ACC.data, ACC.data + rows * Ep, 0.f), std::fill(AT.data, AT.data + rows * Ep, 0.f);
      for (int64_t s0 = split_start(first, split); s0 < last; s0 += split) {  // Forward's splits and tiles
        std::fill(m.begin(), m.begin() + rows, -kInf);
        std::fill(l.begin(), l.begin() + rows, 0.f), std::fill(c.begin(), c.begin() + rows, 0.f);
        std::fill(acc.data, acc.data + rows * Ep, 0.f), std::fill(A.data, A.data + rows * Ep, 0.f);
        for (int64_t c0 = tile_start(s0, first, Bc); c0 < std::min(s0 + split, last); c0 += Bc) {
          const int64_t cols = std::min(Bc, last - c0);
          const int64_t kb = b / d.G;  // the row of k and v
          for (int64_t i = 0; i < rows; ++i) vmax[i].x = V::set1(-kInf);
          tile_spans(rows, lo.data(), hi.data(), c0, cols, nullptr, ka.data(), kz.data());
          tangent_products(rows, cols, D, qs.data, dqs.data, keys.kt_at(kb, c0), dkeys.kt_at(kb, c0), s.data, ds.data, Bc,
                           vmax.data(), spans);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t a = ka[i], z = kz[i];
            rm.other_documents(b, r0 + i, s.data + i * Bc, a, z, c0);
            r[i] = online_row(s.data + i * Bc, ds.data + i * Bc, a, z, cols, vmax[i].x, !rm.ids, m[i], l[i], c[i]);
          }
          rescale(acc.data, rows, E, Ep, r.data()), rescale(A.data, rows, E, Ep, r.data());
          gemm(rows, E, cols, s.data, Bc, 1, keys.v_at(kb, c0), keys.vstride(), acc.data, Ep, true, &spans);
          gemm(rows, E, cols, s.data, Bc, 1, dkeys.v_at(kb, c0), keys.vstride(), A.data, Ep, true, &spans);
          gemm(rows, E, cols, ds.data, Bc, 1, keys.v_at(kb, c0), keys.vstride(), A.data, Ep, true, &spans);
        }
        for (int64_t i = 0; i < rows; ++i) {  // the split merged into the row, as Forward's Total merges it
          if (m[i] == -kInf) continue;
          const auto [fa, fb, top] = merge_factors(M[i], m[i]);
          for (int64_t e = 0; e < E; ++e) AT[i * Ep + e] = AT[i * Ep + e] * fa + A[i * Ep + e] * fb;
          C[i] = C[i] * fa + c[i] * fb;
          merge_split(m[i], l[i], acc.data + i * Ep, E, M[i], L[i], ACC.data + i * Ep);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        const float inv = L[i] == 0.f ? 0.f : 1.f / L[i], dl = C[i] * inv;
        for (int64_t e = 0; e < E; ++e) {
          op[t * E + e] = ACC[i * Ep + e] * inv;
          dop[t * E + e] = AT[i * Ep + e] * inv - dl * op[t * E + e];
        }
        lp[t] = L[i] == 0.f ? -kInf : M[i] + std::log(L[i]);
        mp[t] = std::isnan(L[i]) ? L[i] : M[i];
        dlp[t] = dl;
      }
    }
  });
  return ffi::Error::Success();
}

// The backward (reverse mode) with the forward's lse and delta = rowsum(d out ∘ out) - d lse known: per tile
//   s = (scale q) kᵀ,  p = e^(s - lse),  dp = d out vᵀ,  ds = p∘(dp - delta),
//   dv += pᵀ d out,  dk += dsᵀ (scale q),  dq += scale ds k;
// keys outside a row's interval and rows with no key give p = ds = 0. One task per B row (its dk, dv gather
// over every query block, so one thread owns them), query blocks in order; pᵀ and dsᵀ read in place (the
// micro-kernel's strided A), kᵀ, vᵀ and k packed once a task, the scaled q and d out once a query block.
ffi::Error Backward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::S32> lo_b, ffi::Buffer<ffi::S32> hi_b, ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                    int64_t length, int64_t q_offset, int64_t kv_offset, int64_t left, int64_t right, float scale,
                    int64_t block_q, int64_t block_kv, int64_t threads, int64_t row_mask, int64_t group) {
  Dims d;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, group, d); e.failure()) return e;
  RowMask rm;
  if (ffi::Error e = row_mask_of(lo_b, hi_b, q_ids, kv_ids, row_mask, d, rm); e.failure()) return e;
  const int64_t T = d.T, S = d.S, D = d.D, E = d.E, Sp = d.Sp, Dp = d.Dp, Ep = d.Ep, Bq = block_q, Bc = block_kv;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *gp = d_out.typed_data();
  const float *lp = lse.typed_data(), *dp = delta.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  std::atomic<int64_t> next{0};
  run(static_cast<int>(std::min<int64_t>(d.n, d.Bk)), [&] {
    Scratch kt(Sp * D), vt(Sp * E), kc(Sp * Dp), dks(Sp * Dp), dvs(Sp * Ep);
    Scratch s(Bq * Bc), ds(Bq * Bc), qs(Bq * D), qc(Bq * Dp), gc(Bq * Ep), dqs(Bq * Dp);
    std::vector<int64_t> lo(Bq), hi(Bq), ka(Bq), kz(Bq);
    const Spans spans{ka.data(), kz.data()};
    for (int64_t kb; (kb = next.fetch_add(1)) < d.Bk;) {  // a row of k and v, and its G rows of q
      pack_transposed(kp + kb * S * D, d.length, D, D, Sp, kt.data);
      pack_transposed(vp + kb * S * E, d.length, E, E, Sp, vt.data);
      pack_columns(kp + kb * S * D, d.length, D, D, Sp, kc.data);
      std::fill(dks.data, dks.data + Sp * Dp, 0.f), std::fill(dvs.data, dvs.data + Sp * Ep, 0.f);
      for (int64_t task = kb * d.G * d.blocks; task < (kb + 1) * d.G * d.blocks; ++task) {  // its rows' query blocks
        const int64_t b = task / d.blocks, r0 = task % d.blocks * Bq, rows = std::min(Bq, T - r0);
        const float* gb = gp + (b * T + r0) * E;
        scaled(qp, nullptr, (b * T + r0) * D, rows * D, scale, qs.data, nullptr);
        pack_columns(qs.data, rows, D, D, Bq, qc.data), pack_columns(gb, rows, E, E, Bq, gc.data);
        std::fill(dqs.data, dqs.data + rows * Dp, 0.f);
        const auto [first, last] = intervals(b, r0, rows, q_offset, kv_offset, left, right, d.length, rm, lo.data(), hi.data());
        for (int64_t c0 = first / 64 * 64; c0 < last; c0 += Bc) {
          const int64_t cols = std::min(Bc, last - c0);
          tile_spans(rows, lo.data(), hi.data(), c0, cols, lp + b * T + r0, ka.data(), kz.data());  // lse -inf: none
          gemm_panels(rows, cols, D, qs.data, D, 1, kt.data + c0 * D, D * W, s.data, Bc, false, nullptr, &spans);
          gemm_panels(rows, cols, E, gb, E, 1, vt.data + c0 * E, E * W, ds.data, Bc, false, nullptr, &spans);
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = b * T + r0 + i;
            rm.other_documents(b, r0 + i, s.data + i * Bc, ka[i], kz[i], c0);
            known_row(s.data + i * Bc, ds.data + i * Bc, ka[i], kz[i], cols, lp[t], dp[t]);
          }
          gemm(cols, E, rows, s.data, 1, Bc, gc.data, Bq * W, dvs.data + c0 * Ep, Ep, true);  // pᵀ d out
          gemm(cols, D, rows, ds.data, 1, Bc, qc.data, Bq * W, dks.data + c0 * Dp, Dp, true);  // dsᵀ (scale q)
          gemm(rows, D, cols, ds.data, Bc, 1, kc.data + c0 * W, Sp * W, dqs.data, Dp, true, &spans);  // ds k
        }
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t e = 0; e < D; ++e) dqp[(b * T + r0 + i) * D + e] = dqs[i * Dp + e] * scale;
      }
      for (int64_t j = 0; j < S; ++j) {
        const bool real = j < d.length;
        for (int64_t e = 0; e < D; ++e) dkp[(kb * S + j) * D + e] = real ? dks[j * Dp + e] : 0.f;
        for (int64_t e = 0; e < E; ++e) dvp[(kb * S + j) * E + e] = real ? dvs[j * Ep + e] : 0.f;
      }
    }
  });
  return ffi::Error::Success();
}


// Paged attention (jattn/_paged): q (Q, N, D) a flat ragged batch, request r's rows cu[r]..cu[r+1] at its last q_len
// positions; keys and values in pages kp (P, Z, K, D), vp (P, Z, K, E), request r's key j at page table[r][j / Z],
// slot j % Z, j < kv_lens[r]; query head n reads kv head n / G. Requests whose tables are broken are skipped (the
// caller returns their rows as NaN); rows of no request stay out 0, lse -inf.
// A page pool's element as float32, exactly: float32, bfloat16 (its bits are a float32's top half) or float16.
enum class Kind { f32, bf16, f16 };
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0 && man != 0) return (sign ? -1.f : 1.f) * std::ldexp(static_cast<float>(man), -24);  // subnormal
  const uint32_t u = exp == 0x1f ? sign | 0x7f800000u | (man << 13)  // inf, NaN
                     : exp       ? sign | ((exp + 112) << 23) | (man << 13)
                                 : sign;  // zero
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
template <Kind kind>
inline float element(const void* p, int64_t i) {
  if constexpr (kind == Kind::f32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if constexpr (kind == Kind::f16) return half_to_float(h);
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct PagedPool {
  const float* q;
  const void *kp, *vp;
  const int32_t *table, *kv, *cu;
  Kind kind = Kind::f32;
  int64_t Q = 0, N = 0, D = 0, P = 0, Z = 0, K = 0, E = 0, R = 0, M = 0, G = 1;

  // Whether request r's entries are whole: lengths in range, cu increasing, every page it reads in the pool.
  bool whole(int64_t r) const {
    for (int64_t i = 0; i < R; ++i)
      if (cu[i + 1] < cu[i]) return false;
    const int64_t n = kv[r], ql = cu[r + 1] - cu[r];
    if (cu[0] < 0 || cu[R] > Q || n < 0 || n > M * Z || ql > n) return false;
    for (int64_t j = 0; j < (n + Z - 1) / Z; ++j)
      if (table[r * M + j] < 0 || table[r * M + j] >= P) return false;
    return true;
  }
  // Row i of request r's rows for kv head h: the query of head h G + i / q_len, token i % q_len.
  const float* query(int64_t r, int64_t h, int64_t i) const {
    const int64_t ql = cu[r + 1] - cu[r];
    return q + ((cu[r] + i % ql) * N + h * G + i / ql) * D;
  }
  // The index of key j's (value j's) first element for kv head h, in its pages.
  int64_t key(int64_t r, int64_t h, int64_t j) const { return ((table[r * M + j / Z] * Z + j % Z) * K + h) * D; }
  int64_t value(int64_t r, int64_t h, int64_t j) const { return ((table[r * M + j / Z] * Z + j % Z) * K + h) * E; }
};

// A block of one request's rows for one kv head (rows i0 .. i0 + rows of its G q_len), and its keys [first, last).
struct PagedBlock {
  int64_t r, h, i0, rows, first, last, slot;  // slot: its first split's partial, -1 where it has one split
};

// Each of the block's rows' keys [lo, hi) (key indices below kv); returns [first, last) over the rows.
std::pair<int64_t, int64_t> paged_intervals(const PagedPool& pool, const PagedBlock& blk, int64_t left, int64_t right,
                                            int64_t* lo, int64_t* hi) {
  const int64_t n = pool.kv[blk.r], ql = pool.cu[blk.r + 1] - pool.cu[blk.r];
  int64_t first = n, last = 0;
  for (int64_t i = 0; i < blk.rows; ++i) {
    const int64_t at = n - ql + (blk.i0 + i) % ql;
    lo[i] = std::max<int64_t>(0, left >= (int64_t{1} << 62) ? 0 : at - left);
    hi[i] = std::min<int64_t>(n, right >= (int64_t{1} << 62) ? n : at + right + 1);
    if (lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  }
  return {first, last};
}

// kᵀ of keys c0 .. c0 + cols as panels of W keys (zero past cols), and v as panels of W values (rows W apart,
// panels Bc W apart), read from the pages (as float32).
template <Kind kind>
void pack_pages_of(const PagedPool& pool, int64_t r, int64_t h, int64_t c0, int64_t cols, int64_t Bc, int64_t Ep,
                   float* kt, float* vt) {
  const int64_t D = pool.D, E = pool.E;
  int64_t at[W];  // the first element of each key of a panel (-1 past cols)
  for (int64_t p = 0; p < round_up(cols, W); p += W) {
    for (int64_t w = 0; w < W; ++w) at[w] = p + w < cols ? pool.key(r, h, c0 + p + w) : -1;
    for (int64_t c = 0; c < D; ++c) {  // a row of the panel at a time: its W stores are contiguous
      float* dst = kt + p * D + c * W;
      for (int64_t w = 0; w < W; ++w) dst[w] = at[w] >= 0 ? element<kind>(pool.kp, at[w] + c) : 0.f;
    }
  }
  for (int64_t j = 0; j < round_up(cols, W); ++j) {
    const int64_t at = j < cols ? pool.value(r, h, c0 + j) : -1;
    for (int64_t p = 0; p < Ep; p += W)
      for (int64_t w = 0; w < W; ++w)
        vt[p * Bc + j * W + w] = at >= 0 && p + w < E ? element<kind>(pool.vp, at + p + w) : 0.f;
  }
}
void pack_pages(const PagedPool& pool, int64_t r, int64_t h, int64_t c0, int64_t cols, int64_t Bc, int64_t Ep, float* kt,
                float* vt) {
  switch (pool.kind) {
    case Kind::f32: return pack_pages_of<Kind::f32>(pool, r, h, c0, cols, Bc, Ep, kt, vt);
    case Kind::bf16: return pack_pages_of<Kind::bf16>(pool, r, h, c0, cols, Bc, Ep, kt, vt);
    case Kind::f16: return pack_pages_of<Kind::f16>(pool, r, h, c0, cols, Bc, Ep, kt, vt);
  }
}

// A paged task: the splits [s0, s1) of a block's keys.
struct PagedTask {
  int64_t block, s0, s1, slot;  // slot: where its partial goes, -1: its block has one split (finished here)
};

// The blocks of every whole request (rows of Bq at most) and their tasks (a split each); partials counts the rows of
// the splits of blocks with several.
void paged_plan(const PagedPool& pool, int64_t Bq, int64_t split, int64_t left, int64_t right, std::vector<PagedBlock>& blocks,
                std::vector<PagedTask>& tasks, int64_t& partials) {
  std::vector<int64_t> lo(Bq), hi(Bq);
  partials = 0;
  for (int64_t r = 0; r < pool.R; ++r) {
    if (!pool.whole(r)) continue;
    const int64_t rows = pool.G * (pool.cu[r + 1] - pool.cu[r]);
    for (int64_t h = 0; h < pool.K; ++h)
      for (int64_t i0 = 0; i0 < rows; i0 += Bq) {
        PagedBlock blk{r, h, i0, std::min(Bq, rows - i0), 0, 0, -1};
        std::tie(blk.first, blk.last) = paged_intervals(pool, blk, left, right, lo.data(), hi.data());
        const int64_t s_first = split_start(blk.first, split), n = blk.first < blk.last ? (blk.last - s_first + split - 1) / split : 1;
        if (n > 1) blk.slot = partials, partials += n * blk.rows;
        for (int64_t k = 0; k < n; ++k)
          tasks.push_back({static_cast<int64_t>(blocks.size()), s_first + k * split, s_first + (k + 1) * split,
                           n > 1 ? blk.slot + k * blk.rows : -1});
        blocks.push_back(blk);
      }
  }
}

ffi::Error PagedForward(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kp, ffi::AnyBuffer vp, ffi::Buffer<ffi::S32> table,
                        ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> cu, ffi::ResultBuffer<ffi::F32> out,
                        ffi::ResultBuffer<ffi::F32> lse, int64_t left, int64_t right, float scale, int64_t block_q,
                        int64_t block_kv, int64_t split, int64_t threads) {
  const auto qd = q.dimensions(), kd = kp.dimensions(), vd = vp.dimensions(), td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || kv_lens.dimensions().size() != 1 ||
      cu.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged attention: ranks of q, pages or tables");
  PagedPool pool{q.typed_data(), kp.untyped_data(), vp.untyped_data(), table.typed_data(), kv_lens.typed_data(), cu.typed_data()};
  const ffi::DataType dtype = kp.element_type();
  if (vp.element_type() != dtype ||
      (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16))
    return ffi::Error::InvalidArgument("paged attention: k_pages and v_pages must both be float32, bfloat16 or float16");
  pool.kind = dtype == ffi::DataType::F32 ? Kind::f32 : dtype == ffi::DataType::BF16 ? Kind::bf16 : Kind::f16;
  pool.Q = qd[0], pool.N = qd[1], pool.D = qd[2], pool.P = kd[0], pool.Z = kd[1], pool.K = kd[2], pool.E = vd[3];
  pool.R = td[0], pool.M = td[1];
  if (kd[3] != pool.D || vd[0] != pool.P || vd[1] != pool.Z || vd[2] != pool.K || pool.K < 1 || pool.N % pool.K ||
      kv_lens.dimensions()[0] != pool.R || cu.dimensions()[0] != pool.R + 1 || block_kv % 64 || split % block_kv ||
      block_q < 1 || threads < 1 || pool.Z < 1)
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes or blocks");
  pool.G = pool.N / pool.K;
  const int64_t D = pool.D, E = pool.E, Ep = round_up(E, W), Bq = block_q, Bc = block_kv;
  float *op = out->typed_data(), *lp = lse->typed_data();
  std::fill(op, op + pool.Q * pool.N * E, 0.f), std::fill(lp, lp + pool.Q * pool.N, -kInf);
  std::vector<PagedBlock> blocks;
  std::vector<PagedTask> tasks;
  int64_t partials;
  paged_plan(pool, Bq, split, left, right, blocks, tasks, partials);
  Scratch part(std::max<int64_t>(partials, 1) * (Ep + 2));  // each split row's acc (Ep), then m and l
  // Row i of a block: its output and lse.
  const auto row_out = [&](const PagedBlock& blk, int64_t i) {
    const int64_t ql = pool.cu[blk.r + 1] - pool.cu[blk.r], at = (pool.cu[blk.r] + (blk.i0 + i) % ql) * pool.N +
                                                                    blk.h * pool.G + (blk.i0 + i) / ql;
    return std::pair<float*, float*>{op + at * E, lp + at};
  };
  std::atomic<int64_t> next{0};
  run(static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(tasks.size(), 1))), [&] {
    Online on(Bq, Bc, Ep);
    Total total(Bq, Ep);
    Scratch qs(Bq * D), kt(Bc * D), vt(Bc * Ep);
    std::vector<int64_t> lo(Bq), hi(Bq);
    for (int64_t n; (n = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
      const PagedTask& task = tasks[n];
      const PagedBlock& blk = blocks[task.block];
      for (int64_t i = 0; i < blk.rows; ++i) scaled(pool.query(blk.r, blk.h, blk.i0 + i), nullptr, 0, D, scale, qs.data + i * D, nullptr);
      paged_intervals(pool, blk, left, right, lo.data(), hi.data());
      on.reset(blk.rows);
      for (int64_t c0 = tile_start(task.s0, blk.first, Bc); c0 < std::min(task.s1, blk.last); c0 += Bc) {
        const int64_t cols = std::min(Bc, blk.last - c0);
        pack_pages(pool, blk.r, blk.h, c0, cols, Bc, Ep, kt.data, vt.data);
        on.tile(blk.rows, cols, c0, D, E, qs.data, kt.data, vt.data, Bc * W, lo.data(), hi.data(), true,
                [](int64_t, float*, int64_t, int64_t) {});
      }
      if (task.slot < 0) {  // the block's one split: finished here, as Forward finishes a row
        total.reset(blk.rows), total.merge(on, blk.rows, E);
        for (int64_t i = 0; i < blk.rows; ++i) {
          const auto [o, l] = row_out(blk, i);
          total.finish(i, E, o, l, nullptr);
        }
        continue;
      }
      for (int64_t i = 0; i < blk.rows; ++i) {
        float* dst = part.data + (task.slot + i) * (Ep + 2);
        std::copy(on.acc.data + i * Ep, on.acc.data + i * Ep + Ep, dst), dst[Ep] = on.m[i], dst[Ep + 1] = on.l[i];
      }
    }
  });
  std::atomic<int64_t> next_block{0};
  run(static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(blocks.size(), 1))), [&] {  // split-KV: merge
    Total total(Bq, Ep);
    for (int64_t n; (n = next_block.fetch_add(1)) < static_cast<int64_t>(blocks.size());) {
      const PagedBlock& blk = blocks[n];
      if (blk.slot < 0) continue;
      const int64_t splits = (blk.last - split_start(blk.first, split) + split - 1) / split;
      total.reset(blk.rows);
      for (int64_t k = 0; k < splits; ++k)
        for (int64_t i = 0; i < blk.rows; ++i) {
          const float* src = part.data + (blk.slot + k * blk.rows + i) * (Ep + 2);
          merge_split(src[Ep], src[Ep + 1], src, E, total.m[i], total.l[i], total.acc.data + i * Ep);
        }
      for (int64_t i = 0; i < blk.rows; ++i) {
        const auto [o, l] = row_out(blk, i);
        total.finish(i, E, o, l, nullptr);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The vector layer this library was built with ("avx512", "avx2", "neon" or "scalar").
extern "C" const char* JattnFusedLayer() { return V::name; }

// The handlers' bindings: float32 buffers in, the row mask's four int32 ones, then out, then the attributes every
// kernel takes.
using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;
#define JATTN_ROWS .Arg<S32>().Arg<S32>().Arg<S32>().Arg<S32>()
#define JATTN_ATTRIBUTES                                                                                      \
  .Attr<int64_t>("length").Attr<int64_t>("q_offset").Attr<int64_t>("kv_offset").Attr<int64_t>("left")        \
      .Attr<int64_t>("right").Attr<float>("scale").Attr<int64_t>("block_q").Attr<int64_t>("block_kv")        \
      .Attr<int64_t>("threads").Attr<int64_t>("row_mask").Attr<int64_t>("group")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedForward, Forward,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>() JATTN_ROWS.Ret<F32>().Ret<F32>().Ret<F32>()
                                  JATTN_ATTRIBUTES.Attr<int64_t>("split"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedPaged, PagedForward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<S32>().Arg<S32>().Arg<S32>()
                                  .Ret<F32>().Ret<F32>().Attr<int64_t>("left").Attr<int64_t>("right").Attr<float>("scale")
                                  .Attr<int64_t>("block_q").Attr<int64_t>("block_kv").Attr<int64_t>("split")
                                  .Attr<int64_t>("threads"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedTangent, Tangent,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  JATTN_ROWS.Ret<F32>().Ret<F32>() JATTN_ATTRIBUTES);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedForwardTangent, ForwardTangent,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  JATTN_ROWS.Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>() JATTN_ATTRIBUTES
                                      .Attr<int64_t>("split"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  JATTN_ROWS.Ret<F32>().Ret<F32>().Ret<F32>() JATTN_ATTRIBUTES);
