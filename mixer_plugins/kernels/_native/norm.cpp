// Gated RMSNorm over the last dimension, forward and backward, for CPU tensors (the blocks' output norm).
//
// Compiled at install (setup.py) into mixer_plugins/kernels/_native/_C and registered as
// torch.ops.mixer_plugins_native.norm_forward / norm_backward; the `torch` backend of kernels.gated_rmsnorm calls
// them from its autograd Function (kernels/norm/torch.py owns the checks).
//
// norm_before_gate:  out = w * y r(y) * silu(z)            r(v) = 1 / sqrt(mean(v^2) + eps)
// otherwise:         out = w * v r(v),  v = y * silu(z)    (Mamba-2's order)
// Rows are independent: one pass per row, parallel over rows, the row's silu(z) and silu'(z) in a thread-local
// buffer; the gain gradient is summed per thread and added at the end. y, z: (rows, width) with contiguous rows
// (any row stride); outputs contiguous.

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace mixer_plugins_native;

// s = silu(z), d = silu'(z) = sig + s (1 - sig)
inline void silu_and_slope(const float* z, float* s, float* d, int64_t n) {
  int64_t j = 0;
#ifdef MIXER_PLUGINS_NATIVE_VECTOR
  const Vec one(1.0f);
  for (; j + kLanes <= n; j += kLanes) {
    const Vec v = Vec::loadu(z + j);
    const Vec sig = sigmoid(v);
    const Vec sv = v * sig;
    sv.store(s + j);
    at::vec::fmadd(sv, one - sig, sig).store(d + j);
  }
#endif
  for (; j < n; ++j) {
    const float sig = sigmoid_scalar(z[j]);
    s[j] = z[j] * sig;
    d[j] = sig + s[j] * (1.0f - sig);
  }
}

inline void silu_and_slope(const double* z, double* s, double* d, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const double sig = sigmoid_scalar(z[j]);
    s[j] = z[j] * sig;
    d[j] = sig + s[j] * (1.0 - sig);
  }
}

template <typename T>
inline T mean_square(const T* v, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < n; ++j) acc += v[j] * v[j];
  return acc / static_cast<T>(n);
}

template <typename T>
void forward_impl(const at::Tensor& y, const at::Tensor& z, const at::Tensor& w, double eps, bool before,
                  at::Tensor& out) {
  const int64_t rows = y.size(0), W = y.size(1), sy = y.stride(0), sz = z.stride(0);
  const T* yp = y.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> s(W), d(W);
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict yr = yp + i * sy;
      T* __restrict o = op + i * W;
      silu_and_slope(zp + i * sz, s.data(), d.data(), W);
      const T* __restrict sr = s.data();
      if (before) {
        const T r = T(1) / std::sqrt(mean_square(yr, W) + static_cast<T>(eps));
        for (int64_t j = 0; j < W; ++j) o[j] = wp[j] * yr[j] * r * sr[j];
      } else {
        for (int64_t j = 0; j < W; ++j) o[j] = yr[j] * sr[j];
        const T r = T(1) / std::sqrt(mean_square(o, W) + static_cast<T>(eps));
        for (int64_t j = 0; j < W; ++j) o[j] = wp[j] * o[j] * r;
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& z, const at::Tensor& w, double eps,
                   bool before, at::Tensor& gy, at::Tensor& gz, at::Tensor& gw) {
  const int64_t rows = y.size(0), W = y.size(1), sy = y.stride(0), sz = z.stride(0);
  const T* yp = y.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* gp = grad.data_ptr<T>();
  T* gyp = gy.data_ptr<T>();
  T* gzp = gz.data_ptr<T>();
  const int threads = at::get_num_threads();
  std::vector<T> partial(static_cast<size_t>(threads) * W, T(0));
  std::vector<char> used(threads, 0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    used[tid] = 1;
    T* __restrict acc = partial.data() + static_cast<size_t>(tid) * W;
    std::vector<T> s(W), d(W), n(W), dn(W);
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict yr = yp + i * sy;
      const T* __restrict g = gp + i * W;
      T* __restrict dy = gyp + i * W;
      T* __restrict dz = gzp + i * W;
      silu_and_slope(zp + i * sz, s.data(), d.data(), W);
      const T* __restrict sr = s.data();
      const T* __restrict dr = d.data();
      T* __restrict nr = n.data();
      T* __restrict dnr = dn.data();
      T r;
      if (before) {
        r = T(1) / std::sqrt(mean_square(yr, W) + static_cast<T>(eps));
        for (int64_t j = 0; j < W; ++j) nr[j] = yr[j] * r;
      } else {
        for (int64_t j = 0; j < W; ++j) nr[j] = yr[j] * sr[j];
        r = T(1) / std::sqrt(mean_square(nr, W) + static_cast<T>(eps));
        for (int64_t j = 0; j < W; ++j) nr[j] *= r;
      }
      T m = 0;  // mean(dn n)
      if (before) {  // dn = g w s; gain += g s n; dz = g w n silu'(z)
        for (int64_t j = 0; j < W; ++j) {
          const T gw_j = g[j] * wp[j];
          dnr[j] = gw_j * sr[j];
          acc[j] += g[j] * sr[j] * nr[j];
          dz[j] = gw_j * nr[j] * dr[j];
        }
      } else {  // dn = g w; gain += g n
        for (int64_t j = 0; j < W; ++j) {
          dnr[j] = g[j] * wp[j];
          acc[j] += g[j] * nr[j];
        }
      }
#pragma omp simd reduction(+ : m)
      for (int64_t j = 0; j < W; ++j) m += dnr[j] * nr[j];
      m /= static_cast<T>(W);
      if (before) {  // dy = r (dn - n m)
        for (int64_t j = 0; j < W; ++j) dy[j] = r * (dnr[j] - nr[j] * m);
      } else {  // dv = r (dn - n m); dy = dv s; dz = dv y silu'(z)
        for (int64_t j = 0; j < W; ++j) {
          const T dv = r * (dnr[j] - nr[j] * m);
          dy[j] = dv * sr[j];
          dz[j] = dv * yr[j] * dr[j];
        }
      }
    }
  });
  T* gwp = gw.data_ptr<T>();
  std::fill(gwp, gwp + W, T(0));
  for (int tid = 0; tid < threads; ++tid) {
    if (!used[tid]) continue;
    const T* acc = partial.data() + static_cast<size_t>(tid) * W;
    for (int64_t j = 0; j < W; ++j) gwp[j] += acc[j];
  }
}

