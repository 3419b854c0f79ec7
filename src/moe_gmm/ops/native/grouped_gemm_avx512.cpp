// float32 grouped matmul kernels on AVX-512, every expert in one parallel region: the weight
// gradient out[e] = a[rows_e]^T @ b[rows_e], and the products with the weight of experts up to a
// row limit.
//
// Why: MKL runs this product for experts of few rows far below its rate on one large GEMM, and a
// loop forks and joins its threads once per expert. Here the
// threads split (expert, 48-row panel of the output) tasks by cost once; each 6 x 64 block of the
// output is 24 vector accumulators fed by one pass over the expert's rows (a's 6 values broadcast,
// b's 64 loaded), then stored once: with few rows the output is the largest stream of the call,
// so it is written with streaming stores where aligned (no read of the lines first).
//
// Ops (namespace moe_gmm_native), group_ends[E] int64 on the host (expert e owns rows
// [group_ends[e-1], group_ends[e])), every operand float32 with a contiguous last dimension:
//   avx512_gemm_supported()                                   built with AVX-512F
//   avx512_gemm_tn(a[M,R], b[M,J], group_ends, max_rows, out[E,R,J])
//       out[e] = a[rows_e]^T @ b[rows_e]; zero for an empty expert; experts of more than max_rows
//       rows are left untouched for the caller (on Intel, past about 128 rows MKL is ahead). From
//       kTNPackRows rows on, the blocks read copies of a and b made contiguous per task.
//   avx512_gemm_nn_few_rows(a[M,R], b[E,R,J], group_ends, max_rows, out[M,J])
//       out[rows_e] = a[rows_e] @ b[e] for experts of 1..max_rows rows, others untouched: 6 x 64
//       blocks of the output keep their sums in registers over 256 of the depth at a time, each
//       64-column strip of the weight prefetched while the one before it computes and the next 256
//       of the depth requested front to back, so the weight is read once. On Intel, past 16-32 rows
//       MKL's AVX-512 code is faster; on AMD, where MKL runs generic code, the blocks are ahead
//       of it at every size measured.
//   avx512_gemm_nt_few_rows(a[M,R], b[E,J,R], group_ends, max_rows, out[M,J])
//       out[rows_e] = a[rows_e] @ b[e]^T for experts of 1..max_rows rows, others untouched: the
//       grad_input of an [E, K, N] weight (b is the weight as stored). Under 24 rows it streams
//       the weight once as 4 x 4 blocks of dot products; from 24 rows on, blocks of the weight
//       transposed in a thread's buffer feed the nn blocks.
// Each output element is one float32 sum over the expert's rows in order, computed by one task, so
// results do not depend on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "grouped_gemm_common.h"
#include "simd_reduce.h"
#include "simd_transpose.h"

#if defined(__AVX512F__)
#define MOE_GMM_AVX512 1
#include <immintrin.h>
#endif

