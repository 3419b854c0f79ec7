// How fast one core issues the bf16 `nn` kernel's band passes when everything is in L1: the
// shape of band_rows in src/moe_gmm/ops/native/grouped_gemm_avx512_bf16.cpp (16 weight rows held
// in registers as 8 interleaved pairs of 2 vectors, G input rows per pass, their float32 sums
// loaded before and stored after the pass), with the input's pair broadcast through a register
// (as the kernel compiles) or folded into vdpbf16ps as an embedded {1to16} operand.
//
// Build and run (AVX-512 BF16 needed):
//   g++ -O3 -march=native -o /tmp/band_pass benchmarks/band_pass/band_pass.cpp && /tmp/band_pass
// Prints ns per vdpbf16ps and the GFLOP/s of one core (64 FLOP per instruction).
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace {

constexpr int kRows = 48;  // a multiple of every G below
alignas(64) uint16_t x_rows[kRows * 64];
alignas(64) uint16_t w_rows[16 * 32];
alignas(64) float sums[kRows * 32];

inline __m512 dot_pair_register(__m512 acc, __m512i w, const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}

inline __m512 dot_pair_embedded(__m512 acc, __m512i w, const uint16_t* x) {
  asm("vdpbf16ps %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*(const int32_t*)x));
  return acc;
}

template <int G, bool Embedded>
__attribute__((noinline)) void passes(const __m512i (&w)[16], int repeats) {
  for (int it = 0; it < repeats; ++it)
    for (int r = 0; r < kRows; r += G) {
      __m512 low[G], high[G];
      for (int g = 0; g < G; ++g) {
        low[g] = _mm512_loadu_ps(sums + (r + g) * 32);
        high[g] = _mm512_loadu_ps(sums + (r + g) * 32 + 16);
      }
      for (int p = 0; p < 8; ++p)
        for (int g = 0; g < G; ++g) {
          const uint16_t* xp = x_rows + (r + g) * 64 + 2 * p;
          if constexpr (Embedded) {
            low[g] = dot_pair_embedded(low[g], w[2 * p], xp);
            high[g] = dot_pair_embedded(high[g], w[2 * p + 1], xp);
          } else {
            low[g] = dot_pair_register(low[g], w[2 * p], xp);
            high[g] = dot_pair_register(high[g], w[2 * p + 1], xp);
          }
        }
      for (int g = 0; g < G; ++g) {
        _mm512_storeu_ps(sums + (r + g) * 32, low[g]);
        _mm512_storeu_ps(sums + (r + g) * 32 + 16, high[g]);
      }
    }
}

template <int G, bool Embedded>
void report(const char* name) {
  __m512i w[16];
  for (int i = 0; i < 16; ++i) w[i] = _mm512_loadu_si512(w_rows + (i % 16) * 32);
  constexpr int kRepeats = 40000;
  passes<G, Embedded>(w, kRepeats / 100);
  const auto start = std::chrono::steady_clock::now();
  passes<G, Embedded>(w, kRepeats);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double instructions = double(kRepeats) * kRows * 16;
  std::printf("%-34s %.3f ns per vdpbf16ps, %4.0f GFLOP/s\n", name, seconds / instructions * 1e9,
              instructions * 64 / seconds / 1e9);
}

}  // namespace

int main() {
  for (auto& v : x_rows) v = 0x3f80;  // 1.0: the sums grow without overflowing for this many passes
  for (auto& v : w_rows) v = 0x3400;
  for (int round = 0; round < 2; ++round) {
    report<4, false>("4 rows per pass, broadcast register");
    report<4, true>("4 rows per pass, embedded broadcast");
    report<2, false>("2 rows per pass, broadcast register");
    report<1, false>("1 row per pass, broadcast register");
    report<6, false>("6 rows per pass, broadcast register");
  }
}
