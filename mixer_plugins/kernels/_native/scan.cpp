// The chunked (bi)directional scan, forward and backward, for CPU tensors: the SSD algorithm chunk by chunk, with
// the per-chunk work in small thread-local buffers and the states in per-call workspaces.
//
// Compiled by mixer_plugins/kernels/_native/__init__.py and registered as torch.ops.mixer_plugins_native.scan_forward
// and scan_backward; kernels/scan/native.py calls them and adds the diagonal term.
//
// One direction, in its own order (the backward direction is the forward algorithm on the time-reversed rows;
// rows are gathered into contiguous chunk buffers, so reversal costs nothing). Per chunk of n rows, with
// a_i = dt_i A, p the inclusive cumulative sum of a within the chunk, q_i = p_{i-1} (the exclusive sum, with shift;
// taken from p by a shift, never as p_i - a_i, so the nearest pair keeps decay 1 exactly) or p_i, and
// C~_i = C_{i-1} (shift; zero before the first row) or C_i:
//   y_i += sum_{j <= i (j < i with shift)} (C~_i . B_j) exp(q_i - p_j) dt_j x_j      (one Q x Q product)
//   y_i += exp(q_i) C~_i H                                                         (the entering state H, N x P)
//   H   <- exp(p_last) H + sum_j exp(p_last - p_j) dt_j B_j x_j^T
//
// Two forms compute this. The exact form forms every decay exp(q_i - p_j) itself, per (batch, head). The factored
// form (below) shares one product per (batch, group, chunk) between the group's heads, with decays split into
// factors that stay within the dtype's range only while each chunk's decays do (FACTORED_HALF_RANGE): each call
// checks that first and takes the factored form where every chunk allows it, else the exact one. Excluded pairs are
// zero by selection, never a product with zero, so a non-finite dt, B or C reaches only the rows that see its token.

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace mixer_plugins_native;

// fn(i, i + 1) for every i < total, the items taken one at a time from a shared counter by each thread: when
// another process deschedules one of our threads, the others take its share instead of waiting for it.
template <typename F>
void parallel_dynamic(int64_t total, const F& fn) {
  if (total <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) fn(i, i + 1);
  });
}

// s[j] = exp(s[j]) for j < n. `nonpositive`: every s[j] is known to be <= 0 and finite, so the vector exp (made for
// that range) runs; otherwise std::exp, which gives inf, 0 and NaN where they belong.
template <typename T>
inline void exp_inplace(T* s, int64_t n, bool nonpositive) {
  if (nonpositive) {
    exp_shift_sum(s, n, T(0));  // its sum unused
  } else {
    for (int64_t j = 0; j < n; ++j) s[j] = std::exp(s[j]);
  }
}

struct Shape {
  int64_t B, L, H, P, G, N, Q, rep;
  int64_t xb, xl;  // x's batch and row strides (its heads and channels are dense: x need not be contiguous)
};

// Row i (direction order) of a direction's sequence, in time order.
inline int64_t time_row(const Shape& s, bool reverse, int64_t i) { return reverse ? s.L - 1 - i : i; }

// One direction's inputs for one (batch, head), read in the direction's order.
template <typename T>
struct DirIn {
  const T* dt;  // (B, L, H)
  T A;
  const T* Bm;  // (B, L, G, N)
  const T* Cm;
  bool reverse;
};

template <typename T>
struct Scratch {
  std::vector<T> X, Bc, Cc, CB, M, E, dM, dY, dX, R, dC, dB, Fx, dFx, a, p, q, dt, dq, dp, ddt, F;
  void size(const Shape& s) {  // every entry read is written first: no zeroing
    const size_t Q = s.Q, P = s.P, N = s.N;
    for (auto* v : {&X, &dY, &dX, &R, &Fx, &dFx}) v->resize(Q * P);
    for (auto* v : {&Bc, &Cc, &dC, &dB}) v->resize(Q * N);
    for (auto* v : {&CB, &M, &E, &dM}) v->resize(Q * Q);
    for (auto* v : {&a, &p, &q, &dt, &dq, &dp, &ddt, &F}) v->resize(Q);
  }
};

// Gathers chunk rows [i0, i0 + n) (direction order) of head h of batch b and computes its decays; fills
// X (n x P), Bc, Cc (shifted C) (n x N), dt, a, p, q, CB (n x n) and M (n x n): the masked intra-chunk weights,
// E the masked decays exp(q_i - p_j).
template <typename T>
void load_chunk(const Shape& s, const T* x, const DirIn<T>& d, bool shift, int64_t b, int64_t h, int64_t i0,
                int64_t n, Scratch<T>& w) {
  const int64_t g = h / s.rep;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, d.reverse, i0 + r);
    std::copy_n(x + b * s.xb + t * s.xl + h * s.P, s.P, w.X.data() + r * s.P);
    std::copy_n(d.Bm + ((b * s.L + t) * s.G + g) * s.N, s.N, w.Bc.data() + r * s.N);
    const int64_t ci = shift ? i0 + r - 1 : i0 + r;
    if (ci < 0) {
      std::fill_n(w.Cc.data() + r * s.N, s.N, T(0));
    } else {
      std::copy_n(d.Cm + ((b * s.L + time_row(s, d.reverse, ci)) * s.G + g) * s.N, s.N, w.Cc.data() + r * s.N);
    }
    w.dt[r] = d.dt[(b * s.L + t) * s.H + h];
    w.a[r] = w.dt[r] * d.A;
  }
  T acc = 0;
  bool decaying = true;  // every a_r <= 0 and finite: every exponent below is <= 0
  for (int64_t r = 0; r < n; ++r) {
    decaying = decaying && std::isfinite(w.a[r]) && w.a[r] <= T(0);
    w.q[r] = acc;  // the exclusive sum, used with shift
    acc += w.a[r];
    w.p[r] = acc;
    if (!shift) w.q[r] = acc;
  }
  gemm<T>(false, true, n, n, s.N, T(1), w.Cc.data(), s.N, w.Bc.data(), s.N, T(0), w.CB.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    T* e = w.E.data() + i * n;
    const int64_t allowed = shift ? i : i + 1;  // columns j < allowed
    for (int64_t j = 0; j < allowed; ++j) e[j] = w.q[i] - w.p[j];
    exp_inplace(e, allowed, decaying);
    for (int64_t j = allowed; j < n; ++j) e[j] = T(0);
    const T* cb = w.CB.data() + i * n;
    T* m = w.M.data() + i * n;
    for (int64_t j = 0; j < allowed; ++j) m[j] = cb[j] * e[j] * w.dt[j];
    for (int64_t j = allowed; j < n; ++j) m[j] = T(0);  // by selection: a non-finite C.B or dt stays out
  }
}

// Forward of one direction for (b, h): adds into y (B, L, H, P); H0 (N x P) the entering state or null; final
// (N x P) the state after the last chunk or null.
template <typename T>
void direction_forward(const Shape& s, const T* x, const DirIn<T>& d, bool shift, int64_t b, int64_t h,
                       const T* H0, T* y, T* final, Scratch<T>& w, std::vector<T>& Hs) {
  const int64_t nchunks = (s.L + s.Q - 1) / s.Q;
  std::vector<T>& Hc = Hs;  // N x P
  Hc.assign(s.N * s.P, T(0));
  bool zero = true;
  if (H0 != nullptr) {
    std::copy_n(H0, s.N * s.P, Hc.data());
    zero = false;
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t i0 = c * s.Q, n = std::min(s.Q, s.L - i0);
    load_chunk(s, x, d, shift, b, h, i0, n, w);
    // Y = M X (+ exp(q) C~ H)
    gemm<T>(false, false, n, s.P, n, T(1), w.M.data(), n, w.X.data(), s.P, T(0), w.dY.data(), s.P);
    if (!zero) {
      gemm<T>(false, false, n, s.P, s.N, T(1), w.Cc.data(), s.N, Hc.data(), s.P, T(0), w.R.data(), s.P);
      for (int64_t i = 0; i < n; ++i) {
        const T eq = std::exp(w.q[i]);
        T* yi = w.dY.data() + i * s.P;
        const T* ri = w.R.data() + i * s.P;
        for (int64_t k = 0; k < s.P; ++k) yi[k] += eq * ri[k];
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      T* out = y + ((b * s.L + time_row(s, d.reverse, i0 + i)) * s.H + h) * s.P;
      const T* yi = w.dY.data() + i * s.P;
      for (int64_t k = 0; k < s.P; ++k) out[k] += yi[k];
    }
    if (c + 1 < nchunks || final != nullptr) {
      const T last = w.p[n - 1];
      const T el = std::exp(last);
      for (int64_t j = 0; j < n; ++j) {
        const T f = std::exp(last - w.p[j]) * w.dt[j];
        T* fx = w.Fx.data() + j * s.P;
        const T* xj = w.X.data() + j * s.P;
        for (int64_t k = 0; k < s.P; ++k) fx[k] = f * xj[k];
      }
      for (auto& v : Hc) v *= el;
      gemm<T>(true, false, s.N, s.P, n, T(1), w.Bc.data(), s.N, w.Fx.data(), s.P, T(1), Hc.data(), s.P);
      zero = false;
    }
  }
  if (final != nullptr) std::copy_n(Hc.data(), s.N * s.P, final);
}

// The entering state of every chunk of one direction for (b, h): states (nchunks x N x P) from H0 (N x P; zero
// when null), nonzero[c] set where chunk c's entering state may be nonzero.
template <typename T>
void entering_states(const Shape& s, const T* x, const DirIn<T>& d, int64_t b, int64_t h, const T* H0,
                     Scratch<T>& w, std::vector<T>& states, std::vector<char>& nonzero) {
  const int64_t nchunks = (s.L + s.Q - 1) / s.Q;
  const int64_t NP = s.N * s.P;
  states.assign(static_cast<size_t>(nchunks) * NP, T(0));
  nonzero.assign(nchunks, 0);
  if (H0 != nullptr) {
    std::copy_n(H0, NP, states.data());
    nonzero[0] = 1;
  }
  for (int64_t c = 0; c + 1 < nchunks; ++c) {
    const int64_t i0 = c * s.Q, n = s.Q;
    const int64_t g = h / s.rep;
    T* next = states.data() + (c + 1) * NP;
    const T* cur = states.data() + c * NP;
    T acc = 0;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = time_row(s, d.reverse, i0 + r);
      w.dt[r] = d.dt[(b * s.L + t) * s.H + h];
      acc += w.dt[r] * d.A;
      w.p[r] = acc;
      std::copy_n(x + b * s.xb + t * s.xl + h * s.P, s.P, w.X.data() + r * s.P);
      std::copy_n(d.Bm + ((b * s.L + t) * s.G + g) * s.N, s.N, w.Bc.data() + r * s.N);
    }
    const T last = w.p[n - 1], el = std::exp(last);
    for (int64_t j = 0; j < n; ++j) {
      const T f = std::exp(last - w.p[j]) * w.dt[j];
      for (int64_t k = 0; k < s.P; ++k) w.Fx[j * s.P + k] = f * w.X[j * s.P + k];
    }
    for (int64_t k = 0; k < NP; ++k) next[k] = el * cur[k];
    gemm<T>(true, false, s.N, s.P, n, T(1), w.Bc.data(), s.N, w.Fx.data(), s.P, T(1), next, s.P);
    nonzero[c + 1] = 1;
  }
}

