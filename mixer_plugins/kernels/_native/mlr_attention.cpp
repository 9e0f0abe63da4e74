// Fused MLR attention for CPU tensors: flash-style forward and backward, one score width per group of pairs.
//
// Compiled on first use by mixer_plugins/kernels/_native/__init__.py (torch.utils.cpp_extension) and
// registered as torch.ops.mixer_plugins_native.mlr_forward / mlr_backward. Python owns the argument checks (see
// kernels/mlr_attention/native.py); docs/structured_attention.md has the math.
//
// Layout: q, k (B, L, H, D) with the level scales applied, v and the output (B, L, H, P), the log-sum-exp
// (B, L, H); every row is read in place through its leading dimension (H * D or H * P), never transposed.
//
// Traversal. Levels nest, so the levels a pair (i, j) shares are a prefix 0..m. For a set of query rows inside one
// level-d block, the keys in that block but outside the level-(d+1) block (the "child") holding the rows share
// exactly levels 0..d with every one of the rows: one score width W_d = r_0 + ... + r_d and one scale. `walk`
// visits, for each query tile, these (rows, key range, width, scale) pieces from the coarsest level down to the
// finest block, where the causal mask applies. Each piece is cut into key chunks; a chunk's scores come from one
// BLAS product at the piece's own width, its probabilities from a vectorized exp, its values from a second product
// (online softmax across pieces, as in flash attention). The backward walks the same pieces with the row
// log-sum-exp: five products per chunk (scores, dV, dP, dQ, dK).
//
// Products go to the BLAS that libtorch_cpu exports (sgemm_/dgemm_, LP64); inside at::parallel_for they run on
// the calling thread.

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace mixer_plugins_native;

// The level structure, indexed by depth d = 0 .. n: depth 0 is the whole sequence shared by no level (width 0),
// depth d >= 1 is level d - 1 (blocks of size[d] tokens, L for a global level), its pairs' width and scale.
struct Levels {
  int64_t length;
  std::vector<int64_t> size, width;
  std::vector<double> scale;
  int depth() const { return static_cast<int>(size.size()) - 1; }
};

Levels make_levels(int64_t length, const std::vector<int64_t>& widths, const std::vector<int64_t>& sizes,
                   const std::vector<double>& scales) {
  TORCH_CHECK(widths.size() == sizes.size() && sizes.size() == scales.size() && !sizes.empty(),
              "mlr native: one width, size and scale per level");
  Levels lv;
  lv.length = length;
  lv.size.push_back(length);
  lv.width.push_back(0);
  lv.scale.push_back(0.0);
  for (size_t l = 0; l < sizes.size(); ++l) {
    const int64_t s = sizes[l];
    TORCH_CHECK(s >= 0, "mlr native: block sizes must be >= 0 (0 = global)");
    lv.size.push_back(s == 0 || s >= length ? length : s);
    lv.width.push_back(widths[l]);
    lv.scale.push_back(scales[l]);
  }
  for (int d = 1; d <= lv.depth(); ++d)
    TORCH_CHECK(lv.size[d - 1] % lv.size[d] == 0 || lv.size[d - 1] == length,
                "mlr native: block sizes must nest");
  return lv;
}

// Visit every (rows, keys) piece of uniform width for query rows [r0, r1), which lie inside one depth-d block and
// have seen every key outside it. f(r0, r1, k0, k1, width, scale, diagonal): `diagonal` pieces (finest level)
// need the causal mask per entry.
template <typename F>
void walk(const Levels& lv, int64_t r0, int64_t r1, int d, int64_t valid, bool causal, F& f) {
  const int64_t L = lv.length;
  const int64_t ps = lv.size[d];
  const int64_t p0 = (r0 / ps) * ps, p1 = std::min(p0 + ps, L);
  if (d == lv.depth()) {
    int64_t end = std::min(p1, valid);
    if (causal) end = std::min(end, r1);
    if (p0 < end) f(r0, r1, p0, end, lv.width[d], lv.scale[d], causal);
    return;
  }
  const int64_t cs = lv.size[d + 1];
  for (int64_t c0 = (r0 / cs) * cs; c0 < r1; c0 += cs) {
    const int64_t c1 = std::min(c0 + cs, L);
    const int64_t a = std::max(r0, c0), b = std::min(r1, c1);
    const int64_t before = std::min(c0, valid);
    if (p0 < before) f(a, b, p0, before, lv.width[d], lv.scale[d], false);
    if (!causal) {
      const int64_t after = std::min(p1, valid);
      if (c1 < after) f(a, b, c1, after, lv.width[d], lv.scale[d], false);
    }
    walk(lv, a, b, d + 1, valid, causal, f);
  }
}

