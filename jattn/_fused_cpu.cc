// jattn's fused CPU attention forward and its tangent: XLA FFI custom calls (jattn/_fused_cpu.py builds and loads them).
//
// Dimension key as in jattn/_core.py. q (B, T, D), k (B, S, D), v (B, S, E) float32, contiguous,
// any leading dimensions flattened to B; results out (B, T, E), lse (B, T) and the row max logit
// (B, T), float32. Query row t (position q_offset + t) sees key s (position kv_offset + s) where
//   s < length  and  q_offset + t - left <= kv_offset + s <= q_offset + t + right,
// an interval of keys a row: full attention, causal (right = 0), a sliding window; an unbounded
// side is any value >= 2^62.
//
// One task per (B row, block of `block_q` query rows), taken from a shared counter by `threads`
// std::threads, last query blocks first (the costliest under a causal mask). A task walks the key
// blocks of `block_kv` keys (a multiple of 64) that its rows' intervals touch, with the online
// softmax in the core's cache between the two products:
//   s = (scale q) kᵀ,  m' = max(m, rowmax s),  p = e^(s - m'),  l = l e^(m - m') + rowsum p,
//   acc = acc e^(m - m') + p v,  and at the end  out = acc / l,  lse = m + log l.
// Keys outside a row's interval get p = 0 (never scored); a row with none gives out 0 and lse and
// max -inf. A NaN score makes its row's l, out and lse NaN (and its max logit NaN); a NaN value
// reaches the rows that weigh it (p = 0 included, as in a dense product).
//
// The products are the file's own: a 6 x 64 AVX-512 micro-kernel, kᵀ packed (by gathers) once per
// B row into panels of 64 keys, p v taken in chunks of 128 keys; scratch on 64-byte boundaries.
// AVX-512F only: elsewhere jattn keeps XLA's tiles.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#ifndef __AVX512F__
#error "jattn's fused CPU forward needs AVX-512 (jattn/_fused_cpu.py builds it only where the CPU has it)"
#endif
#include <immintrin.h>

namespace ffi = xla::ffi;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// e^x for x <= 0 (Cephes' polynomial on [-ln2/2, ln2/2], 2^n by scalef; -inf gives 0, NaN stays NaN:
// max_ps returns its second operand when one is NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// row[0:n] = e^(row - m), returning the row's sum; m = -inf (no key yet, none here) sets it to 0.
inline float exp_sum(float* row, int64_t n, float m) {
  if (m == -kInf) {
    std::fill(row, row + n, 0.f);
    return 0.f;
  }
  const __m512 vm = _mm512_set1_ps(m);
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
    _mm512_storeu_ps(row + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), vm));
  _mm512_mask_storeu_ps(row + j, tail, e);
  vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
  return _mm512_reduce_add_ps(vsum);
}

// The max of row[0:n] and m.
inline float row_max(const float* row, int64_t n, float m) {
  __m512 vmax = _mm512_set1_ps(m);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
  vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail, row + j));
  return _mm512_reduce_max_ps(vmax);
}

// C[M x N] (+)= A[M x K] B[K x N], B as panels of 64 columns (panel p at B + p * pstride, rows ldb
// apart). The micro-kernel keeps a R x 64 block of C in 4R registers, streaming A (broadcast) and B.
template <int R>
void ukernel(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
             bool accumulate, const __mmask16* mask, __m512* vmax) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      c[r][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], C + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    const __m512 b0 = _mm512_maskz_loadu_ps(mask[0], b), b1 = _mm512_maskz_loadu_ps(mask[1], b + 16);
    const __m512 b2 = _mm512_maskz_loadu_ps(mask[2], b + 32), b3 = _mm512_maskz_loadu_ps(mask[3], b + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(C + r * ldc + 16 * j, mask[j], c[r][j]);
  if (vmax) {  // each row's running max, 16 lanes wide, over the columns stored
    const __m512 none = _mm512_set1_ps(-kInf);
    for (int r = 0; r < R; ++r) {
      const __m512 m01 = _mm512_max_ps(_mm512_mask_mov_ps(none, mask[0], c[r][0]), _mm512_mask_mov_ps(none, mask[1], c[r][1]));
      const __m512 m23 = _mm512_max_ps(_mm512_mask_mov_ps(none, mask[2], c[r][2]), _mm512_mask_mov_ps(none, mask[3], c[r][3]));
      vmax[r] = _mm512_max_ps(vmax[r], _mm512_max_ps(m01, m23));
    }
  }
}

