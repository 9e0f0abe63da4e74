// The chunked (bi)directional scan, forward and backward, for CPU tensors: the SSD algorithm chunk by chunk.
//
// Compiled at install (setup.py) and registered as torch.ops.mixer_plugins_native.scan_forward
// and scan_backward; kernels/scan/native.py calls them and adds the diagonal term.
//
// One direction, in its own order (the backward direction is the forward algorithm on the time-reversed rows;
// rows are gathered into contiguous chunk buffers, so reversal costs nothing). Per chunk of n rows and head, with
// a_i = dt_i A, C~_i = C_{i-1} (shift; zero before the first row) or C_i, and i~ = i - 1 (shift) or i:
//   y_i += sum_{j <= i~} (C~_i . B_j) exp(a_{j+1} + ... + a_i~) dt_j x_j       (one Q x Q product per head)
//   y_i += exp(q_i) C~_i H,   q_i = a_0 + ... + a_i~                          (the entering state H, N x P)
//   H   <- exp(a_0 + ... + a_last) H + sum_j exp(s_j) dt_j B_j x_j^T,   s_j = a_{j+1} + ... + a_last
// Every exponent is a sum over its own tokens, never the difference of two chunk-wide cumulative sums: its rounding
// is relative to its own size (float32 as accurate as per-pair segment sums), and the gradient of each a_k is the
// sum of the gradients of the exponents whose span holds k, each term with its own bounded decay, so it stays right
// at any decay (no large sums that cancel). Every exponent has the sign of A: no range to check.
//
// Three phases per direction, each parallel over independent items: the chunk products (per batch, group and
// chunk: C~ B^T once for the group's heads, each head's masked decays and Q x Q product, the chunk's own states
// B^T [exp(s) dt x] for all heads in one product), the state pass (per batch and head: the state entering each
// chunk), the read-out (per batch, group and chunk: C~ H for all heads in one product). The backward likewise.
// Excluded pairs are zero by selection, never a product with zero, so a non-finite dt, B or C reaches only the rows
// that see its token.

#include "common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
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

// Products with a chunk's masked n x n matrices (the masked C~ B^T, the weights M and their gradients), which are lower triangular
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

// Per (batch, group, chunk) of one direction: the chunk's rows in direction order (the group's heads side by side,
// n x rep P), and per head its decays.
template <typename T>
struct GroupChunk {
  std::vector<T> X, W, Z, DY, dZ, dW, dX, Bc, Cc, dC, dB, Tm, E, M, dM, S, dT;
  std::vector<T> dt, a, q, sfx, u, v, da, dq, dsfx, ddt, total;  // (rep, Q) or (rep)
  std::vector<T> seg;                                              // (Q): one row of pair sums
  std::vector<char> decaying;                                       // (rep)
  void size(int64_t Q, int64_t N, int64_t P, int64_t rep) {  // every entry read is written first: no zeroing
    const size_t RP = static_cast<size_t>(rep) * P;
    for (auto* x : {&X, &W, &Z, &DY, &dZ, &dW, &dX}) x->resize(Q * RP);
    for (auto* x : {&Bc, &Cc, &dC, &dB}) x->resize(Q * N);
    for (auto* x : {&Tm, &E, &M, &dM, &S, &dT}) x->resize(Q * Q);
    for (auto* x : {&dt, &a, &q, &sfx, &u, &v, &da, &dq, &dsfx, &ddt}) x->resize(rep * Q);
    total.resize(rep);
    decaying.resize(rep);
    seg.resize(Q);
  }
};

