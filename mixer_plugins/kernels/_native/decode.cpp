// One decoding step of an SSD-style block for CPU tensors: the short convolution's rolling update, SiLU, the step
// sizes, the SSD state update and its read-out, fused (kernels/decode/native.py calls it; kernels/decode/__init__.py
// states the formulas).
//
// Per batch row: the convolution over every channel (the state shifted in place, the new input appended), then per
// head the state rows s <- exp(A dt) s + (dt x_i) B (A = -exp(A_log)) and y_i = scale * s.C + D_i x_i, then, given z
// and the norm's weight, the gated RMSNorm of the row (kernels/_native/norm.cpp's formula). Rows run in parallel.
// xbc and dt: (batch, width) with contiguous channels (any row stride); conv_state any strides (mamba-ssm allocates
// it as a transposed view); the state contiguous; the weight (channels, kernel) or (channels, 1, kernel).

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace mixer_plugins_native;

template <typename T>
inline T softplus(T v) {
  return v > T(20) ? v : std::log1p(std::exp(v));  // torch's threshold
}

template <typename T>
void decode_impl(const at::Tensor& xbc, at::Tensor& conv_state, const at::Tensor& weight, const T* bias,
                 at::Tensor& state, const T* dt, int64_t dt_stride, const T* A_log, const T* D, bool d_per_channel,
                 double d_scalar, const T* dt_bias, bool softplus_dt, double lo, double hi, double scale,
                 bool silu, bool c_first, const T* z, int64_t z_stride, const T* norm_w, double eps,
                 bool norm_before_gate, at::Tensor& y) {
  const int64_t batch = state.size(0), heads = state.size(1), P = state.size(2), N = state.size(3);
  const int64_t width = xbc.size(1), K = weight.size(-1), sx = xbc.stride(0);
  const int64_t s_b = conv_state.stride(0), s_c = conv_state.stride(1), s_k = conv_state.stride(2);
  const int64_t groups = (width - heads * P) / (2 * N), per_group = heads / groups;
  const int64_t b_off = heads * P + (c_first ? groups * N : 0), c_off = heads * P + (c_first ? 0 : groups * N);
  const T* xp = xbc.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* cs = conv_state.data_ptr<T>();
  T* sp = state.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const T sc = static_cast<T>(scale), dsc = static_cast<T>(d_scalar);
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> u(width), gate(z ? heads * P : 0);
    for (int64_t b = begin; b < end; ++b) {
      const T* xr = xp + b * sx;
      T* cr = cs + b * s_b;
      for (int64_t c = 0; c < width; ++c) {
        T* window = cr + c * s_c;
        const T* w = wp + c * K;
        T acc = bias ? bias[c] : T(0);
        for (int64_t k = 0; k + 1 < K; ++k) {
          window[k * s_k] = window[(k + 1) * s_k];
          acc += w[k] * window[k * s_k];
        }
        window[(K - 1) * s_k] = xr[c];
        acc += w[K - 1] * xr[c];
        u[c] = acc;
      }
      if (silu) silu_inplace(u.data(), width);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / per_group;
        T step = T(1), decay = T(1);
        if (dt) {
          step = dt[b * dt_stride + h] + (dt_bias ? dt_bias[h] : T(0));
          if (softplus_dt) step = softplus(step);
          if (lo > 0.0 || std::isfinite(hi)) step = std::min(std::max(step, static_cast<T>(lo)), static_cast<T>(hi));
        }
        if (A_log) decay = std::exp(-std::exp(A_log[h]) * step);
        const T* __restrict x = u.data() + h * P;
        const T* __restrict Bv = u.data() + b_off + g * N;
        const T* __restrict Cv = u.data() + c_off + g * N;
        T* __restrict out = yp + (b * heads + h) * P;
        for (int64_t i = 0; i < P; ++i) {
          T* __restrict s = sp + ((b * heads + h) * P + i) * N;
          const T coef = step * x[i];
          T acc = 0;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < N; ++j) {
            const T v = s[j] * decay + coef * Bv[j];
            s[j] = v;
            acc += v * Cv[j];
          }
          const T skip = D ? (d_per_channel ? D[h * P + i] : D[h]) : dsc;
          out[i] = sc * acc + skip * x[i];
        }
      }
      if (z) {  // the gated RMSNorm of the row, in the norm kernel's order of operations
        const int64_t W = heads * P;
        T* __restrict row = yp + b * W;
        std::copy(z + b * z_stride, z + b * z_stride + W, gate.begin());
        silu_inplace(gate.data(), W);
        if (!norm_before_gate) {
          for (int64_t j = 0; j < W; ++j) row[j] = row[j] * gate[j];
        }
        T ms = 0;
#pragma omp simd reduction(+ : ms)
        for (int64_t j = 0; j < W; ++j) ms += row[j] * row[j];
        const T r = T(1) / std::sqrt(ms / static_cast<T>(W) + static_cast<T>(eps));
        for (int64_t j = 0; j < W; ++j) {
          row[j] = norm_before_gate ? norm_w[j] * row[j] * r * gate[j] : norm_w[j] * row[j] * r;
        }
      }
    }
  });
}

