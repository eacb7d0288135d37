// SmallMatmulT's products, y[M, V] = x[M, D] @ e[V, D]^T for a piece of e's rows (a
// tied embedding as the LM head): Rows, for up to kGroup rows of x.
// e's elements are float32, or 16-bit widened as they are read (W: cpu_matmul_vec.h).

#ifndef JAX_SPECDEC_SMALL_MATMUL_TIED_H_
#define JAX_SPECDEC_SMALL_MATMUL_TIED_H_

#include <algorithm>
#include <cstdint>

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

}  // namespace

#endif  // JAX_SPECDEC_SMALL_MATMUL_TIED_H_