// (1) of a chunk's backward, y = M X (w loaded, w.dY the chunk's dy, w.dq, w.dp, w.ddt zero): dM = dY X^T
// (masked), dX = M^T dY; dCB_ij = dM_ij E_ij dt_j, s_ij = dM_ij M_ij: dq_i += sum_j s_ij, dp_j -= sum_i s_ij,
// ddt_j += sum_i dM_ij CB_ij E_ij; dC~ = dCB B, dB = dCB^T C~.
template <typename T>
void intra_chunk_grads(const Shape& s, bool shift, int64_t n, Scratch<T>& w) {
  T* dm = w.dM.data();
  gemm<T>(false, true, n, n, s.P, T(1), w.dY.data(), s.P, w.X.data(), s.P, T(0), dm, n);
  gemm<T>(true, false, n, s.P, n, T(1), w.M.data(), n, w.dY.data(), s.P, T(0), w.dX.data(), s.P);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t allowed = shift ? i : i + 1;
    T* dmi = dm + i * n;
    const T* mi = w.M.data() + i * n;
    const T* ei = w.E.data() + i * n;
    const T* cbi = w.CB.data() + i * n;
    T rowsum = 0;
    for (int64_t j = 0; j < allowed; ++j) {
      const T sij = dmi[j] * mi[j];
      rowsum += sij;
      w.dp[j] -= sij;
      w.ddt[j] += dmi[j] * cbi[j] * ei[j];
      dmi[j] = dmi[j] * ei[j] * w.dt[j];
    }
    for (int64_t j = allowed; j < n; ++j) dmi[j] = T(0);
    w.dq[i] += rowsum;
  }
  gemm<T>(false, false, n, s.N, n, T(1), dm, n, w.Bc.data(), s.N, T(0), w.dC.data(), s.N);
  gemm<T>(true, false, n, s.N, n, T(1), dm, n, w.Cc.data(), s.N, T(0), w.dB.data(), s.N);
}

// (2) of a chunk's backward, y_i += exp(q_i) C~_i H_c (H_c N x P): dq_i += exp(q_i) (C~_i H_c) . dY_i,
// dC~ += dR H_c^T and dH_c = C~^T dR with dR_i = exp(q_i) dY_i.
template <typename T>
void readout_grads(const Shape& s, int64_t n, const T* Hc, Scratch<T>& w, std::vector<T>& dHc) {
  gemm<T>(false, false, n, s.P, s.N, T(1), w.Cc.data(), s.N, Hc, s.P, T(0), w.R.data(), s.P);
  for (int64_t i = 0; i < n; ++i) {
    const T eq = std::exp(w.q[i]);
    T dot = 0;
    T* dri = w.Fx.data() + i * s.P;  // dR_i (Fx is free until (3))
    for (int64_t k = 0; k < s.P; ++k) {
      dot += w.R[i * s.P + k] * w.dY[i * s.P + k];
      dri[k] = eq * w.dY[i * s.P + k];
    }
    w.dq[i] += eq * dot;
  }
  gemm<T>(false, true, n, s.N, s.P, T(1), w.Fx.data(), s.P, Hc, s.P, T(1), w.dC.data(), s.N);
  gemm<T>(true, false, s.N, s.P, n, T(1), w.Cc.data(), s.N, w.Fx.data(), s.P, T(0), dHc.data(), s.P);
}

// (3) of a chunk's backward, H_{c+1} = exp(p_last) H_c + B^T (F x) with F_j = exp(p_last - p_j) dt_j, given dH
// (N x P), the gradient reaching H_{c+1}: d(Fx) = B dH, dB += (Fx) dH^T, then dX, ddt, dp; returns p_last's
// gradient (its share through H_c only where `with_Hc`).
template <typename T>
T state_update_grads(const Shape& s, int64_t n, const T* Hc, bool with_Hc, const std::vector<T>& dH, Scratch<T>& w) {
  const T last = w.p[n - 1], el = std::exp(last);
  T dlast = 0;
  for (int64_t j = 0; j < n; ++j) {
    w.F[j] = std::exp(last - w.p[j]) * w.dt[j];
    for (int64_t k = 0; k < s.P; ++k) w.Fx[j * s.P + k] = w.F[j] * w.X[j * s.P + k];
  }
  gemm<T>(false, false, n, s.P, s.N, T(1), w.Bc.data(), s.N, dH.data(), s.P, T(0), w.dFx.data(), s.P);
  gemm<T>(false, true, n, s.N, s.P, T(1), w.Fx.data(), s.P, dH.data(), s.P, T(1), w.dB.data(), s.N);
  for (int64_t j = 0; j < n; ++j) {
    T dF = 0;
    for (int64_t k = 0; k < s.P; ++k) {
      dF += w.X[j * s.P + k] * w.dFx[j * s.P + k];
      w.dX[j * s.P + k] += w.F[j] * w.dFx[j * s.P + k];
    }
    w.ddt[j] += std::exp(last - w.p[j]) * dF;
    dlast += w.F[j] * dF;
    w.dp[j] -= w.F[j] * dF;
  }
  if (with_Hc) {
    T dot = 0;
    for (int64_t k = 0; k < s.N * s.P; ++k) dot += dH[k] * Hc[k];
    dlast += el * dot;
  }
  return dlast;
}

// The cumulative sums' backward (q_i = p_i, or p_i - a_i with shift; p_i = sum_{k <= i} a_k; a_i = dt_i A): adds
// into w.ddt, and A's gradient into dA.
template <typename T>
void cumsum_grads(bool shift, int64_t n, T A, T dlast, Scratch<T>& w, T& dA) {
  w.dp[n - 1] += dlast;
  T run = 0;
  for (int64_t i = n - 1; i >= 0; --i) {
    run += w.dp[i] + w.dq[i];
    T da = run;
    if (shift) da -= w.dq[i];
    w.ddt[i] += da * A;
    dA += da * w.dt[i];
  }
}

// Adds a chunk's row gradients into dx (B, L, H, P), ddt (B, L, H), dB and dC (B, L, H, N; C's at the row its
// C~ came from).
template <typename T>
void scatter_rows(const Shape& s, const DirIn<T>& d, bool shift, int64_t b, int64_t h, int64_t i0, int64_t n,
                  const Scratch<T>& w, T* dx, T* ddt, T* dB, T* dC) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = time_row(s, d.reverse, i0 + i);
    T* dxo = dx + ((b * s.L + t) * s.H + h) * s.P;
    for (int64_t k = 0; k < s.P; ++k) dxo[k] += w.dX[i * s.P + k];
    ddt[(b * s.L + t) * s.H + h] += w.ddt[i];
    T* dbo = dB + ((b * s.L + t) * s.H + h) * s.N;
    for (int64_t k = 0; k < s.N; ++k) dbo[k] += w.dB[i * s.N + k];
    const int64_t ci = shift ? i0 + i - 1 : i0 + i;
    if (ci >= 0) {
      T* dco = dC + ((b * s.L + time_row(s, d.reverse, ci)) * s.H + h) * s.N;
      for (int64_t k = 0; k < s.N; ++k) dco[k] += w.dC[i * s.N + k];
    }
  }
}

