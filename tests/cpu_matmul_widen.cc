// Test driver (tests/test_cpu_kernel.py): the kernel's 16-bit paths built without
// XLA, for whatever -march the test compiles it with (AVX-512, F16C only, or neither).
// Writes every float16 and every bfloat16 bit pattern widened by Widen and by LoadW
// (2 x 2 x 65536 float32, binary, to the file argv[1]), then prints, for each product
// path, how many results differ from the same weights stored as float32.

#include <cstdio>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "../jax_specdec/kernels/cpu_matmul_dense.h"
#include "../jax_specdec/kernels/cpu_matmul_tied.h"

namespace {

template <typename W>
void WidenAll(std::FILE* out) {
  std::vector<W> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i].bits = static_cast<uint16_t>(i);
  std::vector<float> one(65536), vec(65536);
  for (int i = 0; i < 65536; ++i) one[i] = Widen(all[i]);
  for (int i = 0; i < 65536; i += kLanes) Store(vec.data() + i, LoadW(all.data() + i));
  std::fwrite(one.data(), sizeof(float), one.size(), out);
  std::fwrite(vec.data(), sizeof(float), vec.size(), out);
}

template <typename W>
W Narrow(float f) {  // truncated (normal numbers only): any 16-bit weights will do
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  W w;
  if constexpr (std::is_same_v<W, BFloat>) {
    w.bits = static_cast<uint16_t>(u >> 16);
  } else {
    const int exponent = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
    w.bits = exponent <= 0 || exponent >= 31
                 ? sign
                 : static_cast<uint16_t>(sign | exponent << 10 | ((u >> 13) & 0x3ff));
  }
  return w;
}

// Differences between the products with 16-bit weights and with those weights widened.
template <typename W>
int Differences(int64_t M, int64_t K, int64_t N, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> x(M * K), wide(K * N), a(M * N), b(M * N), c(M * N), d(M * N);
  std::vector<W> w(K * N);
  for (auto& v : x) v = normal(rng);
  for (int64_t i = 0; i < K * N; ++i) wide[i] = Widen(w[i] = Narrow<W>(normal(rng)));
  Columns<W>(x.data(), w.data(), a.data(), M, K, N, 0, N);
  Columns<float>(x.data(), wide.data(), b.data(), M, K, N, 0, N);
  // The same weights read as e [V = N rows, D = K]: x [M, D] @ e^T (the tied LM head).
  const int64_t D = K, V = N;
  std::vector<float> xe(M * D);
  for (auto& v : xe) v = normal(rng);
  Rows<W>(xe.data(), w.data(), c.data(), M, D, V, 0, V);
  Rows<float>(xe.data(), wide.data(), d.data(), M, D, V, 0, V);
  int differ = 0;
  for (int64_t i = 0; i < M * N; ++i) differ += (a[i] != b[i]) + (c[i] != d[i]);
  return differ;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 2;
  WidenAll<Half>(out);
  WidenAll<BFloat>(out);
  std::fclose(out);
  std::mt19937 rng(0);
  int differ = 0;
  for (int64_t M : {1, 3, 5, 8})
    for (auto [K, N] : {std::pair<int64_t, int64_t>{7, 5}, {130, 257}, {64, 100}})
      differ += Differences<Half>(M, K, N, rng) + Differences<BFloat>(M, K, N, rng);
  std::printf("%d\n", differ);
  return 0;
}
