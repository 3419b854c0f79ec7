// AVX-512 blocks for reshaping 16-bit matrices in registers, shared by the GEMM kernels: pairs of
// rows interleaved (the VNNI layout AMX reads) and 16 x 16 transposes of 32-bit values, which
// together transpose a 16-bit matrix 32 x 32 values at a time.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MOE_GMM_SIMD_TRANSPOSE 1
#include <immintrin.h>
#endif

namespace moe_gmm_simd {

#ifdef MOE_GMM_SIMD_TRANSPOSE

// dst[j][0..1] = (r0[j], r1[j]) for j < width (a multiple of 32): two rows as VNNI pairs.
inline void interleave_rows(const uint16_t* r0, const uint16_t* r1, uint16_t* dst, int64_t width) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t j = 0; j < width; j += 32) {
    const __m512i a = _mm512_loadu_si512(r0 + j), b = _mm512_loadu_si512(r1 + j);
    _mm512_storeu_si512(dst + 2 * j, _mm512_permutex2var_epi16(a, low, b));
    _mm512_storeu_si512(dst + 2 * j + 32, _mm512_permutex2var_epi16(a, high, b));
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for a 16 x 16 block of 32-bit values.
inline void transpose_16x16(const uint32_t* src, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * ld_src);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * ld_dst, r[i]);
}

#endif  // MOE_GMM_SIMD_TRANSPOSE

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols (16-bit values). With AVX-512:
// interleaving rows 2i and 2i + 1 makes 32-bit pairs (src[2i][c], src[2i + 1][c]); a 32-bit transpose
// of those puts column c's values in order, 32 rows by 32 columns at a time. The edges (row or
// column counts off a multiple of 32, an odd destination stride) go value by value.
inline void transpose_16bit(const uint16_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst,
                            int64_t ld_dst) {
  int64_t full_rows = 0, full_cols = 0;
#ifdef MOE_GMM_SIMD_TRANSPOSE
  if (ld_dst % 2 == 0) {
    full_rows = rows / 32 * 32, full_cols = cols / 32 * 32;
    alignas(64) uint16_t pairs[16 * 64];
    for (int64_t r = 0; r < full_rows; r += 32)
      for (int64_t c = 0; c < full_cols; c += 32) {
        for (int i = 0; i < 16; ++i)
          interleave_rows(src + (r + 2 * i) * ld_src + c, src + (r + 2 * i + 1) * ld_src + c, pairs + i * 64, 32);
        const auto* p32 = reinterpret_cast<const uint32_t*>(pairs);
        auto* d32 = reinterpret_cast<uint32_t*>(dst + c * ld_dst + r);
        transpose_16x16(p32, 32, d32, ld_dst / 2);
        transpose_16x16(p32 + 16, 32, d32 + 16 * (ld_dst / 2), ld_dst / 2);
      }
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = (r < full_rows ? full_cols : 0); c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

}  // namespace moe_gmm_simd