namespace {

#ifdef MOE_GMM_AVX512

constexpr int kLanes = 16;
constexpr int kVectors = 4;  // 64 output columns per block
constexpr int kColumns = kLanes * kVectors;
constexpr int kRows = 6;     // 6 x 4 accumulators (+ 4 loaded vectors + 1 broadcast of 32 registers)
constexpr int64_t kPanel = 48;
// tn: experts of this many rows or more copy the task's 48 columns of a, and each 64 columns of b
// in turn, into a thread's buffers before the blocks pass over them. Their rows are K and N floats
// apart in the operands: at 4 KiB (K or N = 1024) every row's line of a block falls in one L1 set
// and a few L2 sets, and each block fetched them again from L3. The copy pays from about 384 rows
// (bit-identical; docs/cpu_kernels.md).
constexpr int64_t kTNPackRows = 384;
// nn for experts of many rows: the depth taken per pass of the 6 x 64 blocks (faster than 64 or
// the whole depth).
constexpr int64_t kNNDepthChunk = 256;
// ... and at most this many bytes of the weight per chunk (its rows across the task's columns). The
// blocks read the next chunk ahead while they compute, so a chunk and the next are in L2 at once: a
// task of 1024 float32 columns (experts of up to 32 rows) 256 deep is 1 MiB, and with the next one
// it filled a 2 MiB L2, evicting lines before the blocks got to them (bit-identical either way;
// measured on Intel, not on AMD, whose 1 MiB L2 held even less of the larger chunks).
constexpr int64_t kNNChunkBytes = int64_t(256) << 10;
// ... and shorter where the weight's rows are 8 KiB apart or a larger power of two: then a chunk's
// strip (and the next chunk, read ahead) would fall into a few L2 sets (sets repeat every 128 KiB on
// a 2 MiB 16-way L2 or a 1 MiB 8-way one, 64 KiB on a 1 MiB 16-way one) and every block would fetch
// it again. The chunk keeps at most 8 of a set's lines at a 128 KiB period (as fast as weight rows
// padded by one line; not measured on AMD).
// nn blocks: the terms summed in registers before the partial sums are added to the output: a
// little slower than one chain over the depth, and far closer to MKL's loop on long reductions
// that cancel (in 61 random reductions of 1100 terms to 2 outputs, 8 came out more than 1e-5 from
// MKL's loop, against 32 with one chain).
constexpr int64_t kPartialDepth = 64;
// The depth chunk of nn_blocks (the rules above): a multiple of kPartialDepth unless the rows are
// 32 KiB apart or more, so that the sums are the same as over one chunk.
inline int64_t nn_depth_chunk(int64_t row_bytes, int64_t task_bytes) {
  const int64_t alias = row_bytes & -row_bytes;  // the largest power of two dividing the row stride
  const int64_t by_alias = alias < 8192 ? kNNDepthChunk : std::max<int64_t>(32, (int64_t(1) << 20) / alias);
  const int64_t partials = kNNChunkBytes / std::max<int64_t>(task_bytes, 1) / kPartialDepth;
  const int64_t by_bytes = std::max<int64_t>(1, partials) * kPartialDepth;
  return std::min({kNNDepthChunk, by_alias, by_bytes});
}
// nt: experts of this many rows or more take the nn blocks over 64 x 256 blocks of the weight
// transposed in L2 (the dot products the few-row nt had then summed each output through a permute
// tree, and loaded every vector masked). Since the dot blocks load every vector unmasked, they are
// ahead below 24 rows and even from there.
constexpr int64_t kNTManyRows = 24;
// nt: experts of fewer rows than this transpose the weight in blocks 64 deep, so that each block's 64
// rows x 4 lines can be prefetched by the blocks before it. At 128 rows and more 64 deep ran
// slower: their blocks are bound by the multiply-adds, which pass over each buffer of 256 deep for
// longer.
constexpr int64_t kNTShallowRows = 128;

inline __mmask16 tail_mask(int64_t n) { return n >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }

// *p in every lane, loaded into a register first. Left to itself GCC folds _mm512_set1_ps(*p) into
// the multiply-add as an embedded-broadcast operand ({1to16}), which Zen 5 issues at a fraction of
// the multiply-add rate; a broadcast load is a plain load on every x86 core.
inline __m512 broadcast(const float* p) {
  __m512 v = _mm512_set1_ps(*p);
  asm("" : "+v"(v));
  return v;
}

// c[i, 0:16*NV] = sum_m a[m*lda + i] * b[m*ldb, 0:16*NV] for i < MR and m < depth; the last
// vector masked by tail.
template <int MR, int NV, bool Streaming>
void outer_block(const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc, int64_t depth,
                 __mmask16 tail) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t m = 0; m < depth; ++m) {
    const float* bm = b + m * ldb;
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      bv[j] = j == NV - 1 ? _mm512_maskz_loadu_ps(tail, bm + kLanes * j) : _mm512_loadu_ps(bm + kLanes * j);
    const float* am = a + m * lda;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 av = _mm512_set1_ps(am[i]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* ci = c + i * ldc + kLanes * j;
      // A full last vector streams too: as an ordinary store, a quarter of a 64-column block's
      // lines were read in and cached first.
      if (j == NV - 1 && !(Streaming && tail == __mmask16(0xFFFF))) {
        _mm512_mask_storeu_ps(ci, tail, acc[i][j]);
      } else if constexpr (Streaming) {
        _mm512_stream_ps(ci, acc[i][j]);
      } else {
        _mm512_storeu_ps(ci, acc[i][j]);
      }
    }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, __mmask16);

