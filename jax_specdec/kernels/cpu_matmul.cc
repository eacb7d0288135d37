// Small-M float32 matrix products for XLA:CPU, as XLA FFI custom calls.
//
// A decode step multiplies 1 row per sequence by every weight matrix; a verify call
// multiplies gamma + 1 rows per sequence. Up to kGroup rows both are bound by reading
// the weights once from memory, but XLA:CPU sends 2-8 rows to a GEMM that packs the
// weight panel on every call and costs 1.5-2x the one-row product. These kernels read
// each weight once, front to back, for all rows, so a 5-row product costs little more
// than a 1-row one. More rows are left to XLA (register tiles for them measured at most
// 8% cheaper than XLA's products in the model). See jax_specdec/kernels/cpu_matmul.py
// and docs/performance.md.
//
//   SmallMatmul:  y[M, N] = x[M, K] @ w[K, N]      (w row-major: the Dense layout)
//   SmallMatmulT: y[M, V] = x[M, D] @ e[V, D]^T    (a tied embedding as LM head)
//
// x and y are float32; w (e) float32, float16 or bfloat16: 16-bit elements are widened
// to float32 as they are loaded (exactly), so a product reads half the bytes and gives,
// bit for bit, the result of the same weights stored as float32.
//
// Both sum every output element in the same order whatever M is (and however the work
// is split over threads), so the rows of a verify call equal, bit for bit, the same rows
// computed one at a time.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "cpu_matmul_dense.h"
#include "cpu_matmul_tied.h"
#include "cpu_matmul_vec.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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

template <typename W>
using Work = void (*)(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t,
                      int64_t);

// y = x times a 2-D weight: `inner` is the size each row of x holds, `outer` the outputs
// per row, split over the threads in pieces of a multiple of `align`. No split changes
// the order in which an element is summed.
template <typename W>
ffi::Error Product(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w,
                   ffi::ResultBuffer<ffi::F32>& y, bool transposed, Work<W> work,
                   int64_t align) {
  const auto dims = w.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("the weight must be 2-D");
  const int64_t inner = transposed ? dims[1] : dims[0];
  const int64_t outer = transposed ? dims[0] : dims[1];
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0 || x_dims.back() != inner)
    return ffi::Error::InvalidArgument("x's last dimension must be the weight's inner size");
  const int64_t M = inner == 0 ? 0 : x.element_count() / inner;
  if (M < 1 || M > kGroup) return ffi::Error::InvalidArgument("x must hold 1 to 8 rows");
  if (static_cast<int64_t>(y->element_count()) != M * outer)
    return ffi::Error::InvalidArgument("the result must hold rows x outputs");
  if (outer == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const W* wp = static_cast<const W*>(w.untyped_data());
  float* yp = y->typed_data();
  // One piece of columns per thread, at least 256 wide (pieces of single 64-column
  // strips measured slower: a piece prefetches only its own next strip).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const Split cols(outer, std::clamp<int64_t>(outer / 256, 1, threads), align);
  Parallel(pool, cols.count(), [=](int p) {
    work(xp, wp, yp, M, inner, outer, cols.begin(p), cols.end(p));
  });
  return ffi::Error::Success();
}

// x @ w (SmallMatmul) and x @ e^T (SmallMatmulT) for weights of element type W.
template <typename W>
struct DenseOp {
  static ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w,
                        ffi::ResultBuffer<ffi::F32>& y) {
    return Product<W>(pool, x, w, y, /*transposed=*/false, Columns<W>, 4 * kLanes);
  }
};
template <typename W>
struct TiedOp {
  static ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& e,
                        ffi::ResultBuffer<ffi::F32>& y) {
    return Product<W>(pool, x, e, y, /*transposed=*/true, Rows<W>, 12);
  }
};

// The weight's element type picks the instance: float32, or 16 bits widened on load.
template <template <typename> class Op>
ffi::Error ByWeightType(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::AnyBuffer& w,
                        ffi::ResultBuffer<ffi::F32>& y) {
  switch (w.element_type()) {
    case ffi::DataType::F32: return Op<float>::Run(pool, x, w, y);
    case ffi::DataType::F16: return Op<Half>::Run(pool, x, w, y);
    case ffi::DataType::BF16: return Op<BFloat>::Run(pool, x, w, y);
    default: return ffi::Error::InvalidArgument("the weight must be float32, float16 or bfloat16");
  }
}

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  return ByWeightType<DenseOp>(pool, x, w, y);
}

ffi::Error SmallMatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer e,
                            ffi::ResultBuffer<ffi::F32> y) {
  return ByWeightType<TiedOp>(pool, x, e, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmul, SmallMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallMatmulT, SmallMatmulTImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