// Gathers chunk c of group g (rows [i0, i0 + n) in direction order) and each head's sums of a = dt A: q (the
// read-out's prefix sums a_0 + ... + a_i~; with shift the exclusive sums, taken by a shift of the inclusive ones,
// never as p_i - a_i, so the nearest pair keeps decay 1 exactly), sfx (suffix sums a_{j+1} + ... + a_last, summed
// from the chunk's end) and the chunk's total; u = exp(q), v = exp(sfx) dt and W = v X. The masked T = C~ B^T only
// when `with_T`.
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
    T* a = w.a.data() + k * s.Q;
    T* q = w.q.data() + k * s.Q;
    T* sfx = w.sfx.data() + k * s.Q;
    T* u = w.u.data() + k * s.Q;
    T* v = w.v.data() + k * s.Q;
    bool decaying = true;  // every a_r <= 0 and finite: every exponent is <= 0
    T acc = 0;
    for (int64_t r = 0; r < n; ++r) {
      a[r] = dt[r] * A;
      decaying = decaying && std::isfinite(a[r]) && a[r] <= T(0);
      q[r] = acc;
      acc += a[r];
      if (!shift) q[r] = acc;
    }
    w.total[k] = acc;
    w.decaying[k] = decaying;
    acc = 0;
    for (int64_t r = n - 1; r >= 0; --r) {
      sfx[r] = acc;
      acc += a[r];
    }
    for (int64_t r = 0; r < n; ++r) {
      u[r] = std::exp(q[r]);
      v[r] = std::exp(sfx[r]) * dt[r];
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

// Head k's intra-chunk weights (w loaded with T): E_ij = exp(a_{j+1} + ... + a_i~), each exponent summed over its
// own pair's tokens, and M_ij = T_ij E_ij dt_j for the allowed pairs j <= i~; zero elsewhere. The sums of row i are
// those of row i - 1 plus a_i (seg[j], j < i, one vector add a row), each accumulated from its own pair's first token.
template <typename T>
void head_weights(bool shift, int64_t n, int64_t k, int64_t Q, GroupChunk<T>& w) {
  const T* a = w.a.data() + k * Q;
  const T* dt = w.dt.data() + k * Q;
  T* seg = w.seg.data();  // seg[j] = a_{j+1} + ... + a_i for j <= i (0 at j = i), as row i is reached
  for (int64_t i = 0; i < n; ++i) {
    T* e = w.E.data() + i * n;
    T* m = w.M.data() + i * n;
    const T* t = w.Tm.data() + i * n;
    const int64_t allowed = shift ? i : i + 1;  // columns j < allowed
    if (shift) std::copy_n(seg, allowed, e);    // row i - 1's sums: the span (j, i - 1]
    const T ai = a[i];
    for (int64_t j = 0; j < i; ++j) seg[j] += ai;
    seg[i] = T(0);
    if (!shift) std::copy_n(seg, allowed, e);
    exp_inplace(e, allowed, w.decaying[k] != 0);
    for (int64_t j = 0; j < allowed; ++j) m[j] = t[j] * e[j] * dt[j];
    for (int64_t j = allowed; j < n; ++j) e[j] = m[j] = T(0);  // by selection: a non-finite C.B or dt stays out
  }
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

// The per-call workspaces, sized by the shape alone: one set serves both directions of a call, which run one after
// the other and write every entry before they read it.
template <typename T>
struct ScanWork {
  static size_t slots(const Shape& s) { return static_cast<size_t>(s.B * s.G * ((s.L + s.Q - 1) / s.Q)); }
  static size_t state_size(const Shape& s) { return slots(s) * static_cast<size_t>(s.N * s.rep * s.P); }
  Buffer<T> states, totals;        // S_c then H_c (written over S_c by the state pass); each chunk's total per head
  explicit ScanWork(const Shape& s) : states(state_size(s)), totals(slots(s) * s.rep) {}
};

template <typename T>
struct ScanGradWork : ScanWork<T> {
  Buffer<T> dKs, dtotals;          // dK_c (the read-out's gradient of H_c), then dS_c; each total's gradient
  explicit ScanGradWork(const Shape& s)
      : ScanWork<T>(s), dKs(ScanWork<T>::state_size(s)), dtotals(ScanWork<T>::slots(s) * s.rep) {}
};

// y (B, L, H, P) += Z over the chunk's rows [i0, i0 + n) and group g's heads, each head's rows scaled by u when
// `scaled` (the read-out's exp(q)).
template <typename T>
void add_rows(const Shape& s, const GroupChunk<T>& w, bool scaled, bool reverse, int64_t b, int64_t g, int64_t i0,
              int64_t n, T* y) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    for (int64_t k = 0; k < s.rep; ++k) {
      T* out = y + ((b * s.L + t) * s.H + g * s.rep + k) * s.P;
      const T uk = scaled ? w.u[k * s.Q + r] : T(1);
      const T* z = w.Z.data() + r * RP + k * s.P;
      for (int64_t c2 = 0; c2 < s.P; ++c2) out[c2] += uk * z[c2];
    }
  }
}

