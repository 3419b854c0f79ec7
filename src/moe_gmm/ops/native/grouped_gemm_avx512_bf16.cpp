// bfloat16 grouped GEMM on AVX-512 BF16 (vdpbf16ps), for CPUs without AMX: the three products of
// the grouped matmul, each expert's rows multiplied by its own weight, every expert in one
// parallel region.
//
// Why: without AMX, oneDNN runs a bfloat16 GEMM of the few rows an expert of a many-expert layer
// gets at a fraction of the memory bandwidth, and a loop pays a kernel setup and a
// thread fork/join per expert. Here the threads split (expert, panel) tasks by cost once per call
// and each task reads its part of the expert's weight once.
//   vdpbf16ps multiplies pairs: float32 lane i += x[2i] * y[2i] + x[2i + 1] * y[2i + 1].
//   nn: 6 x 64 blocks of the output over 256 of the depth at a time, 24 sums in registers, every
//       input row's pair of values broadcast against the weight's pairs. The first block of an
//       expert's rows interleaves the weight's row pairs in registers as it goes (unpacklo/hi:
//       each float32 lane then holds one column's pair, in an order undone when the sums are
//       rounded to bfloat16) and, when more blocks follow, keeps them in a thread's buffer for
//       them to read from L1.
//   nt: the weight's rows already hold the reduced dimension contiguously: each output value is a
//       dot product of an input row and a weight row, 4 input rows by 4 weight rows at a time.
//       Experts of kPairBlockMinRows rows or more take nn's 6 x 64 blocks instead, each 64 columns
//       x 256 of the depth of the weight transposed into 32-bit pairs in a thread's buffer once.
//   tn: the expert's rows of b are interleaved in pairs once (the expert's few rows fit in L2)
//       and every 6 x 64 block of the weight gradient is one pass over them, a's pairs broadcast;
//       the gradient, the largest stream of the call, is written with streaming stores.
//
// Ops (namespace moe_gmm_native), with the contracts of the AMX ops (grouped_gemm_amx.cpp):
// group_ends[E] int64 on the host (expert e owns rows [group_ends[e-1], group_ends[e])), every
// operand bfloat16 with a contiguous last dimension, every reduced or output width a multiple of
// 32; outputs caller-provided.
//   avx512_bf16_gemm_supported()                               built with AVX-512 BF16
//   avx512_bf16_gemm_nn(a[M,R], b[E,R,J], group_ends, max_rows, out[M,J])
//                                                              out[rows_e] = a[rows_e] @ b[e]
//   avx512_bf16_gemm_nt(a[M,R], b[E,J,R], group_ends, max_rows, out[M,J])
//                                                              out[rows_e] = a[rows_e] @ b[e]^T
//   avx512_bf16_gemm_tn(a[M,R], b[M,J], group_ends, max_rows, out[E,R,J])
//                                                              out[e] = a[rows_e]^T @ b[rows_e]
// Experts of more than max_rows rows are left untouched for the caller; an empty expert's tn
// output is zero. Accumulation is float32 in a fixed order and each output element is computed by
// one task, so results do not depend on the thread count; each sum is rounded to bfloat16 once
// (to nearest even).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "grouped_gemm_common.h"
#include "simd_reduce.h"
#include "simd_transpose.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define MOE_GMM_AVX512_BF16 1
#include <immintrin.h>
#endif