// C (+)= A B a panel of B at a time, 6 rows of A a micro-kernel call (the panel stays in L1 meanwhile).
void gemm_panels(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t pstride,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate, __m512* vmax = nullptr) {
  for (int64_t j = 0; j < N; j += 64) {
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t n = std::clamp<int64_t>(N - j - 16 * v, 0, 16);
      mask[v] = static_cast<__mmask16>((1u << n) - 1);
    }
    const float* b = B + (j / 64) * pstride;
    int64_t i = 0;
    for (; i + 6 <= M; i += 6)
      ukernel<6>(K, A + i * lda, lda, b, ldb, C + i * ldc + j, ldc, accumulate, mask, vmax ? vmax + i : nullptr);
    __m512* vm = vmax ? vmax + i : nullptr;
    const float* a = A + i * lda;
    float* c = C + i * ldc + j;
    switch (M - i) {
      case 5: ukernel<5>(K, a, lda, b, ldb, c, ldc, accumulate, mask, vm); break;
      case 4: ukernel<4>(K, a, lda, b, ldb, c, ldc, accumulate, mask, vm); break;
      case 3: ukernel<3>(K, a, lda, b, ldb, c, ldc, accumulate, mask, vm); break;
      case 2: ukernel<2>(K, a, lda, b, ldb, c, ldc, accumulate, mask, vm); break;
      case 1: ukernel<1>(K, a, lda, b, ldb, c, ldc, accumulate, mask, vm); break;
    }
  }
}

// C (+)= A B in chunks of kDepth along K, each over all of C's rows: a chunk of B (kDepth rows of 64,
// 32 KiB) stays in L1 while the rows of A stream past it (p v: 4-5% faster than one pass over K).
constexpr int64_t kDepth = 128;
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t pstride, int64_t ldb,
          float* C, int64_t ldc, bool accumulate) {
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    gemm_panels(M, N, std::min(kDepth, K - k0), A + k0, lda, B + k0 * ldb, pstride, ldb, C, ldc, accumulate || k0 > 0);
  }
}

// One panel of kᵀ: keys[0:64] (rows D apart, the first `keys` of them real) as panel[d][0:64], zero past them.
void pack_panel(const float* k, int64_t D, int64_t keys, float* panel) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(D)));
  for (int v = 0; v < 4; ++v) {  // 16 keys a gather
    const int64_t n = std::clamp<int64_t>(keys - 16 * v, 0, 16);
    const __mmask16 real = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t d = 0; d < D; ++d) {
      const float* base = k + 16 * v * D + d;
      _mm512_storeu_ps(panel + d * 64 + 16 * v, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), real, rows, base, 4));
    }
  }
}

// kᵀ of every B row as panels of 64 keys, kt[b][p][d][0:64] (k (B, S, D); zero past `length`; Sp = length
// rounded up to 64), packed by `threads` threads.
template <typename Run>
void pack_all(const Run& run_on, int64_t B, int64_t S, int64_t D, int64_t length, int64_t Sp, const float* k, float* kt) {
  std::atomic<int64_t> next{0};
  run_on([&] {
    for (int64_t b; (b = next.fetch_add(1)) < B;) {
      for (int64_t c0 = 0; c0 < Sp; c0 += 64) pack_panel(k + (b * S + c0) * D, D, length - c0, kt + (b * Sp + c0) * D);
    }
  });
}