// w.DY = dy and w.dZ = u dy over the chunk's rows [i0, i0 + n) and group g's heads (dy (B, L, H, P)).
template <typename T>
void gather_dy(const Shape& s, const T* dy, bool reverse, int64_t b, int64_t g, int64_t i0, int64_t n,
               GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = time_row(s, reverse, i0 + r);
    for (int64_t k = 0; k < s.rep; ++k) {
      const T* src = dy + ((b * s.L + t) * s.H + g * s.rep + k) * s.P;
      T* raw = w.DY.data() + r * RP + k * s.P;
      T* dst = w.dZ.data() + r * RP + k * s.P;
      const T uk = w.u[k * s.Q + r];
      for (int64_t c2 = 0; c2 < s.P; ++c2) {
        raw[c2] = src[c2];
        dst[c2] = uk * src[c2];
      }
    }
  }
}

// The state pass of one (batch, head), in place over its chunk slots (N x P each, leading dimension rep P): slot(c)
// holds S_c on entry and H_c, the state entering chunk c, on return, with H_0 = init (init (P, N); zero when null)
// and H_{c+1} = exp(total_c) H_c + S_c. On return H holds H_last and S holds S_last: the final state is
// exp(total_last) H + S.
template <typename T, typename Slot, typename Total>
void state_pass(const Shape& s, int64_t nC, const Slot& slot, const Total& total, const T* init, std::vector<T>& H,
                std::vector<T>& S) {
  const int64_t RP = s.rep * s.P, NP = s.N * s.P;
  if (init != nullptr) {
    for (int64_t pp = 0; pp < s.P; ++pp)
      for (int64_t nn = 0; nn < s.N; ++nn) H[nn * s.P + pp] = init[pp * s.N + nn];
  } else {
    std::fill(H.begin(), H.end(), T(0));
  }
  for (int64_t c = 0; c < nC; ++c) {
    T* sc = slot(c);
    for (int64_t nn = 0; nn < s.N; ++nn) {  // S <- S_c, slot <- H_c
      std::copy_n(sc + nn * RP, s.P, S.data() + nn * s.P);
      std::copy_n(H.data() + nn * s.P, s.P, sc + nn * RP);
    }
    if (c + 1 < nC) {
      const T carry = std::exp(total(c));
      for (int64_t e = 0; e < NP; ++e) H[e] = carry * H[e] + S[e];
    }
  }
}

// The backward of state_pass for one (batch, head), from the last chunk: with G_c the gradient reaching H_c,
// G_nC = dH (the final state's gradient; zero when null), dS_c = G_{c+1}, G_c = dK_c + exp(total_c) G_{c+1} and
// total_c's gradient exp(total_c) <G_{c+1}, H_c>. dK(c) holds dK_c (the read-out's) on entry and dS_c on return
// (each element read before it is written); Hs(c) holds H_c; dtotal(c) receives total_c's gradient. G holds G_0 on
// return.
template <typename T, typename DKSlot, typename HSlot, typename Total, typename DTotal>
void state_grads(const Shape& s, int64_t nC, const DKSlot& dK, const HSlot& Hs, const Total& total,
                 const DTotal& dtotal, const T* dH, std::vector<T>& G) {
  const int64_t RP = s.rep * s.P;
  if (dH != nullptr) {
    std::copy(dH, dH + s.N * s.P, G.begin());
  } else {
    std::fill(G.begin(), G.end(), T(0));
  }
  for (int64_t c = nC - 1; c >= 0; --c) {
    T* dsc = dK(c);
    const T* hc = Hs(c);
    const T carry = std::exp(total(c));
    T dot = 0;
    for (int64_t nn = 0; nn < s.N; ++nn)
      for (int64_t pp = 0; pp < s.P; ++pp) {
        const T next = G[nn * s.P + pp];
        dot += next * hc[nn * RP + pp];
        G[nn * s.P + pp] = dsc[nn * RP + pp] + carry * next;
        dsc[nn * RP + pp] = next;
      }
    dtotal(c) = carry * dot;
  }
}