namespace {

using moe_gmm_gemm::bf16_bits;
using moe_gmm_gemm::Task;

#ifdef MOE_GMM_AVX512_BF16

using moe_gmm_gemm::ReadAhead;

constexpr int kDotRows = 4;           // nt: input rows per pass (4 x 4 accumulators)
constexpr int64_t kNTPanel = 128;     // nt: weight rows (output columns) per task
// nt: how far ahead the weight rows are prefetched (two quads ahead at short depths beat one).
constexpr int64_t kNTPrefetchBytes = 8192;
constexpr int kOuterRows = 6;         // tn: 6 x 4 accumulators
constexpr int64_t kTNPanel = 48;      // tn: output rows per task

inline __m512bh as_pairs(__m512i v) { return (__m512bh)v; }

template <bool Streaming>
inline void store_row_bits(uint16_t* dst, __m512i v) {
  if constexpr (Streaming) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else {
    _mm512_storeu_si512(dst, v);
  }
}

// 32 float32 in column order (c0: columns 0-15, c1: 16-31) -> 32 bfloat16, rounded to nearest even.
inline __m512i round_to_bf16(__m512 c0, __m512 c1) { return (__m512i)_mm512_cvtne2ps_pbh(c1, c0); }

// ---- nn's pair order ---------------------------------------------------------------------------
// Interleaving rows r and r + 1 with unpacklo/hi_epi16 pairs up their 16-bit values within each
// 128-bit lane: float32 lane 4q + i of the low half holds column 8q + i, of the high half 8q + 4 + i
// (i < 4). The sums keep that order ([low 16][high 16] per 32 columns) until they are rounded.
inline __m512i columns_low(__m512 low, __m512 high) {
  return _mm512_castps_si512(_mm512_permutex2var_ps(
      low, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), high));
}
inline __m512i columns_high(__m512 low, __m512 high) {
  return _mm512_castps_si512(_mm512_permutex2var_ps(
      low, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), high));
}

// ---- pair blocks (nn, and nt for experts of many rows) -------------------------------------------
// nn: every expert takes the blocks. Experts of 1-7 rows used to take bands of 16 weight rows
// loaded straight from the weight (rows 2-4 KiB apart put a band's 16 lines and the next band's
// prefetched 16 in one or two L1 sets) with float32 sums in L1 between bands. Since the first
// block makes the pairs as it multiplies them, the blocks are ahead of the bands from 4 rows and
// about even at 1-2.
// nt: experts of this many rows or more take the blocks over its transposed pairs instead of the
// dot products, which are ahead below it.
constexpr int64_t kPairBlockMinRows = 32;
constexpr int kBlockRows = 6;             // 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int64_t kBlockColumns = 64;
constexpr int64_t kBlockDepth = 256;      // the depth of a packed chunk: 128 pairs x 64 columns, 32 KiB
constexpr int64_t kBlockTaskColumns = 256;

// The pair of bfloat16 values at p in every lane, in a register: GCC would otherwise fold the
// broadcast into the multiply-add as an embedded-broadcast operand.
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  __m512i v = _mm512_set1_epi32(pair);
  asm("" : "+v"(v));
  return as_pairs(v);
}

// Where a pair block's weight pairs come from.
enum class Pairs {
  kPacked,     // packed already (nt's transposed pairs in column order; nn's made by a block before)
  kPackStore,  // nn: made from the weight's rows as they are needed, and stored for the blocks after
  kPackOnly,   // nn: made from the weight's rows, for this block alone
};

