// How fast two threads read many experts' [K, N] float32 weights from memory in the orders the
// few-row kernels read them, with no arithmetic: the ceiling each order puts on a weight-streaming
// product. Built and run by benchmarks/run_read_order.py; prints one JSON object per measurement.
//
//   read_order E K N rounds
//
// Orders (each thread takes every other expert, as the kernels' static split of equal tasks does):
//   sequential      each expert front to back
//   strips          64-float columns over the whole depth, one strip after another (the float32
//                   `nn` blocks' order for experts of 8 rows and more)
//   strips+next     the same, each strip prefetching the next one into L1 as it goes (what the
//                   blocks do)
//   bands           bands of 16 weight rows, 16 floats of each of the 16 rows per step across
//                   the columns (the few-row `nn` bands' order), the next band prefetched
//   chunks+next     chunks of 64 weight rows (contiguous), each read in 64-float strips, while
//                   the next chunk is prefetched front to back, one line per line read
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <string>

namespace {

constexpr int kStrip = 64;
constexpr int kBand = 16;
constexpr int64_t kChunk = 64;

enum Order { kSequential, kStrips, kStripsNext, kBands, kChunksNext, kOrders };
const char* kNames[kOrders] = {"sequential", "strips", "strips+next", "bands", "chunks+next"};

__m512 read_expert(const float* w, int64_t k, int64_t n, Order order, __m512 acc) {
  switch (order) {
    case kSequential:
      for (int64_t i = 0; i < k * n; i += 16) acc = _mm512_add_ps(acc, _mm512_load_ps(w + i));
      break;
    case kStrips:
    case kStripsNext:
      for (int64_t j = 0; j < n; j += kStrip) {
        const float* next = j + kStrip < n ? w + j + kStrip : w + k * n;  // then the next expert's first strip
        for (int64_t d = 0; d < k; ++d) {
          if (order == kStripsNext)
            for (int v = 0; v < kStrip; v += 16) _mm_prefetch(reinterpret_cast<const char*>(next + d * n + v), _MM_HINT_T0);
          for (int v = 0; v < kStrip; v += 16) acc = _mm512_add_ps(acc, _mm512_load_ps(w + d * n + j + v));
        }
      }
      break;
    case kBands:
      for (int64_t d = 0; d < k; d += kBand) {
        const float* next = w + (d + kBand) * n;
        for (int64_t j = 0; j < n; j += 16)
          for (int q = 0; q < kBand; ++q) {
            _mm_prefetch(reinterpret_cast<const char*>(next + q * n + j), _MM_HINT_T0);
            acc = _mm512_add_ps(acc, _mm512_load_ps(w + (d + q) * n + j));
          }
      }
      break;
    case kChunksNext:
      for (int64_t c = 0; c < k; c += kChunk) {
        const int64_t rows = std::min(kChunk, k - c);
        const float* chunk = w + c * n;
        // the next chunk follows this one in memory (after the last, the next expert's first)
        const float* next = chunk + rows * n;
        const int64_t next_elements = (c + rows < k ? std::min(kChunk, k - c - rows) : std::min(kChunk, k)) * n;
        int64_t ahead = 0;
        for (int64_t j = 0; j < n; j += kStrip)
          for (int64_t d = 0; d < rows; ++d)
            for (int v = 0; v < kStrip; v += 16) {
              if (ahead < next_elements) _mm_prefetch(reinterpret_cast<const char*>(next + ahead), _MM_HINT_T0);
              ahead += 16;
              acc = _mm512_add_ps(acc, _mm512_load_ps(chunk + d * n + j + v));
            }
      }
      break;
    default:
      break;
  }
  return acc;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s E K N rounds\n", argv[0]);
    return 2;
  }
  const int64_t e = std::atoll(argv[1]), k = std::atoll(argv[2]), n = std::atoll(argv[3]);
  const int rounds = std::atoi(argv[4]);
  if (e * k * n > (int64_t(1) << 28)) {
    std::fprintf(stderr, "E*K*N must be at most 2^28 (the sums count elements exactly)\n");
    return 2;
  }
  if (e < 2 || k < kBand || k % kBand != 0 || n < kStrip || n % kStrip != 0 || rounds < 1) {
    std::fprintf(stderr, "need E >= 2, K a multiple of %d, N a multiple of %d, rounds >= 1\n", kBand, kStrip);
    return 2;
  }
  const size_t bytes = size_t(e) * k * n * sizeof(float);
  // one expert of slack: the last strip and band prefetch past the end
  float* w = static_cast<float*>(std::aligned_alloc(4096, bytes + size_t(k) * n * sizeof(float)));
  if (w == nullptr) return 1;
  std::fill(w, w + size_t(e + 1) * k * n, 1.0f);
  for (int round = 0; round < rounds; ++round)
    for (int o = 0; o < kOrders; ++o) {
      const auto start = std::chrono::steady_clock::now();
      double total = 0;  // per lane at most E*K*N/16 ones: exact in float up to 2^28 elements
#pragma omp parallel reduction(+ : total)
      {
        __m512 acc = _mm512_setzero_ps();
#pragma omp for schedule(static, 1)
        for (int64_t x = 0; x < e; ++x) acc = read_expert(w + size_t(x) * k * n, k, n, Order(o), acc);
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, acc);
        for (float v : lanes) total += v;
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("{\"round\": %d, \"order\": \"%s\", \"seconds\": %.6e, \"bytes\": %zu, \"elements_read\": %.0f}\n",
                  round, kNames[o], seconds, bytes, total);
    }
  std::free(w);
  return 0;
}
