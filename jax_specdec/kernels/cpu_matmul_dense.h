// SmallMatmul's products, y[M, N] = x[M, K] @ w[K, N] for a piece of the columns:
// Columns (up to kGroup rows, each weight read once) and Tiles (more rows).

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

// More rows than kGroup: the product is bound by arithmetic, not by reading w. A tile
// of MR rows x kTileVecs vectors of columns stays in registers over kDepth rows of w,
// whose strip is first copied to a contiguous buffer: in place, rows a multiple of 4 KiB
// apart map to a few L1 sets and evict each other before the next group of rows reads
// them. Each element is still one multiply-add chain over k = 0 .. K-1, as in Columns.
constexpr int64_t kDepth = 128;
constexpr int kTileRows = 6;
constexpr int kTileVecs = 4;
constexpr int64_t kWidth = kTileVecs * kLanes;

// y[0:MR, c:c+kWidth] += x[0:MR, k0:k0+depth] @ strip (depth x kWidth, contiguous).
template <int MR>
void Tile(const float* x, const float* strip, float* y, int64_t K, int64_t N, int64_t k0,
          int64_t depth, int64_t c) {
  Vec acc[MR][kTileVecs];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kTileVecs; ++j)
      acc[m][j] = k0 == 0 ? Vec{} : Load(y + m * N + c + j * kLanes);
  for (int64_t k = 0; k < depth; ++k) {
    Vec wv[kTileVecs];
    for (int j = 0; j < kTileVecs; ++j) wv[j] = Load(strip + k * kWidth + j * kLanes);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * K + k0 + k];
      for (int j = 0; j < kTileVecs; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kTileVecs; ++j) Store(y + m * N + c + j * kLanes, acc[m][j]);
}

// Copies w[k0:k0+depth, c:c+kWidth] into strip (widened), and asks for the next strip's
// lines (same rows): the rows are more streams than the hardware prefetcher tracks.
template <typename W>
void Pack(const W* w, float* strip, int64_t N, int64_t k0, int64_t depth, int64_t c,
          bool prefetch) {
  for (int64_t k = 0; k < depth; ++k) {
    const W* row = w + (k0 + k) * N + c;
    for (int j = 0; j < kTileVecs; ++j) Store(strip + k * kWidth + j * kLanes, LoadW(row + j * kLanes));
    if (prefetch)
      for (int j = 0; j < kTileVecs; ++j) __builtin_prefetch(row + (kTileVecs + j) * kLanes, 0, 2);
  }
}

using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t);

template <typename W>
void Tiles(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N,
           int64_t n0, int64_t n1) {
  static constexpr TileFn tiles[kTileRows] = {Tile<1>, Tile<2>, Tile<3>,
                                              Tile<4>, Tile<5>, Tile<6>};
  alignas(64) float strip[kDepth * kWidth];
  const int64_t whole = n0 + (n1 - n0) / kWidth * kWidth;
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    const int64_t depth = std::min(K - k0, kDepth);
    for (int64_t c = n0; c < whole; c += kWidth) {
      Pack(w, strip, N, k0, depth, c, c + 2 * kWidth <= n1);
      for (int64_t g = 0; g < M; g += kTileRows)
        tiles[std::min<int64_t>(kTileRows, M - g) - 1](x + g * K, strip, y + g * N, K, N, k0,
                                                       depth, c);
    }
    for (int64_t c = whole; c < n1; ++c)
      for (int64_t m = 0; m < M; ++m)
        y[m * N + c] = Chain(x + m * K, w + c, N, k0, k0 + depth, k0 == 0 ? 0.f : y[m * N + c]);
  }
}

}  // namespace

#endif  // JAX_SPECDEC_SMALL_MATMUL_DENSE_H_