// sums[i][0:16*NV] (+)= sum_p x[i][2p, 2p + 1] . packed[p][0:16*NV] for i < MR, p < pairs (x's rows
// lda apart, packed's pairs 2 * kBlockColumns values apart). nn's pairs are rows 2p and 2p + 1 of
// w (ldw apart) interleaved by unpacklo/hi within 128-bit lanes (columns_low/high's order, undone
// when the sums are rounded; NNOrder); making them as they are needed mixes the weight's loads
// with the multiply-adds instead of a packing pass of their own. With `out`, the sums are rounded
// to bfloat16 into out (ldo apart) instead of stored. Prefetches lines pf_first.. of `pf`, one per
// pair (line L: row L >> pf_shift, line L & ((1 << pf_shift) - 1) of that row, rows ldp apart), and
// steps `ahead` (nullptr: none) once per pair.
template <int MR, int NV, Pairs Source, bool NNOrder>
void pair_block(const uint16_t* x, int64_t lda, uint16_t* packed, const uint16_t* w, int64_t ldw, int64_t pairs,
                float* sums, int64_t lds, bool first, uint16_t* out, int64_t ldo, const uint16_t* pf, int64_t ldp,
                int pf_shift, int64_t pf_first, int pf_count, ReadAhead* ahead) {
  static_assert(NNOrder || Source == Pairs::kPacked, "only nn makes its pairs");
  // a copy in registers: through the pointer, every step would store and reload it
  ReadAhead reader = ahead != nullptr ? *ahead : ReadAhead();
  const bool reads_ahead = reader.active();
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * lds + 16 * v);
  const int64_t line_mask = (int64_t(1) << pf_shift) - 1;
  // the output's lines requested as the block starts (see prefetch_for_write)
  if (out != nullptr) moe_gmm_gemm::prefetch_for_write(out, ldo * 2, MR, NV * 32);
  for (int64_t p = 0; p < pairs; ++p) {
    if (reads_ahead) reader.step();
    if (p < pf_count) {
      const int64_t line = pf_first + p;
      const char* addr = reinterpret_cast<const char*>(pf + (line >> pf_shift) * ldp + (line & line_mask) * 32);
      _mm_prefetch(addr, _MM_HINT_T0);
    }
    __m512i wv[NV];
    uint16_t* pairs_p = packed + p * 2 * kBlockColumns;
    if constexpr (Source == Pairs::kPacked) {
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(pairs_p + 32 * v);
    } else {
      const uint16_t* r0 = w + 2 * p * ldw;
      for (int v = 0; v < NV; v += 2) {
        const __m512i a = _mm512_loadu_si512(r0 + 16 * v), b = _mm512_loadu_si512(r0 + ldw + 16 * v);
        wv[v] = _mm512_unpacklo_epi16(a, b);
        wv[v + 1] = _mm512_unpackhi_epi16(a, b);
        if constexpr (Source == Pairs::kPackStore) {
          _mm512_storeu_si512(pairs_p + 32 * v, wv[v]);
          _mm512_storeu_si512(pairs_p + 32 * v + 32, wv[v + 1]);
        }
      }
    }
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = broadcast_pair(x + i * lda + 2 * p);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], as_pairs(wv[v]), xv);
    }
  }
  if (reads_ahead) *ahead = reader;
  if (out != nullptr) {
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; v += 2) {
        __m512 c0 = acc[i][v], c1 = acc[i][v + 1];
        if constexpr (NNOrder) {
          c0 = _mm512_castsi512_ps(columns_low(acc[i][v], acc[i][v + 1]));
          c1 = _mm512_castsi512_ps(columns_high(acc[i][v], acc[i][v + 1]));
        }
        _mm512_storeu_si512(out + i * ldo + 16 * v, round_to_bf16(c0, c1));
      }
  } else {
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(sums + i * lds + 16 * v, acc[i][v]);
  }
}

using PairBlockFn = void (*)(const uint16_t*, int64_t, uint16_t*, const uint16_t*, int64_t, int64_t, float*, int64_t,
                             bool, uint16_t*, int64_t, const uint16_t*, int64_t, int, int64_t, int, ReadAhead*);
template <Pairs Source, bool NNOrder>
constexpr PairBlockFn pair_block_fn(int mr, int nv) {
  constexpr PairBlockFn kTwo[kBlockRows] = {
      &pair_block<1, 2, Source, NNOrder>, &pair_block<2, 2, Source, NNOrder>, &pair_block<3, 2, Source, NNOrder>,
      &pair_block<4, 2, Source, NNOrder>, &pair_block<5, 2, Source, NNOrder>, &pair_block<6, 2, Source, NNOrder>};
  constexpr PairBlockFn kFour[kBlockRows] = {
      &pair_block<1, 4, Source, NNOrder>, &pair_block<2, 4, Source, NNOrder>, &pair_block<3, 4, Source, NNOrder>,
      &pair_block<4, 4, Source, NNOrder>, &pair_block<5, 4, Source, NNOrder>, &pair_block<6, 4, Source, NNOrder>};
  return nv == 4 ? kFour[mr - 1] : kTwo[mr - 1];
}