// One tile's scores and their tangent, from q and dq rows (already scaled) and the panels of kᵀ and dkᵀ at its
// first key: s = q kᵀ (each row's max into vmax, where given) and dx = dq kᵀ + q dkᵀ.
void tangent_products(int64_t rows, int64_t cols, int64_t D, const float* qs, const float* dqs, const float* ktb,
                      const float* dktb, float* s, float* ds, int64_t Bc, __m512* vmax) {
  gemm_panels(rows, cols, D, qs, D, ktb, 64 * D, 64, s, Bc, false, vmax);
  gemm_panels(rows, cols, D, dqs, D, ktb, 64 * D, 64, ds, Bc, false);
  gemm_panels(rows, cols, D, qs, D, dktb, 64 * D, 64, ds, Bc, true);
}

// n values of q and of dq from (q, dq) + offset, times scale, into qs and dqs.
inline void scaled_pair(const float* q, const float* dq, int64_t offset, int64_t n, float scale, float* qs, float* dqs) {
  for (int64_t i = 0; i < n; ++i) qs[i] = q[offset + i] * scale, dqs[i] = dq[offset + i] * scale;
}

// Scratch of n floats on a 64-byte boundary (whole cache lines: no vector load or store splits one).
struct Scratch {
  explicit Scratch(int64_t n) : data(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64))) {}
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float& operator[](int64_t i) { return data[i]; }
  float* data;
};

template <typename Work>
void run(int threads, const Work& work) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

// q (B, T, D), k (B, S, D), v (B, S, E) with any leading dimensions flattened to B, read from the buffers, and
// what every kernel derives from them: the keys below `length` (at most S), padded to panels of 64 (Sp), the
// query blocks of a B row, and the threads that get a task.
struct Dims {
  int64_t B = 1, T = 0, S = 0, D = 0, E = 0, length = 0, Sp = 0, blocks = 0;
  int n = 1;
};

// The dimensions of q, k, v and the blocks checked; an error names what disagrees.
ffi::Error dims_of(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, int64_t length,
                   int64_t block_q, int64_t block_kv, int64_t threads, Dims& d) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const size_t rank = qd.size();
  if (rank < 2 || kd.size() != rank || vd.size() != rank) return ffi::Error::InvalidArgument("q, k, v: ranks differ");
  d.T = qd[rank - 2], d.D = qd[rank - 1], d.S = kd[rank - 2], d.E = vd[rank - 1];
  for (size_t a = 0; a + 2 < rank; ++a) {
    if (kd[a] != qd[a] || vd[a] != qd[a]) return ffi::Error::InvalidArgument("q, k, v: leading dimensions differ");
    d.B *= qd[a];
  }
  if (kd[rank - 1] != d.D || vd[rank - 2] != d.S || block_kv % 64 || block_q < 1 || threads < 1)
    return ffi::Error::InvalidArgument("fused attention: inconsistent shapes or blocks");
  d.length = std::min(length, d.S), d.Sp = (d.length + 63) / 64 * 64, d.blocks = (d.T + block_q - 1) / block_q;
  d.n = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(d.B * d.blocks, 1)));
  return ffi::Error::Success();
}

// Each of `rows` query rows from r0: its keys [lo, hi) as key indices (below `length`); returns the keys any
// row sees, [first, last) (first >= last: none).
std::pair<int64_t, int64_t> intervals(int64_t r0, int64_t rows, int64_t q_offset, int64_t kv_offset, int64_t left,
                                      int64_t right, int64_t length, int64_t* lo, int64_t* hi) {
  int64_t first = length, last = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = q_offset + r0 + i - kv_offset;  // the row's position among the keys' indices
    lo[i] = std::max<int64_t>(0, left >= (int64_t{1} << 62) ? 0 : at - left);
    hi[i] = std::min<int64_t>(length, right >= (int64_t{1} << 62) ? length : at + right + 1);
    if (lo[i] < hi[i]) first = std::min(first, lo[i]), last = std::max(last, hi[i]);
  }
  return {first, last};
}