// Scores of rows [r0, r0 + rn) against keys [k0, k0 + kn) into s (rn x kn): scale * q[:, :w] k[:, :w]^T, and
// -inf above the diagonal when `diagonal`.
template <typename T>
void scores(T* s, const T* q, int64_t ldq, const T* k, int64_t ldk, int64_t r0, int64_t rn, int64_t k0, int64_t kn,
            int64_t w, T scale, bool diagonal) {
  if (w > 0) {
    gemm<T>(false, true, rn, kn, w, scale, q + r0 * ldq, ldq, k + k0 * ldk, ldk, T(0), s, kn);
  } else {
    std::fill(s, s + rn * kn, T(0));
  }
  if (diagonal && k0 + kn - 1 > r0) {
    const T neg = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < rn; ++i) {
      const int64_t first = std::max<int64_t>(r0 + i + 1 - k0, 0);
      for (int64_t j = first; j < kn; ++j) s[i * kn + j] = neg;
    }
  }
}

struct Tiles {
  int64_t q, k;
};

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& valid,
                  const Levels& lv, bool causal, Tiles tiles, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), P = v.size(3);
  const int64_t ldq = H * D, ldv = H * P;
  const int64_t ntiles = (L + tiles.q - 1) / tiles.q;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  at::parallel_for(0, B * H * ntiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sbuf(tiles.q * tiles.k), mrow(tiles.q), lrow(tiles.q);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / ntiles, t = item % ntiles, b = bh / H, h = bh % H;
      const T* Q = qp + b * L * ldq + h * D;
      const T* K = kp + b * L * ldq + h * D;
      const T* V = vp + b * L * ldv + h * P;
      T* O = op + b * L * ldv + h * P;
      const int64_t t0 = t * tiles.q, t1 = std::min(t0 + tiles.q, L);
      std::fill(mrow.begin(), mrow.end(), -std::numeric_limits<T>::infinity());
      std::fill(lrow.begin(), lrow.end(), T(0));
      for (int64_t i = t0; i < t1; ++i) std::fill(O + i * ldv, O + i * ldv + P, T(0));
      auto piece = [&](int64_t r0, int64_t r1, int64_t k0, int64_t k1, int64_t w, double sc, bool diagonal) {
        const int64_t rn = r1 - r0;
        for (int64_t kc = k0; kc < k1; kc += tiles.k) {
          const int64_t kn = std::min(tiles.k, k1 - kc);
          if (diagonal && kc > r1 - 1) break;  // every entry above the diagonal
          T* s = sbuf.data();
          scores<T>(s, Q, ldq, K, ldq, r0, rn, kc, kn, w, static_cast<T>(sc), diagonal);
          for (int64_t i = 0; i < rn; ++i) {
            T* si = s + i * kn;
            const int64_t row = r0 + i - t0;
            const T mx = row_max(si, kn);
            const T m_new = std::max(mrow[row], mx);
            if (m_new == -std::numeric_limits<T>::infinity()) {  // no allowed key yet: nothing to add
              std::fill(si, si + kn, T(0));
              continue;
            }
            const T alpha = mrow[row] == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(mrow[row] - m_new);
            const T sum = exp_shift_sum(si, kn, m_new);
            lrow[row] = lrow[row] * alpha + sum;
            mrow[row] = m_new;
            if (alpha != T(1)) {
              T* oi = O + (r0 + i) * ldv;
#pragma omp simd
              for (int64_t p = 0; p < P; ++p) oi[p] *= alpha;
            }
          }
          gemm<T>(false, false, rn, P, kn, T(1), s, kn, V + kc * ldv, ldv, T(1), O + r0 * ldv, ldv);
        }
      };
      walk(lv, t0, t1, 0, valid[b], causal, piece);
      for (int64_t i = t0; i < t1; ++i) {
        const T l = lrow[i - t0];
        const T inv = l > T(0) ? T(1) / l : T(0);
        T* oi = O + i * ldv;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) oi[p] *= inv;
        lp[(b * L + i) * H + h] = l > T(0) ? mrow[i - t0] + std::log(l) : -std::numeric_limits<T>::infinity();
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const std::vector<int64_t>& valid, const Levels& lv,
                   bool causal, Tiles tiles, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), P = v.size(3);
  const int64_t ldq = H * D, ldv = H * P;
  const int64_t ntiles = (L + tiles.q - 1) / tiles.q;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* gp = dout.data_ptr<T>();
  const T* op = out.data_ptr<T>();
  const T* lp = lse.data_ptr<T>();
  T* dqp = dq.data_ptr<T>();
  T* dkp = dk.data_ptr<T>();
  T* dvp = dv.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> sbuf(tiles.q * tiles.k), pbuf(tiles.q * tiles.k), delta(tiles.q), lrow(tiles.q);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const T* Q = qp + b * L * ldq + h * D;
      const T* K = kp + b * L * ldq + h * D;
      const T* V = vp + b * L * ldv + h * P;
      const T* G = gp + b * L * ldv + h * P;
      const T* O = op + b * L * ldv + h * P;
      T* dQ = dqp + b * L * ldq + h * D;
      T* dK = dkp + b * L * ldq + h * D;
      T* dV = dvp + b * L * ldv + h * P;
      for (int64_t i = 0; i < L; ++i) {
        std::fill(dQ + i * ldq, dQ + i * ldq + D, T(0));
        std::fill(dK + i * ldq, dK + i * ldq + D, T(0));
        std::fill(dV + i * ldv, dV + i * ldv + P, T(0));
      }
      for (int64_t t0 = 0; t0 < L; t0 += tiles.q) {
        const int64_t t1 = std::min(t0 + tiles.q, L);
        for (int64_t i = t0; i < t1; ++i) {
          T acc = 0;
          const T* gi = G + i * ldv;
          const T* oi = O + i * ldv;
#pragma omp simd reduction(+ : acc)
          for (int64_t p = 0; p < P; ++p) acc += gi[p] * oi[p];
          delta[i - t0] = acc;
          lrow[i - t0] = lp[(b * L + i) * H + h];
        }
        auto piece = [&](int64_t r0, int64_t r1, int64_t k0, int64_t k1, int64_t w, double sc, bool diagonal) {
          const int64_t rn = r1 - r0;
          const T scale = static_cast<T>(sc);
          for (int64_t kc = k0; kc < k1; kc += tiles.k) {
            const int64_t kn = std::min(tiles.k, k1 - kc);
            if (diagonal && kc > r1 - 1) break;
            T* s = sbuf.data();
            T* ds = pbuf.data();
            scores<T>(s, Q, ldq, K, ldq, r0, rn, kc, kn, w, scale, diagonal);
            for (int64_t i = 0; i < rn; ++i) {
              const T l = lrow[r0 + i - t0];
              if (l == -std::numeric_limits<T>::infinity()) {
                std::fill(s + i * kn, s + (i + 1) * kn, T(0));
              } else {
                exp_shift_sum(s + i * kn, kn, l);
              }
            }
            // dV[keys] += P^T dO[rows];  dP = dO[rows] V[keys]^T
            gemm<T>(true, false, kn, P, rn, T(1), s, kn, G + r0 * ldv, ldv, T(1), dV + kc * ldv, ldv);
            gemm<T>(false, true, rn, kn, P, T(1), G + r0 * ldv, ldv, V + kc * ldv, ldv, T(0), ds, kn);
            for (int64_t i = 0; i < rn; ++i) {
              const T di = delta[r0 + i - t0];
              T* dsi = ds + i * kn;
              const T* pi = s + i * kn;
#pragma omp simd
              for (int64_t j = 0; j < kn; ++j) dsi[j] = pi[j] * (dsi[j] - di) * scale;
            }
            if (w > 0) {  // dQ[rows, :w] += dS K[keys, :w];  dK[keys, :w] += dS^T Q[rows, :w]
              gemm<T>(false, false, rn, w, kn, T(1), ds, kn, K + kc * ldq, ldq, T(1), dQ + r0 * ldq, ldq);
              gemm<T>(true, false, kn, w, rn, T(1), ds, kn, Q + r0 * ldq, ldq, T(1), dK + kc * ldq, ldq);
            }
          }
        };
        walk(lv, t0, t1, 0, valid[b], causal, piece);
      }
    }
  });
}