// The 6 x 64 blocks down an expert's rows (x's, lda apart) over one packed chunk of `pairs` pairs
// and `width` columns: sums (lds apart) start at zero with `first`, and with `out` are rounded into
// it instead of stored. With w (nn; nullptr: nt, the chunk is packed already), the first block
// makes the chunk's pairs from w's rows (ldw apart) as it goes, and stores them when blocks follow.
// The blocks share out the prefetch of `lines` lines of `next` (pf_shift as pair_block's; rows ldw
// apart) and step `ahead` (nullptr: none) once per pair.
void blocks_over_chunk(const uint16_t* x, int64_t lda, int64_t rows, uint16_t* packed, const uint16_t* w,
                       int64_t pairs, int64_t width, float* sums, int64_t lds, bool first, uint16_t* out,
                       int64_t ldo, const uint16_t* next, int64_t ldw, int pf_shift, int64_t lines, ReadAhead* ahead) {
  const int nv = width == kBlockColumns ? 4 : 2;
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  if (next == nullptr) lines = 0;
  const int64_t per_block = (lines + blocks - 1) / blocks;
  for (int64_t r = 0, b = 0; r < rows; r += kBlockRows, ++b) {
    const int mr = static_cast<int>(std::min<int64_t>(kBlockRows, rows - r));
    const int64_t pf_first = std::min(lines, b * per_block);
    const int pf_count = static_cast<int>(std::min(lines, pf_first + per_block) - pf_first);
    const PairBlockFn block = w == nullptr ? pair_block_fn<Pairs::kPacked, false>(mr, nv)
                              : b > 0      ? pair_block_fn<Pairs::kPacked, true>(mr, nv)
                              : blocks > 1 ? pair_block_fn<Pairs::kPackStore, true>(mr, nv)
                                           : pair_block_fn<Pairs::kPackOnly, true>(mr, nv);
    block(x + r * lda, lda, packed, w, ldw, pairs, sums + r * lds, lds, first, out != nullptr ? out + r * ldo : nullptr,
          ldo, next, ldw, pf_shift, pf_first, pf_count, ahead);
  }
}

// out[0:rows, 0:cols] = x[0:rows, 0:depth] @ w[0:depth, 0:cols] for an expert of many rows. For each
// kBlockDepth of the depth, each 64 columns of w have their row pairs interleaved in a thread's
// contiguous buffer by the first 6 rows' block, which multiplies them as it goes (a packing pass
// of its own before the blocks was slower on few rows), and 6 x 64 blocks down the
// expert's other rows read it from L1 with their sums in registers (float32 between chunks, in a
// thread's buffer across the task's columns). The blocks prefetch the next 64 columns (after the
// last, the next chunk's first, or at the end `following`'s: the next task's first, laid out as
// w), and each chunk's blocks request the next chunk across the task's columns front to back
// (ReadAhead): ahead of 64 columns over the whole depth before the next 64 on 64-row experts
// (bit-identical); the chunks without the read-ahead were not.
void nn_pair_blocks(const uint16_t* x, int64_t lda, int64_t rows, const uint16_t* w, int64_t ldw, int64_t depth,
                    int64_t cols, uint16_t* out, int64_t ldo, const uint16_t* following) {
  thread_local std::vector<uint16_t> packed_buffer;
  thread_local std::vector<float> sums_buffer;
  packed_buffer.resize(kBlockDepth * kBlockColumns);
  const int64_t lds = (cols + kBlockColumns - 1) / kBlockColumns * kBlockColumns;
  sums_buffer.resize(rows * lds);
  uint16_t* packed = packed_buffer.data();
  float* sums = sums_buffer.data();
  const int64_t steps_per_pair = (rows + kBlockRows - 1) / kBlockRows * ((cols + kBlockColumns - 1) / kBlockColumns);
  for (int64_t k0 = 0; k0 < depth; k0 += kBlockDepth) {
    const int64_t chunk = std::min(kBlockDepth, depth - k0);
    const bool last_chunk = k0 + kBlockDepth >= depth;
    ReadAhead ahead(last_chunk ? following : w + (k0 + kBlockDepth) * ldw,
                    std::min(kBlockDepth, last_chunk ? depth : depth - k0 - kBlockDepth), cols * 2, ldw * 2,
                    steps_per_pair * (chunk / 2));
    for (int64_t j = 0; j < cols; j += kBlockColumns) {
      const int64_t width = std::min(kBlockColumns, cols - j);
      const uint16_t* next = j + kBlockColumns < cols ? w + k0 * ldw + j + kBlockColumns
                             : !last_chunk            ? w + (k0 + kBlockDepth) * ldw
                                                      : following;
      // the next 64 columns: kBlockDepth rows of 2 lines
      blocks_over_chunk(x + k0, lda, rows, packed, w + k0 * ldw + j, chunk / 2, width, sums + j, lds, k0 == 0,
                        last_chunk ? out + j : nullptr, ldo, next, ldw, 1, 2 * kBlockDepth, &ahead);
    }
  }
}