void check(const at::Tensor& y, const at::Tensor& z, const at::Tensor& w) {
  TORCH_CHECK(y.device().is_cpu() && z.device().is_cpu() && w.device().is_cpu(), "native norm: CPU tensors only");
  TORCH_CHECK(y.dim() == 2 && z.sizes() == y.sizes() && y.stride(1) == 1 && z.stride(1) == 1,
              "native norm: y and z must be (rows, width) with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == y.size(1) && w.is_contiguous(), "native norm: weight must be (width,)");
  TORCH_CHECK(y.scalar_type() == z.scalar_type() && y.scalar_type() == w.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kDouble),
              "native norm: float32 or float64, one dtype");
}

at::Tensor norm_forward(const at::Tensor& y, const at::Tensor& z, const at::Tensor& w, double eps, bool before) {
  check(y, z, w);
  at::Tensor out = at::empty(y.sizes(), y.options());
  if (y.scalar_type() == at::kFloat) {
    forward_impl<float>(y, z, w, eps, before, out);
  } else {
    forward_impl<double>(y, z, w, eps, before, out);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(const at::Tensor& grad, const at::Tensor& y,
                                                             const at::Tensor& z, const at::Tensor& w, double eps,
                                                             bool before) {
  check(y, z, w);
  TORCH_CHECK(grad.sizes() == y.sizes() && grad.is_contiguous() && grad.scalar_type() == y.scalar_type(),
              "native norm: grad must be contiguous, of y's shape and dtype");
  at::Tensor gy = at::empty(y.sizes(), y.options());
  at::Tensor gz = at::empty(z.sizes(), z.options());
  at::Tensor gw = at::empty({y.size(1)}, w.options());
  if (y.scalar_type() == at::kFloat) {
    backward_impl<float>(grad, y, z, w, eps, before, gy, gz, gw);
  } else {
    backward_impl<double>(grad, y, z, w, eps, before, gy, gz, gw);
  }
  return {gy, gz, gw};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("norm_forward(Tensor y, Tensor z, Tensor weight, float eps, bool norm_before_gate) -> Tensor");
  m.def("norm_backward(Tensor grad, Tensor y, Tensor z, Tensor weight, float eps, bool norm_before_gate) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("norm_forward", &norm_forward);
  m.impl("norm_backward", &norm_backward);
}
