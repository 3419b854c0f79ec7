// Does the order of the AMX `nn` kernel's tile blocks within a packed chunk matter? The product
// phase of chunked_product in src/moe_gmm/ops/native/grouped_gemm_amx.cpp (one expert's rows times
// a packed chunk of `chunk` weight rows by 512 columns, 2 x 2 tiles of float32 sums per 32 x 32
// output block, the sums loaded from and stored to a float32 buffer between chunks), one thread,
// everything in L1/L2, four ways:
//   rows-outer   for each 32-row block of the input, every 32-column block of the chunk (the
//                kernel's order: the input block stays in L1, the chunk's B tiles come from L2)
//   cols-outer   for each 32-column block, every input block: a column block's B tiles (16 KiB at
//                a 256-row chunk) are reused from L1 by the second input block, the input re-read
//   ...-tiled    the same with the chunk laid out tile by tile (each B tile's 1 KiB contiguous)
//                instead of as rows of pairs 2 KiB apart, which all fall in a few L1 sets
//   tall         64 x 16 output blocks: four products share each B tile (a quarter of a B load
//                from L2 per product instead of a half), the input's tiles loaded in turn
//   tall-tiled-input  the same with the input arranged tile by tile beforehand (not timed)
//
// Build and run (AMX-BF16 and Linux needed), arguments rows depth rounds:
//   g++ -O2 -march=native -o /tmp/amx_chunk_order benchmarks/amx_chunk_order/amx_chunk_order.cpp
//   /tmp/amx_chunk_order 64 1024 200
// Prints GFLOP/s per (chunk, order), the median over 7 rounds taken in alternating order; rows a
// multiple of 64, depth of 256. Outputs are not checked: timing only.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int64_t kWidth = 512;  // the kernel's nn panel

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3 += a[32 rows][depth] @ the chunk's 32 columns; `b_step` values between the B tiles of
// consecutive 32-deep steps, `b_next` between the block's two B tiles, `ldb` bytes between a B
// tile's rows.
inline void multiply_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t b_step, int64_t b_next,
                           int64_t ldb, int64_t depth) {
  for (int64_t d = 0; d < depth; d += 32) {
    _tile_loadd(4, a + d, lda * 2);
    _tile_loadd(5, a + 16 * lda + d, lda * 2);
    const uint16_t* bd = b + (d / 32) * b_step;
    _tile_loadd(6, bd, ldb);
    _tile_loadd(7, bd + b_next, ldb);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
void load_sums(const float* c) {
  _tile_loadd(0, c, kWidth * 4);
  _tile_loadd(1, c + 16, kWidth * 4);
  _tile_loadd(2, c + 16 * kWidth, kWidth * 4);
  _tile_loadd(3, c + 16 * kWidth + 16, kWidth * 4);
}
void store_sums(float* c) {
  _tile_stored(0, c, kWidth * 4);
  _tile_stored(1, c + 16, kWidth * 4);
  _tile_stored(2, c + 16 * kWidth, kWidth * 4);
  _tile_stored(3, c + 16 * kWidth + 16, kWidth * 4);
}

enum Order { kRowsOuter, kColsOuter, kRowsOuterTiled, kColsOuterTiled, kTall, kTallTiledInput, kOrders };
const char* const kNames[kOrders] = {"rows-outer",       "cols-outer", "rows-outer-tiled",
                                     "cols-outer-tiled", "tall",       "tall-tiled-input"};

// Tall blocks: 64 x 16 outputs in tiles 0-3, one B tile (4) per 32-deep step shared by four
// products, the input's tiles loaded in turn into 5 and 6: a quarter of a B tile load from L2 per
// product instead of a half, for twice the input tile loads (from L1). `a_tile(r, d)` is input
// row tile r at depth d, `a_ld` its row stride in bytes.
template <typename ATile>
void multiply_tall(const ATile& a_tile, int64_t a_ld, const uint16_t* b, int64_t depth) {
  for (int64_t d = 0; d < depth; d += 32) {
    _tile_loadd(4, b + (d / 32) * 32 * kWidth, kWidth * 4);
    _tile_loadd(5, a_tile(0, d), a_ld);
    _tile_dpbf16ps(0, 5, 4);
    _tile_loadd(6, a_tile(1, d), a_ld);
    _tile_dpbf16ps(1, 6, 4);
    _tile_loadd(5, a_tile(2, d), a_ld);
    _tile_dpbf16ps(2, 5, 4);
    _tile_loadd(6, a_tile(3, d), a_ld);
    _tile_dpbf16ps(3, 6, 4);
  }
}

void load_tall_sums(const float* c) {
  _tile_loadd(0, c, kWidth * 4);
  _tile_loadd(1, c + 16 * kWidth, kWidth * 4);
  _tile_loadd(2, c + 32 * kWidth, kWidth * 4);
  _tile_loadd(3, c + 48 * kWidth, kWidth * 4);
}
void store_tall_sums(float* c) {
  _tile_stored(0, c, kWidth * 4);
  _tile_stored(1, c + 16 * kWidth, kWidth * 4);
  _tile_stored(2, c + 32 * kWidth, kWidth * 4);
  _tile_stored(3, c + 48 * kWidth, kWidth * 4);
}

// One pass over the whole depth in chunks of `chunk` rows, the same packed chunk reused (its
// packing is not what is timed here).
void run(Order order, const std::vector<uint16_t>& input, const std::vector<uint16_t>& tiled_input, int64_t rows,
         int64_t depth, int64_t chunk, const std::vector<uint16_t>& packed, std::vector<float>& sums) {
  if (order == kTall || order == kTallTiledInput) {
    for (int64_t k0 = 0; k0 < depth; k0 += chunk)
      for (int64_t mb = 0; mb < rows / 64; ++mb)
        for (int64_t nb = 0; nb < kWidth; nb += 16) {
          float* part = sums.data() + mb * 64 * kWidth + nb;
          if (k0 == 0) {
            zero_sums();
          } else {
            load_tall_sums(part);
          }
          const uint16_t* b = packed.data() + nb * 2;
          if (order == kTall) {
            const uint16_t* a = input.data() + mb * 64 * depth + k0;
            multiply_tall([&](int r, int64_t d) { return a + r * 16 * depth + d; }, depth * 2, b, chunk);
          } else {
            const uint16_t* a = tiled_input.data() + mb * 64 * depth + (k0 / 32) * 2048;
            multiply_tall([&](int r, int64_t d) { return a + (d / 32) * 2048 + r * 512; }, 64, b, chunk);
          }
          store_tall_sums(part);
        }
    return;
  }
  const bool tiled = order == kRowsOuterTiled || order == kColsOuterTiled;
  const bool cols_outer = order == kColsOuter || order == kColsOuterTiled;
  const int64_t blocks = rows / 32;
  auto block = [&](int64_t mb, int64_t nb, int64_t k0) {
    float* part = sums.data() + mb * 32 * kWidth + nb;
    if (k0 == 0) {
      zero_sums();
    } else {
      load_sums(part);
    }
    const uint16_t* a = input.data() + mb * 32 * depth + k0;
    if (tiled) {  // [column block][32-deep step][2 tiles][16 rows][32 values]
      multiply_block(a, depth, packed.data() + nb * chunk, 1024, 512, 64, chunk);
    } else {  // [pair row][512 columns x 2]
      multiply_block(a, depth, packed.data() + nb * 2, 32 * kWidth, 32, kWidth * 4, chunk);
    }
    store_sums(part);
  };
  for (int64_t k0 = 0; k0 < depth; k0 += chunk) {
    if (cols_outer) {
      for (int64_t nb = 0; nb < kWidth; nb += 32)
        for (int64_t mb = 0; mb < blocks; ++mb) block(mb, nb, k0);
    } else {
      for (int64_t mb = 0; mb < blocks; ++mb)
        for (int64_t nb = 0; nb < kWidth; nb += 32) block(mb, nb, k0);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "AMX tile data not granted\n");
    return 1;
  }
  const int64_t rows = argc > 1 ? std::atol(argv[1]) : 64, depth = argc > 2 ? std::atol(argv[2]) : 1024;
  const int64_t rounds = argc > 3 ? std::atol(argv[3]) : 200;
  if (rows % 64 != 0 || depth % 256 != 0) {
    std::fprintf(stderr, "rows must be a multiple of 64, depth of 256\n");
    return 2;
  }
  std::vector<uint16_t> input(rows * depth, 0x3f80);
  std::vector<float> sums(rows * kWidth);
  // the input tile by tile for the tall blocks: [64-row block][32-deep step][4 tiles][16 rows][32
  // values], so that a step's four input tiles are 4 KiB in a row (arranged once, not timed)
  std::vector<uint16_t> tiled_input(rows * depth);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t d = 0; d < depth; ++d)
      tiled_input[(m / 64) * 64 * depth + (d / 32) * 2048 + (m % 64) * 32 + d % 32] = input[m * depth + d];
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  _tile_loadconfig(&cfg);
  for (int64_t chunk : {64, 128, 256}) {
    std::vector<uint16_t> packed(chunk * kWidth, 0x3c00);
    std::vector<double> seconds[kOrders];
    for (int round = 0; round < 7; ++round)
      for (int i = 0; i < kOrders; ++i) {
        const Order order = static_cast<Order>(round % 2 == 0 ? i : kOrders - 1 - i);
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t r = 0; r < rounds; ++r) run(order, input, tiled_input, rows, depth, chunk, packed, sums);
        seconds[order].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    for (int i = 0; i < kOrders; ++i) {
      std::sort(seconds[i].begin(), seconds[i].end());
      const double flops = 2.0 * rows * depth * kWidth * rounds;
      std::printf("rows %ld depth %ld chunk %3ld  %-17s %7.1f GFLOP/s\n", long(rows), long(depth), long(chunk),
                  kNames[i], flops / seconds[i][3] * 1e-9);
    }
  }
  _tile_release();
  return 0;
}