ffi::Error Forward(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> mx,
                   int64_t length, int64_t q_offset, int64_t kv_offset, int64_t left, int64_t right, float scale,
                   int64_t block_q, int64_t block_kv, int64_t threads) {
  Dims dims;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, dims); e.failure()) return e;
  const int64_t B = dims.B, T = dims.T, S = dims.S, D = dims.D, E = dims.E, Sp = dims.Sp, blocks = dims.blocks;
  const int64_t Bq = block_q, Bc = block_kv;
  const int n = dims.n;
  length = dims.length;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data(), *mp = mx->typed_data();

  const auto on_threads = [n](const auto& work) { run(n, work); };
  Scratch kt(B * Sp * D);  // kᵀ as panels of 64 keys
  pack_all(on_threads, B, S, D, length, Sp, kp, kt.data);

  std::atomic<int64_t> next{0};
  run(n, [&] {
    Scratch s(Bq * Bc), acc(Bq * E), qs(Bq * D);
    std::vector<float> m(Bq), l(Bq);
    std::vector<__m512> vmax(Bq);  // each row's max over the tile, from the first product
    std::vector<int64_t> lo(Bq), hi(Bq);  // each row's keys, [lo, hi), as key indices
    for (int64_t task; (task = next.fetch_add(1)) < B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      const float* qb = qp + (b * T + r0) * D;
      for (int64_t i = 0; i < rows * D; ++i) qs[i] = qb[i] * scale;  // the scale folded into q, as jattn does
      const auto [first, last] = intervals(r0, rows, q_offset, kv_offset, left, right, length, lo.data(), hi.data());
      std::fill(m.begin(), m.begin() + rows, -kInf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      std::fill(acc.data, acc.data + rows * E, 0.f);
      for (int64_t c0 = first / 64 * 64; c0 < last; c0 += Bc) {
        const int64_t cols = std::min(Bc, last - c0);
        std::fill(vmax.begin(), vmax.begin() + rows, _mm512_set1_ps(-kInf));
        gemm_panels(rows, cols, D, qs.data, D, kt.data + (b * Sp + c0) * D, 64 * D, 64, s.data, Bc, false, vmax.data());
        for (int64_t i = 0; i < rows; ++i) {
          float* row = s.data + i * Bc;
          const int64_t a = std::clamp<int64_t>(lo[i] - c0, 0, cols), z = std::clamp<int64_t>(hi[i] - c0, a, cols);
          std::fill(row, row + a, 0.f);  // keys outside the row's interval weigh 0
          std::fill(row + z, row + cols, 0.f);
          const float m_old = m[i];
          if (a == 0 && z == cols) {  // every key of the tile: the product's own max
            m[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_set1_ps(m_old), vmax[i]));
          } else if (a < z) {
            m[i] = row_max(row + a, z - a, m_old);
          }
          const float sum = a < z ? exp_sum(row + a, z - a, m[i]) : 0.f;
          const float rescale = m[i] == -kInf ? 1.f : std::exp(m_old - m[i]);
          l[i] = l[i] * rescale + sum;
          if (rescale == 1.f) continue;  // the row's max did not move
          for (int64_t e = 0; e < E; ++e) acc[i * E + e] *= rescale;
        }
        gemm(rows, E, cols, s.data, Bc, vp + (b * S + c0) * E, 64, E, acc.data, E, true);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        const float inv = l[i] == 0.f ? 0.f : 1.f / l[i];
        for (int64_t e = 0; e < E; ++e) op[t * E + e] = acc[i * E + e] * inv;
        lp[t] = l[i] == 0.f ? -kInf : m[i] + std::log(l[i]);
        mp[t] = std::isnan(l[i]) ? l[i] : m[i];
      }
    }
  });
  return ffi::Error::Success();
}

