// Can the AMX `nn` kernel's weight packing overlap its tile products? The packed-chunk scheme of
// chunked_product in src/moe_gmm/ops/native/grouped_gemm_amx.cpp (a chunk of full-width weight
// rows interleaved into VNNI pairs, then 2 x 2 tile blocks into float32 sums), on two threads,
// scheduled three ways:
//   serial      each thread packs a chunk, then multiplies it (the kernel's order)
//   split       one thread packs into a ring of 8 chunk buffers, the other multiplies from it
//   touch ...   serial, and during a chunk's tile products the next chunk's weight is touched
//               ahead (software prefetch into L2 of every line or of one line per 1, 2 or 4 KiB,
//               to start the L2 streamer early; or plain loads), so its packing reads from cache
//
// Build and run (AMX-BF16 and Linux needed), arguments rows experts K N:
//   g++ -O2 -march=native -pthread -o /tmp/amx_pack_overlap benchmarks/amx_pack_overlap/amx_pack_overlap.cpp
//   /tmp/amx_pack_overlap 64 128 1024 1024 && /tmp/amx_pack_overlap 32 256 1024 512
// Prints each schedule's median over 7 rounds (schedules taken in alternating order) and its
// GFLOP/s and weight bytes per second. Outputs are not checked: timing only.
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "../../src/moe_gmm/ops/native/simd_transpose.h"  // interleave_rows, the kernel's own

namespace {

using moe_gmm_simd::interleave_rows;

int rows = 64, experts = 128, depth = 1024, width = 1024, chunk = 128;
uint16_t *weight, *input, *output;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void tiles_on() {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
}

void pin(int core) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Rows [k0, k0 + chunk) of an expert's weight into panel[chunk / 2][width][2], 32 rows at a time
// by 64-byte column strips (the kernel's read order).
void pack(const uint16_t* w, int k0, uint16_t* panel) {
  for (int d0 = 0; d0 < chunk; d0 += 32)
    for (int j = 0; j < width; j += 32)
      for (int d = 0; d < 32; d += 2)
        interleave_rows(w + size_t(k0 + d0 + d) * width + j, w + size_t(k0 + d0 + d + 1) * width + j,
                        panel + size_t(d0 + d) * width + 2 * j, 32);
}

struct TouchAhead {
  const char* next = nullptr;  // the next chunk's weight rows (contiguous: full-width rows)
  long bytes = 0, at = 0;
  int per_block = 0, stride = 64, kind = 0;  // kind 0: prefetcht1, 1: prefetcht2, 2: load
  void some() {
    for (int i = 0; i < per_block && at < bytes; ++i, at += stride) {
      if (kind == 0) _mm_prefetch(next + at, _MM_HINT_T1);
      else if (kind == 1) _mm_prefetch(next + at, _MM_HINT_T2);
      else { volatile char c = next[at]; (void)c; }
    }
  }
};

// sums[rows][width] (+)= input rows of expert e, depth [k0, k0 + chunk) @ panel; bf16 out at the end.
void multiply(int e, int k0, const uint16_t* panel, float* sums, TouchAhead& touch) {
  const uint16_t* a = input + size_t(e) * rows * depth + k0;
  const bool first = k0 == 0, last = k0 + chunk >= depth;
  alignas(64) float c[32 * 32];
  for (int mb = 0; mb < rows; mb += 32)
    for (int nb = 0; nb < width; nb += 32) {
      float* part = sums + size_t(mb) * width + nb;
      if (first) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      } else {
        _tile_loadd(0, part, width * 4); _tile_loadd(1, part + 16, width * 4);
        _tile_loadd(2, part + 16 * width, width * 4); _tile_loadd(3, part + 16 * width + 16, width * 4);
      }
      touch.some();
      for (int d = 0; d < chunk; d += 32) {
        _tile_loadd(4, a + size_t(mb) * depth + d, depth * 2);
        _tile_loadd(5, a + size_t(mb + 16) * depth + d, depth * 2);
        const uint16_t* b = panel + size_t(d / 2) * 2 * width + nb * 2;
        _tile_loadd(6, b, width * 4);
        _tile_loadd(7, b + 32, width * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      if (!last) {
        _tile_stored(0, part, width * 4); _tile_stored(1, part + 16, width * 4);
        _tile_stored(2, part + 16 * width, width * 4); _tile_stored(3, part + 16 * width + 16, width * 4);
        continue;
      }
      _tile_stored(0, c, 128); _tile_stored(1, c + 16, 128); _tile_stored(2, c + 512, 128); _tile_stored(3, c + 528, 128);
      uint16_t* o = output + (size_t(e) * rows + mb) * width + nb;
      for (int i = 0; i < 32; ++i) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(c + i * 32 + 16), _mm512_loadu_ps(c + i * 32));
        _mm512_storeu_si512(o + size_t(i) * width, reinterpret_cast<__m512i>(v));
      }
    }
}

struct Schedule {
  const char* name;
  bool split;
  int lines_per_touch;  // 0: no touching ahead; else one touch per this many 64-byte lines
  int kind;
};

