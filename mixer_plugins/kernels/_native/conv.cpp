// Depthwise short convolution over time with SiLU fused, forward and backward, for CPU tensors.
//
// Compiled at install (setup.py) into mixer_plugins/kernels/_native/_C and registered as
// torch.ops.mixer_plugins_native.conv_forward / conv_backward; the `torch` backend of kernels.depthwise_conv1d
// calls them inside its custom ops (kernels/conv/torch.py owns the argument checks and the autograd).
//
// x (B, L, C) with its channels contiguous (rows may be strided: a slice of the block's in_proj output), weight
// taps-first (K, C), bias (C) or empty. y_t = bias + sum_tap w_tap x_{t + tap - left} (zero outside [0, L)), then
// SiLU. One pass over blocks of rows, parallel over (batch, block): each row is K multiply-adds over its channels
// (vectorized) and, fused, the SiLU; nothing of full size is allocated besides the result. The backward recomputes
// the pre-activation of a block and its halo (K - 1 rows) into a thread-local buffer, forms g = grad * silu'(v)
// there, and from it the input gradient of the block, the weight and bias gradients (per-thread partial sums,
// added at the end).

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace {

using namespace mixer_plugins_native;

constexpr int64_t kRows = 32;  // rows per block (a block of 32 x 2048 channels is 256 KiB of float32)

// out row (C) = bias + sum over the taps whose source row exists of w[tap] * x[t + tap - left]
template <typename T>
inline void conv_row(const T* __restrict x, int64_t row_stride, int64_t L, const T* __restrict w, const T* bias,
                     int64_t K, int64_t C, int64_t left, int64_t t, T* __restrict out) {
  if (bias != nullptr) {
    std::copy(bias, bias + C, out);
  } else {
    std::fill(out, out + C, T(0));
  }
  for (int64_t tap = 0; tap < K; ++tap) {
    const int64_t src = t + tap - left;
    if (src < 0 || src >= L) continue;
    const T* __restrict xr = x + src * row_stride;
    const T* __restrict wr = w + tap * C;
    for (int64_t c = 0; c < C; ++c) out[c] += wr[c] * xr[c];
  }
}

template <typename T>
void forward_impl(const at::Tensor& x, const at::Tensor& w, const T* bias, int64_t left, bool silu, at::Tensor& y) {
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), K = w.size(0);
  const int64_t sb = x.stride(0), sl = x.stride(1);
  const int64_t blocks = (L + kRows - 1) / kRows;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, lo = (item % blocks) * kRows, hi = std::min(lo + kRows, L);
      for (int64_t t = lo; t < hi; ++t) {
        T* out = yp + (b * L + t) * C;
        conv_row<T>(xp + b * sb, sl, L, wp, bias, K, C, left, t, out);
        if (silu) silu_inplace(out, C);
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& w, const T* bias, int64_t left,
                   bool silu, bool with_bias, at::Tensor& gx, at::Tensor& gw, at::Tensor& gb) {
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), K = w.size(0);
  const int64_t right = K - 1 - left;
  const int64_t sb = x.stride(0), sl = x.stride(1);
  const int64_t blocks = (L + kRows - 1) / kRows;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* gp = grad.data_ptr<T>();
  T* gxp = gx.data_ptr<T>();
  const int threads = at::get_num_threads();
  // per thread: the weight gradient (K x C, taps first) and the bias gradient (C)
  std::vector<T> partial(static_cast<size_t>(threads) * (K + 1) * C, T(0));
  std::vector<char> used(threads, 0);
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    const int tid = at::get_thread_num();
    used[tid] = 1;
    T* acc_w = partial.data() + static_cast<size_t>(tid) * (K + 1) * C;
    T* acc_b = acc_w + K * C;
    std::vector<T> buf(silu ? static_cast<size_t>(kRows + K - 1) * C : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, lo = (item % blocks) * kRows, hi = std::min(lo + kRows, L);
      const T* xb = xp + b * sb;
      // g for rows [elo, ehi): the block and the rows its input gradient reads
      const int64_t elo = std::max<int64_t>(lo - right, 0), ehi = std::min(hi + left, L);
      const T* g;        // row t of g at g + (t - goff) * C
      int64_t goff;
      if (silu) {
        for (int64_t t = elo; t < ehi; ++t) {
          T* row = buf.data() + (t - elo) * C;
          conv_row<T>(xb, sl, L, wp, bias, K, C, left, t, row);
          silu_grad(row, gp + (b * L + t) * C, row, C);  // row <- grad * silu'(row)
        }
        g = buf.data();
        goff = elo;
      } else {
        g = gp + b * L * C;
        goff = 0;
      }
      for (int64_t s = lo; s < hi; ++s) {
        // input gradient: gx_s = sum_tap w_tap g_{s - tap + left}
        T* out = gxp + (b * L + s) * C;
        std::fill(out, out + C, T(0));
        for (int64_t tap = 0; tap < K; ++tap) {
          const int64_t t = s - tap + left;
          if (t < 0 || t >= L) continue;
          const T* __restrict gr = g + (t - goff) * C;
          const T* __restrict wr = wp + tap * C;
          for (int64_t c = 0; c < C; ++c) out[c] += wr[c] * gr[c];
        }
      }
      for (int64_t t = lo; t < hi; ++t) {
        // weight and bias gradients: gw_tap += g_t x_{t + tap - left}; gb += g_t
        const T* __restrict gr = g + (t - goff) * C;
        for (int64_t tap = 0; tap < K; ++tap) {
          const int64_t src = t + tap - left;
          if (src < 0 || src >= L) continue;
          const T* __restrict xr = xb + src * sl;
          T* __restrict aw = acc_w + tap * C;
          for (int64_t c = 0; c < C; ++c) aw[c] += gr[c] * xr[c];
        }
        if (with_bias) {
          for (int64_t c = 0; c < C; ++c) acc_b[c] += gr[c];
        }
      }
    }
  });
  T* gwp = gw.data_ptr<T>();  // (C, K)
  T* gbp = with_bias ? gb.data_ptr<T>() : nullptr;
  std::fill(gwp, gwp + C * K, T(0));
  if (gbp != nullptr) std::fill(gbp, gbp + C, T(0));
  for (int tid = 0; tid < threads; ++tid) {
    if (!used[tid]) continue;
    const T* acc_w = partial.data() + static_cast<size_t>(tid) * (K + 1) * C;
    for (int64_t tap = 0; tap < K; ++tap)
      for (int64_t c = 0; c < C; ++c) gwp[c * K + tap] += acc_w[tap * C + c];
    if (gbp != nullptr)
      for (int64_t c = 0; c < C; ++c) gbp[c] += acc_w[K * C + c];
  }
}