template <bool Streaming, int... I>
constexpr auto block_table(std::integer_sequence<int, I...>) {
  // [rows - 1][vectors - 1]
  return std::array<std::array<BlockFn, kVectors>, sizeof...(I)>{
      {{&outer_block<I + 1, 1, Streaming>, &outer_block<I + 1, 2, Streaming>, &outer_block<I + 1, 3, Streaming>,
        &outer_block<I + 1, 4, Streaming>}...}};
}
constexpr auto kBlocks = block_table<false>(std::make_integer_sequence<int, kRows>{});
constexpr auto kStreamingBlocks = block_table<true>(std::make_integer_sequence<int, kRows>{});

using moe_gmm_gemm::ReadAhead;
using moe_gmm_gemm::run_tasks;

// rows x cols floats of src (ld_src apart) to dst (ld_dst apart).
inline void copy_rows(const float* src, int64_t ld_src, int64_t rows, int64_t cols, float* dst, int64_t ld_dst) {
  for (int64_t m = 0; m < rows; ++m) std::memcpy(dst + m * ld_dst, src + m * ld_src, cols * sizeof(float));
}

// c[i, 0:16*NV] (+)= sum_m x[i*ldx + m] * w[m*ldw, 0:16*NV] for i < MR and m < depth (added to c's
// values with `accumulate`); the last vector masked by tail. The MR x NV sums stay in registers;
// each w vector loaded serves MR multiply-adds. Every kPartialDepth terms the registers' partial
// sums are added to c and start again from zero: one chain of float32 multiply-adds over a long
// depth drifts from the exact sum (434 terms canceling to small outputs: 2.5e-5 absolute where
// MKL's blocked sums stay at 5.8e-6; partial sums of 64: 6.7e-6, of 128: 1.9e-5).
//
// With PfLines > 0, lines pf + d * ldp + 16 * v for v < PfLines are prefetched into L2 at depth d: a
// share of the next block of the weight, requested while this one computes (into L1 it ran
// slower). With `ahead`, its region is requested a step per depth too.
template <int MR, int NV, int PfLines>
void nn_block(const float* x, int64_t ldx, const float* w, int64_t ldw, float* c, int64_t ldc, int64_t depth,
              __mmask16 tail, bool accumulate, const float* pf, int64_t ldp, ReadAhead* ahead) {
  // a copy in registers: through the pointer, every step would store and reload it
  ReadAhead reader = ahead != nullptr ? *ahead : ReadAhead();
  const bool reads_ahead = reader.active();
  if (!accumulate) moe_gmm_gemm::prefetch_for_write(c, ldc * 4, MR, NV * 64);
  for (int64_t d0 = 0; d0 < depth; d0 += kPartialDepth) {
    const int64_t end = std::min(depth, d0 + kPartialDepth);
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t d = d0; d < end; ++d) {
      const float* wd = w + d * ldw;
      if (reads_ahead) reader.step();
#pragma GCC unroll 4
      for (int v = 0; v < PfLines; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(pf + d * ldp + kLanes * v), _MM_HINT_T1);
      __m512 wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        wv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(tail, wd + kLanes * v) : _mm512_loadu_ps(wd + kLanes * v);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = broadcast(x + i * ldx + d);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
      }
    }
    const bool add = accumulate || d0 > 0;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 m = v == NV - 1 ? tail : __mmask16(0xFFFF);
        float* cv = c + i * ldc + kLanes * v;
        _mm512_mask_storeu_ps(cv, m, add ? _mm512_add_ps(acc[i][v], _mm512_maskz_loadu_ps(m, cv)) : acc[i][v]);
      }
  }
  if (reads_ahead) *ahead = reader;
}

using NNBlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, __mmask16, bool,
                          const float*, int64_t, ReadAhead*);
template <int PfLines, int... I>
constexpr auto nn_block_table(std::integer_sequence<int, I...>) {
  // [rows - 1][vectors - 1]
  return std::array<std::array<NNBlockFn, kVectors>, sizeof...(I)>{
      {{&nn_block<I + 1, 1, PfLines>, &nn_block<I + 1, 2, PfLines>, &nn_block<I + 1, 3, PfLines>,
        &nn_block<I + 1, 4, PfLines>}...}};
}
// [lines prefetched per depth][rows - 1][vectors - 1]
constexpr std::array<decltype(nn_block_table<0>(std::make_integer_sequence<int, kRows>{})), kVectors + 1> kNNBlocks = {
    nn_block_table<0>(std::make_integer_sequence<int, kRows>{}),
    nn_block_table<1>(std::make_integer_sequence<int, kRows>{}),
    nn_block_table<2>(std::make_integer_sequence<int, kRows>{}),
    nn_block_table<3>(std::make_integer_sequence<int, kRows>{}),
    nn_block_table<4>(std::make_integer_sequence<int, kRows>{})};