template <typename T>
void scan_direction_forward(const Shape& s, const T* x, const T* dtp, const T* Ap, const T* Bm, const T* Cm,
                            bool reverse, bool shift, const T* init /* (B, H, P, N) or null */, T* y,
                            T* final /* or null */, ScanWork<T>& work) {
  const int64_t nC = (s.L + s.Q - 1) / s.Q, RP = s.rep * s.P, NRP = s.N * RP, NP = s.N * s.P;
  Buffer<T>& states = work.states;
  Buffer<T>& totals = work.totals;
  // phase 1: the intra-chunk products into y, S_c = B^T W
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, true,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    std::copy_n(w.total.data(), s.rep, totals.data() + item * s.rep);
    if (c + 1 < nC || final != nullptr)  // the last chunk's S only makes the final state
      gemm<T>(true, false, s.N, RP, n, T(1), w.Bc.data(), s.N, w.W.data(), RP, T(0), states.data() + item * NRP,
              RP);
    for (int64_t k = 0; k < s.rep; ++k) {
      head_weights(shift, n, k, s.Q, w);
      lower_times(n, s.P, w.M.data(), w.X.data() + k * s.P, RP, T(0), w.Z.data() + k * s.P, RP);
    }
    add_rows(s, w, false, reverse, b, g, i0, n, y);
  });
  // phase 2: the entering states H_c over S_c, per (b, head)
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    std::vector<T> H(NP), S(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H, g = h / s.rep, k = h % s.rep, base = (b * s.G + g) * nC;
      auto total = [&](int64_t c) { return totals[(base + c) * s.rep + k]; };
      state_pass(s, nC, [&](int64_t c) { return states.data() + (base + c) * NRP + k * s.P; }, total,
                 init != nullptr ? init + (b * s.H + h) * NP : nullptr, H, S);
      if (final != nullptr) {
        const T carry = std::exp(total(nC - 1));
        T* dst = final + (b * s.H + h) * NP;  // (P, N)
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = carry * H[nn * s.P + pp] + S[nn * s.P + pp];
      }
    }
  });
  // phase 3: y += u (C~ H_c)
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, init == nullptr, false,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    gemm<T>(false, false, n, RP, s.N, T(1), w.Cc.data(), s.N, states.data() + item * NRP, RP, T(0), w.Z.data(),
            RP);
    add_rows(s, w, true, reverse, b, g, i0, n, y);
  });
}

// The read-out's and the chunk's own state's products in the backward (w loaded, DY and dZ = u dy gathered), over
// all the group's heads at once: Z = C~ H_c and dC~ = dZ H_c^T (`with_H`, else zero), dW = B dS_c and
// dB = W dS_c^T (`with_dS`, else zero); then per head dq (the read-out's exponents' gradients), dsfx (the own
// state's), the direct ddt and dX = v dW.
template <typename T>
void state_product_grads(const Shape& s, int64_t n, const T* hc, const T* dsc, bool with_H, bool with_dS,
                         GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  if (with_H) {
    gemm<T>(false, false, n, RP, s.N, T(1), w.Cc.data(), s.N, hc, RP, T(0), w.Z.data(), RP);
    gemm<T>(false, true, n, s.N, RP, T(1), w.dZ.data(), RP, hc, RP, T(0), w.dC.data(), s.N);
  } else {
    std::fill_n(w.dC.data(), n * s.N, T(0));
  }
  if (with_dS) {
    gemm<T>(false, false, n, RP, s.N, T(1), w.Bc.data(), s.N, dsc, RP, T(0), w.dW.data(), RP);
    gemm<T>(false, true, n, s.N, RP, T(1), w.W.data(), RP, dsc, RP, T(0), w.dB.data(), s.N);
  } else {
    std::fill_n(w.dB.data(), n * s.N, T(0));
  }
  for (int64_t k = 0; k < s.rep; ++k) {
    const T* u = w.u.data() + k * s.Q;
    const T* v = w.v.data() + k * s.Q;
    const T* sfx = w.sfx.data() + k * s.Q;
    T* dq = w.dq.data() + k * s.Q;
    T* dsfx = w.dsfx.data() + k * s.Q;
    T* ddt = w.ddt.data() + k * s.Q;
    for (int64_t r = 0; r < n; ++r) {
      const T* dyr = w.DY.data() + r * RP + k * s.P;
      const T* zr = w.Z.data() + r * RP + k * s.P;
      const T* dwr = w.dW.data() + r * RP + k * s.P;
      const T* xr = w.X.data() + r * RP + k * s.P;
      T* dxr = w.dX.data() + r * RP + k * s.P;
      T du = 0, dv = 0;
      if (with_H)
        for (int64_t c2 = 0; c2 < s.P; ++c2) du += dyr[c2] * zr[c2];
      if (with_dS) {
        for (int64_t c2 = 0; c2 < s.P; ++c2) {
          dv += dwr[c2] * xr[c2];
          dxr[c2] = v[r] * dwr[c2];
        }
      } else {
        std::fill_n(dxr, s.P, T(0));
      }
      dq[r] = du * u[r];
      dsfx[r] = dv * v[r];
      ddt[r] = dv * std::exp(sfx[r]);
    }
  }
}

