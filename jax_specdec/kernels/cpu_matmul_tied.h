// SmallMatmulT's products, y[M, V] = x[M, D] @ e[V, D]^T for a piece of e's rows (a
// tied embedding as the LM head): Rows (up to kGroup rows) and TransposedTiles (more).
// e's elements are float32, or 16-bit widened as they are read (W: cpu_matmul_vec.h).

#ifndef JAX_SPECDEC_SMALL_MATMUL_TIED_H_
#define JAX_SPECDEC_SMALL_MATMUL_TIED_H_

#include <algorithm>
#include <cstdint>
#include <memory>

#include "cpu_matmul_vec.h"

namespace {

// y[m, v .. v+RV-1] = x[m, :] . e[v + r, :] for M rows of x.
template <typename W, int M, int RV>
void RowGroup(const float* x, const W* e, float* y, int64_t D, int64_t V, int64_t v,
              bool prefetch) {
  const int64_t whole = D / kLanes * kLanes;
  Vec acc[RV][M] = {};
  for (int64_t d = 0; d < whole; d += kLanes) {
    Vec ev[RV];
    for (int r = 0; r < RV; ++r) ev[r] = LoadW(e + (v + r) * D + d);
    if (prefetch)  // the next rows of e, same columns, into L2 (as above)
      for (int r = 0; r < RV; ++r) __builtin_prefetch(e + (v + RV + r) * D + d, 0, 2);
    for (int m = 0; m < M; ++m) {
      const Vec xv = Load(x + m * D + d);
      for (int r = 0; r < RV; ++r) acc[r][m] += xv * ev[r];
    }
  }
  for (int r = 0; r < RV; ++r) {
    for (int m = 0; m < M; ++m) {
      float s = Sum(acc[r][m]);
      for (int64_t d = whole; d < D; ++d)
        s = __builtin_fmaf(x[m * D + d], Widen(e[(v + r) * D + d]), s);
      y[m * V + v + r] = s;
    }
  }
}

template <typename W>
using GroupFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, bool);

// Four rows of e per pass up to 5 rows of x, three beyond (registers: RV * M
// accumulators); measured on the SmolLM2 LM head, 5 rows: 7.7 ms with four, 9.8 with two.
template <int M>
constexpr int kRowsOfE = M <= 5 ? 4 : 3;

template <typename W>
GroupFn<W> GroupFor(int64_t m, bool one) {
  static constexpr GroupFn<W> many[kGroup] = {
      RowGroup<W, 1, kRowsOfE<1>>, RowGroup<W, 2, kRowsOfE<2>>, RowGroup<W, 3, kRowsOfE<3>>,
      RowGroup<W, 4, kRowsOfE<4>>, RowGroup<W, 5, kRowsOfE<5>>, RowGroup<W, 6, kRowsOfE<6>>,
      RowGroup<W, 7, kRowsOfE<7>>, RowGroup<W, 8, kRowsOfE<8>>};
  static constexpr GroupFn<W> single[kGroup] = {
      RowGroup<W, 1, 1>, RowGroup<W, 2, 1>, RowGroup<W, 3, 1>, RowGroup<W, 4, 1>,
      RowGroup<W, 5, 1>, RowGroup<W, 6, 1>, RowGroup<W, 7, 1>, RowGroup<W, 8, 1>};
  return (one ? single : many)[m - 1];
}

// y[:, v0:v1] for up to kGroup rows of x: groups of rows of e, each read once.
template <typename W>
void Rows(const float* x, const W* e, float* y, int64_t M, int64_t D, int64_t V,
          int64_t v0, int64_t v1) {
  const int64_t step = M <= 5 ? 4 : 3;  // kRowsOfE<M>
  for (int64_t v = v0; v < v1;) {
    const bool one = v + step > v1;
    GroupFor<W>(M, one)(x, e, y, D, V, v, !one && v + 2 * step <= v1);
    v += one ? 1 : step;
  }
}