// The tangent (forward mode) with the lse known, for tangents dq, dk, dv of q, k, v: per tile
//   p = e^(s - lse),  dx = (dq kᵀ + q dkᵀ)·scale,  A += p dv + (p∘dx) v,  c += rowsum(p∘dx),
// and per row  d lse = c,  d out = A - c·out;  a row with lse -inf (no key) gives 0. Same tasks,
// intervals and products as Forward; kᵀ and dkᵀ packed once per B row.
ffi::Error Tangent(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> dq,
                   ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv, ffi::Buffer<ffi::F32> out,
                   ffi::Buffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> d_out, ffi::ResultBuffer<ffi::F32> d_lse,
                   int64_t length, int64_t q_offset, int64_t kv_offset, int64_t left, int64_t right, float scale,
                   int64_t block_q, int64_t block_kv, int64_t threads) {
  Dims dims;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, dims); e.failure()) return e;
  const int64_t B = dims.B, T = dims.T, S = dims.S, D = dims.D, E = dims.E, Sp = dims.Sp, blocks = dims.blocks;
  const int64_t Bq = block_q, Bc = block_kv;
  const int n = dims.n;
  length = dims.length;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *dqp = dq.typed_data();
  const float *dkp = dk.typed_data(), *dvp = dv.typed_data(), *op = out.typed_data(), *lp = lse.typed_data();
  float *dop = d_out->typed_data(), *dlp = d_lse->typed_data();

  const auto on_threads = [n](const auto& work) { run(n, work); };
  Scratch kt(B * Sp * D), dkt(B * Sp * D);  // kᵀ and dkᵀ as panels of 64 keys
  pack_all(on_threads, B, S, D, length, Sp, kp, kt.data);
  pack_all(on_threads, B, S, D, length, Sp, dkp, dkt.data);

  std::atomic<int64_t> next{0};
  run(n, [&] {
    Scratch s(Bq * Bc), ds(Bq * Bc), acc(Bq * E), qs(Bq * D), dqs(Bq * D);
    std::vector<float> c(Bq);
    std::vector<int64_t> lo(Bq), hi(Bq);
    for (int64_t task; (task = next.fetch_add(1)) < B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      scaled_pair(qp, dqp, (b * T + r0) * D, rows * D, scale, qs.data, dqs.data);
      const auto [first, last] = intervals(r0, rows, q_offset, kv_offset, left, right, length, lo.data(), hi.data());
      std::fill(c.begin(), c.begin() + rows, 0.f);
      std::fill(acc.data, acc.data + rows * E, 0.f);
      for (int64_t c0 = first / 64 * 64; c0 < last; c0 += Bc) {
        const int64_t cols = std::min(Bc, last - c0);
        const float *ktb = kt.data + (b * Sp + c0) * D, *dktb = dkt.data + (b * Sp + c0) * D;
        tangent_products(rows, cols, D, qs.data, dqs.data, ktb, dktb, s.data, ds.data, Bc, nullptr);
        for (int64_t i = 0; i < rows; ++i) {
          float *row = s.data + i * Bc, *drow = ds.data + i * Bc;
          const float l = lp[b * T + r0 + i];
          int64_t a = std::clamp<int64_t>(lo[i] - c0, 0, cols), z = std::clamp<int64_t>(hi[i] - c0, a, cols);
          if (l == -kInf) a = z = 0;  // a row with no key
          std::fill(row, row + a, 0.f), std::fill(row + z, row + cols, 0.f);
          std::fill(drow, drow + a, 0.f), std::fill(drow + z, drow + cols, 0.f);
          const __m512 vl = _mm512_set1_ps(l);
          __m512 vc = _mm512_setzero_ps();
          for (int64_t j = a; j < z; j += 16) {
            const __mmask16 m = static_cast<__mmask16>(z - j >= 16 ? 0xffff : (1u << (z - j)) - 1);
            const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + j), vl);
            const __m512 p = exp16(_mm512_min_ps(_mm512_setzero_ps(), x));  // clamped at 1; NaN stays NaN
            const __m512 pds = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(m, drow + j));
            _mm512_mask_storeu_ps(row + j, m, p);
            _mm512_mask_storeu_ps(drow + j, m, pds);
            vc = _mm512_add_ps(vc, _mm512_maskz_mov_ps(m, pds));
          }
          c[i] += _mm512_reduce_add_ps(vc);
        }
        gemm(rows, E, cols, s.data, Bc, dvp + (b * S + c0) * E, 64, E, acc.data, E, true);
        gemm(rows, E, cols, ds.data, Bc, vp + (b * S + c0) * E, 64, E, acc.data, E, true);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        const bool none = lp[t] == -kInf;
        dlp[t] = none ? 0.f : c[i];
        for (int64_t e = 0; e < E; ++e) dop[t * E + e] = none ? 0.f : acc[i * E + e] - c[i] * op[t * E + e];
      }
    }
  });
  return ffi::Error::Success();
}