// r[0] + ... + r[len - 1], in eight running sums (independent adds the compiler keeps in vector registers).
template <typename T>
T row_sum(const T* r, int64_t len) {
  T acc[8] = {T(0), T(0), T(0), T(0), T(0), T(0), T(0), T(0)};
  int64_t j = 0;
  for (; j + 8 <= len; j += 8)
    for (int l = 0; l < 8; ++l) acc[l] += r[j + l];
  T total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; j < len; ++j) total += r[j];
  return total;
}

// Head k's intra-chunk gradients (after state_product_grads; w.E, w.M from head_weights): dM = dy x^T (masked),
// dX += M^T dY, ddt_j += sum_i dM_ij T_ij E_ij, dT (the group's C~ B^T gradient) += dM E dt (assigned for the first
// head), and the pairs' share of each a_k's gradient: s_ij = dM_ij M_ij is the gradient of pair (i, j)'s exponent
// a_{j+1} + ... + a_i~, so with R_ij = sum_{i' >= i} s_i'j (column sums from the bottom) a_k receives
// sum_{j < k} R_{k + shift, j}, into w.da. Every term keeps its own decay: no large sums that cancel.
template <typename T>
void head_intra_grads(const Shape& s, bool shift, int64_t n, int64_t k, GroupChunk<T>& w) {
  const int64_t RP = s.rep * s.P;
  T* dm = w.dM.data();
  lower_product(n, s.P, w.DY.data() + k * s.P, RP, w.X.data() + k * s.P, RP, dm, shift);
  lower_t_times(n, s.P, w.M.data(), w.DY.data() + k * s.P, RP, T(1), w.dX.data() + k * s.P, RP);
  const T* dt = w.dt.data() + k * s.Q;
  T* ddt = w.ddt.data() + k * s.Q;
  T* da = w.da.data() + k * s.Q;
  T* col = w.seg.data();  // R's row i as row i is reached from the bottom: col[j] = sum_{i' >= i} s_i'j
  std::fill_n(col, n, T(0));
  if (shift) da[n - 1] = T(0);  // its row, n, is past the chunk
  // one pass from the bottom row up: each row's s_ij joins the column sums, and a_{i - shift} reads its row of R
  for (int64_t i = n - 1; i >= 0; --i) {
    const int64_t allowed = shift ? i : i + 1;
    const T* __restrict dmi = dm + i * n;
    const T* __restrict mi = w.M.data() + i * n;
    const T* __restrict ei = w.E.data() + i * n;
    const T* __restrict ti = w.Tm.data() + i * n;
    T* __restrict dti = w.dT.data() + i * n;
    for (int64_t j = 0; j < allowed; ++j) {
      col[j] += dmi[j] * mi[j];
      ddt[j] += dmi[j] * ti[j] * ei[j];
    }
    if (k == 0) {  // the group's first head assigns dT, the others add
      for (int64_t j = 0; j < allowed; ++j) dti[j] = dmi[j] * ei[j] * dt[j];
      std::fill(dti + allowed, dti + n, T(0));
    } else {
      for (int64_t j = 0; j < allowed; ++j) dti[j] += dmi[j] * ei[j] * dt[j];
    }
    const int64_t kk = i - (shift ? 1 : 0);
    if (kk >= 0) da[kk] = row_sum(col, kk);
  }
}