// out[0:rows, 0:cols] = x[0:rows, 0:depth] @ w[0:cols, 0:depth]^T for an expert of many rows. For
// each 64 columns and kBlockDepth of the depth, w's 32-bit pairs are transposed into a thread's
// contiguous buffer once, and 6 x 64 blocks down the expert's rows read it from L1 with their sums
// in registers (float32 between chunks, in a thread's buffer). The blocks prefetch the next chunk,
// or at the end `following` (the next task's first, laid out as w). (The next task's weight rows
// read ahead over this task's blocks did not pay here.)
void nt_pair_blocks(const uint16_t* x, int64_t lda, int64_t rows, const uint16_t* w, int64_t ldw, int64_t depth,
                    int64_t cols, uint16_t* out, int64_t ldo, const uint16_t* following) {
  thread_local std::vector<uint16_t> packed_buffer;
  thread_local std::vector<float> sums_buffer;
  packed_buffer.resize(kBlockDepth * kBlockColumns);
  sums_buffer.resize(rows * kBlockColumns);
  uint16_t* packed = packed_buffer.data();
  float* sums = sums_buffer.data();
  for (int64_t j = 0; j < cols; j += kBlockColumns) {
    const int64_t width = std::min(kBlockColumns, cols - j);
    for (int64_t k0 = 0; k0 < depth; k0 += kBlockDepth) {
      const int64_t chunk = std::min(kBlockDepth, depth - k0);
      // packed[p][c] = the 32-bit pair w[j + c][k0 + 2p, k0 + 2p + 1]
      auto* packed32 = reinterpret_cast<uint32_t*>(packed);
      for (int64_t c0 = 0; c0 < width; c0 += 16)
        for (int64_t p0 = 0; p0 < chunk / 2; p0 += 16)
          moe_gmm_simd::transpose_16x16(reinterpret_cast<const uint32_t*>(w + (j + c0) * ldw + k0 + 2 * p0), ldw / 2,
                                        packed32 + p0 * kBlockColumns + c0, kBlockColumns);
      const bool last = k0 + kBlockDepth >= depth;
      const uint16_t* next = !last                       ? w + j * ldw + k0 + kBlockDepth
                             : j + kBlockColumns < cols ? w + (j + kBlockColumns) * ldw
                                                        : following;
      // the next chunk: kBlockColumns rows of kBlockDepth / 32 lines
      blocks_over_chunk(x + k0, lda, rows, packed, nullptr, chunk / 2, width, sums, kBlockColumns, k0 == 0,
                        last ? out + j : nullptr, ldo, next, ldw, 3, kBlockColumns * (kBlockDepth / 32), nullptr);
    }
  }
}

// ---- nt ----------------------------------------------------------------------------------------

using moe_gmm_simd::sum_lanes_of_16;

constexpr int kDotColumns = 4;  // nt: weight rows per pass

// out[g][0:4] = <x row g, w rows 0..3> for G rows of x (lda apart), over depth values; each
// loaded vector serves 4 products. With `next`, weight rows next + i * ldw for i = pf_first,
// pf_first + pf_step, ... < 4 are prefetched into L2, one line of each per step (into L1 the
// weight of few-row experts streamed slower).
template <int G>
inline void dot_rows(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t ldw, const uint16_t* next,
                     int pf_first, int pf_step, int64_t depth, uint16_t* out, int64_t ldo) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < depth; d += 32) {
    if (next != nullptr)
      for (int j = pf_first; j < kDotColumns; j += pf_step)
        _mm_prefetch(reinterpret_cast<const char*>(next + j * ldw + d), _MM_HINT_T1);
    __m512bh wv[kDotColumns];
    for (int j = 0; j < kDotColumns; ++j) wv[j] = as_pairs(_mm512_loadu_si512(w + j * ldw + d));
    for (int g = 0; g < G; ++g) {
      const __m512bh xv = as_pairs(_mm512_loadu_si512(x + g * lda + d));
      for (int j = 0; j < kDotColumns; ++j) acc[g * kDotColumns + j] = _mm512_dpbf16_ps(acc[g * kDotColumns + j], xv, wv[j]);
    }
  }
  alignas(32) uint16_t sums[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), (__m256i)_mm512_cvtneps_pbh(sum_lanes_of_16(acc)));
  for (int g = 0; g < G; ++g) std::memcpy(out + g * ldo, sums + g * kDotColumns, kDotColumns * sizeof(uint16_t));
}

using DotFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, int, int, int64_t, uint16_t*,
                       int64_t);
constexpr DotFn kDots[kDotRows] = {&dot_rows<1>, &dot_rows<2>, &dot_rows<3>, &dot_rows<4>};

// ---- tn ----------------------------------------------------------------------------------------
// out[i][0:16*NV] = sum_p pairs_of_a[p][i] * pairs_of_b[p][0:16*NV] for i < MR, p < pairs, where
// a_t[p * lda + i] holds row pair p of a's column i and b[p * ldb + 2j..] row pair p of b's column j.
template <int MR, int NV, bool Streaming>
void outer_block(const uint32_t* a_t, int64_t lda, const uint16_t* b, int64_t ldb, int64_t pairs, uint16_t* out,
                 int64_t ldo) {
  // Every loop over the block unrolled: otherwise GCC keeps acc on the stack around the loop over
  // the pairs, and at 2-8 pairs (experts of 4-16 rows) storing and reloading the 24 sums took longer
  // than the multiply-adds; those stack stores also queue behind the gradient's streaming stores.
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_si512(b + p * ldb + 32 * v);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = as_pairs(_mm512_set1_epi32(int32_t(a_t[p * lda + i])));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], as_pairs(bv[v]), av);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; v += 2) store_row_bits<Streaming>(out + i * ldo + 16 * v, round_to_bf16(acc[i][v], acc[i][v + 1]));
}

using OuterFn = void (*)(const uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*, int64_t);

template <bool Streaming>
constexpr OuterFn outer_fn(int mr, int nv) {
  constexpr OuterFn kTwo[kOuterRows] = {&outer_block<1, 2, Streaming>, &outer_block<2, 2, Streaming>,
                                        &outer_block<3, 2, Streaming>, &outer_block<4, 2, Streaming>,
                                        &outer_block<5, 2, Streaming>, &outer_block<6, 2, Streaming>};
  constexpr OuterFn kFour[kOuterRows] = {&outer_block<1, 4, Streaming>, &outer_block<2, 4, Streaming>,
                                         &outer_block<3, 4, Streaming>, &outer_block<4, 4, Streaming>,
                                         &outer_block<5, 4, Streaming>, &outer_block<6, 4, Streaming>};
  return nv == 4 ? kFour[mr - 1] : kTwo[mr - 1];
}

#endif  // MOE_GMM_AVX512_BF16

// One task per (expert, range of `step` output columns or rows) for experts of at most max_rows
// rows (and, with keep_empty, empty ones); cost: the rows plus a constant for reading the range.
void tasks_of(const std::vector<int64_t>& starts, int64_t width, int64_t step, bool keep_empty, int64_t max_rows,
              std::vector<Task>& tasks, std::vector<double>& cost, int64_t min_rows = 0) {
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t rows = starts[e + 1] - starts[e];
    if ((rows == 0 && !keep_empty) || rows > max_rows || rows < min_rows) continue;
    for (int64_t j = 0; j < width; j += step) {
      const int64_t end = std::min(width, j + step);
      tasks.push_back({e, j, end});
      cost.push_back(double(rows + 8) * double(end - j));
    }
  }
}

bool avx512_bf16_gemm_supported() {
#ifdef MOE_GMM_AVX512_BF16
  return true;
#else
  return false;
#endif
}

void require_bf16(const char* op) { TORCH_CHECK(avx512_bf16_gemm_supported(), op, ": this build has no AVX-512 BF16"); }

// nn and nt: a[M, depth] times expert weights b[E, ...] into out[M, width]; returns the group starts.
std::vector<int64_t> check_product(const char* op, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& group_ends, const at::Tensor& out, int64_t depth, int64_t width) {
  require_bf16(op);
  return moe_gmm_gemm::check_bf16_product(op, a, b, group_ends, out, depth, width);
}

