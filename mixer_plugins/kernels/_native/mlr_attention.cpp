// Fused MLR attention for CPU tensors: flash-style forward and backward, one score width per group of pairs.
//
// Compiled at install (setup.py: torch.utils.cpp_extension) into mixer_plugins/kernels/_native/_C and
// registered as torch.ops.mixer_plugins_native.mlr_forward / mlr_backward. Python owns the argument checks (see
// kernels/mlr_attention/native.py); docs/structured_attention.md has the math.
//
// Layout: q, k (B, L, H, D) and v (B, L, H, P) with any strides but a unit feature stride (read in place: the
// mixer's views need no copy), the output (B, L, H, P) and the log-sum-exp (B, L, H) contiguous. The level scales
// are applied to each query tile as it is read (a thread's scratch copy), and to dQ as each tile's rows complete.
//
// Traversal. Levels nest, so the levels a pair (i, j) shares are a prefix 0..m: one score width
// W_m = r_0 + ... + r_m and one scale. For each query tile, `tile_ranges` lists key ranges that a set of the tile's
// rows all share the same levels with (plain ranges: one BLAS product at their own width; the coarse levels' ranges
// take all the tile's rows at once) and, near the diagonal, leaves where finer blocks cut the rows (a product per
// finer level, added entry by entry over each row's block, and the causal mask). Each range is cut into key chunks; a chunk's probabilities come
// from a vectorized exp, its values from a second product (online softmax across chunks, as in flash attention). The
// backward visits the same ranges with the row log-sum-exp: five products per chunk (scores, dV, dP, dQ, dK), two
// more per finer level in a leaf. Every buffer is a thread's scratch, allocated once per call.
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
// `feature` holds each feature's level scale tau_l.
struct Levels {
  int64_t length;
  std::vector<int64_t> size, width;
  std::vector<double> scale, feature;
  int depth() const { return static_cast<int>(size.size()) - 1; }
};

Levels make_levels(int64_t length, const std::vector<int64_t>& widths, const std::vector<int64_t>& sizes,
                   const std::vector<double>& scales, const std::vector<double>& taus) {
  TORCH_CHECK(widths.size() == sizes.size() && sizes.size() == scales.size() && taus.size() == sizes.size() &&
                  !sizes.empty(),
              "mlr native: one width, size, scale and tau per level");
  Levels lv;
  lv.length = length;
  for (size_t l = 0; l < widths.size(); ++l) {
    TORCH_CHECK(widths[l] > (l ? widths[l - 1] : 0), "mlr native: the widths must increase");
    lv.feature.resize(widths[l], taus[l]);
  }
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

// Products with a narrow output: dQ and dK of the coarse levels' score width (often 8 or 16 features). BLAS packs
// panels for such shapes at a cost several times the arithmetic, so up to NARROW features they are loops: dQ's rows
// as NARROW-wide vectors, over a copy kp (kn x NARROW) of the chunk's key features padded with zeros; dK's columns
// along the chunk's keys.
constexpr int64_t NARROW = 16;

template <typename T>
void pad_rows(T* kp, const T* K, int64_t ldk, int64_t kn, int64_t w) {
  for (int64_t j = 0; j < kn; ++j) {
    std::copy_n(K + j * ldk, w, kp + j * NARROW);
    std::fill(kp + j * NARROW + w, kp + (j + 1) * NARROW, T(0));
  }
}

// dq (rn x w, rows ldq apart) += ds (rn x kn) kp[:, :w]
template <typename T>
void narrow_dq(T* dq, int64_t ldq, const T* ds, const T* kp, int64_t rn, int64_t kn, int64_t w) {
  for (int64_t i = 0; i < rn; ++i) {
    T* dqi = dq + i * ldq;
    for (int64_t j = 0; j < kn; ++j) {
      const T d = ds[i * kn + j];
      for (int64_t c = 0; c < w; ++c) dqi[c] += d * kp[j * NARROW + c];
    }
  }
}

#ifdef MIXER_PLUGINS_NATIVE_VECTOR
// The same for float32 in ATen's vectors, R rows at a time: each key's padded features are loaded once for the R
// rows, whose sums stay in registers (two per row, over alternate keys, so that the additions overlap)
template <int64_t R>
inline void narrow_dq_rows(float* dq, int64_t ldq, const float* d, const float* kp, int64_t kn, int64_t w) {
  constexpr int64_t V = NARROW / kLanes;
  Vec acc[2][R][V];
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t v = 0; v < V; ++v) acc[h][r][v] = Vec(0.0f);
  int64_t j = 0;
  for (; j + 2 <= kn; j += 2) {
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t v = 0; v < V; ++v) {
        const Vec kv = Vec::loadu(kp + (j + h) * NARROW + v * kLanes);
        for (int64_t r = 0; r < R; ++r) acc[h][r][v] = at::vec::fmadd(Vec(d[r * kn + j + h]), kv, acc[h][r][v]);
      }
    }
  }
  if (j < kn) {
    for (int64_t v = 0; v < V; ++v) {
      const Vec kv = Vec::loadu(kp + j * NARROW + v * kLanes);
      for (int64_t r = 0; r < R; ++r) acc[0][r][v] = at::vec::fmadd(Vec(d[r * kn + j]), kv, acc[0][r][v]);
    }
  }
  float sum[NARROW];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t v = 0; v < V; ++v) (acc[0][r][v] + acc[1][r][v]).store(sum + v * kLanes);
    float* dqi = dq + r * ldq;
    for (int64_t c = 0; c < w; ++c) dqi[c] += sum[c];
  }
}

