// Shared pieces of the native CPU kernels (see __init__.py beside this file): the BLAS that libtorch_cpu exports,
// row-major products through it, and a vectorized exp for arguments <= 0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace mixer_plugins_native {

// Row-major C (M x N, ldc) = alpha * op(A) * op(B) + beta * C, through the column-major BLAS (C^T = op(B)^T op(A)^T).
inline void blas(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                 const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                 const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                 const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                 const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char ca = trans_a ? 'T' : 'N', cb = trans_b ? 'T' : 'N';
  const int m = static_cast<int>(N), n = static_cast<int>(M), k = static_cast<int>(K);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  blas(&cb, &ca, &m, &n, &k, &alpha, B, &lb, A, &la, &beta, C, &lc);
}

// s[j] = exp(s[j] - shift) for j < n (every s[j] - shift <= 0: a score minus its row's maximum or log-sum-exp);
// returns their sum. float32: vector code (AVX-512 or AVX2 + FMA, whichever the compiler targets), Cody-Waite
// reduction x = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor polynomial (relative error < 1e-8 before
// rounding) times 2^n, and exactly 0 below -87.3 (and for -inf). float64: std::exp.
#if defined(__AVX512F__)
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

inline float exp_shift_sum(float* s, int64_t n, float shift) {
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), sh));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), sh)));
    _mm512_mask_storeu_ps(s + j, m, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

inline float exp_shift_sum(float* s, int64_t n, float shift) {
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), sh));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}
#else
inline float exp_shift_sum(float* s, int64_t n, float shift) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}
#endif

// SiLU and its derivative, in place over n values: silu(v) = v sigmoid(v); silu_grad: g <- g * silu'(v) with
// silu'(v) = s (1 + v (1 - s)), s = sigmoid(v) = 1 / (1 + e^-|v|) for v >= 0 and e^-|v| / (1 + e^-|v|) below.
template <typename T>
inline T sigmoid_scalar(T v) {
  const T e = std::exp(-std::abs(v));
  const T r = T(1) / (T(1) + e);
  return v >= T(0) ? r : e * r;
}

#if defined(__AVX512F__)
inline __m512 sigmoid(__m512 v) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 pos = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ);
  return _mm512_mask_blend_ps(pos, _mm512_mul_ps(e, r), r);
}
constexpr int kLanes = 16;
inline __m512 vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 vfmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vsub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
inline __m512 vset(float a) { return _mm512_set1_ps(a); }
#define MIXER_PLUGINS_NATIVE_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 sigmoid(__m256 v) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  const __m256 pos = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_blendv_ps(_mm256_mul_ps(e, r), r, pos);
}
constexpr int kLanes = 8;
inline __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 vfmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vsub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
inline __m256 vset(float a) { return _mm256_set1_ps(a); }
#define MIXER_PLUGINS_NATIVE_VECTOR 1
#endif

inline void silu_inplace(float* v, int64_t n) {
  int64_t j = 0;
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
  for (; j + kLanes <= n; j += kLanes) {
    const auto x = vload(v + j);
    vstore(v + j, vmul(x, sigmoid(x)));
  }
#endif
  for (; j < n; ++j) v[j] = v[j] * sigmoid_scalar(v[j]);
}

inline void silu_inplace(double* v, int64_t n) {
  for (int64_t j = 0; j < n; ++j) v[j] = v[j] * sigmoid_scalar(v[j]);
}

// out[j] = grad[j] * silu'(pre[j]) (out may be pre)
inline void silu_grad(const float* pre, const float* grad, float* out, int64_t n) {
  int64_t j = 0;
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
  const auto one = vset(1.0f);
  for (; j + kLanes <= n; j += kLanes) {
    const auto v = vload(pre + j);
    const auto s = sigmoid(v);
    const auto d = vmul(s, vfmadd(v, vsub(one, s), one));
    vstore(out + j, vmul(vload(grad + j), d));
  }
#endif
  for (; j < n; ++j) {
    const float v = pre[j];
    const float s = sigmoid_scalar(v);
    out[j] = grad[j] * (s * (1.0f + v * (1.0f - s)));
  }
}

inline void silu_grad(const double* pre, const double* grad, double* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const double v = pre[j];
    const double s = sigmoid_scalar(v);
    out[j] = grad[j] * (s * (1.0 + v * (1.0 - s)));
  }
}

inline double exp_shift_sum(double* s, int64_t n, double shift) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - shift);
    sum += s[j];
  }
  return sum;
}

template <typename T>
T row_max(const T* s, int64_t n) {
  T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = s[j] > mx ? s[j] : mx;
  return mx;
}

}  // namespace mixer_plugins_native
