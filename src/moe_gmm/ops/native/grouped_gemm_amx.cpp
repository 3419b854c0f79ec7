// bfloat16 grouped GEMM on Intel AMX: the three products of the grouped matmul, each expert's rows
// multiplied by its own weight, every expert in one parallel region.
//
// Why: oneDNN runs the row counts MoE experts get far below its rate on one large GEMM (the
// figures are in docs/cpu_kernels.md), and a loop pays a kernel setup and a thread fork/join per
// expert. Here the threads split (expert, panel) tasks by cost once per call; each task packs its
// operand into AMX's pair-interleaved (VNNI) layout in L2, reading the weight from memory once,
// and multiplies with 2 x 2 tiles of 16 x 16 float32 accumulators.
//   nt: the weight's rows are already what an A tile holds (reduced dimension contiguous), so the
//       tiles load them straight from memory and the expert's few input rows are packed instead;
//       the product is out^T, transposed 32 x 32 at a time (weight_rows_product). Building a
//       VNNI panel of the weight with 16 x 16 transposes instead ran slower.
//   nn, tn: the 512-wide (nn) or 256-wide (tn) panel is read in chunks of row segments, 32 rows
//       at a time (32 memory streams in flight: 2 rows at a time ran slower), float32
//       partial sums kept in L2 between chunks (chunked_product). Reading two rows' segments per
//       step into a whole-depth panel instead ran slower; so did tn's partial sums over 1024
//       columns at once (1 MiB) against 256-column blocks.
//   nn for experts of at most 16 rows: no packing at all. The weight's rows go straight into B
//       tiles, read as pairs of adjacent columns, and each product runs twice, against the input
//       spread into the pairs' first and second places (spread_product): twice the tile arithmetic,
//       which few rows leave idle anyway. The weight is read in bands of 16 full rows with the
//       next band prefetched. Faster than chunked_product at 4-16 rows, slower from 32 rows.
//       The spread's zeros meet the other column's weights, so a task whose sums come out Inf or
//       NaN runs again with the band's columns split (zeros only against zeros).
// All three are ahead of a oneDNN loop on 64-row experts. With more rows per expert oneDNN, one
// GEMM per expert on a thread of its own (experts_mm.cpp), catches up: the Python side gives each
// kernel experts up to a row limit of its own (ops/backends/cpu/tuning.py) and the rest to
// experts_mm.
//
// Ops (namespace moe_gmm_native); group_ends[E] int64 on the host: expert e owns rows
// [group_ends[e-1], group_ends[e]). Every operand is bfloat16 with a contiguous last dimension,
// every reduced or output width a multiple of 32 (the Python side checks and otherwise takes
// another path). Outputs are caller-provided and every element is written.
//   amx_gemm_supported()                                       AMX built in and granted by the OS
//   amx_gemm_nn(a[M,R], b[E,R,J], group_ends, max_rows, out[M,J])
//                                                              out[rows_e] = a[rows_e] @ b[e]
//   amx_gemm_nt(a[M,R], b[E,J,R], group_ends, max_rows, out[M,J])
//                                                              out[rows_e] = a[rows_e] @ b[e]^T
//                                                              (a's row stride even)
//   amx_gemm_tn(a[M,R], b[M,J], group_ends, max_rows, out[E,R,J])
//                                                              out[e] = a[rows_e]^T @ b[rows_e]
// (an empty expert's tn output is zero; experts of more than max_rows rows are left untouched for
// the caller). Accumulation is float32 in a fixed order and each output element is computed by one
// task, so results do not depend on the thread count; each sum is rounded to bfloat16 once (to
// nearest even).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "grouped_gemm_common.h"
#include "simd_transpose.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define MOE_GMM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using moe_gmm_gemm::bf16_bits;
using moe_gmm_gemm::next_call;
using moe_gmm_gemm::PreparedExpert;
using moe_gmm_gemm::Task;
#ifdef MOE_GMM_AMX
using moe_gmm_simd::interleave_rows;
using moe_gmm_simd::transpose_16x16;
#endif

