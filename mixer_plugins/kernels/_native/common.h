// Shared pieces of the native CPU kernels (see __init__.py beside this file): the BLAS that libtorch_cpu exports,
// row-major products through it, and a vectorized exp for arguments <= 0 in ATen's vector types.
#pragma once

// ATen's vector types (at::vec::Vectorized) take their width from CPU_CAPABILITY_AVX512 / CPU_CAPABILITY_AVX2, which
// torch sets for its own kernels only. Set it from what the compiler targets (setup.py compiles with -march=native
// where the compiler has it), before any ATen header: 16 float lanes with AVX-512, 8 with AVX2 and FMA, else the
// scalar loops below.
#if !defined(CPU_CAPABILITY_AVX512) && !defined(CPU_CAPABILITY_AVX2)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#endif
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define MIXER_PLUGINS_NATIVE_VECTOR 1
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
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
// returns their sum. float32: vector code (16 or 8 lanes, whichever the compiler targets), Cody-Waite reduction
// x = n ln2 + r with |r| <= ln2 / 2, a degree-7 Taylor polynomial (relative error < 1e-8 before rounding) times 2^n
// (built in the exponent bits: n >= -126 here), and exactly 0 below -87.3 (and for -inf). float64: std::exp.
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
using Vec = at::vec::Vectorized<float>;
using VecInt = at::vec::Vectorized<int32_t>;
constexpr int64_t kLanes = Vec::size();
static_assert(kLanes == 16 || kLanes == 8, "ATen's float vectors are 16 (AVX-512) or 8 (AVX2) lanes wide here");

inline Vec exp_nonpositive(const Vec& x) {
  const Vec lo(-87.3f);
  const Vec xc = at::vec::clamp_min(x, lo);
  const Vec n = (xc * Vec(1.44269504088896341f)).round();
  Vec r = at::vec::fnmadd(n, Vec(0.693145751953125f), xc);
  r = at::vec::fnmadd(n, Vec(1.428606765330187045e-06f), r);
  Vec p(1.0f / 5040.0f);
  p = at::vec::fmadd(p, r, Vec(1.0f / 720.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 120.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 24.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 6.0f));
  p = at::vec::fmadd(p, r, Vec(0.5f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  const VecInt bits = (at::vec::convert_to_int_of_same_size(n) + VecInt(127)) << VecInt(23);
  return (p * at::vec::cast<float>(bits)) & (x >= lo);  // 2^n from its exponent bits; 0 below -87.3
}

inline float exp_shift_sum(float* s, int64_t n, float shift) {
  const Vec sh(shift);
  Vec acc(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec e = exp_nonpositive(Vec::loadu(s + j) - sh);
    e.store(s + j);
    acc = acc + e;
  }
  if (j < n) {  // the tail, its missing lanes zero
    const int64_t m = n - j;
    const Vec e = Vec::set(Vec(0.0f), exp_nonpositive(Vec::loadu(s + j, m) - sh), m);
    e.store(s + j, m);
    acc = acc + e;
  }
  return acc.reduce_add();
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

#ifdef MIXER_PLUGINS_NATIVE_VECTOR
inline Vec sigmoid(const Vec& v) {
  const Vec e = exp_nonpositive(Vec(0.0f) - v.abs());
  const Vec r = Vec(1.0f) / (Vec(1.0f) + e);
  return Vec::blendv(e * r, r, v >= Vec(0.0f));
}
#endif

inline void silu_inplace(float* v, int64_t n) {
  int64_t j = 0;
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
  for (; j + kLanes <= n; j += kLanes) {
    const Vec x = Vec::loadu(v + j);
    (x * sigmoid(x)).store(v + j);
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
  const Vec one(1.0f);
  for (; j + kLanes <= n; j += kLanes) {
    const Vec v = Vec::loadu(pre + j);
    const Vec s = sigmoid(v);
    const Vec d = s * at::vec::fmadd(v, one - s, one);
    (Vec::loadu(grad + j) * d).store(out + j);
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