// Backward of one direction for (b, h). dy (B, L, H, P); dfinal (N x P) or null; adds into dx (B, L, H, P) and
// ddt (B, L, H); writes dB, dC (B, L, H, N) for this head (added, the caller zeroes them), dA_out (this (b, h)'s
// share) and dH0 (N x P, the entering state's gradient) when non-null.
template <typename T>
void direction_backward(const Shape& s, const T* x, const DirIn<T>& d, bool shift, int64_t b, int64_t h,
                        const T* H0, const T* dy, const T* dfinal, T* dx, T* ddt, T* dB, T* dC, T* dA_out, T* dH0,
                        Scratch<T>& w, std::vector<T>& states) {
  const int64_t nchunks = (s.L + s.Q - 1) / s.Q;
  const int64_t NP = s.N * s.P;
  std::vector<char> nonzero;
  entering_states(s, x, d, b, h, H0, w, states, nonzero);
  std::vector<T> dH(NP, T(0)), dHc(NP, T(0));  // the gradient reaching the state after the chunk; before it
  bool dH_zero = true;
  if (dfinal != nullptr) {
    std::copy_n(dfinal, NP, dH.data());
    dH_zero = false;
  }
  T dA = 0;
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t i0 = c * s.Q, n = std::min(s.Q, s.L - i0);
    load_chunk(s, x, d, shift, b, h, i0, n, w);
    const T* Hc = states.data() + c * NP;
    for (int64_t i = 0; i < n; ++i) {
      std::copy_n(dy + ((b * s.L + time_row(s, d.reverse, i0 + i)) * s.H + h) * s.P, s.P, w.dY.data() + i * s.P);
      w.dq[i] = w.dp[i] = w.ddt[i] = T(0);
    }
    intra_chunk_grads(s, shift, n, w);
    std::fill(dHc.begin(), dHc.end(), T(0));
    if (nonzero[c]) readout_grads(s, n, Hc, w, dHc);
    const T dlast = dH_zero ? T(0) : state_update_grads(s, n, Hc, nonzero[c] != 0, dH, w);
    // the gradient reaching H_c: exp(p_last) dH + dH_c
    const T el = std::exp(w.p[n - 1]);
    for (int64_t k = 0; k < NP; ++k) dH[k] = (dH_zero ? T(0) : el * dH[k]) + dHc[k];
    dH_zero = false;
    cumsum_grads(shift, n, d.A, dlast, w, dA);
    scatter_rows(s, d, shift, b, h, i0, n, w, dx, ddt, dB, dC);
  }
  *dA_out += dA;
  if (dH0 != nullptr) std::copy_n(dH.data(), NP, dH0);
}

Shape shape_of(const at::Tensor& x, const at::Tensor& Bm, int64_t chunk) {
  Shape s;
  s.B = x.size(0);
  s.L = x.size(1);
  s.H = x.size(2);
  s.P = x.size(3);
  s.G = Bm.size(2);
  s.N = Bm.size(3);
  s.Q = chunk;
  s.rep = s.H / s.G;
  s.xb = x.stride(0);
  s.xl = x.stride(1);
  return s;
}

void check_direction(const at::Tensor& x, const c10::optional<at::Tensor>& dt, const c10::optional<at::Tensor>& A,
                     const c10::optional<at::Tensor>& Bm, const c10::optional<at::Tensor>& Cm) {
  TORCH_CHECK(dt.has_value() == A.has_value() && A.has_value() == Bm.has_value() && Bm.has_value() == Cm.has_value(),
              "native scan: a direction needs dt, A, B and C");
  if (!dt.has_value()) return;
  const auto B = x.size(0), L = x.size(1), H = x.size(2);
  TORCH_CHECK(dt->sizes() == at::IntArrayRef({B, L, H}) && A->sizes() == at::IntArrayRef({H}) && Bm->dim() == 4 &&
                  Bm->size(0) == B && Bm->size(1) == L && H % Bm->size(2) == 0 && Cm->sizes() == Bm->sizes(),
              "native scan: dt (B, L, H), A (H,), B and C (B, L, G, N)");
  for (const auto* t : {&*dt, &*A, &*Bm, &*Cm})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type() && t->device().is_cpu(),
                "native scan: contiguous CPU inputs of x's dtype");
}

// The checks every scan entry point shares (dy: the backward's incoming gradient, or null).
void check_scan(const at::Tensor& x, const at::Tensor* dy, const c10::optional<at::Tensor>& dtf,
                const c10::optional<at::Tensor>& Af, const c10::optional<at::Tensor>& Bf,
                const c10::optional<at::Tensor>& Cf, const c10::optional<at::Tensor>& dtb,
                const c10::optional<at::Tensor>& Ab, const c10::optional<at::Tensor>& Bb,
                const c10::optional<at::Tensor>& Cb, const c10::optional<at::Tensor>& init, int64_t chunk) {
  TORCH_CHECK(x.dim() == 4 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "native scan: x must be a float32/float64 CPU tensor (B, L, H, P)");
  TORCH_CHECK((x.size(3) <= 1 || x.stride(3) == 1) && (x.size(2) <= 1 || x.stride(2) == x.size(3)),
              "native scan: x's heads and channels must be dense (any batch and row strides)");
  TORCH_CHECK(x.size(1) > 0, "native scan: the sequence is empty (L = 0)");
  if (dy != nullptr)
    TORCH_CHECK(dy->sizes() == x.sizes() && dy->is_contiguous() && dy->scalar_type() == x.scalar_type(),
                "native scan: dy must be contiguous, of x's shape and dtype");
  TORCH_CHECK(chunk > 0 && (dtf.has_value() || dtb.has_value()), "native scan: chunk > 0 and a direction");
  check_direction(x, dtf, Af, Bf, Cf);
  check_direction(x, dtb, Ab, Bb, Cb);
  TORCH_CHECK(!init.has_value() || dtf.has_value(), "native scan: the initial state needs the forward direction");
  if (init.has_value()) {
    const int64_t N = Bf->size(3);
    TORCH_CHECK(init->sizes() == at::IntArrayRef({x.size(0), x.size(2), x.size(3), N}) && init->is_contiguous() &&
                    init->scalar_type() == x.scalar_type(),
                "native scan: initial state (B, H, P, N)");
  }
}

template <typename T>
DirIn<T> dir_of(const c10::optional<at::Tensor>& dt, const c10::optional<at::Tensor>& A,
                const c10::optional<at::Tensor>& Bm, const c10::optional<at::Tensor>& Cm, bool reverse, int64_t h) {
  return DirIn<T>{dt->data_ptr<T>(), A->data_ptr<T>()[h], Bm->data_ptr<T>(), Cm->data_ptr<T>(), reverse};
}

template <typename T>
void forward_impl(const at::Tensor& x, const c10::optional<at::Tensor>& dtf, const c10::optional<at::Tensor>& Af,
                  const c10::optional<at::Tensor>& Bf, const c10::optional<at::Tensor>& Cf,
                  const c10::optional<at::Tensor>& dtb, const c10::optional<at::Tensor>& Ab,
                  const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& Cb,
                  const c10::optional<at::Tensor>& init, bool shift, int64_t chunk, at::Tensor& y,
                  at::Tensor& final) {
  const at::Tensor& Bref = Bf.has_value() ? *Bf : *Bb;
  const Shape s = shape_of(x, Bref, chunk);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t NP = s.N * s.P;
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    thread_local Scratch<T> w;  // per thread, reused across items and calls
    w.size(s);
    std::vector<T> Hs, H0(NP), fin(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      if (dtf.has_value()) {
        const T* h0 = nullptr;
        if (init.has_value()) {  // (B, H, P, N) -> N x P
          const T* src = init->data_ptr<T>() + (b * s.H + h) * NP;
          for (int64_t pp = 0; pp < s.P; ++pp)
            for (int64_t nn = 0; nn < s.N; ++nn) H0[nn * s.P + pp] = src[pp * s.N + nn];
          h0 = H0.data();
        }
        const bool want_final = final.numel() > 0;
        direction_forward(s, xp, dir_of<T>(dtf, Af, Bf, Cf, false, h), shift, b, h, h0, yp,
                          want_final ? fin.data() : nullptr, w, Hs);
        if (want_final) {
          T* dst = final.data_ptr<T>() + (b * s.H + h) * NP;
          for (int64_t pp = 0; pp < s.P; ++pp)
            for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = fin[nn * s.P + pp];
        }
      }
      if (dtb.has_value())
        direction_forward(s, xp, dir_of<T>(dtb, Ab, Bb, Cb, true, h), shift, b, h, static_cast<const T*>(nullptr),
                          yp, static_cast<T*>(nullptr), w, Hs);
    }
  });
}

// Both forwards' outputs: y (zero-filled, accumulated into) and the final state (B, H, P, N) when wanted (else
// empty).
std::tuple<at::Tensor, at::Tensor> forward_outputs(const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                                   const c10::optional<at::Tensor>& Bf,
                                                   const c10::optional<at::Tensor>& Bb, bool want_final) {
  TORCH_CHECK(!want_final || dtf.has_value(), "native scan: the final state needs the forward direction");
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  at::Tensor y = at::zeros(x.sizes(), x.options());
  at::Tensor final = want_final ? at::empty({x.size(0), x.size(2), x.size(3), N}, x.options())
                                : at::empty({0}, x.options());
  return {y, final};
}