#ifdef MOE_GMM_AMX

constexpr int kTileRows = 16;
constexpr int kTileDepth = 32;   // bfloat16 values in one 64-byte tile row
constexpr int kBlock = 32;       // output block: 2 x 2 tiles of 16 x 16
constexpr int64_t kPanel = 256;  // nt, tn: output columns (nt) or rows (tn) per task; a packed
                                 // panel of K = 1024 is 512 KiB, so it and its rows fit in L2
constexpr int64_t kPanelNN = 512;
constexpr int64_t kSpreadMaxRows = 16;  // nn: experts of at most this many rows take spread_product
constexpr int kStripRows = 32;  // nn: output columns per task, read in chunks of full rows

// Linux hands out AMX's 8 KiB of tile state only to processes that ask (arch_prctl).
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile state is per thread: configured at the start of a thread's share of the work, released
// after (oneDNN configures its own before each of its kernels).
struct TileScope {
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kTileRows;
    _tile_loadconfig(&cfg);
  }
  ~TileScope() {
    _mm_sfence();  // streaming stores are visible before the thread's share of the work ends
    _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// 32 float32 -> 32 bfloat16 (round to nearest even). Streaming stores skip reading the
// destination's lines first: tn's output (a weight gradient) is written once and is the largest
// stream of the call (ordinary stores read every line in first).
template <bool Streaming>
inline void store_bf16(const float* src, uint16_t* dst) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  if constexpr (Streaming) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), reinterpret_cast<__m512i>(v));
  } else {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(v));
  }
}