// More than kGroup rows of x through a tied LM head: the product is bound by arithmetic.
// Turned around, y^T = e @ x^T is a product of many rows (e's) with a small matrix (x^T,
// packed once per piece), taken by tiles of kTileRows rows of e x NV vectors of x^T's
// columns over kDepth of d at a time (that block of x^T stays in L1), for kChunk rows
// of e (in L2) whose partial sums wait in a small buffer, written to y's columns at the
// end. Every element is one multiply-add chain over d: not the lane order of Rows, so
// these rows are not bit for bit those of fewer rows (nor are XLA's).
constexpr int64_t kChunk = 96;

template <typename W, int RE, int NV>
void TileT(const float* xt, const W* e, float* part, int64_t D, int64_t v, int64_t d0,
           int64_t d1, bool prefetch) {
  constexpr int64_t stride = NV * kLanes;
  Vec acc[RE][NV];
  for (int r = 0; r < RE; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = d0 == 0 ? Vec{} : Load(part + r * stride + j * kLanes);
  for (int64_t d = d0; d < d1; ++d) {
    Vec xv[NV];
    for (int j = 0; j < NV; ++j) xv[j] = Load(xt + d * stride + j * kLanes);
    for (int r = 0; r < RE; ++r) {
      const float ev = Widen(e[(v + r) * D + d]);
      for (int j = 0; j < NV; ++j) acc[r][j] += ev * xv[j];
    }
    // The same rows of the next chunk into L2, a line at a time: every line once.
    if (prefetch && d % kLanes == 0)
      for (int r = 0; r < RE; ++r) __builtin_prefetch(e + (v + kChunk + r) * D + d, 0, 2);
  }
  for (int r = 0; r < RE; ++r)
    for (int j = 0; j < NV; ++j) Store(part + r * stride + j * kLanes, acc[r][j]);
}

template <typename W>
using TileTFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t,
                         bool);

template <typename W, int NV>
void RowsOfE(const float* xt, const W* e, float* y, int64_t M, int64_t D, int64_t V,
             int64_t v0, int64_t v1) {
  static constexpr TileTFn<W> tiles[kTileRows] = {TileT<W, 1, NV>, TileT<W, 2, NV>,
                                                  TileT<W, 3, NV>, TileT<W, 4, NV>,
                                                  TileT<W, 5, NV>, TileT<W, 6, NV>};
  constexpr int64_t stride = NV * kLanes;
  alignas(64) float part[kChunk * stride];
  for (int64_t c = v0; c < v1; c += kChunk) {
    const int64_t c1 = std::min(v1, c + kChunk);
    for (int64_t d0 = 0; d0 < D; d0 += kDepth)
      for (int64_t v = c; v < c1; v += kTileRows)
        tiles[std::min<int64_t>(kTileRows, c1 - v) - 1](xt, e, part + (v - c) * stride, D, v,
                                                        d0, std::min(D, d0 + kDepth),
                                                        c1 + kChunk <= v1);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t v = c; v < c1; ++v) y[m * V + v] = part[(v - c) * stride + m];
  }
}

template <typename W>
void TransposedTiles(const float* x, const W* e, float* y, int64_t M, int64_t D,
                     int64_t V, int64_t v0, int64_t v1) {
  static constexpr decltype(&RowsOfE<W, 1>) by_width[kMaxRows / kLanes] = {
      RowsOfE<W, 1>, RowsOfE<W, 2>, RowsOfE<W, 3>, RowsOfE<W, 4>};
  const int64_t nv = (M + kLanes - 1) / kLanes;
  std::unique_ptr<float[]> xt(new float[D * nv * kLanes]());  // x^T, columns padded
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = 0; d < D; ++d) xt[d * nv * kLanes + m] = x[m * D + d];
  by_width[nv - 1](xt.get(), e, y, M, D, V, v0, v1);
}

}  // namespace

#endif  // JAX_SPECDEC_SMALL_MATMUL_TIED_H_