inline void narrow_dq(float* dq, int64_t ldq, const float* ds, const float* kp, int64_t rn, int64_t kn, int64_t w) {
  int64_t i = 0;
  for (; i + 4 <= rn; i += 4) narrow_dq_rows<4>(dq + i * ldq, ldq, ds + i * kn, kp, kn, w);
  for (; i < rn; ++i) narrow_dq_rows<1>(dq + i * ldq, ldq, ds + i * kn, kp, kn, w);
}
#endif

// dk (kn x w, rows ldk apart) += ds^T q (q: rn x w, rows ldq apart), through dkt (w x kn) scratch, four rows of ds
// at a time
template <typename T>
void narrow_dk(T* dk, int64_t ldk, const T* ds, const T* q, int64_t ldq, T* dkt, int64_t rn, int64_t kn,
               int64_t w) {
  std::fill(dkt, dkt + w * kn, T(0));
  int64_t i = 0;
  for (; i + 4 <= rn; i += 4) {
    const T *d0 = ds + i * kn, *d1 = d0 + kn, *d2 = d1 + kn, *d3 = d2 + kn;
    for (int64_t c = 0; c < w; ++c) {
      const T q0 = q[i * ldq + c], q1 = q[(i + 1) * ldq + c], q2 = q[(i + 2) * ldq + c], q3 = q[(i + 3) * ldq + c];
      T* dc = dkt + c * kn;
#pragma omp simd
      for (int64_t j = 0; j < kn; ++j) dc[j] += (q0 * d0[j] + q1 * d1[j]) + (q2 * d2[j] + q3 * d3[j]);
    }
  }
  for (; i < rn; ++i) {
    const T* di = ds + i * kn;
    for (int64_t c = 0; c < w; ++c) {
      const T qc = q[i * ldq + c];
      T* dc = dkt + c * kn;
#pragma omp simd
      for (int64_t j = 0; j < kn; ++j) dc[j] += qc * di[j];
    }
  }
  for (int64_t j = 0; j < kn; ++j) {
    T* dkj = dk + j * ldk;
    for (int64_t c = 0; c < w; ++c) dkj[c] += dkt[c * kn + j];
  }
}

// Leaves are split while the finer blocks that cut them hold at least this many rows (below it, one masked leaf).
constexpr int64_t LEAF_SPLIT = 64;