// The share of a next block's `lines` prefetch streams (lines per depth, or weight rows) that block
// b of `blocks` issues as it goes: [first, first + count), count 0 for the blocks past them all.
struct PrefetchShare {
  int64_t first;
  int count;
};
inline PrefetchShare prefetch_share(int64_t lines, int64_t blocks, int64_t b) {
  const int64_t per_block = (lines + blocks - 1) / blocks;
  const int64_t first = std::min(lines, b * per_block);
  return {first, static_cast<int>(std::min(lines, first + per_block) - first)};
}

// out[0:rows, 0:width] (+)= x[0:rows, 0:depth] @ w[0:depth, 0:width] for width <= 64: the 6 x 64
// blocks down the expert's rows (added to out's values with `accumulate`). With `next`, the 64
// floats at next + d * ldn for d < depth (the weight's next block) are prefetched, the 4 lines of
// each depth shared out over the blocks (rather than all in the first block): the weight is read
// once from memory, and a block whose strip arrives on demand waits for it. `ahead` (nullptr: none)
// steps once per depth of every block.
void blocks_down_rows(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t depth,
                      int64_t width, float* o, int64_t ldo, bool accumulate, const float* next, int64_t ldn,
                      ReadAhead* ahead) {
  const int vectors = static_cast<int>((width + kLanes - 1) / kLanes);
  const __mmask16 tail = tail_mask(width - kLanes * (vectors - 1));
  const int64_t blocks = (rows + kRows - 1) / kRows;
  for (int64_t r = 0, b = 0; r < rows; r += kRows, ++b) {
    const int mr = static_cast<int>(std::min<int64_t>(kRows, rows - r));
    const PrefetchShare share = next == nullptr ? PrefetchShare{0, 0} : prefetch_share(kVectors, blocks, b);
    kNNBlocks[share.count][mr - 1][vectors - 1](x + r * ldx, ldx, w, ldw, o + r * ldo, ldo, depth, tail, accumulate,
                                                share.count > 0 ? next + kLanes * share.first : nullptr, ldn, ahead);
  }
}

// out[0:rows, 0:cols] = x[0:rows, 0:depth] @ w[0:depth, 0:cols] for one expert: 6 x 64
// blocks of the output, each over nn_depth_chunk of the depth with its 24 sums in registers (the
// chunk's 64-column strip of the weight is read from L2 by every 6 rows after the first). Each
// strip's blocks prefetch the next strip, or after the last one `following` (the next task's
// first strip, laid out as w; nullptr: none). Each chunk's blocks also request the next chunk (after
// the last one, `following`'s first) across the task's columns front to back (ReadAhead): memory
// serves strips that touch every row at a fraction of a front-to-back read's rate (bit-identical;
// the same over nt's transposed blocks did not pay).
void nn_blocks(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t depth, int64_t cols,
               float* o, int64_t ldo, const float* following) {
  if (depth == 0)  // an empty sum: the blocks would write nothing
    for (int64_t r = 0; r < rows; ++r) std::memset(o + r * ldo, 0, cols * sizeof(float));
  const int64_t blocks = (rows + kRows - 1) / kRows, strips = (cols + kColumns - 1) / kColumns;
  const int64_t depth_chunk = nn_depth_chunk(ldw * int64_t(sizeof(float)), cols * int64_t(sizeof(float)));
  for (int64_t k0 = 0; k0 < depth; k0 += depth_chunk) {
    const int64_t chunk = std::min(depth_chunk, depth - k0);
    const bool last = k0 + depth_chunk >= depth;
    ReadAhead ahead(last ? following : w + (k0 + depth_chunk) * ldw,
                    std::min(depth_chunk, last ? depth : depth - k0 - depth_chunk), cols * sizeof(float),
                    ldw * sizeof(float), blocks * chunk * strips);
    for (int64_t j = 0; j < cols; j += kColumns) {
      const float* next = j + kColumns < cols           ? w + k0 * ldw + j + kColumns
                          : k0 + depth_chunk < depth ? w + (k0 + depth_chunk) * ldw
                                                       : following;
      blocks_down_rows(x + k0, ldx, rows, w + k0 * ldw + j, ldw, chunk, std::min<int64_t>(kColumns, cols - j), o + j,
                       ldo, k0 > 0, next, ldw, &ahead);
    }
  }
}

