// The grouped matmul's large experts as one library GEMM each (oneDNN for 16-bit types, MKL for
// float32), whole experts shared between the threads, each GEMM on one thread.
//
// Why: a per-expert loop lets every GEMM split itself between torch's threads, and for some row
// counts oneDNN's split leaves one of two threads idle (the one-thread time). Whole experts per
// thread avoid the split, and the threads' fork and join once per expert with it.
// The weight gradient a^T @ b is given oneDNN with a^T as a contiguous matrix: with the
// transposed view it ran far slower, and transposing into a per-thread buffer costs little.
// oneDNN (the 16-bit types) compiles and keeps a kernel for every GEMM shape: one GEMM per expert
// at its own row count held much more memory, and a new routing would bring new shapes, and new
// compiles, every step. So a 16-bit expert of fewer than kExactRows rows runs on its rows
// rounded up to a multiple of 32, the extra rows zero rows of per-thread scratch (their products
// dropped, or summed as zeros): at most 16 shapes per weight shape and pass. Larger experts
// keep their row count: copying their rows through scratch cost more than the shapes they save,
// and there are few of them per step. Measurements: docs/cpu_kernels.md.
//
// Ops (namespace moe_gmm_native); group_ends[E] int64 on the host: expert e owns rows
// [group_ends[e-1], group_ends[e]). Operands share one dtype and live on the CPU; b may have any
// strides torch.mm takes (the transposed view of a weight, too). Only experts of more than
// min_rows rows are computed; the others' outputs are left to the caller.
//   experts_mm(a[M,R], b[E,R,J], group_ends, min_rows, out[M,J])    out[rows_e] = a[rows_e] @ b[e]
//   experts_mm_tn(a[M,R], b[M,J], group_ends, min_rows, out[E,R,J]) out[e] = a[rows_e]^T @ b[rows_e]
//                                                                   (min_rows < 0: an empty
//                                                                   expert's out[e] is zero)
// Experts are handed out longest first, each to the thread with the least work so far; with one
// expert (or fewer experts than threads) a GEMM may use the library's own threads. oneDNN's
// 16-bit GEMMs come out the same at any thread count; MKL's float32 ones split reductions of
// more than a few hundred rows between threads, as torch.mm's do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "grouped_gemm_common.h"
#include "simd_transpose.h"

namespace {

using moe_gmm_gemm::starts_of;

// Which thread runs which experts: longest first, each to the least-loaded thread.
std::vector<std::vector<int64_t>> share_by_cost(const std::vector<int64_t>& experts, const std::vector<double>& cost,
                                                int64_t threads) {
  std::vector<int64_t> order(experts.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  std::vector<std::vector<int64_t>> shares(threads);
  std::vector<double> load(threads, 0.0);
  for (int64_t i : order) {
    const auto t = std::min_element(load.begin(), load.end()) - load.begin();
    shares[t].push_back(experts[i]);
    load[t] += cost[i];
  }
  return shares;
}

// Runs run(e) for every expert of more than min_rows rows (and, with keep_empty, every empty one),
// the experts shared between torch's intra-op threads by cost (rows, plus a constant for reading
// the weight).
template <typename Run>
void for_each_expert(const std::vector<int64_t>& starts, int64_t min_rows, bool keep_empty, const Run& run) {
  std::vector<int64_t> experts;
  std::vector<double> cost;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(starts.size()); ++e) {
    const int64_t rows = starts[e + 1] - starts[e];
    if (rows > min_rows || (keep_empty && rows == 0)) {
      experts.push_back(e);
      cost.push_back(double(rows) + 64.0);
    }
  }
  if (experts.empty()) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), experts.size()));
  const auto shares = share_by_cost(experts, cost, threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    // A worker thread does not inherit the caller's dispatch state: stay below autograd here too
    // (the operands may be parameters that require grad; an out= GEMM must not be recorded).
    at::AutoDispatchBelowAutograd below_autograd;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t e : shares[t]) run(e);
  });
}

// Rows of the GEMM that computes an expert of `rows` rows (see the top of the file).
constexpr int64_t kRowQuantum = 32;
constexpr int64_t kExactRows = 512;
int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }
int64_t gemm_rows(int64_t rows, bool sixteen_bit) {
  if (!sixteen_bit || rows >= kExactRows) return rows;
  return round_up(rows, kRowQuantum);
}

// The row stride a 16-bit GEMM's first operand gets for a reduction of `depth`: oneDNN's 16-bit
// GEMMs read a row's values up to the depth rounded up to 32 (multiplied by zeros of their own), so
// past an unaligned depth they read the next row's values, and an Inf or NaN there made this row's
// products NaN. Rows this far apart, zero-padded, give those reads zeros.
int64_t padded_depth(int64_t depth, bool sixteen_bit) { return sixteen_bit ? round_up(depth, kRowQuantum) : depth; }

// A per-thread scratch matrix of at least rows x cols, reused across calls (grown when needed).
// A tensor's storage: 64-byte aligned (a std::vector's 16-byte alignment made oneDNN slower).
at::Tensor scratch(at::Tensor& buffer, int64_t rows, int64_t cols, const at::TensorOptions& options) {
  if (!buffer.defined() || buffer.numel() < rows * cols || buffer.scalar_type() != options.dtype())
    buffer = at::empty({rows * cols}, options);
  return buffer.narrow(0, 0, rows * cols).view({rows, cols});
}