// Tiles 0-3 (a 32 x 32 float32 block as 2 x 2 tiles) += a[32 rows][depth] @ b, where b is the
// VNNI panel starting at this block's columns, vnni_row bfloat16 values per row of pairs.
inline void multiply_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t vnni_row, int64_t depth) {
  for (int64_t d = 0; d < depth; d += kTileDepth) {
    _tile_loadd(4, a + d, lda * 2);
    _tile_loadd(5, a + kTileRows * lda + d, lda * 2);
    const uint16_t* bd = b + (d / 2) * vnni_row;
    _tile_loadd(6, bd, vnni_row * 2);
    _tile_loadd(7, bd + kTileRows * 2, vnni_row * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Tiles 0-3 to and from a float32 block whose rows are ld floats apart.
inline void store_block(float* c, int64_t ld) {
  _tile_stored(0, c, ld * 4);
  _tile_stored(1, c + 16, ld * 4);
  _tile_stored(2, c + 16 * ld, ld * 4);
  _tile_stored(3, c + 16 * ld + 16, ld * 4);
}
inline void load_block(const float* c, int64_t ld) {
  _tile_loadd(0, c, ld * 4);
  _tile_loadd(1, c + 16, ld * 4);
  _tile_loadd(2, c + 16 * ld, ld * 4);
  _tile_loadd(3, c + 16 * ld + 16, ld * 4);
}
inline void zero_block() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// nn for one expert and the output columns [0, cols): out = a @ w, w's rows read front to back in
// chunks of full-width rows (sequential, which the hardware prefetcher streams at full speed),
// each chunk packed and multiplied into float32 partial sums that stay in L2.
template <bool Streaming, typename RowOf>
void chunked_product(const uint16_t* a, int64_t lda, int64_t rows, const RowOf& row_of, int64_t depth, int64_t cols,
                     uint16_t* out, int64_t ldo) {
  thread_local std::vector<uint16_t> panel, a_pad;
  thread_local std::vector<float> acc;
  alignas(64) float c[kBlock * kBlock];
  const int64_t blocks = (rows + kBlock - 1) / kBlock, tail = rows % kBlock;
  const int64_t chunk = std::clamp<int64_t>((int64_t(256) << 10) / (cols * 2) / kBlock * kBlock, kBlock, 256);
  panel.resize(chunk * cols);
  acc.resize(blocks * kBlock * cols);
  if (tail != 0) {
    a_pad.assign(kBlock * depth, 0);
    for (int64_t i = 0; i < tail; ++i) std::memcpy(a_pad.data() + i * depth, a + ((blocks - 1) * kBlock + i) * lda, depth * 2);
  }
  for (int64_t k0 = 0; k0 < depth; k0 += chunk) {
    const int64_t kk = std::min(chunk, depth - k0);
    const bool first = k0 == 0, last = k0 + kk == depth;
    // 32 rows at a time, a 64-byte column strip of each in turn: 32 streams in flight instead of 2
    for (int64_t d0 = 0; d0 < kk; d0 += kStripRows) {
      const int64_t strip = std::min<int64_t>(kStripRows, kk - d0);
      const uint16_t* src[kStripRows];
      for (int64_t d = 0; d < strip; ++d) src[d] = row_of(k0 + d0 + d);
      for (int64_t j = 0; j < cols; j += 32)
        for (int64_t d = 0; d < strip; d += 2)
          interleave_rows(src[d] + j, src[d + 1] + j, panel.data() + (d0 + d) * cols + 2 * j, 32);
    }
    for (int64_t mb = 0; mb < blocks; ++mb) {
      const bool padded = tail != 0 && mb == blocks - 1;
      const uint16_t* ab = padded ? a_pad.data() : a + mb * kBlock * lda;
      const int64_t ld = padded ? depth : lda;
      float* part = acc.data() + mb * kBlock * cols;
      for (int64_t nb = 0; nb < cols; nb += kBlock) {
        if (first) {
          zero_block();
        } else {
          load_block(part + nb, cols);
        }
        multiply_block(ab + k0, ld, panel.data() + nb * 2, cols * 2, kk);
        if (!last) {
          store_block(part + nb, cols);
          continue;
        }
        store_block(c, kBlock);
        const int64_t real = std::min<int64_t>(kBlock, rows - mb * kBlock);
        for (int64_t i = 0; i < real; ++i) store_bf16<Streaming>(c + i * kBlock, out + (mb * kBlock + i) * ldo + nb);
      }
    }
  }
}

// The VNNI form of a's rows for B tiles: a[rows][pairs] as 32-bit values (pairs along the reduced
// dimension), transposed per block of 32 rows to packed[block][pairs][32]; rows past the end are
// zero. Blocked so that a B tile's 16 rows are 128 bytes apart (a [pairs][rows] layout put them
// 4 KiB apart at 1024 rows, and ran slower).
void pack_rows_as_pairs(const uint32_t* a, int64_t lda, int64_t rows, int64_t pairs, std::vector<uint32_t>& packed) {
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  packed.resize(blocks * pairs * kBlock);
  alignas(64) uint32_t tail[kTileRows * 16], t[16 * 16];
  for (int64_t m = 0; m < blocks * kBlock; m += kTileRows) {
    uint32_t* block = packed.data() + (m / kBlock) * pairs * kBlock + m % kBlock;
    const int64_t real = std::clamp<int64_t>(rows - m, 0, kTileRows);
    for (int64_t p = 0; p < pairs; p += 16) {
      const int64_t cols = std::min<int64_t>(16, pairs - p);
      if (real == kTileRows && cols == 16) {
        transpose_16x16(a + m * lda + p, lda, block + p * kBlock, kBlock);
        continue;
      }
      std::memset(tail, 0, sizeof(tail));
      for (int64_t i = 0; i < real; ++i) std::memcpy(tail + i * 16, a + (m + i) * lda + p, cols * 4);
      transpose_16x16(tail, 16, t, 16);
      for (int64_t c = 0; c < cols; ++c) std::memcpy(block + (p + c) * kBlock, t + c * 16, 64);
    }
  }
}

// out[m, j] = sum_d a[m, d] * w[j, d] for m < rows and j in [begin, end): the weight's rows are
// the A tiles, loaded straight from memory (their reduced dimension is contiguous, so nothing is
// packed or transposed), and a's rows are the B tiles (a_t from pack_rows_as_pairs). A 32 x 32
// (or 32 x 16 for a last block of at most 16 rows) block of out^T collects in tiles over the whole
// reduction, then is transposed into out's rows.
void weight_rows_product(const uint16_t* w, int64_t ldw, int64_t begin, int64_t end, const uint32_t* a_t, int64_t rows,
                         int64_t depth, uint16_t* out, int64_t ldo) {
  alignas(64) float c[kBlock * kBlock], ct[kBlock * kBlock];
  // The weight panel [begin, end) stays in L2 across blocks of rows, each block of a_t in L1
  for (int64_t mb = 0; mb < rows; mb += kBlock) {
    const bool both = rows - mb > kTileRows;  // two 16-column B tiles, or one
    const uint32_t* block = a_t + (mb / kBlock) * (depth / 2) * kBlock;
    for (int64_t j = begin; j < end; j += kBlock) {
      const uint16_t* wj = w + j * ldw;
      _tile_zero(0);
      _tile_zero(2);
      if (both) {
        _tile_zero(1);
        _tile_zero(3);
      }
      for (int64_t d = 0; d < depth; d += kTileDepth) {
        _tile_loadd(4, wj + d, ldw * 2);
        _tile_loadd(5, wj + kTileRows * ldw + d, ldw * 2);
        const uint32_t* bd = block + (d / 2) * kBlock;
        _tile_loadd(6, bd, kBlock * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (both) {
          _tile_loadd(7, bd + kTileRows, kBlock * 4);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      // c[j][m] for 32 weight rows j and 32 (or 16) rows m; ct = its transpose, [m][j]
      store_block(c, kBlock);
      const auto* c32 = reinterpret_cast<const uint32_t*>(c);
      auto* ct32 = reinterpret_cast<uint32_t*>(ct);
      transpose_16x16(c32, kBlock, ct32, kBlock);
      transpose_16x16(c32 + kTileRows * kBlock, kBlock, ct32 + kTileRows, kBlock);
      if (both) {
        transpose_16x16(c32 + kTileRows, kBlock, ct32 + kTileRows * kBlock, kBlock);
        transpose_16x16(c32 + kTileRows * kBlock + kTileRows, kBlock, ct32 + kTileRows * kBlock + kTileRows, kBlock);
      }
      const int64_t real = std::min<int64_t>(kBlock, rows - mb);
      for (int64_t i = 0; i < real; ++i) store_bf16<false>(ct + i * kBlock, out + (mb + i) * ldo + j);
    }
  }
}

// a's rows [rows][depth] spread over two buffers of 2 * depth bfloat16 values per row, rows padded
// with zeros to a multiple of 16: even[m][2k] = a[m, k] and odd[m][2k + 1] = a[m, k], zero
// elsewhere. A 32-value row of an A tile taken from `even` holds 16 values of a in the pairs' first
// places, from `odd` in their second.
void spread_rows(const uint16_t* a, int64_t lda, int64_t rows, int64_t depth, std::vector<uint32_t>& even,
                 std::vector<uint32_t>& odd) {
  const int64_t padded = (rows + kTileRows - 1) / kTileRows * kTileRows;
  even.assign(padded * depth, 0);
  odd.assign(padded * depth, 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t k = 0; k < depth; k += 16) {
      const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m * lda + k)));
      _mm512_storeu_si512(even.data() + m * depth + k, v);
      _mm512_storeu_si512(odd.data() + m * depth + k, _mm512_slli_epi32(v, 16));
    }
}

// out[m, c..c+31] (bfloat16) from even[m][i] (column c + 2i) and odd[m][i] (column c + 2i + 1).
inline void store_interleaved(const float* even, const float* odd, uint16_t* dst) {
  alignas(64) static const int32_t kLow[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t kHigh[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512 e = _mm512_loadu_ps(even), o = _mm512_loadu_ps(odd);
  const __m512 lo = _mm512_permutex2var_ps(e, _mm512_load_si512(kLow), o);
  const __m512 hi = _mm512_permutex2var_ps(e, _mm512_load_si512(kHigh), o);
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// Requests `lines` 64-byte lines of each of 16 rows, ldw bfloat16 values apart, into L1.
inline void prefetch_band(const uint16_t* rows, int64_t ldw, int lines) {
  for (int r = 0; r < kTileRows; ++r)
    for (int l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(rows + r * ldw) + 64 * l, _MM_HINT_T0);
}

// One 32-column block of a band (16 weight rows, ldw apart) as two B tiles: `even` keeps each
// pair's first value (the even column) with a zero in its second place, `odd` the other way round.
// Each then meets the spread input's pairs with the zeros in the same places, so a zero only ever
// multiplies a zero: with the weight loaded whole, the spread's zeros met the other column's
// values, and an Inf or NaN there made this column's sums NaN (0 * Inf).
inline void split_band_block(const uint16_t* src, int64_t ldw, uint16_t* even, uint16_t* odd) {
  const __m512i first = _mm512_set1_epi32(0x0000FFFF);
  for (int r = 0; r < kTileRows; ++r) {
    const __m512i v = _mm512_loadu_si512(src + r * ldw);
    _mm512_store_si512(even + r * kBlock, _mm512_and_si512(v, first));
    _mm512_store_si512(odd + r * kBlock, _mm512_andnot_si512(first, v));
  }
  // The tile loads that read these copies are asm the compiler does not see reading memory: without
  // this barrier it dropped the stores as dead (the next block's copy overwrites them).
  asm volatile("" : : "r"(even), "r"(odd) : "memory");
}

// Whether any of 16 float32 is Inf or NaN (all exponent bits set).
inline bool any_special(const float* v) {
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __m512i bits = _mm512_and_si512(_mm512_loadu_si512(v), exponent);
  return _mm512_cmpeq_epi32_mask(bits, exponent) != 0;
}

// Tiles 0-3 (+)= the even (4) and odd (5) spread inputs times two 32-column blocks of a band (16
// weight rows, ldw apart, from src), requesting `next` (nullptr: none) as prefetch_band does. Whole:
// each block's rows straight from memory into one B tile serving both products, the prefetch
// issued after the tile loads (before them ran slower). Split: each block as two copies, the odd
// and the even columns zeroed (split_band_block), one B tile each; `split` holds them.
template <bool Split>
inline void band_blocks_product(const uint16_t* src, int64_t ldw, const uint16_t* next, uint16_t* split) {
  if constexpr (Split) {
    if (next != nullptr) prefetch_band(next, ldw, 2);
    uint16_t* odd = split + kTileRows * kBlock;
    split_band_block(src, ldw, split, odd);
    _tile_loadd(6, split, 64);
    _tile_loadd(7, odd, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 7);
    split_band_block(src + kBlock, ldw, split, odd);
    _tile_loadd(6, split, 64);
    _tile_loadd(7, odd, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 5, 7);
  } else {
    _tile_loadd(6, src, ldw * 2);
    _tile_loadd(7, src + kBlock, ldw * 2);
    if (next != nullptr) prefetch_band(next, ldw, 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// Tiles 0-1 (+)= the same for one block.
template <bool Split>
inline void band_block_product(const uint16_t* src, int64_t ldw, const uint16_t* next, uint16_t* split) {
  if constexpr (Split) {
    if (next != nullptr) prefetch_band(next, ldw, 1);
    uint16_t* odd = split + kTileRows * kBlock;
    split_band_block(src, ldw, split, odd);
    _tile_loadd(6, split, 64);
    _tile_loadd(7, odd, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 7);
  } else {
    _tile_loadd(6, src, ldw * 2);
    if (next != nullptr) prefetch_band(next, ldw, 1);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
  }
}

// nn for one expert of at most 16 rows and the output columns [begin, end): out = a @ w, the
// weight unpacked: a B tile row is then 16 pairs of adjacent *columns* of one weight row, so each
// product runs twice, against a's values spread into the pairs' first places (the even columns)
// and into their second (the odd ones): twice the tile arithmetic, which few rows leave idle, and
// no packing of the weight.
// Whole (Split = false), the spread's zeros multiply the other column's weights: exact while those
// are finite (0 * w adds nothing), but an Inf or NaN there makes this column's sum NaN (0 * Inf).
// So the whole pass returns false when any of its sums is Inf or NaN, and the caller runs the task
// again split (zeros only against zeros: exact, the same sums where both are finite). Split on
// every band ran far slower (docs/cpu_kernels.md); a weight with a special is the rare case.
// The weight is read band by band: 16 rows across the task's whole width, each row front to back,
// while the next band is requested (software prefetch, 16 rows ahead); the sums of every 32-column
// block stay in L1 between bands. Reading 128-byte column strips down all the rows instead, with or
// without prefetches, streamed the weight more slowly.
template <bool Split>
bool spread_product(const uint16_t* even, const uint16_t* odd, int64_t ld, int64_t rows, const uint16_t* w, int64_t ldw,
                    int64_t begin, int64_t end, int64_t depth, uint16_t* out, int64_t ldo) {
  constexpr int64_t kTile = kTileRows * kTileRows;  // floats in one 16 x 16 tile
  thread_local std::vector<float> storage;
  alignas(64) uint16_t split[2 * kTileRows * kBlock];  // a block's even and odd copies (Split)
  const int64_t blocks = (end - begin) / kBlock;
  storage.resize(blocks * 2 * kTile + 16);
  float* acc = storage.data() + (16 - reinterpret_cast<uintptr_t>(storage.data()) / 4 % 16) % 16;  // 64-byte aligned
  for (int64_t k = 0; k < depth; k += kTileRows) {
    _tile_loadd(4, even + 2 * k, ld * 2);
    _tile_loadd(5, odd + 2 * k, ld * 2);
    const uint16_t* band = w + k * ldw + begin;
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
      float* c = acc + b * 2 * kTile;
      if (k == 0) {
        zero_block();
      } else {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + kTile, 64);
        _tile_loadd(2, c + 2 * kTile, 64);
        _tile_loadd(3, c + 3 * kTile, 64);
      }
      const uint16_t* next = k + kTileRows < depth ? band + kTileRows * ldw + b * kBlock : nullptr;
      band_blocks_product<Split>(band + b * kBlock, ldw, next, split);
      _tile_stored(0, c, 64);
      _tile_stored(1, c + kTile, 64);
      _tile_stored(2, c + 2 * kTile, 64);
      _tile_stored(3, c + 3 * kTile, 64);
    }
    if (b < blocks) {
      float* c = acc + b * 2 * kTile;
      if (k == 0) {
        _tile_zero(0);
        _tile_zero(1);
      } else {
        _tile_loadd(0, c, 64);
        _tile_loadd(1, c + kTile, 64);
      }
      const uint16_t* next = k + kTileRows < depth ? band + kTileRows * ldw + b * kBlock : nullptr;
      band_block_product<Split>(band + b * kBlock, ldw, next, split);
      _tile_stored(0, c, 64);
      _tile_stored(1, c + kTile, 64);
    }
  }
  bool special = false;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t i = 0; i < rows; ++i) {
      const float* e = acc + b * 2 * kTile + i * kTileRows;
      const float* o = acc + (b * 2 + 1) * kTile + i * kTileRows;
      if constexpr (!Split) special |= any_special(e) || any_special(o);
      store_interleaved(e, o, out + i * ldo + begin + b * kBlock);
    }
  return !special;
}

// One task per (expert, panel) for experts of at most max_rows rows; an empty expert has none
// unless its output must be zeroed (tn).
// Cost: the expert's rows rounded up to a block, plus a constant for reading the weight panel.
void panel_tasks(const std::vector<int64_t>& starts, int64_t width, bool keep_empty, int64_t max_rows,
                 std::vector<Task>& tasks, std::vector<double>& cost, int64_t panel = kPanel) {
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t rows = starts[e + 1] - starts[e];
    if ((rows == 0 && !keep_empty) || rows > max_rows) continue;
    for (int64_t j = 0; j < width; j += panel) {
      const int64_t end = std::min(width, j + panel);
      tasks.push_back({e, j, end});
      cost.push_back(double((rows + kBlock - 1) / kBlock * kBlock + 64) * double(end - j));
    }
  }
}

// moe_gmm_gemm::run_tasks with the AMX tiles configured on each thread.
template <typename Run>
void run_tasks(const std::vector<Task>& tasks, const std::vector<double>& cost, const Run& run) {
  moe_gmm_gemm::run_tasks<TileScope>(tasks, cost, run);
}

#endif  // MOE_GMM_AMX


bool amx_gemm_supported() {
#ifdef MOE_GMM_AMX
  return amx_granted();
#else
  return false;
#endif
}

void require_amx() { TORCH_CHECK(amx_gemm_supported(), "AMX bfloat16 is not available on this CPU or build"); }

// nn and nt: a[M, depth] times expert weights b[E, ...] into out[M, width]; returns the group starts.
std::vector<int64_t> check_product(const char* op, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& group_ends, const at::Tensor& out, int64_t depth, int64_t width) {
  require_amx();
  return moe_gmm_gemm::check_bf16_product(op, a, b, group_ends, out, depth, width);
}

void amx_gemm_nn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                 at::Tensor& out) {
  const int64_t depth = b.size(1), width = b.size(2);
  const auto starts = check_product("amx_gemm_nn", a, b, group_ends, out, depth, width);
#ifdef MOE_GMM_AMX
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<Task> tasks;
  std::vector<double> cost;
  panel_tasks(starts, width, false, max_rows, tasks, cost, kPanelNN);
  const int64_t call = next_call();
  run_tasks(tasks, cost, [&](const Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    const uint16_t* w = bp + task.expert * lde;
    if (rows > kSpreadMaxRows) {
      chunked_product<false>(ap + m0 * lda, lda, rows, [&](int64_t k) { return w + k * ldb + task.begin; }, depth,
                             task.end - task.begin, op + m0 * ldo + task.begin, ldo);
      return;
    }
    thread_local std::vector<uint32_t> even, odd;
    thread_local PreparedExpert spread;
    if (spread.stale(call, task.expert)) spread_rows(ap + m0 * lda, lda, rows, depth, even, odd);
    const auto* e = reinterpret_cast<const uint16_t*>(even.data());
    const auto* o = reinterpret_cast<const uint16_t*>(odd.data());
    if (!spread_product<false>(e, o, 2 * depth, rows, w, ldb, task.begin, task.end, depth, op + m0 * ldo, ldo))
      spread_product<true>(e, o, 2 * depth, rows, w, ldb, task.begin, task.end, depth, op + m0 * ldo, ldo);
  });
#endif
}

void amx_gemm_nt(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                 at::Tensor& out) {
  const int64_t depth = b.size(2), width = b.size(1);
  const auto starts = check_product("amx_gemm_nt", a, b, group_ends, out, depth, width);
  TORCH_CHECK(a.stride(0) % 2 == 0, "amx_gemm_nt: a's row stride must be even");
#ifdef MOE_GMM_AMX
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<Task> tasks;
  std::vector<double> cost;
  panel_tasks(starts, width, false, max_rows, tasks, cost);
  const int64_t call = next_call();
  run_tasks(tasks, cost, [&](const Task& task) {
    thread_local std::vector<uint32_t> a_t;
    thread_local PreparedExpert packed;
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    if (packed.stale(call, task.expert))
      pack_rows_as_pairs(reinterpret_cast<const uint32_t*>(ap + m0 * lda), lda / 2, rows, depth / 2, a_t);
    weight_rows_product(bp + task.expert * lde, ldb, task.begin, task.end, a_t.data(), rows, depth,
                        op + m0 * ldo, ldo);
  });
#endif
}

void amx_gemm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                 at::Tensor& out) {
  require_amx();
  const int64_t height = a.size(1), width = b.size(1);
  const auto starts = moe_gmm_gemm::check_bf16_weight_gradient("amx_gemm_tn", a, b, group_ends, out);
#ifdef MOE_GMM_AMX
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), ldb = b.stride(0), lde = out.stride(0), ldo = out.stride(1);
  const bool aligned = reinterpret_cast<uintptr_t>(op) % 64 == 0 && (ldo * 2) % 64 == 0 && (lde * 2) % 64 == 0;
  std::vector<Task> tasks;
  std::vector<double> cost;
  panel_tasks(starts, height, true, max_rows, tasks, cost);
  run_tasks(tasks, cost, [&](const Task& task) {
    thread_local std::vector<uint16_t> a_t, pairs, zero_row;
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    const int64_t panel_rows = task.end - task.begin;
    uint16_t* o = op + task.expert * lde + task.begin * ldo;
    if (rows == 0) {
      for (int64_t r = 0; r < panel_rows; ++r) moe_gmm_gemm::zero_bytes(o + r * ldo, width * 2, aligned);
      return;
    }
    const int64_t depth = (rows + kBlock - 1) / kBlock * kBlock;  // the expert's rows, zero-padded
    zero_row.assign(std::max(width, height), 0);
    auto row_of = [&](const uint16_t* base, int64_t ld, int64_t m) { return m < rows ? base + (m0 + m) * ld : zero_row.data(); };
    // a^T for this panel, [panel_rows][depth]: a's rows as pairs (32-bit values [depth/2][panel_rows]),
    // then a 32-bit transpose.
    pairs.resize(depth * panel_rows);
    for (int64_t m = 0; m < depth; m += 2)
      interleave_rows(row_of(ap, lda, m) + (m < rows ? task.begin : 0), row_of(ap, lda, m + 1) + (m + 1 < rows ? task.begin : 0),
                      pairs.data() + m * panel_rows, panel_rows);
    a_t.resize(panel_rows * depth);
    const auto* pairs32 = reinterpret_cast<const uint32_t*>(pairs.data());
    auto* a_t32 = reinterpret_cast<uint32_t*>(a_t.data());
    for (int64_t mp = 0; mp < depth / 2; mp += 16)
      for (int64_t r = 0; r < panel_rows; r += 16)
        transpose_16x16(pairs32 + mp * panel_rows + r, panel_rows, a_t32 + r * (depth / 2) + mp, depth / 2);
    // out[panel] = a_t @ b[rows_e]: b's rows (zero past the expert's) read in chunks as in nn, a
    // block of at most kPanel columns at a time so the float32 partial sums stay at 256 KiB
    // (with all 1024 columns at once, 1 MiB of them, oneDNN was faster on 256-row experts).
    for (int64_t j = 0; j < width; j += kPanel) {
      const int64_t cols = std::min(kPanel, width - j);
      auto b_row = [&](int64_t m) { return row_of(bp, ldb, m) + (m < rows ? j : 0); };
      if (aligned) chunked_product<true>(a_t.data(), depth, panel_rows, b_row, depth, cols, o + j, ldo);
      else chunked_product<false>(a_t.data(), depth, panel_rows, b_row, depth, cols, o + j, ldo);
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_gmm_native, m) {
  m.def("amx_gemm_supported() -> bool", amx_gemm_supported);
  m.def("amx_gemm_nn(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("amx_gemm_nt(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("amx_gemm_tn(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moe_gmm_native, CPU, m) {
  m.impl("amx_gemm_nn", amx_gemm_nn);
  m.impl("amx_gemm_nt", amx_gemm_nt);
  m.impl("amx_gemm_tn", amx_gemm_tn);
}