void serial(int thread, const Schedule& s) {
  pin(thread);
  tiles_on();
  std::vector<uint16_t> panel(size_t(chunk) * width);
  std::vector<float> sums(size_t(rows) * width);
  std::vector<std::pair<int, int>> order;  // (expert, k0) of this thread, in order
  for (int e = thread; e < experts; e += 2)
    for (int k0 = 0; k0 < depth; k0 += chunk) order.push_back({e, k0});
  const long chunk_bytes = long(chunk) * width * 2;
  const int blocks = (rows / 32) * (width / 32);
  for (size_t i = 0; i < order.size(); ++i) {
    const auto [e, k0] = order[i];
    TouchAhead touch;
    if (s.lines_per_touch && i + 1 < order.size()) {
      touch.next = reinterpret_cast<const char*>(weight + size_t(order[i + 1].first) * depth * width +
                                                 size_t(order[i + 1].second) * width);
      touch.bytes = chunk_bytes;
      touch.stride = 64 * s.lines_per_touch;
      touch.per_block = int((chunk_bytes / touch.stride + blocks - 1) / blocks);
      touch.kind = s.kind;
    }
    pack(weight + size_t(e) * depth * width, k0, panel.data());
    multiply(e, k0, panel.data(), sums.data(), touch);
  }
  _tile_release();
}

constexpr int kRing = 8;
struct alignas(64) Sequence {
  std::atomic<long> value{-1};
};
Sequence packed[kRing], consumed[kRing];
uint16_t* ring[kRing];

void packer() {
  pin(0);
  long seq = 0;
  for (int e = 0; e < experts; ++e)
    for (int k0 = 0; k0 < depth; k0 += chunk, ++seq) {
      const int slot = seq % kRing;
      while (consumed[slot].value.load(std::memory_order_acquire) < seq - kRing) _mm_pause();
      pack(weight + size_t(e) * depth * width, k0, ring[slot]);
      packed[slot].value.store(seq, std::memory_order_release);
    }
}

void multiplier() {
  pin(1);
  tiles_on();
  std::vector<float> sums(size_t(rows) * width);
  TouchAhead none;
  long seq = 0;
  for (int e = 0; e < experts; ++e)
    for (int k0 = 0; k0 < depth; k0 += chunk, ++seq) {
      const int slot = seq % kRing;
      while (packed[slot].value.load(std::memory_order_acquire) < seq) _mm_pause();
      multiply(e, k0, ring[slot], sums.data(), none);
      consumed[slot].value.store(seq, std::memory_order_release);
    }
  _tile_release();
}

double run(const Schedule& s) {
  const auto start = std::chrono::steady_clock::now();
  if (s.split) {
    for (int i = 0; i < kRing; ++i) packed[i].value = -1, consumed[i].value = -1;
    std::thread a(packer), b(multiplier);
    a.join(), b.join();
  } else {
    std::thread a(serial, 0, s), b(serial, 1, s);
    a.join(), b.join();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) rows = atoi(argv[1]);
  if (argc > 2) experts = atoi(argv[2]);
  if (argc > 3) depth = atoi(argv[3]);
  if (argc > 4) width = atoi(argv[4]);
  chunk = std::clamp((256 << 10) / (width * 2) / 32 * 32, 32, 256);  // the kernel's 256 KiB chunks
  if (rows % 32 || width % 32 || depth % chunk) {
    fprintf(stderr, "rows and N must be multiples of 32, K of the chunk (%d rows)\n", chunk);
    return 1;
  }
  weight = static_cast<uint16_t*>(aligned_alloc(64, size_t(experts) * depth * width * 2));
  input = static_cast<uint16_t*>(aligned_alloc(64, size_t(experts) * rows * depth * 2));
  output = static_cast<uint16_t*>(aligned_alloc(64, size_t(experts) * rows * width * 2));
  std::fill_n(weight, size_t(experts) * depth * width, uint16_t(0x3f80));  // 1.0
  std::fill_n(input, size_t(experts) * rows * depth, uint16_t(0x3c00));    // 2^-7
  std::memset(output, 0, size_t(experts) * rows * width * 2);
  for (auto& slot : ring) slot = static_cast<uint16_t*>(aligned_alloc(64, size_t(chunk) * width * 2));
  for (auto& slot : ring) std::memset(slot, 0, size_t(chunk) * width * 2);

  const std::vector<Schedule> schedules = {
      {"serial", false, 0, 0},
      {"split", true, 0, 0},
      {"touch every line T1", false, 1, 0},
      {"touch 1 per 1 KiB T1", false, 16, 0},
      {"touch 1 per 2 KiB T1", false, 32, 0},
      {"touch 1 per 4 KiB T1", false, 64, 0},
      {"touch every line T2", false, 1, 1},
      {"touch 1 per 1 KiB load", false, 16, 2},
      {"touch 1 per 4 KiB load", false, 64, 2},
  };
  constexpr int kRounds = 7;
  std::vector<std::vector<double>> seconds(schedules.size());
  for (int r = 0; r < kRounds; ++r)
    for (size_t j = 0; j < schedules.size(); ++j) {
      const size_t i = r % 2 ? schedules.size() - 1 - j : j;
      seconds[i].push_back(run(schedules[i]));
    }
  const double flops = 2.0 * experts * rows * depth * width, bytes = 2.0 * experts * depth * width;
  printf("E%d, %d rows each, K%d N%d, chunks of %d rows; median of %d rounds\n", experts, rows, depth, width, chunk,
         kRounds);
  std::sort(seconds[0].begin(), seconds[0].end());
  const double base = seconds[0][kRounds / 2];
  for (size_t i = 0; i < schedules.size(); ++i) {
    std::sort(seconds[i].begin(), seconds[i].end());
    const double t = seconds[i][kRounds / 2];
    printf("  %-24s %7.2f ms  %5.0f GFLOP/s  %5.1f GB/s of weight  serial/this %.2fx\n", schedules[i].name, t * 1e3,
           flops / t / 1e9, bytes / t / 1e9, base / t);
  }
}