std::vector<int64_t> valid_lengths(const at::Tensor& key_len, int64_t batch, int64_t length) {
  std::vector<int64_t> valid(batch, length);
  if (key_len.defined() && key_len.numel() > 0) {
    TORCH_CHECK(key_len.numel() == batch && key_len.scalar_type() == at::kLong,
                "mlr native: key_len must be int64 (batch,)");
    auto acc = key_len.contiguous().cpu();
    const int64_t* p = acc.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(p[b] >= 1 && p[b] <= length, "mlr native: key lengths must lie in [1, L]");
      valid[b] = p[b];
    }
  }
  return valid;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "mlr native: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && v.size(2) == q.size(2),
              "mlr native: q, k (B, L, H, D) and v (B, L, H, P)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
              "mlr native: float32 or float64 inputs of one dtype");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "mlr native: contiguous inputs");
}

std::tuple<at::Tensor, at::Tensor> mlr_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const c10::optional<at::Tensor>& key_len, at::IntArrayRef widths,
                                               at::IntArrayRef sizes, at::ArrayRef<double> scales, bool causal,
                                               int64_t tile_q, int64_t tile_k) {
  check_inputs(q, k, v);
  TORCH_CHECK(tile_q > 0 && tile_k > 0, "mlr native: tiles must be positive");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), P = v.size(3);
  const Levels lv = make_levels(L, widths.vec(), sizes.vec(), scales.vec());
  TORCH_CHECK(lv.width.back() <= q.size(3), "mlr native: the widths exceed the head width");
  const auto valid = valid_lengths(key_len.has_value() ? *key_len : at::Tensor(), B, L);
  at::Tensor out = at::empty({B, L, H, P}, q.options());
  at::Tensor lse = at::empty({B, L, H}, q.options());
  if (q.scalar_type() == at::kFloat) {
    forward_impl<float>(q, k, v, valid, lv, causal, {tile_q, tile_k}, out, lse);
  } else {
    forward_impl<double>(q, k, v, valid, lv, causal, {tile_q, tile_k}, out, lse);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> mlr_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const c10::optional<at::Tensor>& key_len, at::IntArrayRef widths, at::IntArrayRef sizes,
    at::ArrayRef<double> scales, bool causal, int64_t tile_q, int64_t tile_k) {
  check_inputs(q, k, v);
  TORCH_CHECK(tile_q > 0 && tile_k > 0, "mlr native: tiles must be positive");
  TORCH_CHECK(dout.sizes() == v.sizes() && out.sizes() == v.sizes() && dout.is_contiguous() && out.is_contiguous() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "mlr native: dout and out must be contiguous (B, L, H, P) of q's dtype");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2) &&
                  lse.is_contiguous() && lse.scalar_type() == q.scalar_type(),
              "mlr native: lse must be contiguous (B, L, H) of q's dtype");
  const int64_t B = q.size(0), L = q.size(1);
  const Levels lv = make_levels(L, widths.vec(), sizes.vec(), scales.vec());
  const auto valid = valid_lengths(key_len.has_value() ? *key_len : at::Tensor(), B, L);
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (q.scalar_type() == at::kFloat) {
    backward_impl<float>(dout, q, k, v, out, lse, valid, lv, causal, {tile_q, tile_k}, dq, dk, dv);
  } else {
    backward_impl<double>(dout, q, k, v, out, lse, valid, lv, causal, {tile_q, tile_k}, dq, dk, dv);
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("mlr_forward(Tensor q, Tensor k, Tensor v, Tensor? key_len, int[] widths, int[] sizes, float[] scales, "
        "bool causal, int tile_q, int tile_k) -> (Tensor, Tensor)");
  m.def("mlr_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_len, "
        "int[] widths, int[] sizes, float[] scales, bool causal, int tile_q, int tile_k) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("mlr_forward", &mlr_forward);
  m.impl("mlr_backward", &mlr_backward);
}