std::tuple<at::Tensor, at::Tensor> exact_forward(const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                                const c10::optional<at::Tensor>& Af,
                                                const c10::optional<at::Tensor>& Bf,
                                                const c10::optional<at::Tensor>& Cf,
                                                const c10::optional<at::Tensor>& dtb,
                                                const c10::optional<at::Tensor>& Ab,
                                                const c10::optional<at::Tensor>& Bb,
                                                const c10::optional<at::Tensor>& Cb,
                                                const c10::optional<at::Tensor>& init, bool shift, int64_t chunk,
                                                bool want_final) {
  at::Tensor y, final;  // (not a structured binding: lambdas below capture them, which C++17 does not allow)
  std::tie(y, final) = forward_outputs(x, dtf, Bf, Bb, want_final);
  if (x.scalar_type() == at::kFloat) {
    forward_impl<float>(x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, y, final);
  } else {
    forward_impl<double>(x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, y, final);
  }
  return {y, final};
}

template <typename T>
void backward_impl(const at::Tensor& dy, const c10::optional<at::Tensor>& dfinal, const at::Tensor& x,
                   const c10::optional<at::Tensor>& dtf, const c10::optional<at::Tensor>& Af,
                   const c10::optional<at::Tensor>& Bf, const c10::optional<at::Tensor>& Cf,
                   const c10::optional<at::Tensor>& dtb, const c10::optional<at::Tensor>& Ab,
                   const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& Cb,
                   const c10::optional<at::Tensor>& init, bool shift, int64_t chunk, std::vector<at::Tensor>& out) {
  const at::Tensor& Bref = dtf.has_value() ? *Bf : *Bb;
  const Shape s = shape_of(x, Bref, chunk);
  const int64_t NP = s.N * s.P;
  const T* xp = x.data_ptr<T>();
  const T* gp = dy.data_ptr<T>();
  T* dxp = out[0].data_ptr<T>();
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    thread_local Scratch<T> w;  // per thread, reused across items and calls
    w.size(s);
    std::vector<T> states, H0(NP), dfin(NP), dH0(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      for (int dir = 0; dir < 2; ++dir) {
        const auto& dt = dir == 0 ? dtf : dtb;
        if (!dt.has_value()) continue;
        const auto& A = dir == 0 ? Af : Ab;
        const auto& Bm = dir == 0 ? Bf : Bb;
        const auto& Cm = dir == 0 ? Cf : Cb;
        const int base = 1 + 4 * dir;  // ddt, dA (B, H), dB, dC (B, L, H, N)
        const T* h0 = nullptr;
        if (dir == 0 && init.has_value()) {
          const T* src = init->data_ptr<T>() + (b * s.H + h) * NP;
          for (int64_t pp = 0; pp < s.P; ++pp)
            for (int64_t nn = 0; nn < s.N; ++nn) H0[nn * s.P + pp] = src[pp * s.N + nn];
          h0 = H0.data();
        }
        const T* df = nullptr;
        if (dir == 0 && dfinal.has_value() && dfinal->numel() > 0) {
          const T* src = dfinal->data_ptr<T>() + (b * s.H + h) * NP;
          for (int64_t pp = 0; pp < s.P; ++pp)
            for (int64_t nn = 0; nn < s.N; ++nn) dfin[nn * s.P + pp] = src[pp * s.N + nn];
          df = dfin.data();
        }
        const bool want_init = dir == 0 && init.has_value();
        direction_backward(s, xp, dir_of<T>(dt, A, Bm, Cm, dir == 1, h), shift, b, h, h0, gp, df, dxp,
                           out[base].data_ptr<T>(), out[base + 2].data_ptr<T>(), out[base + 3].data_ptr<T>(),
                           out[base + 1].data_ptr<T>() + b * s.H + h, want_init ? dH0.data() : nullptr, w, states);
        if (want_init) {
          T* dst = out[9].data_ptr<T>() + (b * s.H + h) * NP;
          for (int64_t pp = 0; pp < s.P; ++pp)
            for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = dH0[nn * s.P + pp];
        }
      }
    }
  });
}

// The zero-filled gradients both backwards return: dx, then per direction (forward, backward) ddt (B, L, H), dA
// (shape dA_shape), dB and dC (per head, (B, L, H, N), when per_head; else per group, B's own shape), then d init
// (B, H, P, N); absent pieces are empty tensors.
std::vector<at::Tensor> backward_outputs(const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                         const c10::optional<at::Tensor>& Bf, const c10::optional<at::Tensor>& dtb,
                                         const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& init,
                                         at::IntArrayRef dA_shape, bool per_head) {
  const auto B = x.size(0), L = x.size(1), H = x.size(2), P = x.size(3);
  std::vector<at::Tensor> out(10);
  out[0] = at::zeros(x.sizes(), x.options());
  const auto empty = at::empty({0}, x.options());
  for (int dir = 0; dir < 2; ++dir) {
    const auto& dt = dir == 0 ? dtf : dtb;
    const auto& Bm = dir == 0 ? Bf : Bb;
    const int base = 1 + 4 * dir;
    if (!dt.has_value()) {
      for (int k = 0; k < 4; ++k) out[base + k] = empty;
      continue;
    }
    const std::vector<int64_t> bc = per_head ? std::vector<int64_t>{B, L, H, Bm->size(3)} : Bm->sizes().vec();
    out[base] = at::zeros({B, L, H}, x.options());
    out[base + 1] = at::zeros(dA_shape, x.options());
    out[base + 2] = at::zeros(bc, x.options());
    out[base + 3] = at::zeros(bc, x.options());
  }
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  out[9] = init.has_value() ? at::zeros({B, H, P, N}, x.options()) : empty;
  return out;
}

// Returns dx, then per direction (forward, backward) ddt (B, L, H), dA (B, H) (summed over the batch by the
// caller), dB and dC per head (B, L, H, N) (summed over each group's heads by the caller), then d init (B, H, P, N);
// absent pieces are empty tensors.
std::vector<at::Tensor> exact_backward(const at::Tensor& dy, const c10::optional<at::Tensor>& dfinal,
                                      const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                      const c10::optional<at::Tensor>& Af, const c10::optional<at::Tensor>& Bf,
                                      const c10::optional<at::Tensor>& Cf, const c10::optional<at::Tensor>& dtb,
                                      const c10::optional<at::Tensor>& Ab, const c10::optional<at::Tensor>& Bb,
                                      const c10::optional<at::Tensor>& Cb, const c10::optional<at::Tensor>& init,
                                      bool shift, int64_t chunk) {
  const auto B = x.size(0), H = x.size(2), P = x.size(3);
  std::vector<at::Tensor> out = backward_outputs(x, dtf, Bf, dtb, Bb, init, {B, H}, true);
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  if (dfinal.has_value() && dfinal->numel() > 0)
    TORCH_CHECK(dfinal->sizes() == at::IntArrayRef({B, H, P, N}) && dfinal->is_contiguous() &&
                    dfinal->scalar_type() == x.scalar_type(),
                "native scan: the final state's gradient must be contiguous (B, H, P, N)");
  if (x.scalar_type() == at::kFloat) {
    backward_impl<float>(dy, dfinal, x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, out);
  } else {
    backward_impl<double>(dy, dfinal, x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, out);
  }
  return out;
}


// ---------------------------------------------------------------------------------------------------------------
// Factored decays: within a chunk, exp(q_i - p_j) = u_i v_j / dt_j with
// u_i = exp(q_i - m), v_j = exp(m - p_j) dt_j, m = p_last / 2, so one product per (group, chunk) serves all the
// group's heads: Z = mask(C~ B^T) W with W = [v_h X_h]_h side by side (n x rep P), and y_h = u_h Z_h. Chunk states
// S'_c = B^T W; the states between chunks are kept scaled, K_c = e^{m_c} H_c, K_{c+1} = e^{m_c + m_{c+1}}
// (K_c + S'_c), and read out as Z += C~ K_c. Taken only where factored_fits says so. Three phases per
// direction: chunk products (parallel over batch, group, chunk), the state pass (parallel over batch, head), the
// read-out (parallel over batch, group, chunk); the backward likewise.

// Products with a chunk's masked n x n matrices (T = mask(C~ B^T) and its gradient), which are lower triangular
// (strictly so with shift): row-major, leading dimension n, zero above the diagonal. They run in row blocks of
// TRI_BLOCK, each block's product stopping at the block's last column, so most of the zero upper part is skipped
// (197 rows in one chunk: 58% of the full product; 50 rows: 77%).
constexpr int64_t TRI_BLOCK = 32;

// C (n x cols, ldc) = beta C + Lo Bm, with Bm n x cols (ldb) and Lo lower triangular
template <typename T>
void lower_times(int64_t n, int64_t cols, const T* Lo, const T* Bm, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i0 = 0; i0 < n; i0 += TRI_BLOCK) {
    const int64_t rows = std::min(TRI_BLOCK, n - i0);
    gemm<T>(false, false, rows, cols, i0 + rows, T(1), Lo + i0 * n, n, Bm, ldb, beta, C + i0 * ldc, ldc);
  }
}

