// This CPU's peak float32 FMA rate per core: 12 independent chains of 512-bit FMAs per
// thread, one thread per core (OpenMP). Used in step_cost.md for the arithmetic bound of
// a batch-8 verify. Build and run:
//   gcc -O2 -march=native -fopenmp scripts/experiments/verify_arithmetic_floor/peak_fma.c -o /tmp/peak_fma && /tmp/peak_fma
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

int main(void) {
#pragma omp parallel
  {
    __m512 acc[12];
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
    const long n = 200000000;
    const double t0 = omp_get_wtime();
    for (long k = 0; k < n; k++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
    }
    const double t = omp_get_wtime() - t0;
    float sum = 0;  // keeps the chains live
    for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_ps(acc[i]);
#pragma omp critical
    printf("thread %d: %.1f GFLOP/s (checksum %g)\n", omp_get_thread_num(),
           n * 12.0 * 16 * 2 / t / 1e9, sum);
  }
  return 0;
}
