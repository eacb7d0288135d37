// Small-M float32 matrix products for XLA:CPU, as XLA FFI custom calls.
//
// A decode step multiplies 1 row per sequence by every weight matrix; a verify call
// multiplies gamma + 1 rows per sequence. Up to kGroup rows both are bound by reading
// the weights once from memory, but XLA:CPU sends 2-8 rows to a GEMM that packs the
// weight panel on every call and costs 1.5-2x the one-row product. These kernels read
// each weight once, front to back, for all rows, so a 5-row product costs little more
// than a 1-row one. More rows (up to kMaxRows: a verify at batch 2 and up) are bound by
// arithmetic and take register tiles instead (Tiles, TransposedTiles). See
// jax_specdec/nn/small_matmul.py and docs/step_cost.md.
//
//   SmallMatmul:  y[M, N] = x[M, K] @ w[K, N]      (w row-major: the Dense layout)
//   SmallMatmulT: y[M, V] = x[M, D] @ e[V, D]^T    (a tied embedding as LM head)
//
// SmallMatmul sums every output element in the same order whatever M is (and however
// the work is split over threads), so the rows of a verify call equal, bit for bit, the
// same rows computed one at a time; SmallMatmulT does so up to kGroup rows.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 64;  // rows of x a call takes
constexpr int64_t kGroup = 8;     // the most rows of x the streaming paths take
constexpr int kLanes = 16;  // one 64-byte vector of float32
typedef float Vec __attribute__((vector_size(64), aligned(4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
// Scalar tails call fma explicitly, as the vector lanes do (x * w + acc contracted by
// -O3 -ffp-contract=fast on a CPU with FMA): left to the compiler, a tail loop may
// become vector multiplies and scalar adds. Other flags or a CPU without FMA would
// break the bit-identity of rows (tests/test_small_matmul.py checks it).

// s + x[k0] w[k0 N] + ... + x[k1-1] w[(k1-1) N], one fma at a time: the order in which a
// vector lane sums its element, for the columns outside whole vectors.
inline float Chain(const float* x, const float* w, int64_t N, int64_t k0, int64_t k1, float s) {
  for (int64_t k = k0; k < k1; ++k) s = __builtin_fmaf(x[k], w[k * N], s);
  return s;
}

// Rows k .. k+R-1 of w, columns [n0, n1): y[m, c] += sum_r x[m, k + r] * w[k + r, c],
// NV vectors of columns at a time. Each weight row is read front to back; y (M x N
// floats) stays in cache.
template <int M, int R, int NV>
void RowBlock(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k,
              int64_t n0, int64_t n1) {
  const bool first = k == 0;
  int64_t c = n0;
  for (; c + NV * kLanes <= n1; c += NV * kLanes) {
    Vec acc[M][NV];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = first ? Vec{} : Load(y + m * N + c + j * kLanes);
    for (int r = 0; r < R; ++r) {
      Vec wv[NV];
      for (int j = 0; j < NV; ++j) wv[j] = Load(w + (k + r) * N + c + j * kLanes);
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
template <int M, int R>
void Block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k,
           int64_t n0, int64_t n1) {
  RowBlock<M, R, (M <= 5 ? 1 : 2)>(x, w, y, K, N, k, n0, n1);
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t);

BlockFn BlockFor(int64_t m, bool eight) {
  static constexpr BlockFn whole[kGroup] = {Block<1, 8>, Block<2, 8>, Block<3, 8>, Block<4, 8>,
                                            Block<5, 8>, Block<6, 8>, Block<7, 8>, Block<8, 8>};
  static constexpr BlockFn single[kGroup] = {Block<1, 1>, Block<2, 1>, Block<3, 1>,
                                             Block<4, 1>, Block<5, 1>, Block<6, 1>,
                                             Block<7, 1>, Block<8, 1>};
  return (eight ? whole : single)[m - 1];
}

// y[:, n0:n1] for up to kGroup rows of x: blocks of 8 weight rows, each read once.
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  for (int64_t k = 0; k < K;) {
    const bool eight = k + 8 <= K;
    BlockFor(M, eight)(x, w, y, K, N, k, n0, n1);
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

// Copies w[k0:k0+depth, c:c+kWidth] into strip, and asks for the next strip's lines
// (same rows): the rows are more streams than the hardware prefetcher tracks.
void Pack(const float* w, float* strip, int64_t N, int64_t k0, int64_t depth, int64_t c,
          bool prefetch) {
  for (int64_t k = 0; k < depth; ++k) {
    const float* row = w + (k0 + k) * N + c;
    for (int j = 0; j < kTileVecs; ++j) Store(strip + k * kWidth + j * kLanes, Load(row + j * kLanes));
    if (prefetch)
      for (int j = 0; j < kTileVecs; ++j) __builtin_prefetch(row + (kTileVecs + j) * kLanes, 0, 2);
  }
}

using TileFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t, int64_t);

void Tiles(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
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

// The lanes' sum as a fixed tree (the same order for every call).
inline float Sum(Vec v) {
  typedef float Half __attribute__((vector_size(32)));
  typedef float Quarter __attribute__((vector_size(16)));
  const Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Quarter q = __builtin_shufflevector(h, h, 0, 1, 2, 3) +
                    __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// y[m, v .. v+RV-1] = x[m, :] . e[v + r, :] for M rows of x.
template <int M, int RV>
void RowGroup(const float* x, const float* e, float* y, int64_t D, int64_t V, int64_t v,
              bool prefetch) {
  const int64_t whole = D / kLanes * kLanes;
  Vec acc[RV][M] = {};
  for (int64_t d = 0; d < whole; d += kLanes) {
    Vec ev[RV];
    for (int r = 0; r < RV; ++r) ev[r] = Load(e + (v + r) * D + d);
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
      for (int64_t d = whole; d < D; ++d) s = __builtin_fmaf(x[m * D + d], e[(v + r) * D + d], s);
      y[m * V + v + r] = s;
    }
  }
}

using GroupFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, bool);

// Four rows of e per pass up to 5 rows of x, three beyond (registers: RV * M
// accumulators); measured on the SmolLM2 LM head, 5 rows: 7.7 ms with four, 9.8 with two.
template <int M>
constexpr int kRowsOfE = M <= 5 ? 4 : 3;

GroupFn GroupFor(int64_t m, bool one) {
  static constexpr GroupFn many[kGroup] = {
      RowGroup<1, kRowsOfE<1>>, RowGroup<2, kRowsOfE<2>>, RowGroup<3, kRowsOfE<3>>,
      RowGroup<4, kRowsOfE<4>>, RowGroup<5, kRowsOfE<5>>, RowGroup<6, kRowsOfE<6>>,
      RowGroup<7, kRowsOfE<7>>, RowGroup<8, kRowsOfE<8>>};
  static constexpr GroupFn single[kGroup] = {RowGroup<1, 1>, RowGroup<2, 1>, RowGroup<3, 1>,
                                             RowGroup<4, 1>, RowGroup<5, 1>, RowGroup<6, 1>,
                                             RowGroup<7, 1>, RowGroup<8, 1>};
  return (one ? single : many)[m - 1];
}

// y[:, v0:v1] for up to kGroup rows of x: groups of rows of e, each read once.
void Rows(const float* x, const float* e, float* y, int64_t M, int64_t D, int64_t V,
          int64_t v0, int64_t v1) {
  const int64_t step = M <= 5 ? 4 : 3;  // kRowsOfE<M>
  for (int64_t v = v0; v < v1;) {
    const bool one = v + step > v1;
    GroupFor(M, one)(x, e, y, D, V, v, !one && v + 2 * step <= v1);
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

template <int RE, int NV>
void TileT(const float* xt, const float* e, float* part, int64_t D, int64_t v, int64_t d0,
           int64_t d1, bool prefetch) {
  constexpr int64_t stride = NV * kLanes;
  Vec acc[RE][NV];
  for (int r = 0; r < RE; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = d0 == 0 ? Vec{} : Load(part + r * stride + j * kLanes);
  for (int64_t d = d0; d < d1; ++d) {
    Vec xv[NV];
    for (int j = 0; j < NV; ++j) xv[j] = Load(xt + d * stride + j * kLanes);
    for (int r = 0; r < RE; ++r) {
      const float ev = e[(v + r) * D + d];
      for (int j = 0; j < NV; ++j) acc[r][j] += ev * xv[j];
    }
    // The same rows of the next chunk into L2, a line at a time: every line once.
    if (prefetch && d % kLanes == 0)
      for (int r = 0; r < RE; ++r) __builtin_prefetch(e + (v + kChunk + r) * D + d, 0, 2);
  }
  for (int r = 0; r < RE; ++r)
    for (int j = 0; j < NV; ++j) Store(part + r * stride + j * kLanes, acc[r][j]);
}

using TileTFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t, bool);

template <int NV>
void RowsOfE(const float* xt, const float* e, float* y, int64_t M, int64_t D, int64_t V,
             int64_t v0, int64_t v1) {
  static constexpr TileTFn tiles[kTileRows] = {TileT<1, NV>, TileT<2, NV>, TileT<3, NV>,
                                               TileT<4, NV>, TileT<5, NV>, TileT<6, NV>};
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

void TransposedTiles(const float* x, const float* e, float* y, int64_t M, int64_t D,
                     int64_t V, int64_t v0, int64_t v1) {
  static constexpr decltype(&RowsOfE<1>) by_width[kMaxRows / kLanes] = {
      RowsOfE<1>, RowsOfE<2>, RowsOfE<3>, RowsOfE<4>};
  const int64_t nv = (M + kLanes - 1) / kLanes;
  std::unique_ptr<float[]> xt(new float[D * nv * kLanes]());  // x^T, columns padded
  for (int64_t m = 0; m < M; ++m)
    for (int64_t d = 0; d < D; ++d) xt[d * nv * kLanes + m] = x[m * D + d];
  by_width[nv - 1](xt.get(), e, y, M, D, V, v0, v1);
}

// Runs part(p) for p in [0, parts) on the caller and the thread pool. Parts are claimed
// from a counter, so the caller finishes the work alone if the pool is busy; the shared
// state outlives a task that starts late.
template <typename F>
void Parallel(ffi::ThreadPool& pool, int parts, F part) {
  struct State {
    std::atomic<int> next{0};
    std::atomic<int> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, parts, part]() {
    for (int p; (p = state->next.fetch_add(1)) < parts;) {
      part(p);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int helpers = std::min<int>(parts, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int i = 0; i < helpers; ++i) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// Splits [0, n) into at most `parts` pieces of a multiple of `align` (the last one
// shorter).
struct Split {
  int64_t n, chunk;
  Split(int64_t n, int64_t parts, int64_t align)
      : n(n), chunk(((n + parts - 1) / parts + align - 1) / align * align) {}
  int count() const { return static_cast<int>((n + chunk - 1) / chunk); }
  int64_t begin(int p) const { return std::min(n, p * chunk); }
  int64_t end(int p) const { return std::min(n, (p + 1) * chunk); }
};

using Work = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                      int64_t);

// y = x times a 2-D weight: `inner` is the size each row of x holds, `outer` the outputs
// per row, split over the threads in pieces of a multiple of `align`; `many` (if given)
// takes more than kGroup rows, whose rows are split too where the columns are too few
// to go round. No split changes the order in which an element is summed.
ffi::Error Product(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                   ffi::ResultBuffer<ffi::F32>& y, bool transposed, Work few, Work many,
                   int64_t align) {
  const auto dims = w.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("the weight must be 2-D");
  const int64_t inner = transposed ? dims[1] : dims[0];
  const int64_t outer = transposed ? dims[0] : dims[1];
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != inner)
    return ffi::Error::InvalidArgument("x's last dimension must be the weight's inner size");
  const int64_t M = inner == 0 ? 0 : x.element_count() / inner;
  if (M < 1 || M > kMaxRows)
    return ffi::Error::InvalidArgument("x must hold 1 to 64 rows");
  if (y->element_count() != M * outer)
    return ffi::Error::InvalidArgument("the result must hold rows x outputs");
  if (outer == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const bool tiled = M > kGroup && many != nullptr;
  // One piece of columns per thread, at least 256 wide (pieces of single 64-column
  // strips measured slower: a piece prefetches only its own next strip). Where the
  // columns are too few to go round (k and v: 192), rows are split too (from
  // 2 * kGroup rows).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const Split cols(outer, std::clamp<int64_t>(outer / 256, 1, threads), align);
  const int col_parts = cols.count();
  const Split rows(M, tiled ? std::clamp<int64_t>(threads / col_parts, 1, M / kGroup) : 1, 1);
  const Work work = tiled ? many : few;
  Parallel(pool, rows.count() * col_parts, [=](int p) {
    const int64_t r0 = rows.begin(p / col_parts), r1 = rows.end(p / col_parts);
    work(xp + r0 * inner, wp, yp + r0 * outer, r1 - r0, inner, outer,
         cols.begin(p % col_parts), cols.end(p % col_parts));
  });
  return ffi::Error::Success();
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  return Product(pool, x, w, y, /*transposed=*/false, Columns, Tiles, 4 * kLanes);
}

ffi::Error SmallMatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> e, ffi::ResultBuffer<ffi::F32> y) {
  return Product(pool, x, e, y, /*transposed=*/true, Rows, TransposedTiles, 12);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulT, SmallMatmulTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