// out[0:rows, 0:cols] = x[0:rows, 0:depth] @ w[0:cols, 0:depth]^T for an expert of many rows: each
// 64-row block of w, kNNDepthChunk deep, is transposed into a thread-local buffer (16 x 16 blocks in
// registers), which the nn blocks then read as a weight of 64 contiguous columns. Experts of fewer
// than kNTShallowRows rows take blocks 64 deep instead, whose 64 rows of 4 lines the blocks before
// prefetch (the next block, or after the last one `following`: the next task's first, laid out as
// w; nullptr: none).
void nt_many_rows(const float* x, int64_t ldx, int64_t rows, const float* w, int64_t ldw, int64_t depth, int64_t cols,
                  float* o, int64_t ldo, const float* following) {
  if (depth == 0)
    for (int64_t r = 0; r < rows; ++r) std::memset(o + r * ldo, 0, cols * sizeof(float));
  thread_local std::vector<float> buffer;
  buffer.resize(kNNDepthChunk * kColumns);
  float* packed = buffer.data();
  const bool shallow = rows < kNTShallowRows;
  const int64_t deep = shallow ? kColumns : kNNDepthChunk;
  for (int64_t k0 = 0; k0 < depth; k0 += deep) {
    const int64_t chunk = std::min(deep, depth - k0);
    for (int64_t j = 0; j < cols; j += kColumns) {
      const int64_t width = std::min<int64_t>(kColumns, cols - j);
      const float* next = !shallow                 ? nullptr
                          : j + kColumns < cols   ? w + (j + kColumns) * ldw + k0
                          : k0 + deep < depth     ? w + k0 + deep
                                                  : following;
      // packed[d * kColumns + c] = w[(j + c) * ldw + k0 + d]
      for (int64_t c0 = 0; c0 < width; c0 += kLanes)
        for (int64_t d0 = 0; d0 < chunk; d0 += kLanes) {
          const float* src = w + (j + c0) * ldw + k0 + d0;
          float* dst = packed + d0 * kColumns + c0;
          if (c0 + kLanes <= width && d0 + kLanes <= chunk) {
            moe_gmm_simd::transpose_16x16(reinterpret_cast<const uint32_t*>(src), ldw, reinterpret_cast<uint32_t*>(dst),
                                          kColumns);
          } else {
            for (int64_t c = 0; c < std::min<int64_t>(kLanes, width - c0); ++c)
              for (int64_t d = 0; d < std::min<int64_t>(kLanes, chunk - d0); ++d) dst[d * kColumns + c] = src[c * ldw + d];
          }
        }
      blocks_down_rows(x + k0, ldx, rows, packed, kColumns, chunk, width, o + j, ldo, k0 > 0, next, ldw, nullptr);
    }
  }
}

// out[i * ldo + j] = <x row i, w row j> for i < MR (x's rows lda apart), j < NJ (w's rows ldw apart),
// over depth values: 16 sums of 16 lanes in registers (each x vector loaded serves NJ
// multiply-adds, each w vector MR), reduced together at the end. With PfRows > 0, rows
// pf + p * ldw for p < PfRows are prefetched one line per 16 depth values: a share of the weight
// rows after these, into L2 (`prefetcht1`): into L1 (`t0`) the weight streamed slower, as if each
// core then kept fewer lines in flight.
template <int MR, int NJ, int PfRows>
void dot_block(const float* x, int64_t lda, const float* w, int64_t ldw, int64_t depth, float* out, int64_t ldo,
               const float* pf) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const auto step = [&](int64_t d, auto load) {
#pragma GCC unroll 4
    for (int p = 0; p < PfRows; ++p) _mm_prefetch(reinterpret_cast<const char*>(pf + p * ldw + d), _MM_HINT_T1);
    __m512 wv[NJ];
#pragma GCC unroll 4
    for (int j = 0; j < NJ; ++j) wv[j] = load(w + j * ldw + d);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = load(x + i * lda + d);
#pragma GCC unroll 4
      for (int j = 0; j < NJ; ++j) acc[4 * i + j] = _mm512_fmadd_ps(xv, wv[j], acc[4 * i + j]);
    }
  };
  int64_t d = 0;
  for (; d + kLanes <= depth; d += kLanes) step(d, [](const float* p) { return _mm512_loadu_ps(p); });
  if (d < depth) {
    const __mmask16 m = tail_mask(depth - d);
    step(d, [m](const float* p) { return _mm512_maskz_loadu_ps(m, p); });
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, moe_gmm_simd::sum_lanes_of_16(acc));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NJ; ++j) out[i * ldo + j] = sums[4 * i + j];
}

using DotBlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, const float*);
template <int PfRows, int... I>
constexpr auto dot_block_table(std::integer_sequence<int, I...>) {
  // [x rows - 1][w rows - 1]
  return std::array<std::array<DotBlockFn, 4>, sizeof...(I)>{
      {{&dot_block<I + 1, 1, PfRows>, &dot_block<I + 1, 2, PfRows>, &dot_block<I + 1, 3, PfRows>,
        &dot_block<I + 1, 4, PfRows>}...}};
}
// [weight rows prefetched][x rows - 1][w rows - 1]
constexpr std::array<decltype(dot_block_table<0>(std::make_integer_sequence<int, 4>{})), 5> kDotBlocks = {
    dot_block_table<0>(std::make_integer_sequence<int, 4>{}), dot_block_table<1>(std::make_integer_sequence<int, 4>{}),
    dot_block_table<2>(std::make_integer_sequence<int, 4>{}), dot_block_table<3>(std::make_integer_sequence<int, 4>{}),
    dot_block_table<4>(std::make_integer_sequence<int, 4>{})};

// out[0:rows, 0:cols] = x[0:rows, 0:depth] @ w[0:cols, 0:depth]^T for an expert of few rows: 4 x 4
// blocks of dot products, 4 weight rows at a time down the expert's rows (the weight read once;
// the expert's rows stay in L1). The blocks share out the prefetch of the next 4 weight rows
// (after the last, `following`: the next task's first rows, ldw apart; nullptr: none).
void nt_dots(const float* x, int64_t lda, int64_t rows, const float* w, int64_t ldw, int64_t depth, int64_t cols,
             float* o, int64_t ldo, const float* following) {
  constexpr int64_t kBlock = 4;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  moe_gmm_gemm::prefetch_for_write(o, ldo * 4, rows, cols * 4);
  for (int64_t j = 0; j < cols; j += kBlock) {
    const int nj = static_cast<int>(std::min(kBlock, cols - j));
    const float* next = j + kBlock < cols ? w + (j + kBlock) * ldw : following;
    for (int64_t r = 0, b = 0; r < rows; r += kBlock, ++b) {
      const int mr = static_cast<int>(std::min(kBlock, rows - r));
      const PrefetchShare share = next == nullptr ? PrefetchShare{0, 0} : prefetch_share(kBlock, blocks, b);
      kDotBlocks[share.count][mr - 1][nj - 1](x + r * lda, lda, w + j * ldw, ldw, depth, o + r * ldo + j, ldo,
                                              share.count > 0 ? next + share.first * ldw : nullptr);
    }
  }
}

// One task per (expert, range of `step` output columns or weight rows) for experts of 1..max_rows
// rows; cost: the rows plus a constant for reading the range of the weight.
void few_rows_tasks(const std::vector<int64_t>& starts, int64_t max_rows, int64_t width, int64_t step,
                    std::vector<moe_gmm_gemm::Task>& tasks, std::vector<double>& cost) {
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t rows = starts[e + 1] - starts[e];
    if (rows == 0 || rows > max_rows) continue;
    for (int64_t j = 0; j < width; j += step) {
      const int64_t end = std::min(width, j + step);
      tasks.push_back({e, j, end});
      cost.push_back(double(rows + 8) * double(end - j));
    }
  }
}

#endif  // MOE_GMM_AVX512

bool avx512_gemm_supported() {
#ifdef MOE_GMM_AVX512
  return true;
#else
  return false;
#endif
}

void check_operand(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.stride(dim - 1) == 1,
              name, ": expected a ", dim, "-d float32 CPU tensor with a contiguous last dimension");
}

// The few-rows products' operand checks: a[M, depth], b[E, ...], out[M, width]; returns the group
// starts.
std::vector<int64_t> check_few_rows(const char* op, const at::Tensor& a, const at::Tensor& b,
                                    const at::Tensor& group_ends, const at::Tensor& out, int64_t depth,
                                    int64_t width) {
  TORCH_CHECK(avx512_gemm_supported(), op, ": this build has no AVX-512");
  check_operand(a, "a", 2), check_operand(b, "b", 3), check_operand(out, "out", 2);
  TORCH_CHECK(a.size(1) == depth && out.size(0) == a.size(0) && out.size(1) == width && b.size(0) == group_ends.numel(),
              op, ": shapes do not match");
  return moe_gmm_gemm::starts_of(group_ends, a.size(0));
}

