// Small-M float32 matrix products for XLA:CPU, as XLA FFI custom calls.
//
// A decode step multiplies 1 row per sequence by every weight matrix; a verify call
// multiplies gamma + 1 rows. Both are bound by reading the weights once from memory,
// but XLA:CPU sends 2-8 rows to a GEMM that packs the weight panel on every call and
// costs 1.5-2x the one-row product. These kernels read each weight once, front to
// back, for all rows (at most kMaxRows), so a 5-row product costs little more than a
// 1-row one. See jax_specdec/nn/small_matmul.py and docs/step_cost.md.
//
//   SmallMatmul:  y[M, N] = x[M, K] @ w[K, N]      (w row-major: the Dense layout)
//   SmallMatmulT: y[M, V] = x[M, D] @ e[V, D]^T    (a tied embedding as LM head)
//
// Every output element is summed in the same order whatever M is (and however the
// work is split over threads), so the rows of a verify call equal, bit for bit, the
// same rows computed one at a time.

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
constexpr int64_t kGroup = 8;     // rows of x one pass over a block of weights takes
constexpr int kLanes = 16;  // one 64-byte vector of float32
typedef float Vec __attribute__((vector_size(64), aligned(4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// Rows k .. k+R-1 of w, columns [n0, n1): y[m, c] += sum_r x[m, k + r] * w[k + r, c],
// NV vectors of columns at a time. Each weight row is read front to back; y (M x N
// floats) stays in cache.
template <int M, int R, int NV>
void RowBlock(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k,
              int64_t n0, int64_t n1, bool prefetch) {
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
      if (prefetch && k + R + r < K)
        for (int j = 0; j < NV; ++j) __builtin_prefetch(w + (k + R + r) * N + c + j * kLanes, 0, 2);
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * K + k + r];
        for (int j = 0; j < NV; ++j) acc[m][j] += xv * wv[j];
      }
    }
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < NV; ++j) Store(y + m * N + c + j * kLanes, acc[m][j]);
  }
  for (; c < n1; ++c) {
    for (int m = 0; m < M; ++m) {
      float s = first ? 0.f : y[m * N + c];
      for (int r = 0; r < R; ++r) s += x[m * K + k + r] * w[(k + r) * N + c];
      y[m * N + c] = s;
    }
  }
}

// Two vectors of columns per pass where more rows would leave the loads of x the
// bottleneck (measured: 8 rows 1.4x faster, 5 rows 8% slower than one vector).
template <int M, int R>
void Block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k,
           int64_t n0, int64_t n1, bool prefetch) {
  RowBlock<M, R, (M <= 5 ? 1 : 2)>(x, w, y, K, N, k, n0, n1, prefetch);
}

using BlockFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                         int64_t, int64_t, bool);

BlockFn BlockFor(int64_t m, bool eight) {
  static constexpr BlockFn whole[kGroup] = {Block<1, 8>, Block<2, 8>, Block<3, 8>, Block<4, 8>,
                                            Block<5, 8>, Block<6, 8>, Block<7, 8>, Block<8, 8>};
  static constexpr BlockFn single[kGroup] = {Block<1, 1>, Block<2, 1>, Block<3, 1>,
                                             Block<4, 1>, Block<5, 1>, Block<6, 1>,
                                             Block<7, 1>, Block<8, 1>};
  return (eight ? whole : single)[m - 1];
}

// y[:, n0:n1] for all M rows: blocks of 8 weight rows; more than kGroup rows of x are
// taken kGroup at a time over the same block, which the first group brought into cache.
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  for (int64_t k = 0; k < K;) {
    const bool eight = k + 8 <= K;
    for (int64_t g = 0; g < M; g += kGroup) {
      const int64_t rows = std::min<int64_t>(kGroup, M - g);
      BlockFor(rows, eight)(x + g * K, w, y + g * N, K, N, k, n0, n1, g == 0);
    }
    k += eight ? 8 : 1;
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
      for (int64_t d = whole; d < D; ++d) s += x[m * D + d] * e[(v + r) * D + d];
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

// y[:, v0:v1] for all M rows of x: groups of rows of e; more than kGroup rows of x are
// taken 5 at a time over the same rows of e (in L1 by then).
void Rows(const float* x, const float* e, float* y, int64_t M, int64_t D, int64_t V,
          int64_t v0, int64_t v1) {
  const int64_t group = M <= kGroup ? M : 5;
  const int64_t step = group <= 5 ? 4 : 3;  // kRowsOfE<group>
  for (int64_t v = v0; v < v1;) {
    const bool one = v + step > v1;
    for (int64_t g = 0; g < M; g += group) {
      const int64_t rows = std::min(group, M - g);
      const bool prefetch = g == 0 && !one && v + 2 * step <= v1;
      GroupFor(rows, one)(x + g * D, e, y + g * V, D, V, v, prefetch);
    }
    v += one ? 1 : step;
  }
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
  for (int i = 1; i < parts; ++i) pool.Schedule([work]() { work(); });
  work();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

int Parts(ffi::ThreadPool& pool, int64_t units) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return static_cast<int>(std::max<int64_t>(1, std::min(threads, units)));
}

// Splits [0, n) into `parts` pieces of a multiple of `align` (the last one shorter).
struct Split {
  int64_t n, chunk;
  Split(int64_t n, int parts, int64_t align)
      : n(n), chunk((n / parts + align - 1) / align * align) {}
  int64_t begin(int p) const { return std::min(n, p * chunk); }
  int64_t end(int p) const { return std::min(n, (p + 1) * chunk); }
};

using Work = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t,
                      int64_t);

// y = x times a 2-D weight: `inner` is the size each row of x holds, `outer` the outputs
// per row, split over the threads in pieces of a multiple of `align` that do not depend
// on M (so every M sums the same way).
ffi::Error Product(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w,
                   ffi::ResultBuffer<ffi::F32>& y, bool transposed, Work work,
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
  const Split split(outer, Parts(pool, outer / 256), align);
  const int parts = static_cast<int>((outer + split.chunk - 1) / split.chunk);
  Parallel(pool, parts, [=](int p) {
    work(xp, wp, yp, M, inner, outer, split.begin(p), split.end(p));
  });
  return ffi::Error::Success();
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  return Product(pool, x, w, y, /*transposed=*/false, Columns, 4 * kLanes);
}

ffi::Error SmallMatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::F32> e, ffi::ResultBuffer<ffi::F32> y) {
  return Product(pool, x, e, y, /*transposed=*/true, Rows, 12);
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