void check_cpu_operands(const char* op, std::initializer_list<const at::Tensor*> operands) {
  const at::Tensor& first = **operands.begin();
  for (const at::Tensor* t : operands)
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == first.scalar_type(), op,
                ": expected CPU operands of one dtype");
}

void experts_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t min_rows,
                at::Tensor& out) {
  check_cpu_operands("experts_mm", {&a, &b, &out});
  TORCH_CHECK(a.dim() == 2 && b.dim() == 3 && out.dim() == 2 && b.size(0) == group_ends.numel() &&
                  b.size(1) == a.size(1) && out.size(0) == a.size(0) && out.size(1) == b.size(2),
              "experts_mm: shapes do not match");
  const auto starts = starts_of(group_ends, a.size(0));
  const bool sixteen_bit = a.element_size() == 2;
  const int64_t depth = a.size(1), ld = padded_depth(depth, sixteen_bit);
  for_each_expert(starts, min_rows, false, [&](int64_t e) {
    const int64_t m0 = starts[e], rows = starts[e + 1] - m0, padded = gemm_rows(rows, sixteen_bit);
    at::Tensor o = out.narrow(0, m0, rows);
    if (padded == rows && ld == depth) {
      at::mm_out(o, a.narrow(0, m0, rows), b.select(0, e));
      return;
    }
    // The padding rows' products are dropped, but they are zero, not whatever memory held: with a
    // transposed b, oneDNN's product of an expert's last row came out NaN when the row after it
    // held NaN (bfloat16, 100 rows padded to 128, K = 50, N = 2). So are the padding columns.
    thread_local at::Tensor a_buffer, out_buffer;
    at::Tensor a_e = scratch(a_buffer, padded, ld, a.options());
    a_e.narrow(0, 0, rows).narrow(1, 0, depth).copy_(a.narrow(0, m0, rows));
    if (ld > depth) a_e.narrow(0, 0, rows).narrow(1, depth, ld - depth).zero_();
    a_e.narrow(0, rows, padded - rows).zero_();
    at::Tensor o_e = padded == rows ? o : scratch(out_buffer, padded, out.size(1), out.options());
    at::mm_out(o_e, a_e.narrow(1, 0, depth), b.select(0, e));
    if (padded != rows) o.copy_(o_e.narrow(0, 0, rows));
  });
}

void experts_mm_tn(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends, int64_t min_rows,
                   at::Tensor& out) {
  check_cpu_operands("experts_mm_tn", {&a, &b, &out});
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 3 && b.size(0) == a.size(0) &&
                  out.size(0) == group_ends.numel() && out.size(1) == a.size(1) && out.size(2) == b.size(1),
              "experts_mm_tn: shapes do not match");
  const auto starts = starts_of(group_ends, a.size(0));
  const bool wide16 = a.element_size() == 2 && a.stride(1) == 1;
  for_each_expert(starts, min_rows, min_rows < 0, [&](int64_t e) {
    const int64_t m0 = starts[e], rows = starts[e + 1] - m0;
    at::Tensor o = out.select(0, e);
    if (rows == 0) {
      o.zero_();
      return;
    }
    const at::Tensor a_e = a.narrow(0, m0, rows);
    if (!wide16) {
      at::mm_out(o, a_e.t(), b.narrow(0, m0, rows));
      return;
    }
    // a^T into a per-thread buffer, padded with zero columns to the GEMM's rows: the padding's
    // products are summed, so both operands' padding is zero (0 x NaN from stale memory is NaN).
    // The stride is a multiple of 32 (padded_depth), which keeps the transpose on its vector path;
    // past an unaligned count oneDNN reads the stride's pad columns, so those are zero too.
    thread_local at::Tensor a_t_buffer, b_buffer;
    const int64_t padded = gemm_rows(rows, true), ld = padded_depth(padded, true);
    at::Tensor a_t = scratch(a_t_buffer, a.size(1), ld, a.options());
    moe_gmm_simd::transpose_16bit(static_cast<const uint16_t*>(a_e.const_data_ptr()), a.stride(0), rows, a.size(1),
                                  static_cast<uint16_t*>(a_t.data_ptr()), ld);
    if (ld > rows) a_t.narrow(1, rows, ld - rows).zero_();
    at::Tensor b_e = b.narrow(0, m0, rows);
    if (padded > rows) {
      at::Tensor b_pad = scratch(b_buffer, padded, b.size(1), b.options());
      b_pad.narrow(0, 0, rows).copy_(b_e);
      b_pad.narrow(0, rows, padded - rows).zero_();
      b_e = b_pad;
    }
    at::mm_out(o, a_t.narrow(1, 0, padded), b_e);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_gmm_native, m) {
  m.def("experts_mm(Tensor a, Tensor b, Tensor group_ends, int min_rows, Tensor(a!) out) -> ()");
  m.def("experts_mm_tn(Tensor a, Tensor b, Tensor group_ends, int min_rows, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(moe_gmm_native, CPU, m) {
  m.impl("experts_mm", experts_mm);
  m.impl("experts_mm_tn", experts_mm_tn);
}
