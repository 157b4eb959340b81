// A sketch of a fused CPU attention forward, for measurement only (python -m bench.fused_cpu).
//
// Full attention (no mask), float32, q (H, T, D), k and v (H, S, D), out (H, T, D), all
// contiguous; H counts batch x heads. One task per (head, block of Br query rows), handed to
// `threads` std::threads; each task walks the keys in blocks of Bc with the online softmax:
//   s = scale q kᵀ, m' = max(m, rowmax s), p = exp(s - m'), l = l e^(m - m') + rowsum p,
//   acc = acc e^(m - m') + p v, and at the end out = acc / l.
// The tile s (Br x Bc) stays in the core's cache between the two products; the row max, the exp
// and the row sum are one pass each over it (AVX-512 where the compiler targets it).
// The products are the sketch's own (a 6 x 64 micro-kernel; kᵀ packed once a head in panels of
// 64 keys, key blocks rounded up to whole panels) or a CBLAS library's, opened at run time:
// OpenBLAS from NumPy's wheel (scipy_cblas_sgemm64_, ILP64) or MKL's mkl_rt (cblas_sgemm, LP64),
// each on one thread.
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using Sgemm32 = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
Sgemm64 blas64 = nullptr;
Sgemm32 blas32 = nullptr;

void sgemm(int ta, int tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (blas32) {
    blas32(kRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    blas64(kRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

#ifdef __AVX512F__
// e^x for x <= 0 (Cephes' polynomial on [-ln2/2, ln2/2], 2^n applied by scalef; -inf gives 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
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

// Row max of row[0:n] folded into m; then row = exp(row - max), returning the row sum.
inline float softmax_row(float* row, int64_t n, float* m) {
  __m512 vmax = _mm512_set1_ps(*m);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
  __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
  vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail, row + j));
  *m = _mm512_reduce_max_ps(vmax);
  __m512 vm = _mm512_set1_ps(*m), vsum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
    _mm512_storeu_ps(row + j, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), vm));
  _mm512_mask_storeu_ps(row + j, tail, e);
  vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, e));
  return _mm512_reduce_add_ps(vsum);
}
#else
inline float softmax_row(float* row, int64_t n, float* m) {
  for (int64_t j = 0; j < n; ++j) *m = std::max(*m, row[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += row[j] = std::exp(row[j] - *m);
  return sum;
}
#endif


// The built-in products: C[M x n] (+)= A[M x K] B[K x n], B given as panels of 64 columns
// (panel p at B + p * pstride, rows ldb apart). The micro-kernel keeps a 6 x 64 block of C in 24
// registers and streams A (broadcast) and B (4 vectors a row) over K.
#ifdef __AVX512F__
template <int R>
void ukernel(int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
             bool accumulate, const __mmask16* mask) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      c[r][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], C + r * ldc + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    __m512 b0 = _mm512_maskz_loadu_ps(mask[0], b), b1 = _mm512_maskz_loadu_ps(mask[1], b + 16);
    __m512 b2 = _mm512_maskz_loadu_ps(mask[2], b + 32), b3 = _mm512_maskz_loadu_ps(mask[3], b + 48);
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_set1_ps(A[r * lda + k]);
      c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(C + r * ldc + 16 * j, mask[j], c[r][j]);
}

void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t pstride,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t j = 0; j < N; j += 64) {
    __mmask16 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t n = std::clamp<int64_t>(N - j - 16 * v, 0, 16);
      mask[v] = static_cast<__mmask16>((1u << n) - 1);
    }
    const float* b = B + (j / 64) * pstride;
    int64_t i = 0;
    for (; i + 6 <= M; i += 6) ukernel<6>(K, A + i * lda, lda, b, ldb, C + i * ldc + j, ldc, accumulate, mask);
    const float* a = A + i * lda;
    float* c = C + i * ldc + j;
    switch (M - i) {
      case 5: ukernel<5>(K, a, lda, b, ldb, c, ldc, accumulate, mask); break;
      case 4: ukernel<4>(K, a, lda, b, ldb, c, ldc, accumulate, mask); break;
      case 3: ukernel<3>(K, a, lda, b, ldb, c, ldc, accumulate, mask); break;
      case 2: ukernel<2>(K, a, lda, b, ldb, c, ldc, accumulate, mask); break;
      case 1: ukernel<1>(K, a, lda, b, ldb, c, ldc, accumulate, mask); break;
    }
  }
}
#else
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t pstride,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      float sum = accumulate ? C[i * ldc + j] : 0.f;
      for (int64_t k = 0; k < K; ++k) sum += A[i * lda + k] * B[(j / 64) * pstride + k * ldb + j % 64];
      C[i * ldc + j] = sum;
    }
}
#endif

}  // namespace

