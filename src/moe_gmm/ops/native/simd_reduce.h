// AVX-512 horizontal sums of many vectors at once, shared by the GEMM kernels whose outputs are dot
// products: 16 vectors reduced to one vector of their 16 sums.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#define MOE_GMM_SIMD_REDUCE 1
#include <immintrin.h>
#endif

namespace moe_gmm_simd {

#ifdef MOE_GMM_SIMD_REDUCE

// The sums of 16 vectors' lanes, lane i of the result the sum of v[i]'s: four levels of halving,
// each folding two vectors' segments in half into one vector (15 folds of 2 permutes and an add,
// against 16 full horizontal sums).
struct FoldIndex {
  alignas(64) int32_t low[16], high[16];
};

constexpr FoldIndex fold_index(int segment) {
  FoldIndex f{};
  for (int t = 0; t < 16; ++t) {
    const int u = t & 7, half = segment / 2;
    f.low[t] = (t < 8 ? 0 : 16) + u / half * segment + u % half;
    f.high[t] = f.low[t] + half;
  }
  return f;
}

template <int Segment>
__attribute__((always_inline)) inline __m512 fold(__m512 a, __m512 b) {
  static constexpr FoldIndex kIndex = fold_index(Segment);
  const __m512i lo = _mm512_load_si512(kIndex.low), hi = _mm512_load_si512(kIndex.high);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b));
}

// Inlined: as a call, the 16 vectors would go through memory (the caller's sums stored and reloaded).
__attribute__((always_inline)) inline __m512 sum_lanes_of_16(__m512 (&v)[16]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) v[i] = fold<16>(v[2 * i], v[2 * i + 1]);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) v[i] = fold<8>(v[2 * i], v[2 * i + 1]);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) v[i] = fold<4>(v[2 * i], v[2 * i + 1]);
  return fold<2>(v[0], v[1]);
}

#endif  // MOE_GMM_SIMD_REDUCE

}  // namespace moe_gmm_simd