at::Tensor ssd_decode(const at::Tensor& xbc, at::Tensor conv_state, const at::Tensor& conv_weight,
                      const c10::optional<at::Tensor>& bias, at::Tensor state, const c10::optional<at::Tensor>& dt,
                      const c10::optional<at::Tensor>& A_log, const c10::optional<at::Tensor>& D, double d_scalar,
                      const c10::optional<at::Tensor>& dt_bias, bool dt_softplus, double dt_lo, double dt_hi,
                      double scale, bool silu, bool c_first, const c10::optional<at::Tensor>& z,
                      const c10::optional<at::Tensor>& norm_weight, double eps, bool norm_before_gate) {
  // the weight as (channels, kernel) or nn.Conv1d's depthwise (channels, 1, kernel)
  const at::Tensor weight = conv_weight.contiguous();
  TORCH_CHECK(weight.dim() == 2 || (weight.dim() == 3 && weight.size(1) == 1),
              "native decode: the weight must be (channels, kernel) or (channels, 1, kernel)");
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous() && conv_state.dim() == 3,
              "native decode: the state must be contiguous");
  TORCH_CHECK(xbc.dim() == 2 && xbc.stride(1) == 1, "native decode: xbc must be (batch, width), contiguous rows");
  const auto type = state.scalar_type();
  auto same = [&](const c10::optional<at::Tensor>& t) { return !t.has_value() || t->scalar_type() == type; };
  TORCH_CHECK(xbc.scalar_type() == type && conv_state.scalar_type() == type && weight.scalar_type() == type &&
                  same(bias) && same(dt) && same(A_log) && same(D) && same(dt_bias),
              "native decode: every tensor in the state's dtype");
  TORCH_CHECK(!dt.has_value() || dt->stride(1) == 1, "native decode: dt must have contiguous heads");
  TORCH_CHECK(z.has_value() == norm_weight.has_value() && same(z) && same(norm_weight),
              "native decode: the norm takes z and its weight, in the state's dtype");
  TORCH_CHECK(!z.has_value() || (z->dim() == 2 && z->stride(1) == 1 && z->size(0) == state.size(0) &&
                                  z->size(1) == state.size(1) * state.size(2) &&
                                  norm_weight->numel() == z->size(1)),
              "native decode: z must be (batch, heads * head_dim) with contiguous channels, the norm's weight "
              "(heads * head_dim,)");
  const c10::optional<at::Tensor> norm_w =
      norm_weight.has_value() ? c10::optional<at::Tensor>(norm_weight->contiguous()) : norm_weight;
  const c10::optional<at::Tensor> skip = D.has_value() ? c10::optional<at::Tensor>(D->contiguous()) : D;
  const int64_t heads = state.size(1), P = state.size(2);
  at::Tensor y = at::empty({state.size(0), heads * P}, state.options());
  const bool d_per_channel = skip.has_value() && skip->numel() == heads * P && P > 1;
  AT_DISPATCH_FLOATING_TYPES(type, "ssd_decode", [&] {
    auto ptr = [](const c10::optional<at::Tensor>& t) -> const scalar_t* {
      return t.has_value() ? t->data_ptr<scalar_t>() : nullptr;
    };
    decode_impl<scalar_t>(xbc, conv_state, weight, ptr(bias), state, ptr(dt), dt.has_value() ? dt->stride(0) : 0,
                          ptr(A_log), ptr(skip), d_per_channel, d_scalar, ptr(dt_bias), dt_softplus, dt_lo, dt_hi, scale,
                          silu, c_first, ptr(z), z.has_value() ? z->stride(0) : 0, ptr(norm_w), eps,
                          norm_before_gate, y);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("ssd_decode(Tensor xbc, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor(b!) state, Tensor? dt, "
        "Tensor? A_log, Tensor? D, float d_scalar, Tensor? dt_bias, bool dt_softplus, float dt_lo, float dt_hi, "
        "float scale, bool silu, bool c_first, Tensor? z, Tensor? norm_weight, float eps, bool norm_before_gate) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("ssd_decode", &ssd_decode);
}