// The (rows, keys) ranges of query tile [t0, t1): f(r0, r1, k0, k1, d, leaf) with [r0, r1) a subrange of the tile.
//
// Let d* be the deepest depth whose one block holds the whole tile. For every depth e < d*, the keys of the tile's
// depth-e block outside its depth-(e + 1) block share exactly depths 0..e with every row: plain ranges (all the
// tile's rows, width W_e). Inside a depth-d block B holding rows [r0, r1), the keys outside the span of the
// depth-(d + 1) blocks that meet the rows share exactly depths 0..d with them: plain ranges again. The span, the
// rows' neighbourhood, is split by the finer blocks while they hold at least LEAF_SPLIT rows (each block's rows
// against its siblings' keys plain, against its own keys one level deeper); below that it is one *leaf*: every pair
// shares depths 0..d and, entry by entry, the finer levels whose block holds it (and the causal mask). Keys at and
// beyond `valid` (right padding), and after the rows when causal, are never visited.
template <typename F>
void tile_ranges(const Levels& lv, int64_t t0, int64_t t1, int64_t valid, bool causal, F& f) {
  const int64_t L = lv.length;
  const int D = lv.depth();
  auto emit = [&](int64_t r0, int64_t r1, int64_t k0, int64_t k1, int d, bool leaf) {
    k1 = std::min(k1, causal ? std::min(valid, r1) : valid);
    if (k0 < k1) f(r0, r1, k0, k1, d, leaf);
  };
  int d = 0;
  while (d < D && t0 / lv.size[d + 1] == (t1 - 1) / lv.size[d + 1]) ++d;
  for (int e = 0; e < d; ++e) {
    const int64_t p0 = t0 / lv.size[e] * lv.size[e], p1 = std::min(p0 + lv.size[e], L);
    const int64_t c0 = t0 / lv.size[e + 1] * lv.size[e + 1], c1 = std::min(c0 + lv.size[e + 1], L);
    emit(t0, t1, p0, c0, e, false);
    emit(t0, t1, c1, p1, e, false);
  }
  // rows [r0, r1) inside one depth-e block: every key of the block
  auto block = [&](auto& self, int64_t r0, int64_t r1, int e) -> void {
    const int64_t p0 = r0 / lv.size[e] * lv.size[e], p1 = std::min(p0 + lv.size[e], L);
    if (e == D) {  // the rows lie in one finest block: every pair shares every depth
      emit(r0, r1, p0, p1, e, causal);
      return;
    }
    const int64_t cs = lv.size[e + 1];
    const int64_t s0 = r0 / cs * cs, s1 = std::min(((r1 - 1) / cs + 1) * cs, p1);
    emit(r0, r1, p0, s0, e, false);
    emit(r0, r1, s1, p1, e, false);
    if (cs < LEAF_SPLIT) {
      emit(r0, r1, s0, s1, e, true);
      return;
    }
    for (int64_t c0 = s0; c0 < s1; c0 += cs) {
      const int64_t c1 = std::min(c0 + cs, p1), a = std::max(r0, c0), b = std::min(r1, c1);
      emit(a, b, s0, c0, e, false);
      emit(a, b, c1, s1, e, false);
      self(self, a, b, e + 1);
    }
  };
  block(block, t0, t1, d);
}

// Below, qt (rn rows, ldq apart) are scaled query rows, r0 the first one's position; K (keys from k0, ldk apart) the
// head's key rows.

// Scores of the tile against keys [k0, k0 + kn) sharing exactly depths 0..d: s = scale_d qt[:, :W_d] k^T.
template <typename T>
void plain_scores(T* s, const T* qt, int64_t ldq, const T* K, int64_t ldk, int64_t rn, int64_t k0, int64_t kn, int d,
                  const Levels& lv) {
  if (lv.width[d] > 0) {
    gemm<T>(false, true, rn, kn, lv.width[d], static_cast<T>(lv.scale[d]), qt, ldq, K + k0 * ldk, ldk, T(0), s, kn);
  } else {
    std::fill(s, s + rn * kn, T(0));
  }
}

// s (rn x kn, a leaf chunk) *= the scale of each entry's number of shared depths; -inf above the diagonal when
// `causal`.
template <typename T>
void leaf_scale(T* s, int64_t r0, int64_t rn, int64_t k0, int64_t kn, int d, const Levels& lv, bool causal) {
  const int D = lv.depth();
  for (int64_t i = 0; i < rn; ++i) {
    T* si = s + i * kn;
    // nested ranges [a, b) of the row's depth-e blocks (e = d .. D) within the chunk; entries in range e but not in
    // range e + 1 share exactly depths 0..e
    int64_t a = 0, b = kn;
    for (int e = d; e <= D; ++e) {
      int64_t na = b, nb = b;  // the next range (empty past the finest level)
      if (e < D) {
        const int64_t b0 = (r0 + i) / lv.size[e + 1] * lv.size[e + 1];
        na = std::max(std::min(std::max(b0, k0) - k0, b), a);
        nb = std::max(std::min(b0 + lv.size[e + 1], k0 + kn) - k0, na);
      }
      const T sc = static_cast<T>(lv.scale[e]);
      if (sc != T(1)) {
        for (int64_t j = a; j < na; ++j) si[j] *= sc;
        for (int64_t j = nb; j < b; ++j) si[j] *= sc;
      }
      if (na >= nb) break;
      a = na;
      b = nb;
    }
    if (causal) {
      const int64_t first = std::max<int64_t>(r0 + i + 1 - k0, 0);
      for (int64_t j = first; j < kn; ++j) si[j] = -std::numeric_limits<T>::infinity();
    }
  }
}

