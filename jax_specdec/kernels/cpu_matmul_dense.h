// SmallMatmul's products, y[M, N] = x[M, K] @ w[K, N] for a piece of the columns:
// Columns, for up to kGroup rows (each weight read once).

#ifndef JAX_SPECDEC_SMALL_MATMUL_DENSE_H_
#define JAX_SPECDEC_SMALL_MATMUL_DENSE_H_

#include <algorithm>
#include <cstdint>

#include "cpu_matmul_vec.h"

namespace {

// Rows k .. k+R-1 of w, columns [n0, n1): y[m, c] += sum_r x[m, k + r] * w[k + r, c],
// NV vectors of columns at a time. Each weight row is read front to back; y (M x N
// floats) stays in cache.
template <typename W, int M, int R, int NV>
void RowBlock(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t k,
              int64_t n0, int64_t n1) {
  const bool first = k == 0;
  int64_t c = n0;
  for (; c + NV * kLanes <= n1; c += NV * kLanes) {
    Vec acc[M][NV];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = first ? Vec{} : Load(y + m * N + c + j * kLanes);
    for (int r = 0; r < R; ++r) {
      Vec wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = LoadW(w + (k + r) * N + c + j * kLanes);
      // The next block's rows, same columns, into L2: without it the streams of 8 rows
      // stall once several rows of x make each line take longer (5 rows: 1.45x slower).
      if (k + R + r < K)
        for (int j = 0; j < NV; ++j) __builtin_prefetch(w + (k + R + r) * N + c + j * kLanes, 0, 2);
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * K + k + r];
        for (int j = 0; j < NV; ++j) acc[m][j] += xv * wv[j];
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NV; ++j) Store(y + m * N + c + j * kLanes, acc[m][j]);
  }
  for (; c < n1; ++c)
    for (int m = 0; m < M; ++m)
      y[m * N + c] = Chain(x + m * K, w + c, N, k, k + R, first ? 0.f : y[m * N + c]);
}

// Two vectors of columns per pass where more rows would leave the loads of x the
// bottleneck (measured: 8 rows 1.4x faster, 5 rows 8% slower than one vector).
template <typename W, int M, int R>
void Block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t k,
           int64_t n0, int64_t n1) {
  RowBlock<W, M, R, (M <= 5 ? 1 : 2)>(x, w, y, K, N, k, n0, n1);
}

template <typename W>
using BlockFn = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

template <typename W>
BlockFn<W> BlockFor(int64_t m, bool eight) {
  static constexpr BlockFn<W> whole[kGroup] = {
      Block<W, 1, 8>, Block<W, 2, 8>, Block<W, 3, 8>, Block<W, 4, 8>,
      Block<W, 5, 8>, Block<W, 6, 8>, Block<W, 7, 8>, Block<W, 8, 8>};
  static constexpr BlockFn<W> single[kGroup] = {
      Block<W, 1, 1>, Block<W, 2, 1>, Block<W, 3, 1>, Block<W, 4, 1>,
      Block<W, 5, 1>, Block<W, 6, 1>, Block<W, 7, 1>, Block<W, 8, 1>};
  return (eight ? whole : single)[m - 1];
}

// y[:, n0:n1] for up to kGroup rows of x: blocks of 8 weight rows, each read once.
template <typename W>
void Columns(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  for (int64_t k = 0; k < K;) {
    const bool eight = k + 8 <= K;
    BlockFor<W>(M, eight)(x, w, y, K, N, k, n0, n1);
    k += eight ? 8 : 1;
  }
}

}  // namespace

#endif  // JAX_SPECDEC_SMALL_MATMUL_DENSE_H_
