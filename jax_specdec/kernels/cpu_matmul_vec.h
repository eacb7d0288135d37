// The pieces every product of cpu_matmul.cc is made of: 16-lane float32 vectors,
// weights stored in 32 or 16 bits and widened on load, and the fixed orders of sums.

#ifndef JAX_SPECDEC_SMALL_MATMUL_VEC_H_
#define JAX_SPECDEC_SMALL_MATMUL_VEC_H_

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kGroup = 8;  // the most rows of x a call takes
constexpr int kLanes = 16;  // one 64-byte vector of float32
typedef float Vec __attribute__((vector_size(64), aligned(4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// Weights stored in 16 bits, widened to float32 on load (every value exactly).
struct Half {
  uint16_t bits;
};
struct BFloat {
  uint16_t bits;
};
inline float Widen(float w) { return w; }
inline float Widen(BFloat w) {
  const uint32_t u = uint32_t{w.bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float Widen(Half w) {  // no _Float16: GCC < 12 has none on x86
#if defined(__F16C__)
  return _cvtsh_ss(w.bits);
#else
  const uint32_t exponent = (w.bits >> 10) & 0x1f, mantissa = w.bits & 0x3ff;
  uint32_t u = uint32_t{w.bits & 0x8000u} << 16;
  if (exponent == 31) {
    u |= 0x7f800000u | mantissa << 13;  // inf, NaN
  } else if (exponent > 0) {
    u |= (exponent + 112) << 23 | mantissa << 13;  // rebias 15 -> 127
  } else {
    const float subnormal = static_cast<float>(mantissa) * 0x1p-24f;  // exact
    uint32_t bits;
    std::memcpy(&bits, &subnormal, sizeof(bits));
    u |= bits;
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}
inline Vec LoadW(const float* p) { return Load(p); }
inline Vec LoadW(const BFloat* p) {
  typedef uint16_t Narrow __attribute__((vector_size(32), aligned(2)));
  typedef uint32_t Wide __attribute__((vector_size(64), aligned(4)));
  Narrow n;
  std::memcpy(&n, p, sizeof(n));
  const Wide u = __builtin_convertvector(n, Wide) << 16;
  Vec v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}
inline Vec LoadW(const Half* p) {  // vcvtph2ps: GCC scalarises a _Float16 vector's cast
  Vec v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
#elif defined(__F16C__)
  for (int i = 0; i < 2; ++i) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i)));
    std::memcpy(reinterpret_cast<float*>(&v) + 8 * i, &f, sizeof(f));
  }
#else
  for (int i = 0; i < kLanes; ++i) v[i] = Widen(p[i]);
#endif
  return v;
}
// Scalar tails call fma explicitly, as the vector lanes do (x * w + acc contracted by
// -O3 -ffp-contract=fast on a CPU with FMA): left to the compiler, a tail loop may
// become vector multiplies and scalar adds. Other flags or a CPU without FMA would
// break the bit-identity of rows (tests/test_cpu_kernel.py checks it).

// s + x[k0] w[k0 N] + ... + x[k1-1] w[(k1-1) N], one fma at a time: the order in which a
// vector lane sums its element, for the columns outside whole vectors.
template <typename W>
inline float Chain(const float* x, const W* w, int64_t N, int64_t k0, int64_t k1, float s) {
  for (int64_t k = k0; k < k1; ++k) s = __builtin_fmaf(x[k], Widen(w[k * N]), s);
  return s;
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

}  // namespace

#endif  // JAX_SPECDEC_SMALL_MATMUL_VEC_H_