// Scores of a leaf chunk, every pair sharing depths 0..d and, entry by entry, the finer depths whose block holds it:
// s = scale(i, j) * sum of the shared levels' products, -inf above the diagonal when `causal`; g is scratch.
template <typename T>
void leaf_scores(T* s, T* g, const T* qt, int64_t ldq, const T* K, int64_t ldk, int64_t r0, int64_t rn, int64_t k0,
                 int64_t kn, int d, const Levels& lv, bool causal) {
  const int D = lv.depth();
  if (lv.width[d] > 0) {
    gemm<T>(false, true, rn, kn, lv.width[d], T(1), qt, ldq, K + k0 * ldk, ldk, T(0), s, kn);
  } else {
    std::fill(s, s + rn * kn, T(0));
  }
  for (int e = d + 1; e <= D; ++e) {
    const int64_t size = lv.size[e], c0 = lv.width[e - 1], r = lv.width[e] - c0;
    // the keys of the chunk inside some row's depth-e block: none, none at the finer levels either
    const int64_t lo = std::max(r0 / size * size, k0), hi = std::min(((r0 + rn - 1) / size + 1) * size, k0 + kn);
    if (lo >= hi) break;
    gemm<T>(false, true, rn, kn, r, T(1), qt + c0, ldq, K + k0 * ldk + c0, ldk, T(0), g, kn);
    for (int64_t i = 0; i < rn; ++i) {
      const int64_t b0 = (r0 + i) / size * size;
      const int64_t a = std::max(b0, k0) - k0, b = std::min(b0 + size, k0 + kn) - k0;
      T* si = s + i * kn;
      const T* gi = g + i * kn;
#pragma omp simd
      for (int64_t j = a; j < b; ++j) si[j] += gi[j];
    }
  }
  leaf_scale(s, r0, rn, k0, kn, d, lv, causal);
}

// The leaf's gradients of the finer levels: for each depth e > d, dQ[rows, level cols] += dS_e K[keys, level cols]
// and dK[keys, level cols] += dS_e^T qt[:, level cols], with dS_e the entries of ds inside the rows' depth-e blocks
// (copied into g, zeros elsewhere).
template <typename T>
void leaf_level_grads(const T* ds, T* g, const T* qt, int64_t ldq, const T* K, int64_t ldk, T* dQt, int64_t lddq,
                      T* dK, int64_t lddk, int64_t r0, int64_t rn, int64_t k0, int64_t kn, int d, const Levels& lv) {
  const int D = lv.depth();
  for (int e = d + 1; e <= D; ++e) {
    const int64_t size = lv.size[e], c0 = lv.width[e - 1], r = lv.width[e] - c0;
    const int64_t lo = std::max(r0 / size * size, k0), hi = std::min(((r0 + rn - 1) / size + 1) * size, k0 + kn);
    if (lo >= hi) break;
    for (int64_t i = 0; i < rn; ++i) {
      const int64_t b0 = (r0 + i) / size * size;
      const int64_t a = std::min(std::max(b0, k0) - k0, kn), b = std::max(std::min(b0 + size, k0 + kn) - k0, a);
      T* gi = g + i * kn;
      const T* di = ds + i * kn;
      std::fill(gi, gi + a, T(0));
      std::copy(di + a, di + b, gi + a);
      std::fill(gi + b, gi + kn, T(0));
    }
    gemm<T>(false, false, rn, r, kn, T(1), g, kn, K + k0 * ldk + c0, ldk, T(1), dQt + c0, lddq);
    gemm<T>(true, false, kn, r, rn, T(1), g, kn, qt + c0, ldq, T(1), dK + k0 * lddk + c0, lddk);
  }
}

struct Tiles {
  int64_t q, k;
};