// Head k's decay gradients: a_k's gradient is the sum of the gradients of every exponent whose span holds k, each
// summed over its own terms: the pairs' (w.da), the read-outs' q_i (k <= i~: a sum from the chunk's end), the own
// state's sfx_j (j < k: a sum from its start) and the chunk total's, dtotal (every k). Adds A da into w.ddt and
// returns the chunk's share of A's gradient.
template <typename T>
T head_decay_grads(const Shape& s, bool shift, int64_t n, int64_t k, T A, T dtotal, GroupChunk<T>& w) {
  T* da = w.da.data() + k * s.Q;
  const T* dq = w.dq.data() + k * s.Q;
  const T* dsfx = w.dsfx.data() + k * s.Q;
  const T* dt = w.dt.data() + k * s.Q;
  T* ddt = w.ddt.data() + k * s.Q;
  T from_end = 0;  // sum of dq_i over i~ >= k, i~ = i - shift
  for (int64_t r = n - 1; r >= 0; --r) {
    const int64_t i = r + (shift ? 1 : 0);
    if (i < n) from_end += dq[i];
    da[r] += from_end + dtotal;
  }
  T from_start = 0, dA = 0;  // sum of dsfx_j over j < k
  for (int64_t r = 0; r < n; ++r) {
    da[r] += from_start;
    from_start += dsfx[r];
    ddt[r] += da[r] * A;
    dA += da[r] * dt[r];
  }
  return dA;
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
      const T* dxr = w.dX.data() + r * RP + k * s.P;
      for (int64_t c2 = 0; c2 < s.P; ++c2) dxo[c2] += dxr[c2];
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

// The backward of scan_direction_forward. Adds into dx (B, L, H, P), ddt (B, L, H), dB (B, L, G, N), dCt (the
// gradient of C~ at each row's own position, B, L, G, N; the caller shifts it onto C), dA_part (B, nC, H); writes
// dinit (B, H, P, N) when non-null.
template <typename T>
void scan_direction_backward(const Shape& s, const T* x, const T* dtp, const T* Ap, const T* Bm, const T* Cm,
                             bool reverse, bool shift, const T* init, const T* dy, const T* dfinal, T* dx, T* ddt,
                             T* dB, T* dCt, T* dA_part, T* dinit, ScanGradWork<T>& work) {
  const int64_t nC = (s.L + s.Q - 1) / s.Q, RP = s.rep * s.P, NRP = s.N * RP, NP = s.N * s.P;
  Buffer<T>& states = work.states;   // S_c, then H_c (written over S_c once the state pass has read it)
  Buffer<T>& totals = work.totals;
  Buffer<T>& dKs = work.dKs;         // dK_c (the read-out's), then dS_c (written over dK_c once read)
  Buffer<T>& dtotals = work.dtotals;
  // phase A: S_c = B^T W, the totals, dK_c = C~^T dZ
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, false,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    std::copy_n(w.total.data(), s.rep, totals.data() + item * s.rep);
    if (c + 1 < nC || dfinal != nullptr)  // the last chunk's S only makes the final state
      gemm<T>(true, false, s.N, RP, n, T(1), w.Bc.data(), s.N, w.W.data(), RP, T(0), states.data() + item * NRP,
              RP);
    if (c > 0 || init != nullptr) {  // H_0 = 0 without an initial state: its gradient is never used
      gather_dy(s, dy, reverse, b, g, i0, n, w);
      gemm<T>(true, false, s.N, RP, n, T(1), w.Cc.data(), s.N, w.dZ.data(), RP, T(0), dKs.data() + item * NRP, RP);
    } else {
      std::fill_n(dKs.data() + item * NRP, NRP, T(0));
    }
  });
  // phase B: the states H_c (over S_c), then the state gradients backwards (dS_c over dK_c, the totals' into
  // dtotals)
  parallel_dynamic(s.B * s.H, [&](int64_t begin, int64_t end) {
    std::vector<T> H(NP), S(NP), G(NP), dH(NP);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.H, h = bh % s.H, g = h / s.rep, k = h % s.rep, base = (b * s.G + g) * nC;
      auto total = [&](int64_t c) { return totals[(base + c) * s.rep + k]; };
      auto slot = [&](Buffer<T>& buf) { return [&buf, base, k, NRP, &s](int64_t c) {
        return buf.data() + (base + c) * NRP + k * s.P; }; };
      state_pass(s, nC, slot(states), total, init != nullptr ? init + (b * s.H + h) * NP : nullptr, H, S);
      if (dfinal != nullptr) {
        const T* src = dfinal + (b * s.H + h) * NP;
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dH[nn * s.P + pp] = src[pp * s.N + nn];
      }
      state_grads(s, nC, slot(dKs), slot(states), total,
                  [&](int64_t c) -> T& { return dtotals[(base + c) * s.rep + k]; },
                  dfinal != nullptr ? dH.data() : static_cast<const T*>(nullptr), G);
      if (dinit != nullptr) {
        T* dst = dinit + (b * s.H + h) * NP;
        for (int64_t pp = 0; pp < s.P; ++pp)
          for (int64_t nn = 0; nn < s.N; ++nn) dst[pp * s.N + nn] = G[nn * s.P + pp];
      }
    }
  });
  // phase C: everything of each chunk
  for_each_group_chunk(s, nC, x, dtp, Ap, Bm, Cm, reverse, shift, false, true,
                       [&](int64_t item, int64_t b, int64_t g, int64_t c, int64_t i0, int64_t n, GroupChunk<T>& w) {
    gather_dy(s, dy, reverse, b, g, i0, n, w);
    state_product_grads(s, n, states.data() + item * NRP, dKs.data() + item * NRP, c > 0 || init != nullptr,
                        c + 1 < nC || dfinal != nullptr, w);
    for (int64_t k = 0; k < s.rep; ++k) {
      head_weights(shift, n, k, s.Q, w);
      head_intra_grads(s, shift, n, k, w);
      dA_part[(b * nC + c) * s.H + g * s.rep + k] +=
          head_decay_grads(s, shift, n, k, Ap[g * s.rep + k], dtotals[item * s.rep + k], w);
    }
    lower_times(n, s.N, w.dT.data(), w.Bc.data(), s.N, T(1), w.dC.data(), s.N);
    lower_t_times(n, s.N, w.dT.data(), w.Cc.data(), s.N, T(1), w.dB.data(), s.N);
    scatter_chunk_grads(s, w, reverse, b, g, i0, n, dx, ddt, dB, dCt);
  });
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
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->numel() > 0 ? t->data_ptr<T>() : nullptr;
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
                                                bool want_final) {
  check_scan(x, nullptr, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, chunk);
  TORCH_CHECK(!want_final || dtf.has_value(), "native scan: the final state needs the forward direction");
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  at::Tensor y = at::zeros(x.sizes(), x.options());  // accumulated into
  at::Tensor final = want_final ? at::empty({x.size(0), x.size(2), x.size(3), N}, x.options())
                                : at::empty({0}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scan_forward", [&] {
    const Shape s = shape_of(x, dtf.has_value() ? *Bf : *Bb, chunk);
    ScanWork<scalar_t> work(s);
    if (dtf.has_value())
      scan_direction_forward<scalar_t>(s, x.data_ptr<scalar_t>(), dtf->data_ptr<scalar_t>(),
                                       Af->data_ptr<scalar_t>(), Bf->data_ptr<scalar_t>(), Cf->data_ptr<scalar_t>(),
                                       false, shift, ptr_or_null<scalar_t>(init), y.data_ptr<scalar_t>(),
                                       want_final ? final.data_ptr<scalar_t>() : nullptr, work);
    if (dtb.has_value())
      scan_direction_forward<scalar_t>(s, x.data_ptr<scalar_t>(), dtb->data_ptr<scalar_t>(),
                                       Ab->data_ptr<scalar_t>(), Bb->data_ptr<scalar_t>(), Cb->data_ptr<scalar_t>(),
                                       true, shift, nullptr, y.data_ptr<scalar_t>(), nullptr, work);
  });
  return {y, final};
}