void avx512_gemm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                    at::Tensor& out) {
  TORCH_CHECK(avx512_gemm_supported(), "avx512_gemm_tn: this build has no AVX-512");
  check_operand(a, "a", 2), check_operand(b, "b", 2), check_operand(out, "out", 3);
  const int64_t height = a.size(1), width = b.size(1);
  TORCH_CHECK(b.size(0) == a.size(0) && out.size(0) == group_ends.numel() && out.size(1) == height &&
                  out.size(2) == width,
              "avx512_gemm_tn: shapes do not match");
  const std::vector<int64_t> starts = moe_gmm_gemm::starts_of(group_ends, a.size(0));
#ifdef MOE_GMM_AVX512
  const float* ap = a.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t lda = a.stride(0), ldb = b.stride(0), lde = out.stride(0), ldo = out.stride(1);
  const bool aligned = reinterpret_cast<uintptr_t>(op) % 64 == 0 && ldo % kLanes == 0 && lde % kLanes == 0;
  std::vector<moe_gmm_gemm::Task> tasks;
  std::vector<double> cost;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t rows = starts[e + 1] - starts[e];
    if (rows > max_rows) continue;
    for (int64_t r = 0; r < height; r += kPanel) {
      const int64_t end = std::min(height, r + kPanel);
      tasks.push_back({e, r, end});
      cost.push_back(double(rows + 8) * double(end - r));  // + writing the panel
    }
  }
  run_tasks<moe_gmm_gemm::StreamingStores>(tasks, cost, [&](const moe_gmm_gemm::Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    float* o = op + task.expert * lde;
    if (rows == 0) {
      for (int64_t r = task.begin; r < task.end; ++r) moe_gmm_gemm::zero_bytes(o + r * ldo, width * sizeof(float), aligned);
      return;
    }
    const auto& table = aligned ? kStreamingBlocks : kBlocks;
    if (rows >= kTNPackRows) {
      thread_local std::vector<float> a_panel, b_strip;
      a_panel.resize(rows * kPanel), b_strip.resize(rows * kColumns);
      copy_rows(ap + m0 * lda + task.begin, lda, rows, task.end - task.begin, a_panel.data(), kPanel);
      for (int64_t j = 0; j < width; j += kColumns) {
        const int64_t cols = std::min<int64_t>(kColumns, width - j);
        const int vectors = static_cast<int>((cols + kLanes - 1) / kLanes);
        const __mmask16 tail = tail_mask(cols - int64_t(vectors - 1) * kLanes);
        copy_rows(bp + m0 * ldb + j, ldb, rows, cols, b_strip.data(), kColumns);
        for (int64_t r = task.begin; r < task.end; r += kRows) {
          const int mr = static_cast<int>(std::min<int64_t>(kRows, task.end - r));
          table[mr - 1][vectors - 1](a_panel.data() + (r - task.begin), kPanel, b_strip.data(), kColumns,
                                     o + r * ldo + j, ldo, rows, tail);
        }
      }
      return;
    }
    for (int64_t r = task.begin; r < task.end; r += kRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows, task.end - r));
      for (int64_t j = 0; j < width; j += kColumns) {
        const int64_t cols = std::min<int64_t>(kColumns, width - j);
        const int vectors = static_cast<int>((cols + kLanes - 1) / kLanes);
        const __mmask16 tail = tail_mask(cols - int64_t(vectors - 1) * kLanes);
        table[mr - 1][vectors - 1](ap + m0 * lda + r, lda, bp + m0 * ldb + j, ldb, o + r * ldo + j, ldo, rows,
                                   tail);
      }
    }
  });
#endif
}