// Scratch of one thread for a whole call (reused by every tile): scores, the leaf's level products, the score
// gradients (backward), the tile's scaled queries, the padded narrow keys and dK's narrow columns, and two row
// statistics.
template <typename T>
struct Scratch {
  std::vector<T> s, g, p, qs, kp, dkt, r1, r2;
  Scratch(Tiles tiles, int64_t width, bool backward)
      : s(tiles.q * tiles.k), g(tiles.q * tiles.k), p(backward ? tiles.q * tiles.k : 0), qs(tiles.q * width),
        kp(backward ? NARROW * tiles.k : 0), dkt(backward ? NARROW * tiles.k : 0), r1(tiles.q), r2(tiles.q) {}
};

// qs (rn x D, contiguous) = the rows of Q from t0 times each feature's level scale
template <typename T>
void scaled_rows(T* qs, const T* Q, int64_t ldq, int64_t t0, int64_t rn, int64_t D, const Levels& lv) {
  for (int64_t i = 0; i < rn; ++i) {
    const T* qi = Q + (t0 + i) * ldq;
    T* si = qs + i * D;
    for (int64_t c = 0; c < D; ++c) si[c] = qi[c] * static_cast<T>(c < int64_t(lv.feature.size()) ? lv.feature[c] : 0);
  }
}