// C (n x cols, ldc) = beta C + Lo^T Bm: row block [j0, j0 + rows) of Lo^T Bm sums Bm's rows i >= j0 only
template <typename T>
void lower_t_times(int64_t n, int64_t cols, const T* Lo, const T* Bm, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += TRI_BLOCK) {
    const int64_t rows = std::min(TRI_BLOCK, n - j0);
    gemm<T>(true, false, rows, cols, n - j0, T(1), Lo + j0 * n + j0, n, Bm + j0 * ldb, ldb, beta, C + j0 * ldc,
            ldc);
  }
}

// Out (n x n) = mask(A Bm^T), A and Bm n x k: entries (i, j) with j > i (j >= i when `strict`) are zero, and are
// not computed beyond each row block's last column
template <typename T>
void lower_product(int64_t n, int64_t k, const T* A, int64_t lda, const T* Bm, int64_t ldb, T* Out, bool strict) {
  for (int64_t i0 = 0; i0 < n; i0 += TRI_BLOCK) {
    const int64_t rows = std::min(TRI_BLOCK, n - i0);
    gemm<T>(false, true, rows, i0 + rows, k, T(1), A + i0 * lda, lda, Bm, ldb, T(0), Out + i0 * n, n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t allowed = strict ? i : i + 1;
    std::fill(Out + i * n + allowed, Out + (i + 1) * n, T(0));
  }
}

// Per (batch, group, chunk) of one direction: the chunk's rows in direction order, its decays per head.
template <typename T>
struct GroupChunk {
  std::vector<T> X, W, Bc, Cc, Tm, Z, dZ, dW, dT, dC, dB, tmp;
  std::vector<T> dt, p, q, u, v, m, du, dv, dp, dq, ddt, a;  // (rep, Q) or (rep)
  void size(int64_t Q, int64_t N, int64_t P, int64_t rep) {  // every entry read is written first: no zeroing
    const size_t RP = static_cast<size_t>(rep) * P;
    for (auto* x : {&X, &W, &Z, &dZ, &dW, &tmp}) x->resize(Q * RP);
    for (auto* x : {&Bc, &Cc, &dC, &dB}) x->resize(Q * N);
    for (auto* x : {&Tm, &dT}) x->resize(Q * Q);
    for (auto* x : {&dt, &p, &q, &u, &v, &du, &dv, &dp, &dq, &ddt, &a}) x->resize(rep * Q);
    m.resize(rep);
  }
};

// Gathers chunk c of group g (rows [i0, i0 + n) in direction order) and its per-head decays; forms W = v X and
// the masked T = C~ B^T.
template <typename T>
void load_group_chunk(const Shape& s, const T* x, const T* dtp, const T* Ap, const T* Bm, const T* Cm, bool reverse,
                      bool shift, int64_t b, int64_t g, int64_t i0, int64_t n, GroupChunk<T>& w, bool with_T) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    std::copy_n(x + b * s.xb + t * s.xl + g * s.rep * s.P, RP, w.X.data() + r * RP);  // the group's heads
    std::copy_n(Bm + ((b * s.L + t) * s.G + g) * s.N, s.N, w.Bc.data() + r * s.N);
    const int64_t ci = shift ? i0 + r - 1 : i0 + r;
    if (ci < 0) {
      std::fill_n(w.Cc.data() + r * s.N, s.N, T(0));
    } else {
      std::copy_n(Cm + ((b * s.L + time_row(s, reverse, ci)) * s.G + g) * s.N, s.N, w.Cc.data() + r * s.N);
    }
    for (int64_t k = 0; k < s.rep; ++k) w.dt[k * s.Q + r] = dtp[(b * s.L + t) * s.H + g * s.rep + k];
  }
  for (int64_t k = 0; k < s.rep; ++k) {
    const T A = Ap[g * s.rep + k];
    T* dt = w.dt.data() + k * s.Q;
    T* p = w.p.data() + k * s.Q;
    T* q = w.q.data() + k * s.Q;
    T* a = w.a.data() + k * s.Q;
    T acc = 0;
    for (int64_t r = 0; r < n; ++r) {
      a[r] = dt[r] * A;
      q[r] = acc;  // the exclusive sum, used with shift
      acc += a[r];
      p[r] = acc;
      if (!shift) q[r] = acc;
    }
    const T m = p[n - 1] * T(0.5);
    w.m[k] = m;
    T* u = w.u.data() + k * s.Q;
    T* v = w.v.data() + k * s.Q;
    for (int64_t r = 0; r < n; ++r) {
      u[r] = std::exp(q[r] - m);
      v[r] = std::exp(m - p[r]) * dt[r];
    }
    for (int64_t r = 0; r < n; ++r) {
      const T* xr = w.X.data() + r * RP + k * s.P;
      T* wr = w.W.data() + r * RP + k * s.P;
      for (int64_t c = 0; c < s.P; ++c) wr[c] = v[r] * xr[c];
    }
  }
  if (!with_T) return;
  lower_product(n, s.N, w.Cc.data(), s.N, w.Bc.data(), s.N, w.Tm.data(), shift);
}

// fn(item, b, g, c, i0, n, w) for every (batch, group, chunk) of one direction, with the chunk loaded into w (a
// per-thread buffer reused across items and calls; the masked C~ B^T only when `with_T`: the state and read-out
// phases never read it); the first chunk of each sequence is skipped when `skip_first`.
template <typename T, typename F>
void for_each_group_chunk(const Shape& s, int64_t nC, const T* x, const T* dtp, const T* Ap, const T* Bm,
                          const T* Cm, bool reverse, bool shift, bool skip_first, bool with_T, const F& fn) {
  parallel_dynamic(s.B * s.G * nC, [&](int64_t begin, int64_t end) {
    thread_local GroupChunk<T> w;
    w.size(s.Q, s.N, s.P, s.rep);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bg = item / nC, c = item % nC, b = bg / s.G, g = bg % s.G;
      if (skip_first && c == 0) continue;
      const int64_t i0 = c * s.Q, n = std::min(s.Q, s.L - i0);
      load_group_chunk(s, x, dtp, Ap, Bm, Cm, reverse, shift, b, g, i0, n, w, with_T);
      fn(item, b, g, c, i0, n, w);
    }
  });
}

// A buffer of n elements (uninitialised) for the duration of one call.
template <typename T>
struct Buffer {
  at::Tensor storage;
  T* ptr;
  explicit Buffer(size_t n)
      : storage(at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value))),
        ptr(storage.data_ptr<T>()) {}
  T* data() { return ptr; }
  T& operator[](size_t i) { return ptr[i]; }
};

// The factored form's per-call workspaces, sized by the shape alone: one set serves both directions of a call, which
// run one after the other and write every entry before they read it.
template <typename T>
struct FactoredWork {
  static size_t slots(const Shape& s) { return static_cast<size_t>(s.B * s.G * ((s.L + s.Q - 1) / s.Q)); }
  static size_t state_size(const Shape& s) { return slots(s) * static_cast<size_t>(s.N * s.rep * s.P); }
  Buffer<T> states, half;          // S' then K (written over S' by the state pass); m per chunk and head
  explicit FactoredWork(const Shape& s) : states(state_size(s)), half(slots(s) * s.rep) {}
};

template <typename T>
struct FactoredGradWork : FactoredWork<T> {
  Buffer<T> dKs, dms;              // dK_c (the read-out's), then dS'_c; dm from the state pass
  explicit FactoredGradWork(const Shape& s)
      : FactoredWork<T>(s), dKs(FactoredWork<T>::state_size(s)), dms(FactoredWork<T>::slots(s) * s.rep) {}
};

// y (B, L, H, P) += u Z over the chunk's rows [i0, i0 + n) and group g's heads.
template <typename T>
void add_u_z(const Shape& s, const GroupChunk<T>& w, bool reverse, int64_t b, int64_t g, int64_t i0, int64_t n, T* y) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    for (int64_t k = 0; k < s.rep; ++k) {
      T* out = y + ((b * s.L + t) * s.H + g * s.rep + k) * s.P;
      const T uk = w.u[k * s.Q + r];
      const T* z = w.Z.data() + r * RP + k * s.P;
      for (int64_t c2 = 0; c2 < s.P; ++c2) out[c2] += uk * z[c2];
    }
  }
}

// w.dZ = u dy over the chunk's rows [i0, i0 + n) and group g's heads (dy (B, L, H, P)).
template <typename T>
void gather_u_dy(const Shape& s, const T* dy, bool reverse, int64_t b, int64_t g, int64_t i0, int64_t n,
                 GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    for (int64_t k = 0; k < s.rep; ++k) {
      const T* src = dy + ((b * s.L + t) * s.H + g * s.rep + k) * s.P;
      T* dst = w.dZ.data() + r * RP + k * s.P;
      const T uk = w.u[k * s.Q + r];
      for (int64_t c2 = 0; c2 < s.P; ++c2) dst[c2] = uk * src[c2];
    }
  }
}