// out[rows_e, :] = a[rows_e] @ b[e] for experts of 1..max_rows rows (others untouched), b[E, R, J]
// with J contiguous: every expert through the 6 x 64 blocks of nn_blocks, which read the weight
// once and request its next chunk front to back while they compute.
//
// Experts of 1-7 rows used to stream the weight in bands of 16 rows instead (each band prefetched
// into L1 a band ahead, its vectors multiplied into the expert's output rows in L1). With the
// blocks' read-ahead the blocks were faster at every row count: the bands' prefetches into L1 kept
// few lines in flight per core.
void avx512_gemm_nn_few_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                             at::Tensor& out) {
  const int64_t depth = b.size(1), width = b.size(2);
  const std::vector<int64_t> starts = check_few_rows("avx512_gemm_nn_few_rows", a, b, group_ends, out, depth, width);
#ifdef MOE_GMM_AVX512
  constexpr int64_t kTaskColumns = 512;
  const float* ap = a.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<moe_gmm_gemm::Task> tasks;
  std::vector<double> cost;
  // Tasks of 1024 columns while the experts taken have at most 32 rows (with 64-row experts 1024
  // ran slower).
  const int64_t step = moe_gmm_gemm::largest_group(starts, max_rows) <= 32 ? 2 * kTaskColumns : kTaskColumns;
  few_rows_tasks(starts, max_rows, width, step, tasks, cost);
  const int64_t b_elements = b.size(0) * lde;
  run_tasks<moe_gmm_gemm::NoScope>(tasks, cost, [&](const moe_gmm_gemm::Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0, cols = task.end - task.begin;
    // the next panel or expert, usually this thread's next task: read ahead by the last chunk's blocks
    const float* following = moe_gmm_gemm::following_panel(bp, task, width, lde, b_elements);
    nn_blocks(ap + m0 * lda, lda, rows, bp + task.expert * lde + task.begin, ldb, depth, cols,
              op + m0 * ldo + task.begin, ldo, following);
  });
#endif
}

// out[rows_e, :] = a[rows_e] @ b[e]^T for experts of 1..max_rows rows (others untouched), b[E, J, R]
// with R contiguous: the grad_input of an [E, K, N] weight (b is the weight as stored) and the
// forward of an [E, N, K] one. Each task takes a panel of 128 of b's rows: under kNTManyRows rows
// per expert, 4 at a time, front to back with the next 4 prefetched, dotted with the expert's rows
// 4 at a time (nt_dots); from there, through blocks of b transposed (nt_many_rows).
void avx512_gemm_nt_few_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t max_rows,
                             at::Tensor& out) {
  const int64_t depth = b.size(2), width = b.size(1);
  const std::vector<int64_t> starts = check_few_rows("avx512_gemm_nt_few_rows", a, b, group_ends, out, depth, width);
#ifdef MOE_GMM_AVX512
  constexpr int64_t kPanelRows = 128;
  const float* ap = a.const_data_ptr<float>();
  const float* bp = b.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t lda = a.stride(0), lde = b.stride(0), ldb = b.stride(1), ldo = out.stride(0);
  std::vector<moe_gmm_gemm::Task> tasks;
  std::vector<double> cost;
  few_rows_tasks(starts, max_rows, width, kPanelRows, tasks, cost);
  const bool contiguous = lde == width * ldb;
  const int64_t b_elements = b.size(0) * lde;
  run_tasks<moe_gmm_gemm::NoScope>(tasks, cost, [&](const moe_gmm_gemm::Task& task) {
    const int64_t m0 = starts[task.expert], rows = starts[task.expert + 1] - m0;
    const float* w = bp + task.expert * lde + task.begin * ldb;
    // b's rows after the panel: in a contiguous b, those of this thread's next task as a rule
    const int64_t after = task.expert * lde + task.end * ldb;
    const float* following = contiguous && after < b_elements ? bp + after : nullptr;
    const auto product = rows >= kNTManyRows ? nt_many_rows : nt_dots;
    product(ap + m0 * lda, lda, rows, w, ldb, depth, task.end - task.begin, op + m0 * ldo + task.begin, ldo, following);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_gmm_native, m) {
  m.def("avx512_gemm_supported() -> bool", avx512_gemm_supported);
  m.def("avx512_gemm_tn(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("avx512_gemm_nn_few_rows(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
  m.def("avx512_gemm_nt_few_rows(Tensor a, Tensor b, Tensor group_ends, int max_rows, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moe_gmm_native, CPU, m) {
  m.impl("avx512_gemm_tn", avx512_gemm_tn);
  m.impl("avx512_gemm_nn_few_rows", avx512_gemm_nn_few_rows);
  m.impl("avx512_gemm_nt_few_rows", avx512_gemm_nt_few_rows);
}