extern "C" int fused_init(const char* library) {  // "" for the built-in products
  blas64 = nullptr;
  blas32 = nullptr;
  if (!*library) return 0;
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (!handle) return 1;
  blas64 = reinterpret_cast<Sgemm64>(dlsym(handle, "scipy_cblas_sgemm64_"));
  if (blas64) {
    auto set_threads = reinterpret_cast<void (*)(int)>(dlsym(handle, "scipy_openblas_set_num_threads64_"));
    if (set_threads) set_threads(1);
    return 0;
  }
  blas32 = reinterpret_cast<Sgemm32>(dlsym(handle, "cblas_sgemm"));  // MKL: MKL_THREADING_LAYER=SEQUENTIAL
  return blas32 ? 0 : 2;
}

extern "C" void fused_forward(const float* q, const float* k, const float* v, float* out, int64_t H,
                              int64_t T, int64_t S, int64_t D, float scale, int64_t Br, int64_t Bc,
                              int threads) {
  const bool builtin = !blas32 && !blas64;
  if (builtin) Bc = (Bc + 63) / 64 * 64;  // key blocks of whole panels
  const int64_t blocks = (T + Br - 1) / Br, Sp = (S + 63) / 64 * 64;
  // The built-in products read kᵀ as panels of 64 keys, kt[h][p][d][0:64], packed once a head.
  std::vector<float> kt(builtin ? H * Sp * D : 0);
  auto run = [threads](auto&& work) {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  };
  std::atomic<int64_t> next{0};
  if (builtin) {
    run([&] {
      for (int64_t h; (h = next.fetch_add(1)) < H;) {
        for (int64_t c = 0; c < Sp; ++c) {
          float* panel = kt.data() + (h * Sp + c / 64 * 64) * D + c % 64;
          for (int64_t d = 0; d < D; ++d) panel[d * 64] = c < S ? k[(h * S + c) * D + d] : 0.f;
        }
      }
    });
    next = 0;
  }
  run([&] {
    std::vector<float> s(Br * Bc), acc(Br * D), m(Br), l(Br), rescale(Br), qs(builtin ? Br * D : 0);
    for (int64_t task; (task = next.fetch_add(1)) < H * blocks;) {
      const int64_t h = task / blocks, r0 = (task % blocks) * Br, rows = std::min(Br, T - r0);
      const float* qh = q + (h * T + r0) * D;
      if (builtin) {  // the scale folded into a copy of the q block
        for (int64_t i = 0; i < rows * D; ++i) qs[i] = qh[i] * scale;
      }
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c0 = 0; c0 < S; c0 += Bc) {
        const int64_t cols = std::min(Bc, S - c0);
        const float* vb = v + (h * S + c0) * D;
        if (builtin) {
          gemm(rows, cols, D, qs.data(), D, kt.data() + (h * Sp + c0) * D, 64 * D, 64, s.data(), Bc, false);
        } else {
          sgemm(kNoTrans, kTrans, rows, cols, D, scale, qh, D, k + (h * S + c0) * D, D, 0.f, s.data(), Bc);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const float m_old = m[i];
          const float sum = softmax_row(s.data() + i * Bc, cols, &m[i]);
          rescale[i] = std::exp(m_old - m[i]);
          l[i] = l[i] * rescale[i] + sum;
        }
        if (builtin) {
          for (int64_t i = 0; i < rows; ++i) {
            if (rescale[i] == 1.f) continue;  // the row's max did not move
            for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= rescale[i];
          }
          gemm(rows, D, cols, s.data(), Bc, vb, 64, D, acc.data(), D, true);
        } else {
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t d = 0; d < D; ++d) acc[i * D + d] *= rescale[i];
          sgemm(kNoTrans, kNoTrans, rows, D, cols, 1.f, s.data(), Bc, vb, D, 1.f, acc.data(), D);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t d = 0; d < D; ++d) out[(h * T + r0 + i) * D + d] = acc[i * D + d] / l[i];
      }
    }
  });
}