// The scaled states of one (batch, head), in place over its chunk slots (N x P each, leading dimension rep P):
// slot(c) holds S'_c on entry and K_c on return, with K_0 = e^{m_0} init (init (P, N); zero when null) and
// K_{c+1} = e^{m_c + m_{c+1}} (K_c + S'_c); m(c) is m_c. On return K holds K_last and S holds S'_last: the final
// state is e^{m_last} (K_last + S'_last).
template <typename T, typename Slot, typename M>
void scaled_state_pass(const Shape& s, int64_t nC, const Slot& slot, const M& m, const T* init, std::vector<T>& K,
                       std::vector<T>& S) {
  const int64_t RP = s.rep * s.P, NP = s.N * s.P;
  if (init != nullptr) {
    const T e0 = std::exp(m(0));
    for (int64_t pp = 0; pp < s.P; ++pp)
      for (int64_t nn = 0; nn < s.N; ++nn) K[nn * s.P + pp] = e0 * init[pp * s.N + nn];
  } else {
    std::fill(K.begin(), K.end(), T(0));
  }
  for (int64_t c = 0; c < nC; ++c) {
    T* sc = slot(c);
    for (int64_t nn = 0; nn < s.N; ++nn) {  // S <- S'_c, slot <- K_c
      std::copy_n(sc + nn * RP, s.P, S.data() + nn * s.P);
      std::copy_n(K.data() + nn * s.P, s.P, sc + nn * RP);
    }
    if (c + 1 < nC) {
      const T link = std::exp(m(c) + m(c + 1));
      for (int64_t e = 0; e < NP; ++e) K[e] = link * (K[e] + S[e]);
    }
  }
}

// The backward of scaled_state_pass for one (batch, head), over the chunks from the last: G_c, the gradient
// reaching K_c, is G_last = dK_last + e^{m_last} dH and G_c = dK_c + e^{m_c + m_{c+1}} G_{c+1}. dK(c) holds dK_c (the
// read-out's) on entry and dS'_c on return (each element read before it is written); K(c) holds K_c; dm(c) receives
// m_c's gradient. dH (N x P, the final state's gradient) with Hf (the final state), or dH null. G holds G_0 on return.
template <typename T, typename DKSlot, typename KSlot, typename M, typename DM>
void scaled_state_grads(const Shape& s, int64_t nC, const DKSlot& dK, const KSlot& K, const M& m, const DM& dm,
                        const T* dH, const T* Hf, std::vector<T>& G) {
  const int64_t RP = s.rep * s.P;
  T r_next = 0;
  for (int64_t c = nC - 1; c >= 0; --c) {
    T* dsc = dK(c);
    const T* dkc = dsc;
    const T* kc = K(c);
    if (c == nC - 1) {  // dS'_last = e^{m_last} dH
      const T el = std::exp(m(c));
      T fin = 0;
      for (int64_t nn = 0; nn < s.N; ++nn)
        for (int64_t pp = 0; pp < s.P; ++pp) {
          const T d = dH != nullptr ? el * dH[nn * s.P + pp] : T(0);
          G[nn * s.P + pp] = dkc[nn * RP + pp] + d;
          dsc[nn * RP + pp] = d;
          if (dH != nullptr) fin += dH[nn * s.P + pp] * Hf[nn * s.P + pp];
        }
      T r = 0;
      for (int64_t nn = 0; nn < s.N; ++nn)
        for (int64_t pp = 0; pp < s.P; ++pp) r += G[nn * s.P + pp] * kc[nn * RP + pp];
      dm(c) = r + fin;
      r_next = r;
    } else {
      const T link = std::exp(m(c) + m(c + 1));
      T r = 0;
      for (int64_t nn = 0; nn < s.N; ++nn)
        for (int64_t pp = 0; pp < s.P; ++pp) {
          const T dnext = link * G[nn * s.P + pp];  // dS'_c = link_c G_{c+1}
          const T gc = dkc[nn * RP + pp] + dnext;
          dsc[nn * RP + pp] = dnext;
          G[nn * s.P + pp] = gc;
          r += gc * kc[nn * RP + pp];
        }
      dm(c) = r + r_next;
      r_next = r;
    }
  }
}

template <typename T>
void factored_forward(const Shape& s, const T* x, const T* dtp, const T* Ap, const T* Bm, const T* Cm, bool reverse,
                      bool shift, const T* init /* (B, H, P, N) or null */, T* y, T* final /* or null */,
                      FactoredWork<T>& work) {
  const int64_t nC = (s.L + s.Q - 1) / s.Q, RP = s.rep * s.P, NRP = s.N * RP, NP = s.N * s.P;
  // S' then K, per (b, g, c): N x rep P; m per (b, g, c, head)
  Buffer<T>& states = work.states;
  Buffer<T>& half = work.half;
  // phase 1: Z = T W into y (scaled later), S'_c = B^T W
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, true,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    std::copy_n(w.m.data(), s.rep, half.data() + item * s.rep);
    if (c + 1 < nC || final != nullptr)  // the last chunk's S' only makes the final state
      gemm<T>(true, false, s.N, RP, n, T(1), w.Bc.data(), s.N, w.W.data(), RP, T(0), states.data() + item * NRP,
              RP);
    lower_times(n, RP, w.Tm.data(), w.W.data(), RP, T(0), w.Z.data(), RP);
    add_u_z(s, w, reverse, b, g, i0, n, y);  // (the read-out is added in phase 3)
  });
  // phase 2: the scaled states K_c over S'_c, per (b, head)
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    std::vector<T> K(NP), S(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H, g = h / s.rep, k = h % s.rep, base = (b * s.G + g) * nC;
      auto m = [&](int64_t c) { return half[(base + c) * s.rep + k]; };
      scaled_state_pass(s, nC, [&](int64_t c) { return states.data() + (base + c) * NRP + k * s.P; }, m,
                        init != nullptr ? init + (b * s.H + h) * NP : nullptr, K, S);
      if (final != nullptr) {
        const T el = std::exp(m(nC - 1));
        T* dst = final + (b * s.H + h) * NP;  // (P, N)
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = el * (K[nn * s.P + pp] + S[nn * s.P + pp]);
      }
    }
  });
  // phase 3: y += u (C~ K_c)
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, init == nullptr, false,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    gemm<T>(false, false, n, RP, s.N, T(1), w.Cc.data(), s.N, states.data() + item * NRP, RP, T(0), w.Z.data(),
            RP);
    add_u_z(s, w, reverse, b, g, i0, n, y);
  });
}

// One chunk's products in the factored backward (w loaded with T, dZ = u dy): Z = T W + C~ K_c, and
// dT = dZ W^T (masked), dW = T^T dZ + B dS', dC~ = dZ K^T + dT B, dB = dT^T C~ + W dS'^T. K_c (kc) is skipped
// where it is zero (`with_K` false: the first chunk without an initial state), dS'_c (dsc) likewise (`with_dS`
// false: the last chunk without a final state's gradient).
template <typename T>
void chunk_product_grads(const Shape& s, int64_t n, const T* kc, const T* dsc, bool with_K, bool with_dS,
                         bool shift, GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  lower_times(n, RP, w.Tm.data(), w.W.data(), RP, T(0), w.Z.data(), RP);
  if (with_K) gemm<T>(false, false, n, RP, s.N, T(1), w.Cc.data(), s.N, kc, RP, T(1), w.Z.data(), RP);
  lower_product(n, RP, w.dZ.data(), RP, w.W.data(), RP, w.dT.data(), shift);
  lower_t_times(n, RP, w.Tm.data(), w.dZ.data(), RP, T(0), w.dW.data(), RP);
  if (with_dS) gemm<T>(false, false, n, RP, s.N, T(1), w.Bc.data(), s.N, dsc, RP, T(1), w.dW.data(), RP);
  if (with_K) {
    gemm<T>(false, true, n, s.N, RP, T(1), w.dZ.data(), RP, kc, RP, T(0), w.dC.data(), s.N);
    lower_times(n, s.N, w.dT.data(), w.Bc.data(), s.N, T(1), w.dC.data(), s.N);
  } else {
    lower_times(n, s.N, w.dT.data(), w.Bc.data(), s.N, T(0), w.dC.data(), s.N);
  }
  lower_t_times(n, s.N, w.dT.data(), w.Cc.data(), s.N, T(0), w.dB.data(), s.N);
  if (with_dS) gemm<T>(false, true, n, s.N, RP, T(1), w.W.data(), RP, dsc, RP, T(1), w.dB.data(), s.N);
}