// A strided (B, L, H, X) tensor: the rows of (b, h) start at p + b * sb + h * sh and lie ld apart.
template <typename T>
struct Strided {
  T* p;
  int64_t sb, ld, sh;
  T* head(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

template <typename T>
Strided<T> strided(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& valid,
                  const Levels& lv, bool causal, Tiles tiles, at::Tensor& out, at::Tensor& lse) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), P = v.size(3);
  const int64_t ldo = H * P;
  const int64_t ntiles = (L + tiles.q - 1) / tiles.q;
  const auto Qs = strided<T>(q), Ks = strided<T>(k), Vs = strided<T>(v);
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  at::parallel_for(0, B * H * ntiles, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> buf(tiles, D, false);
    T* mrow = buf.r1.data();
    T* lrow = buf.r2.data();
    T* qs = buf.qs.data();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bh = item / ntiles, t = item % ntiles, b = bh / H, h = bh % H;
      const T* K = Ks.head(b, h);
      const T* V = Vs.head(b, h);
      T* O = op + b * L * ldo + h * P;
      const int64_t t0 = t * tiles.q, t1 = std::min(t0 + tiles.q, L), rn = t1 - t0;
      scaled_rows(qs, Qs.head(b, h), Qs.ld, t0, rn, D, lv);
      std::fill(mrow, mrow + rn, -std::numeric_limits<T>::infinity());
      std::fill(lrow, lrow + rn, T(0));
      for (int64_t i = t0; i < t1; ++i) std::fill(O + i * ldo, O + i * ldo + P, T(0));
      auto range = [&](int64_t r0, int64_t r1, int64_t k0, int64_t k1, int d, bool leaf) {
        const int64_t off = r0 - t0, n = r1 - r0;
        const T* qr = qs + off * D;
        T* m = mrow + off;
        T* l = lrow + off;
        for (int64_t kc = k0; kc < k1; kc += tiles.k) {
          const int64_t kn = std::min(tiles.k, k1 - kc);
          T* s = buf.s.data();
          if (leaf) {
            leaf_scores<T>(s, buf.g.data(), qr, D, K, Ks.ld, r0, n, kc, kn, d, lv, causal);
          } else {
            plain_scores<T>(s, qr, D, K, Ks.ld, n, kc, kn, d, lv);
          }
          for (int64_t i = 0; i < n; ++i) {  // online softmax
            T* si = s + i * kn;
            const T m_new = std::max(m[i], row_max(si, kn));
            if (m_new == -std::numeric_limits<T>::infinity()) {  // no allowed key yet: nothing to add
              std::fill(si, si + kn, T(0));
              continue;
            }
            const T alpha = m[i] == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(m[i] - m_new);
            l[i] = l[i] * alpha + exp_shift_sum(si, kn, m_new);
            m[i] = m_new;
            if (alpha != T(1)) {
              T* oi = O + (r0 + i) * ldo;
#pragma omp simd
              for (int64_t p = 0; p < P; ++p) oi[p] *= alpha;
            }
          }
          gemm<T>(false, false, n, P, kn, T(1), s, kn, V + kc * Vs.ld, Vs.ld, T(1), O + r0 * ldo, ldo);
        }
      };
      tile_ranges(lv, t0, t1, valid[b], causal, range);
      for (int64_t i = 0; i < rn; ++i) {
        const T l = lrow[i];
        const T inv = l > T(0) ? T(1) / l : T(0);
        T* oi = O + (t0 + i) * ldo;
#pragma omp simd
        for (int64_t p = 0; p < P; ++p) oi[p] *= inv;
        lp[(b * L + t0 + i) * H + h] = l > T(0) ? mrow[i] + std::log(l) : -std::numeric_limits<T>::infinity();
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const std::vector<int64_t>& valid, const Levels& lv,
                   bool causal, Tiles tiles, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), P = v.size(3);
  const int64_t ldg = H * D, ldo = H * P;  // the contiguous outputs' row strides (dq, dk; out, dv)
  const auto Qs = strided<T>(q), Ks = strided<T>(k), Vs = strided<T>(v), Gs = strided<T>(dout);
  const T* op = out.data_ptr<T>();
  const T* lp = lse.data_ptr<T>();
  T* dqp = dq.data_ptr<T>();
  T* dkp = dk.data_ptr<T>();
  T* dvp = dv.data_ptr<T>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> buf(tiles, D, true);
    T* delta = buf.r1.data();
    T* lrow = buf.r2.data();
    T* qs = buf.qs.data();
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const T* K = Ks.head(b, h);
      const T* V = Vs.head(b, h);
      const T* G = Gs.head(b, h);
      const T* O = op + b * L * ldo + h * P;
      T* dQ = dqp + b * L * ldg + h * D;
      T* dK = dkp + b * L * ldg + h * D;
      T* dV = dvp + b * L * ldo + h * P;
      for (int64_t i = 0; i < L; ++i) {
        std::fill(dQ + i * ldg, dQ + i * ldg + D, T(0));
        std::fill(dK + i * ldg, dK + i * ldg + D, T(0));
        std::fill(dV + i * ldo, dV + i * ldo + P, T(0));
      }
      for (int64_t t0 = 0; t0 < L; t0 += tiles.q) {
        const int64_t t1 = std::min(t0 + tiles.q, L), rn = t1 - t0;
        scaled_rows(qs, Qs.head(b, h), Qs.ld, t0, rn, D, lv);
        for (int64_t i = t0; i < t1; ++i) {
          T acc = 0;
          const T* gi = G + i * Gs.ld;
          const T* oi = O + i * ldo;
#pragma omp simd reduction(+ : acc)
          for (int64_t p = 0; p < P; ++p) acc += gi[p] * oi[p];
          delta[i - t0] = acc;
          lrow[i - t0] = lp[(b * L + i) * H + h];
        }
        T* dQt = dQ + t0 * ldg;
        auto range = [&](int64_t r0, int64_t r1, int64_t k0, int64_t k1, int d, bool leaf) {
          const int64_t off = r0 - t0, n = r1 - r0;
          const T* qr = qs + off * D;
          T* dQr = dQt + off * ldg;
          const T* Gr = G + r0 * Gs.ld;
          const T scale = static_cast<T>(lv.scale[d]);
          for (int64_t kc = k0; kc < k1; kc += tiles.k) {
            const int64_t kn = std::min(tiles.k, k1 - kc);
            T* s = buf.s.data();
            T* ds = buf.p.data();
            if (leaf) {
              leaf_scores<T>(s, buf.g.data(), qr, D, K, Ks.ld, r0, n, kc, kn, d, lv, causal);
            } else {
              plain_scores<T>(s, qr, D, K, Ks.ld, n, kc, kn, d, lv);
            }
            for (int64_t i = 0; i < n; ++i) {
              if (lrow[off + i] == -std::numeric_limits<T>::infinity()) {
                std::fill(s + i * kn, s + (i + 1) * kn, T(0));
              } else {
                exp_shift_sum(s + i * kn, kn, lrow[off + i]);
              }
            }
            // dV[keys] += P^T dO[rows];  dP = dO[rows] V[keys]^T
            gemm<T>(true, false, kn, P, n, T(1), s, kn, Gr, Gs.ld, T(1), dV + kc * ldo, ldo);
            gemm<T>(false, true, n, kn, P, T(1), Gr, Gs.ld, V + kc * Vs.ld, Vs.ld, T(0), ds, kn);
            const T plain = leaf ? T(1) : scale;  // a leaf's scale is per entry (below)
            for (int64_t i = 0; i < n; ++i) {
              const T di = delta[off + i];
              T* dsi = ds + i * kn;
              const T* pi = s + i * kn;
#pragma omp simd
              for (int64_t j = 0; j < kn; ++j) dsi[j] = pi[j] * (dsi[j] - di) * plain;
            }
            if (leaf) leaf_scale<T>(ds, r0, n, kc, kn, d, lv, false);
            // dQ[rows, :W] += dS K[keys, :W];  dK[keys, :W] += dS^T qs[rows, :W]
            const int64_t w = lv.width[d];
            if (w > 0 && w <= NARROW) {
              pad_rows(buf.kp.data(), K + kc * Ks.ld, Ks.ld, kn, w);
              narrow_dq(dQr, ldg, ds, buf.kp.data(), n, kn, w);
              narrow_dk(dK + kc * ldg, ldg, ds, qr, D, buf.dkt.data(), n, kn, w);
            } else if (w > 0) {
              gemm<T>(false, false, n, w, kn, T(1), ds, kn, K + kc * Ks.ld, Ks.ld, T(1), dQr, ldg);
              gemm<T>(true, false, kn, w, n, T(1), ds, kn, qr, D, T(1), dK + kc * ldg, ldg);
            }
            if (leaf) {
              leaf_level_grads<T>(ds, buf.g.data(), qr, D, K, Ks.ld, dQr, ldg, dK, ldg, r0, n, kc, kn, d, lv);
            }
          }
        };
        tile_ranges(lv, t0, t1, valid[b], causal, range);
        for (int64_t i = 0; i < rn; ++i) {  // the tile's dQ is complete: the gradient of the unscaled queries
          T* dqi = dQt + i * ldg;
          for (int64_t c = 0; c < D; ++c) dqi[c] *= static_cast<T>(c < int64_t(lv.feature.size()) ? lv.feature[c] : 0);
        }
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
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "mlr native: inputs with unit feature stride");
}

std::tuple<at::Tensor, at::Tensor> mlr_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const c10::optional<at::Tensor>& key_len, at::IntArrayRef widths,
                                               at::IntArrayRef sizes, at::ArrayRef<double> scales,
                                               at::ArrayRef<double> taus, bool causal, int64_t tile_q, int64_t tile_k) {
  check_inputs(q, k, v);
  TORCH_CHECK(tile_q > 0 && tile_k > 0, "mlr native: tiles must be positive");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), P = v.size(3);
  const Levels lv = make_levels(L, widths.vec(), sizes.vec(), scales.vec(), taus.vec());
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
    at::ArrayRef<double> scales, at::ArrayRef<double> taus, bool causal, int64_t tile_q, int64_t tile_k) {
  check_inputs(q, k, v);
  TORCH_CHECK(tile_q > 0 && tile_k > 0, "mlr native: tiles must be positive");
  TORCH_CHECK(dout.sizes() == v.sizes() && out.sizes() == v.sizes() && dout.stride(3) == 1 && out.is_contiguous() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "mlr native: dout (B, L, H, P) with unit feature stride and contiguous out, of q's dtype");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2) &&
                  lse.is_contiguous() && lse.scalar_type() == q.scalar_type(),
              "mlr native: lse must be contiguous (B, L, H) of q's dtype");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), P = v.size(3);
  const Levels lv = make_levels(L, widths.vec(), sizes.vec(), scales.vec(), taus.vec());
  const auto valid = valid_lengths(key_len.has_value() ? *key_len : at::Tensor(), B, L);
  at::Tensor dq = at::empty({B, L, H, D}, q.options()), dk = at::empty({B, L, H, D}, q.options());
  at::Tensor dv = at::empty({B, L, H, P}, q.options());
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
        "float[] taus, bool causal, int tile_q, int tile_k) -> (Tensor, Tensor)");
  m.def("mlr_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? key_len, "
        "int[] widths, int[] sizes, float[] scales, float[] taus, bool causal, int tile_q, int tile_k) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CPU, m) {
  m.impl("mlr_forward", &mlr_forward);
  m.impl("mlr_backward", &mlr_backward);
}