void check(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t left) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "native conv: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "native conv: x must be (B, L, C) with contiguous channels");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(2) && w.is_contiguous(), "native conv: weight must be (K, C)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "native conv: float32 or float64, one dtype");
  TORCH_CHECK(left >= 0 && left < w.size(0), "native conv: left must lie in [0, K)");
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(2) && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "native conv: bias must be (C,) of x's dtype");
  }
}

at::Tensor conv_forward(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                        int64_t left, bool silu) {
  check(x, w, bias, left);
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    forward_impl<float>(x, w, bias.has_value() ? bias->data_ptr<float>() : nullptr, left, silu, y);
  } else {
    forward_impl<double>(x, w, bias.has_value() ? bias->data_ptr<double>() : nullptr, left, silu, y);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_backward(const at::Tensor& grad, const at::Tensor& x,
                                                             const at::Tensor& w,
                                                             const c10::optional<at::Tensor>& bias, int64_t left,
                                                             bool silu, bool with_bias) {
  check(x, w, bias, left);
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.is_contiguous() && grad.scalar_type() == x.scalar_type(),
              "native conv: grad must be contiguous, of x's shape and dtype");
  TORCH_CHECK(!silu || !with_bias || bias.has_value(), "native conv: the SiLU backward needs the bias it used");
  at::Tensor gx = at::empty(x.sizes(), x.options());
  at::Tensor gw = at::empty({x.size(2), w.size(0)}, w.options());
  at::Tensor gb = with_bias ? at::empty({x.size(2)}, x.options()) : at::empty({0}, x.options());
  if (x.scalar_type() == at::kFloat) {
    backward_impl<float>(grad, x, w, bias.has_value() ? bias->data_ptr<float>() : nullptr, left, silu, with_bias,
                         gx, gw, gb);
  } else {
    backward_impl<double>(grad, x, w, bias.has_value() ? bias->data_ptr<double>() : nullptr, left, silu,
                          with_bias, gx, gw, gb);
  }
  return {gx, gw, gb};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("conv_forward(Tensor x, Tensor weight, Tensor? bias, int left, bool silu) -> Tensor");
  m.def("conv_backward(Tensor grad, Tensor x, Tensor weight, Tensor? bias, int left, bool silu, bool with_bias) "
        "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("conv_forward", &conv_forward);
  m.impl("conv_backward", &conv_backward);
}