// One chunk's decay gradients in the factored backward, per head k of group g (w after chunk_product_grads):
// from u_r = exp(q_r - m) and v_r = exp(m - p_r) dt_r, through the cumulative sums, into w.ddt (dt's gradient at
// each row) and dA_k (this chunk's share of A's gradient, added into dA_part[k]); dm[k] is m's gradient from the
// state pass.
template <typename T>
void chunk_decay_grads(const Shape& s, const T* Ap, const T* dy, bool reverse, bool shift, int64_t b, int64_t g,
                       int64_t i0, int64_t n, const T* dm_in, T* dA_part, GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  for (int64_t k = 0; k < s.rep; ++k) {
    const T A = Ap[g * s.rep + k];
    const T* u = w.u.data() + k * s.Q;
    const T* v = w.v.data() + k * s.Q;
    const T* p = w.p.data() + k * s.Q;
    const T* dt = w.dt.data() + k * s.Q;
    T* dq = w.dq.data() + k * s.Q;
    T* dp = w.dp.data() + k * s.Q;
    T* gdt = w.ddt.data() + k * s.Q;
    const T m = w.m[k];
    T dm = dm_in[k];
    for (int64_t r = 0; r < n; ++r) {
      const T* dyr = dy + ((b * s.L + time_row(s, reverse, i0 + r)) * s.H + g * s.rep + k) * s.P;
      const T* zr = w.Z.data() + r * RP + k * s.P;
      const T* dwr = w.dW.data() + r * RP + k * s.P;
      const T* xr = w.X.data() + r * RP + k * s.P;
      T du = 0, dv = 0;
      for (int64_t c2 = 0; c2 < s.P; ++c2) {
        du += dyr[c2] * zr[c2];
        dv += dwr[c2] * xr[c2];
      }
      dq[r] = du * u[r];
      dm -= du * u[r];
      const T vr = v[r] * dv;
      dm += vr;
      dp[r] = -vr;
      gdt[r] = dv * std::exp(m - p[r]);
    }
    dp[n - 1] += dm * T(0.5);
    T run = 0, dA = 0;
    for (int64_t r = n - 1; r >= 0; --r) {
      run += dp[r] + dq[r];
      const T da = shift ? run - dq[r] : run;
      gdt[r] += da * A;
      dA += da * dt[r];
    }
    dA_part[k] += dA;
  }
}

// Adds one chunk's row gradients into dx (B, L, H, P), ddt (B, L, H), dB and dCt (B, L, G, N).
template <typename T>
void scatter_chunk_grads(const Shape& s, const GroupChunk<T>& w, bool reverse, int64_t b, int64_t g, int64_t i0,
                         int64_t n, T* dx, T* ddt, T* dB, T* dCt) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    for (int64_t k = 0; k < s.rep; ++k) {
      T* dxo = dx + ((b * s.L + t) * s.H + g * s.rep + k) * s.P;
      const T* dwr = w.dW.data() + r * RP + k * s.P;
      const T vk = w.v[k * s.Q + r];
      for (int64_t c2 = 0; c2 < s.P; ++c2) dxo[c2] += vk * dwr[c2];
      ddt[(b * s.L + t) * s.H + g * s.rep + k] += w.ddt[k * s.Q + r];
    }
    T* dbo = dB + ((b * s.L + t) * s.G + g) * s.N;
    T* dco = dCt + ((b * s.L + t) * s.G + g) * s.N;
    for (int64_t nn = 0; nn < s.N; ++nn) {
      dbo[nn] += w.dB[r * s.N + nn];
      dco[nn] += w.dC[r * s.N + nn];
    }
  }
}

// The backward of factored_forward for one direction. Adds into dx (B, L, H, P), ddt (B, L, H), dB (B, L, G, N),
// dCt (the gradient of C~ at each row's own position, B, L, G, N; the caller shifts it onto C), dA_part
// (B, nC, H); writes dinit (B, H, P, N) when non-null.
template <typename T>
void factored_backward(const Shape& s, const T* x, const T* dtp, const T* Ap, const T* Bm, const T* Cm, bool reverse,
                       bool shift, const T* init, const T* dy, const T* dfinal, T* dx, T* ddt, T* dB, T* dCt,
                       T* dA_part, T* dinit, FactoredGradWork<T>& work) {
  const int64_t nC = (s.L + s.Q - 1) / s.Q, RP = s.rep * s.P, NRP = s.N * RP, NP = s.N * s.P;
  Buffer<T>& states = work.states;  // S'_c, then K_c (written over S'_c once the state pass has read it)
  Buffer<T>& half = work.half;      // m
  Buffer<T>& dKs = work.dKs;        // dK_c (the read-out's), then dS'_c (written over dK_c once read)
  Buffer<T>& dms = work.dms;        // dm from the state pass
  // phase A: S'_c = B^T W, m, dK_c = C~^T dZ
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, false,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    std::copy_n(w.m.data(), s.rep, half.data() + item * s.rep);
    if (c + 1 < nC || dfinal != nullptr)  // the last chunk's S' only makes the final state
      gemm<T>(true, false, s.N, RP, n, T(1), w.Bc.data(), s.N, w.W.data(), RP, T(0), states.data() + item * NRP,
              RP);
    if (c > 0 || init != nullptr) {  // K_0 = 0 without an initial state: its gradient is never used
      gather_u_dy(s, dy, reverse, b, g, i0, n, w);
      gemm<T>(true, false, s.N, RP, n, T(1), w.Cc.data(), s.N, w.dZ.data(), RP, T(0), dKs.data() + item * NRP, RP);
    } else {
      std::fill_n(dKs.data() + item * NRP, NRP, T(0));
    }
  });
  // phase B: the states K_c (over S'_c), then the state gradients backwards (dS'_c over dK_c, dm into `dms`)
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    std::vector<T> K(NP), S(NP), G(NP), Hf(NP), dH(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H, g = h / s.rep, k = h % s.rep, base = (b * s.G + g) * nC;
      auto m = [&](int64_t c) { return half[(base + c) * s.rep + k]; };
      auto slot = [&](Buffer<T>& buf) { return [&buf, base, k, NRP, &s](int64_t c) {
        return buf.data() + (base + c) * NRP + k * s.P; }; };
      scaled_state_pass(s, nC, slot(states), m, init != nullptr ? init + (b * s.H + h) * NP : nullptr, K, S);
      if (dfinal != nullptr) {  // (without it, S'_last was not computed: phase A)
        const T el = std::exp(m(nC - 1));
        for (int64_t e = 0; e < NP; ++e) Hf[e] = el * (K[e] + S[e]);
        const T* src = dfinal + (b * s.H + h) * NP;
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dH[nn * s.P + pp] = src[pp * s.N + nn];
      }
      scaled_state_grads(s, nC, slot(dKs), slot(states), m,
                         [&](int64_t c) -> T& { return dms[(base + c) * s.rep + k]; },
                         dfinal != nullptr ? dH.data() : static_cast<const T*>(nullptr), Hf.data(), G);
      if (dinit != nullptr) {
        const T e0 = std::exp(m(0));
        T* dst = dinit + (b * s.H + h) * NP;
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = e0 * G[nn * s.P + pp];
      }
    }
  });
  // phase C: everything of each chunk
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, true,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    gather_u_dy(s, dy, reverse, b, g, i0, n, w);
    chunk_product_grads(s, n, states.data() + item * NRP, dKs.data() + item * NRP, c > 0 || init != nullptr,
                        c + 1 < nC || dfinal != nullptr, shift, w);
    chunk_decay_grads(s, Ap, dy, reverse, shift, b, g, i0, n, dms.data() + item * s.rep,
                      dA_part + (b * nC + c) * s.H + g * s.rep, w);
    scatter_chunk_grads(s, w, reverse, b, g, i0, n, dx, ddt, dB, dCt);
  });
}

template <typename T>
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->numel() > 0 ? t->data_ptr<T>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> factored_forward_op(
    const at::Tensor& x, const c10::optional<at::Tensor>& dtf, const c10::optional<at::Tensor>& Af,
    const c10::optional<at::Tensor>& Bf, const c10::optional<at::Tensor>& Cf, const c10::optional<at::Tensor>& dtb,
    const c10::optional<at::Tensor>& Ab, const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& Cb,
    const c10::optional<at::Tensor>& init, bool shift, int64_t chunk, bool want_final) {
  at::Tensor y, final;  // (not a structured binding: lambdas below capture them, which C++17 does not allow)
  std::tie(y, final) = forward_outputs(x, dtf, Bf, Bb, want_final);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scan_factored_forward", [&] {
    const Shape s = shape_of(x, dtf.has_value() ? *Bf : *Bb, chunk);
    FactoredWork<scalar_t> work(s);
    if (dtf.has_value())
      factored_forward<scalar_t>(s, x.data_ptr<scalar_t>(), dtf->data_ptr<scalar_t>(), Af->data_ptr<scalar_t>(),
                                 Bf->data_ptr<scalar_t>(), Cf->data_ptr<scalar_t>(), false, shift,
                                 ptr_or_null<scalar_t>(init), y.data_ptr<scalar_t>(),
                                 want_final ? final.data_ptr<scalar_t>() : nullptr, work);
    if (dtb.has_value())
      factored_forward<scalar_t>(s, x.data_ptr<scalar_t>(), dtb->data_ptr<scalar_t>(), Ab->data_ptr<scalar_t>(),
                                 Bb->data_ptr<scalar_t>(), Cb->data_ptr<scalar_t>(), true, shift, nullptr,
                                 y.data_ptr<scalar_t>(), nullptr, work);
  });
  return {y, final};
}