// p[0:n] = e^(row - m) (row overwritten with p), drow[0:n] *= p; returns (rowsum p, rowsum p∘drow). m = -inf
// (no key yet) gives zeros.
inline std::pair<float, float> exp_times(float* row, float* drow, int64_t n, float m) {
  if (m == -kInf) {
    std::fill(row, row + n, 0.f), std::fill(drow, drow + n, 0.f);
    return {0.f, 0.f};
  }
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps(), vc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = static_cast<__mmask16>(n - j >= 16 ? 0xffff : (1u << (n - j)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), vm));
    const __m512 pds = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(k, drow + j));
    _mm512_mask_storeu_ps(row + j, k, p);
    _mm512_mask_storeu_ps(drow + j, k, pds);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, p));
    vc = _mm512_add_ps(vc, _mm512_maskz_mov_ps(k, pds));
  }
  return {_mm512_reduce_add_ps(vsum), _mm512_reduce_add_ps(vc)};
}

// One row's online softmax over a tile of the one-pass jvp: keys [a, z) of the tile's `cols` kept, the running
// max m moved by the row's max (`vmax`, the product's, where the row sees the whole tile), p and p∘dx formed,
// l and c (rowsum p∘dx) rescaled and summed; returns the rescale of the row's accumulators (1: unmoved).
inline float online_row(float* row, float* drow, int64_t a, int64_t z, int64_t cols, __m512 vmax, float& m, float& l,
                        float& c) {
  std::fill(row, row + a, 0.f), std::fill(row + z, row + cols, 0.f);
  std::fill(drow, drow + a, 0.f), std::fill(drow + z, drow + cols, 0.f);
  const float m_old = m;
  if (a == 0 && z == cols) {
    m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_set1_ps(m_old), vmax));
  } else if (a < z) {
    m = row_max(row + a, z - a, m_old);
  }
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
                          ffi::Buffer<ffi::F32> dq, ffi::Buffer<ffi::F32> dk, ffi::Buffer<ffi::F32> dv,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                          ffi::ResultBuffer<ffi::F32> mx, ffi::ResultBuffer<ffi::F32> d_out,
                          ffi::ResultBuffer<ffi::F32> d_lse, int64_t length, int64_t q_offset, int64_t kv_offset,
                          int64_t left, int64_t right, float scale, int64_t block_q, int64_t block_kv,
                          int64_t threads) {
  Dims dims;
  if (ffi::Error e = dims_of(q, k, v, length, block_q, block_kv, threads, dims); e.failure()) return e;
  const int64_t B = dims.B, T = dims.T, S = dims.S, D = dims.D, E = dims.E, Sp = dims.Sp, blocks = dims.blocks;
  const int64_t Bq = block_q, Bc = block_kv;
  const int n = dims.n;
  length = dims.length;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *dqp = dq.typed_data();
  const float *dkp = dk.typed_data(), *dvp = dv.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data(), *mp = mx->typed_data();
  float *dop = d_out->typed_data(), *dlp = d_lse->typed_data();

  const auto on_threads = [n](const auto& work) { run(n, work); };
  Scratch kt(B * Sp * D), dkt(B * Sp * D);  // kᵀ and dkᵀ as panels of 64 keys
  pack_all(on_threads, B, S, D, length, Sp, kp, kt.data);
  pack_all(on_threads, B, S, D, length, Sp, dkp, dkt.data);

  std::atomic<int64_t> next{0};
  run(n, [&] {
    Scratch s(Bq * Bc), ds(Bq * Bc), acc(Bq * E), A(Bq * E), qs(Bq * D), dqs(Bq * D);
    std::vector<float> m(Bq), l(Bq), c(Bq);
    std::vector<__m512> vmax(Bq);
    std::vector<int64_t> lo(Bq), hi(Bq);
    for (int64_t task; (task = next.fetch_add(1)) < B * blocks;) {
      const int64_t b = task / blocks, r0 = (blocks - 1 - task % blocks) * Bq, rows = std::min(Bq, T - r0);
      scaled_pair(qp, dqp, (b * T + r0) * D, rows * D, scale, qs.data, dqs.data);
      const auto [first, last] = intervals(r0, rows, q_offset, kv_offset, left, right, length, lo.data(), hi.data());
      std::fill(m.begin(), m.begin() + rows, -kInf);
      std::fill(l.begin(), l.begin() + rows, 0.f), std::fill(c.begin(), c.begin() + rows, 0.f);
      std::fill(acc.data, acc.data + rows * E, 0.f), std::fill(A.data, A.data + rows * E, 0.f);
      for (int64_t c0 = first / 64 * 64; c0 < last; c0 += Bc) {
        const int64_t cols = std::min(Bc, last - c0);
        const float *ktb = kt.data + (b * Sp + c0) * D, *dktb = dkt.data + (b * Sp + c0) * D;
        std::fill(vmax.begin(), vmax.begin() + rows, _mm512_set1_ps(-kInf));
        tangent_products(rows, cols, D, qs.data, dqs.data, ktb, dktb, s.data, ds.data, Bc, vmax.data());
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t a = std::clamp<int64_t>(lo[i] - c0, 0, cols), z = std::clamp<int64_t>(hi[i] - c0, a, cols);
          const float r = online_row(s.data + i * Bc, ds.data + i * Bc, a, z, cols, vmax[i], m[i], l[i], c[i]);
          if (r == 1.f) continue;  // the row's max did not move
          for (int64_t e = 0; e < E; ++e) acc[i * E + e] *= r, A[i * E + e] *= r;
        }
        gemm(rows, E, cols, s.data, Bc, vp + (b * S + c0) * E, 64, E, acc.data, E, true);
        gemm(rows, E, cols, s.data, Bc, dvp + (b * S + c0) * E, 64, E, A.data, E, true);
        gemm(rows, E, cols, ds.data, Bc, vp + (b * S + c0) * E, 64, E, A.data, E, true);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = b * T + r0 + i;
        const float inv = l[i] == 0.f ? 0.f : 1.f / l[i], dl = c[i] * inv;
        for (int64_t e = 0; e < E; ++e) {
          op[t * E + e] = acc[i * E + e] * inv;
          dop[t * E + e] = A[i * E + e] * inv - dl * op[t * E + e];
        }
        lp[t] = l[i] == 0.f ? -kInf : m[i] + std::log(l[i]);
        mp[t] = std::isnan(l[i]) ? l[i] : m[i];
        dlp[t] = dl;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// The handlers' bindings: float32 buffers in, then out, then the attributes every kernel takes.
using F32 = ffi::Buffer<ffi::F32>;
#define JATTN_ATTRIBUTES                                                                                      \
  .Attr<int64_t>("length").Attr<int64_t>("q_offset").Attr<int64_t>("kv_offset").Attr<int64_t>("left")        \
      .Attr<int64_t>("right").Attr<float>("scale").Attr<int64_t>("block_q").Attr<int64_t>("block_kv")        \
      .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedForward, Forward,
                              ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Ret<F32>().Ret<F32>().Ret<F32>()
                                  JATTN_ATTRIBUTES);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedTangent, Tangent,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<F32>().Ret<F32>() JATTN_ATTRIBUTES);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JattnFusedForwardTangent, ForwardTangent,
                              ffi::Ffi::Bind()
                                  .Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>().Arg<F32>()
                                  .Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>().Ret<F32>() JATTN_ATTRIBUTES);