void avx512_bf16_gemm_nn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                         at::Tensor& out) {
  const int64_t depth = b.size(1), width = b.size(2);
  const auto starts = check_product("avx512_bf16_gemm_nn", a, b, group_ends, out, depth, width);
#ifdef MOE_GMM_AVX512_BF16
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<Task> tasks;
  std::vector<double> cost;
  tasks_of(starts, width, kBlockTaskColumns, false, max_rows, tasks, cost);
  const int64_t b_elements = b.size(0) * lde;
  moe_gmm_gemm::run_tasks<moe_gmm_gemm::NoScope>(tasks, cost, [&](const Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    if (depth == 0) {  // an empty sum: the blocks would not write it
      for (int64_t r = m0; r < m0 + rows; ++r)
        moe_gmm_gemm::zero_bytes(op + r * ldo + task.begin, (task.end - task.begin) * 2, false);
      return;
    }
    // The last block prefetches the first of the next panel or expert, usually this thread's next
    // task.
    const uint16_t* following = moe_gmm_gemm::following_panel(bp, task, width, lde, b_elements);
    nn_pair_blocks(ap + m0 * lda, lda, rows, bp + task.expert * lde + task.begin, ldb, depth, task.end - task.begin,
                   op + m0 * ldo + task.begin, ldo, following);
  });
#endif
}

void avx512_bf16_gemm_nt(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                         at::Tensor& out) {
  const int64_t depth = b.size(2), width = b.size(1);
  const auto starts = check_product("avx512_bf16_gemm_nt", a, b, group_ends, out, depth, width);
#ifdef MOE_GMM_AVX512_BF16
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<Task> tasks;
  std::vector<double> cost;
  // an odd row stride would split the weight's pairs: such weights stay on the dot products
  const int64_t block_min_rows = ldb % 2 == 0 ? kPairBlockMinRows : std::numeric_limits<int64_t>::max();
  tasks_of(starts, width, kNTPanel, false, std::min(max_rows, block_min_rows - 1), tasks, cost);
  tasks_of(starts, width, kBlockTaskColumns, false, max_rows, tasks, cost, block_min_rows);
  const bool contiguous = lde == width * ldb;
  const int64_t b_elements = b.size(0) * lde;
  moe_gmm_gemm::run_tasks<moe_gmm_gemm::NoScope>(tasks, cost, [&](const Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    const uint16_t* w = bp + task.expert * lde;
    if (depth == 0) {  // an empty sum: the blocks would not write it
      for (int64_t r = m0; r < m0 + rows; ++r)
        moe_gmm_gemm::zero_bytes(op + r * ldo + task.begin, (task.end - task.begin) * 2, false);
      return;
    }
    if (rows >= block_min_rows) {
      const int64_t following = task.end < width ? task.expert * lde + task.end * ldb : (task.expert + 1) * lde;
      nt_pair_blocks(ap + m0 * lda, lda, rows, w + task.begin * ldb, ldb, depth, task.end - task.begin,
                        op + m0 * ldo + task.begin, ldo, following < b_elements ? bp + following : nullptr);
      return;
    }
    // Each pass over the input rows prefetches its share of the weight rows kNTPrefetchBytes
    // ahead: the lines spread over the whole quad's work, not issued all at once.
    const int64_t groups = (rows + kDotRows - 1) / kDotRows;
    const int prefetch_step = static_cast<int>(std::min<int64_t>(groups, kDotColumns));
    const int64_t ahead = kDotColumns * std::max<int64_t>(1, kNTPrefetchBytes / (kDotColumns * depth * 2));
    moe_gmm_gemm::prefetch_for_write(op + m0 * ldo + task.begin, ldo * 2, rows, (task.end - task.begin) * 2);
    for (int64_t j = task.begin; j < task.end; j += kDotColumns) {
      // Past the task's range a contiguous weight goes on with the next panel or expert's rows,
      // usually this thread's next task.
      const int64_t next_offset = task.expert * lde + (j + ahead) * ldb;
      const bool prefetch =
          contiguous ? next_offset + (kDotColumns - 1) * ldb < b_elements : j + ahead + kDotColumns <= task.end;
      const uint16_t* next = prefetch ? bp + next_offset : nullptr;
      for (int64_t r = 0, q = 0; r < rows; r += kDotRows, ++q) {
        const int64_t g = std::min<int64_t>(kDotRows, rows - r);
        kDots[g - 1](ap + (m0 + r) * lda, lda, w + j * ldb, ldb, q < kDotColumns ? next : nullptr, static_cast<int>(q),
                     prefetch_step, depth, op + (m0 + r) * ldo + j, ldo);
      }
    }
  });
#endif
}