// dx, then per direction: ddt (B, L, H), dA per chunk (B, nC, H), dB (B, L, G, N), dC~ (B, L, G, N, each row's
// own C~: the caller shifts it); then d init.
std::vector<at::Tensor> factored_backward_op(
    const at::Tensor& dy, const c10::optional<at::Tensor>& dfinal, const at::Tensor& x,
    const c10::optional<at::Tensor>& dtf, const c10::optional<at::Tensor>& Af, const c10::optional<at::Tensor>& Bf,
    const c10::optional<at::Tensor>& Cf, const c10::optional<at::Tensor>& dtb, const c10::optional<at::Tensor>& Ab,
    const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& Cb, const c10::optional<at::Tensor>& init,
    bool shift, int64_t chunk) {
  const int64_t nC = (x.size(1) + chunk - 1) / chunk;
  std::vector<at::Tensor> out = backward_outputs(x, dtf, Bf, dtb, Bb, init, {x.size(0), nC, x.size(2)}, false);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scan_factored_backward", [&] {
    const Shape s = shape_of(x, dtf.has_value() ? *Bf : *Bb, chunk);
    FactoredGradWork<scalar_t> work(s);
    for (int dir = 0; dir < 2; ++dir) {
      const auto& dt = dir == 0 ? dtf : dtb;
      if (!dt.has_value()) continue;
      const auto& A = dir == 0 ? Af : Ab;
      const auto& Bm = dir == 0 ? Bf : Bb;
      const auto& Cm = dir == 0 ? Cf : Cb;
      const int base = 1 + 4 * dir;
      factored_backward<scalar_t>(
          s, x.data_ptr<scalar_t>(), dt->data_ptr<scalar_t>(), A->data_ptr<scalar_t>(), Bm->data_ptr<scalar_t>(),
          Cm->data_ptr<scalar_t>(), dir == 1, shift, dir == 0 ? ptr_or_null<scalar_t>(init) : nullptr,
          dy.data_ptr<scalar_t>(), dir == 0 ? ptr_or_null<scalar_t>(dfinal) : nullptr, out[0].data_ptr<scalar_t>(),
          out[base].data_ptr<scalar_t>(), out[base + 2].data_ptr<scalar_t>(), out[base + 3].data_ptr<scalar_t>(),
          out[base + 1].data_ptr<scalar_t>(), dir == 0 && init.has_value() ? out[9].data_ptr<scalar_t>() : nullptr,
          work);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// The entry points: one forward and one backward; each chooses its form (the backward the same one as the forward,
// from the same inputs) and returns the gradients in one layout whichever form ran.

// The largest |exponent| of the factored form's factors, per dtype: they stay below e^limit, which leaves float32
// (and its 3e38) e^40 ~ 2e17 of room below its range for the values, float64 e^300 of its 1e308.
template <typename T>
constexpr T factored_limit() {
  return std::is_same<T, float>::value ? T(40) : T(300);
}

// Whether the factored form's factors u = exp(q - m) and v = exp(m - p) stay within factored_limit for every chunk
// and head of one direction (m = p_last / 2); a non-finite decay fails.
template <typename T>
bool factored_fits(const Shape& s, const T* dtp, const T* Ap, bool reverse, bool shift) {
  const int64_t nC = (s.L + s.Q - 1) / s.Q;
  const T limit = factored_limit<T>();
  std::atomic<bool> ok{true};
  at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end && ok.load(std::memory_order_relaxed); ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H;
      const T A = Ap[h];
      for (int64_t c = 0; c < nC; ++c) {
        const int64_t i0 = c * s.Q, n = std::min(s.Q, s.L - i0);
        T last = 0;
        for (int64_t r = 0; r < n; ++r) last += dtp[(b * s.L + time_row(s, reverse, i0 + r)) * s.H + h] * A;
        const T m = last * T(0.5);
        T acc = 0;
        for (int64_t r = 0; r < n; ++r) {
          const T before = acc;
          acc += dtp[(b * s.L + time_row(s, reverse, i0 + r)) * s.H + h] * A;
          const T q = shift ? before : acc;
          if (!(std::abs(q - m) <= limit && std::abs(m - acc) <= limit)) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    }
  });
  return ok.load();
}

// form: 0 = factored where every chunk of every direction allows it, else exact; 1 = factored (an error where a chunk
// does not allow it); 2 = exact.
bool choose_factored(int64_t form, const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                     const c10::optional<at::Tensor>& Af, const c10::optional<at::Tensor>& Bf,
                     const c10::optional<at::Tensor>& dtb, const c10::optional<at::Tensor>& Ab,
                     const c10::optional<at::Tensor>& Bb, bool shift, int64_t chunk) {
  TORCH_CHECK(form >= 0 && form <= 2, "native scan: form must be 0 (choose), 1 (factored) or 2 (exact)");
  if (form == 2) return false;
  bool fits = true;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scan_factored_fits", [&] {
    const Shape s = shape_of(x, dtf.has_value() ? *Bf : *Bb, chunk);
    if (dtf.has_value())
      fits = factored_fits<scalar_t>(s, dtf->data_ptr<scalar_t>(), Af->data_ptr<scalar_t>(), false, shift);
    if (fits && dtb.has_value())
      fits = factored_fits<scalar_t>(s, dtb->data_ptr<scalar_t>(), Ab->data_ptr<scalar_t>(), true, shift);
  });
  TORCH_CHECK(fits || form == 0, "native scan: the factored form was asked for, but a chunk's decays exceed its range");
  return fits;
}

std::tuple<at::Tensor, at::Tensor> scan_forward(const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                                const c10::optional<at::Tensor>& Af,
                                                const c10::optional<at::Tensor>& Bf,
                                                const c10::optional<at::Tensor>& Cf,
                                                const c10::optional<at::Tensor>& dtb,
                                                const c10::optional<at::Tensor>& Ab,
                                                const c10::optional<at::Tensor>& Bb,
                                                const c10::optional<at::Tensor>& Cb,
                                                const c10::optional<at::Tensor>& init, bool shift, int64_t chunk,
                                                bool want_final, int64_t form) {
  check_scan(x, nullptr, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, chunk);
  if (choose_factored(form, x, dtf, Af, Bf, dtb, Ab, Bb, shift, chunk))
    return factored_forward_op(x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, want_final);
  return exact_forward(x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk, want_final);
}

// The gradient of C from that of C~ (C~_t = C_{t-1}, or C_{t+1} in the backward direction, with shift).
at::Tensor unshift(const at::Tensor& grad_shifted, bool shift, bool reverse) {
  if (!shift) return grad_shifted;
  const int64_t L = grad_shifted.size(1);
  at::Tensor grad = at::zeros_like(grad_shifted);
  if (L > 1) {
    if (reverse) {
      grad.narrow(1, 1, L - 1).copy_(grad_shifted.narrow(1, 0, L - 1));
    } else {
      grad.narrow(1, 0, L - 1).copy_(grad_shifted.narrow(1, 1, L - 1));
    }
  }
  return grad;
}

// dx, then per direction (forward, backward) ddt (B, L, H), dA (H,), dB and dC (B, L, G, N), then d init
// (B, H, P, N); absent pieces are empty tensors.
std::vector<at::Tensor> scan_backward(const at::Tensor& dy, const c10::optional<at::Tensor>& dfinal,
                                      const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                      const c10::optional<at::Tensor>& Af, const c10::optional<at::Tensor>& Bf,
                                      const c10::optional<at::Tensor>& Cf, const c10::optional<at::Tensor>& dtb,
                                      const c10::optional<at::Tensor>& Ab, const c10::optional<at::Tensor>& Bb,
                                      const c10::optional<at::Tensor>& Cb, const c10::optional<at::Tensor>& init,
                                      bool shift, int64_t chunk, int64_t form) {
  check_scan(x, &dy, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, chunk);
  const bool factored = choose_factored(form, x, dtf, Af, Bf, dtb, Ab, Bb, shift, chunk);
  std::vector<at::Tensor> out = factored
      ? factored_backward_op(dy, dfinal, x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk)
      : exact_backward(dy, dfinal, x, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, shift, chunk);
  for (int dir = 0; dir < 2; ++dir) {
    const auto& Bm = dir == 0 ? Bf : Bb;
    if (!(dir == 0 ? dtf : dtb).has_value()) continue;
    const int base = 1 + 4 * dir;
    if (factored) {  // dA per (batch, chunk, head); dB per group; dC~ at each row's own position
      out[base + 1] = out[base + 1].sum(at::IntArrayRef{0, 1});
      out[base + 3] = unshift(out[base + 3], shift, dir == 1);
    } else {  // dA per (batch, head); dB and dC per head
      out[base + 1] = out[base + 1].sum(0);
      const auto G = Bm->size(2), N = Bm->size(3), B = x.size(0), L = x.size(1), H = x.size(2);
      for (int k = 2; k < 4; ++k) out[base + k] = out[base + k].view({B, L, G, H / G, N}).sum(3);
    }
  }
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("scan_forward(Tensor x, Tensor? dt_f, Tensor? A_f, Tensor? B_f, Tensor? C_f, Tensor? dt_b, Tensor? A_b, "
        "Tensor? B_b, Tensor? C_b, Tensor? initial_state, bool shift, int chunk, bool want_final, int form) "
        "-> (Tensor, Tensor)");
  m.def("scan_backward(Tensor dy, Tensor? dfinal, Tensor x, Tensor? dt_f, Tensor? A_f, Tensor? B_f, Tensor? C_f, "
        "Tensor? dt_b, Tensor? A_b, Tensor? B_b, Tensor? C_b, Tensor? initial_state, bool shift, int chunk, "
        "int form) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("scan_forward", &scan_forward);
  m.impl("scan_backward", &scan_backward);
}