// The zero-filled gradients the backward returns: dx, then per direction (forward, backward) ddt (B, L, H), dA
// (shape dA_shape), dB and dC (B's own shape), then d init (B, H, P, N); absent pieces are empty tensors.
std::vector<at::Tensor> backward_outputs(const at::Tensor& x, const c10::optional<at::Tensor>& dtf,
                                         const c10::optional<at::Tensor>& Bf, const c10::optional<at::Tensor>& dtb,
                                         const c10::optional<at::Tensor>& Bb, const c10::optional<at::Tensor>& init,
                                         at::IntArrayRef dA_shape) {
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
    const std::vector<int64_t> bc = Bm->sizes().vec();
    out[base] = at::zeros({B, L, H}, x.options());
    out[base + 1] = at::zeros(dA_shape, x.options());
    out[base + 2] = at::zeros(bc, x.options());
    out[base + 3] = at::zeros(bc, x.options());
  }
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  out[9] = init.has_value() ? at::zeros({B, H, P, N}, x.options()) : empty;
  return out;
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
                                      bool shift, int64_t chunk) {
  check_scan(x, &dy, dtf, Af, Bf, Cf, dtb, Ab, Bb, Cb, init, chunk);
  const auto B = x.size(0), H = x.size(2), P = x.size(3);
  const int64_t N = (dtf.has_value() ? *Bf : *Bb).size(3);
  if (dfinal.has_value() && dfinal->numel() > 0)
    TORCH_CHECK(dfinal->sizes() == at::IntArrayRef({B, H, P, N}) && dfinal->is_contiguous() &&
                    dfinal->scalar_type() == x.scalar_type(),
                "native scan: the final state's gradient must be contiguous (B, H, P, N)");
  const int64_t nC = (x.size(1) + chunk - 1) / chunk;
  std::vector<at::Tensor> out = backward_outputs(x, dtf, Bf, dtb, Bb, init, {B, nC, H});
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scan_backward", [&] {
    const Shape s = shape_of(x, dtf.has_value() ? *Bf : *Bb, chunk);
    ScanGradWork<scalar_t> work(s);
    for (int dir = 0; dir < 2; ++dir) {
      const auto& dt = dir == 0 ? dtf : dtb;
      if (!dt.has_value()) continue;
      const auto& A = dir == 0 ? Af : Ab;
      const auto& Bm = dir == 0 ? Bf : Bb;
      const auto& Cm = dir == 0 ? Cf : Cb;
      const int base = 1 + 4 * dir;
      scan_direction_backward<scalar_t>(
          s, x.data_ptr<scalar_t>(), dt->data_ptr<scalar_t>(), A->data_ptr<scalar_t>(), Bm->data_ptr<scalar_t>(),
          Cm->data_ptr<scalar_t>(), dir == 1, shift, dir == 0 ? ptr_or_null<scalar_t>(init) : nullptr,
          dy.data_ptr<scalar_t>(), dir == 0 ? ptr_or_null<scalar_t>(dfinal) : nullptr, out[0].data_ptr<scalar_t>(),
          out[base].data_ptr<scalar_t>(), out[base + 2].data_ptr<scalar_t>(), out[base + 3].data_ptr<scalar_t>(),
          out[base + 1].data_ptr<scalar_t>(), dir == 0 && init.has_value() ? out[9].data_ptr<scalar_t>() : nullptr,
          work);
    }
  });
  for (int dir = 0; dir < 2; ++dir) {
    if (!(dir == 0 ? dtf : dtb).has_value()) continue;
    const int base = 1 + 4 * dir;
    out[base + 1] = out[base + 1].sum(at::IntArrayRef{0, 1});  // dA per (batch, chunk, head)
    out[base + 3] = unshift(out[base + 3], shift, dir == 1);    // dC~ at each row's own position
  }
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("scan_forward(Tensor x, Tensor? dt_f, Tensor? A_f, Tensor? B_f, Tensor? C_f, Tensor? dt_b, Tensor? A_b, "
        "Tensor? B_b, Tensor? C_b, Tensor? initial_state, bool shift, int chunk, bool want_final) "
        "-> (Tensor, Tensor)");
  m.def("scan_backward(Tensor dy, Tensor? dfinal, Tensor x, Tensor? dt_f, Tensor? A_f, Tensor? B_f, Tensor? C_f, "
        "Tensor? dt_b, Tensor? A_b, Tensor? B_b, Tensor? C_b, Tensor? initial_state, bool shift, int chunk) "
        "-> Tensor[]");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("scan_forward", &scan_forward);
  m.impl("scan_backward", &scan_backward);
}