void avx512_bf16_gemm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                         at::Tensor& out) {
  require_bf16("avx512_bf16_gemm_tn");
  const int64_t height = a.size(1), width = b.size(1);
  const auto starts = moe_gmm_gemm::check_bf16_weight_gradient("avx512_bf16_gemm_tn", a, b, group_ends, out);
#ifdef MOE_GMM_AVX512_BF16
  const uint16_t *ap = bf16_bits(a), *bp = bf16_bits(b);
  uint16_t* op = bf16_bits(out);
  const int64_t lda = a.stride(0), ldb = b.stride(0), lde = out.stride(0), ldo = out.stride(1);
  const bool aligned = reinterpret_cast<uintptr_t>(op) % 64 == 0 && (ldo * 2) % 64 == 0 && (lde * 2) % 64 == 0;
  std::vector<Task> tasks;
  std::vector<double> cost;
  tasks_of(starts, height, kTNPanel, true, max_rows, tasks, cost);
  const int64_t call = moe_gmm_gemm::next_call();
  moe_gmm_gemm::run_tasks<moe_gmm_gemm::StreamingStores>(tasks, cost, [&](const Task& task) {
    thread_local std::vector<uint16_t> a_pairs, b_pairs, zero_row;
    thread_local moe_gmm_gemm::PreparedExpert prepared;
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    uint16_t* o = op + task.expert * lde;
    if (rows == 0) {
      for (int64_t r = task.begin; r < task.end; ++r) moe_gmm_gemm::zero_bytes(o + r * ldo, width * 2, aligned);
      return;
    }
    const int64_t pairs = (rows + 1) / 2;
    if (prepared.stale(call, task.expert)) {
      // row pair p of a and of b, interleaved: a_pairs[p][k] = (a[2p][k], a[2p + 1][k]) as one
      // 32-bit value, b_pairs[p][2j..2j + 1] likewise; an odd count's last pair takes a zero row
      zero_row.assign(std::max(height, width), 0);
      a_pairs.resize(2 * pairs * height), b_pairs.resize(2 * pairs * width);
      for (int64_t p = 0; p < pairs; ++p) {
        const bool odd_end = 2 * p + 1 == rows;
        const uint16_t* a1 = odd_end ? zero_row.data() : ap + (m0 + 2 * p + 1) * lda;
        const uint16_t* b1 = odd_end ? zero_row.data() : bp + (m0 + 2 * p + 1) * ldb;
        moe_gmm_simd::interleave_rows(ap + (m0 + 2 * p) * lda, a1, a_pairs.data() + 2 * p * height, height);
        moe_gmm_simd::interleave_rows(bp + (m0 + 2 * p) * ldb, b1, b_pairs.data() + 2 * p * width, width);
      }
    }
    const auto* a_t = reinterpret_cast<const uint32_t*>(a_pairs.data());
    for (int64_t r = task.begin; r < task.end; r += kOuterRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kOuterRows, task.end - r));
      for (int64_t j = 0; j < width; j += 64) {
        const int nv = width - j >= 64 ? 4 : 2;
        const OuterFn block = aligned ? outer_fn<true>(mr, nv) : outer_fn<false>(mr, nv);
        block(a_t + r, height, b_pairs.data() + 2 * j, 2 * width, pairs, o + r * ldo + j, ldo);
      }
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_gmm_native, m) {
  m.def("avx512_bf16_gemm_supported() -> bool", avx512_bf16_gemm_supported);
  m.def("avx512_bf16_gemm_nn(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("avx512_bf16_gemm_nt(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("avx512_bf16_gemm_tn(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moe_gmm_native, CPU, m) {
  m.impl("avx512_bf16_gemm_nn", avx512_bf16_gemm_nn);
  m.impl("avx512_bf16_gemm_nt", avx512_bf16_gemm_nt);
  m.impl("avx512_bf16_gemm_tn", avx512_bf16_gemm_tn);
}
