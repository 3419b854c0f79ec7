// Shared by the grouped GEMM kernels (grouped_gemm_amx.cpp, grouped_gemm_avx512_bf16.cpp,
// grouped_gemm_avx512.cpp): the group bounds, the (expert, range) tasks and their split between
// threads, per-call state of a thread, and the weight's read-ahead.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace moe_gmm_gemm {

struct Task {
  int64_t expert, begin, end;  // the expert, and the output columns or rows [begin, end) it owns
};

// Where the weight panel after `task`'s starts in b[E, depth, width] (expert stride lde, lde *
// E elements in all): the next panel of its expert, or the next expert's first; null past the end.
// Tasks run in that order on a thread, so the nn kernels prefetch it while finishing `task`.
template <typename T>
const T* following_panel(const T* b, const Task& task, int64_t width, int64_t lde, int64_t elements) {
  const int64_t offset = task.end < width ? task.expert * lde + task.end : (task.expert + 1) * lde;
  return offset < elements ? b + offset : nullptr;
}

// [0, end_0, ..., end_{E-1}] from group_ends[E], checked against the `rows` rows of the input.
inline std::vector<int64_t> starts_of(const at::Tensor& group_ends, int64_t rows) {
  TORCH_CHECK(group_ends.device().is_cpu() && group_ends.scalar_type() == at::kLong && group_ends.dim() == 1 &&
                  group_ends.is_contiguous(),
              "group_ends: expected a contiguous 1-d int64 CPU tensor");
  const int64_t* ends = group_ends.data_ptr<int64_t>();
  std::vector<int64_t> starts(group_ends.numel() + 1, 0);
  for (int64_t e = 0; e < group_ends.numel(); ++e) {
    TORCH_CHECK(ends[e] >= starts[e] && ends[e] <= rows, "group_ends: must be non-decreasing and at most ", rows);
    starts[e + 1] = ends[e];
  }
  TORCH_CHECK(starts.back() == rows, "group_ends: the last end must equal the number of rows ", rows);
  return starts;
}

// The most rows of any expert with at most max_rows rows (0 where none has): what a kernel taking
// those experts sizes its panels by.
inline int64_t largest_group(const std::vector<int64_t>& starts, int64_t max_rows) {
  int64_t largest = 0;
  for (size_t e = 0; e + 1 < starts.size(); ++e)
    if (const int64_t rows = starts[e + 1] - starts[e]; rows <= max_rows) largest = std::max(largest, rows);
  return largest;
}

// The bfloat16 kernels' operands (AMX, AVX-512 BF16): a `dim`-d bfloat16 CPU tensor with a
// contiguous last dimension, and reduced and output widths that are multiples of 32.
inline void check_bf16_operand(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.dim() == dim && t.stride(dim - 1) == 1,
              name, ": expected a ", dim, "-d bfloat16 CPU tensor with a contiguous last dimension");
}

inline void check_multiple_of_32(int64_t value, const char* what) {
  TORCH_CHECK(value % 32 == 0, what, " must be a multiple of 32, got ", value);
}

// nn and nt: a[M, depth] times expert weights b[E, ...] into out[M, width]; returns the group starts.
inline std::vector<int64_t> check_bf16_product(const char* op, const at::Tensor& a, const at::Tensor& b,
                                               const at::Tensor& group_ends, const at::Tensor& out, int64_t depth,
                                               int64_t width) {
  check_bf16_operand(a, "a", 2), check_bf16_operand(b, "b", 3), check_bf16_operand(out, "out", 2);
  TORCH_CHECK(a.size(1) == depth && out.size(0) == a.size(0) && out.size(1) == width && b.size(0) == group_ends.numel(),
              op, ": shapes do not match");
  check_multiple_of_32(depth, "the reduced width"), check_multiple_of_32(width, "the output width");
  return starts_of(group_ends, a.size(0));
}

// tn: a[M, height] and b[M, width] into out[E, height, width]; returns the group starts.
inline std::vector<int64_t> check_bf16_weight_gradient(const char* op, const at::Tensor& a, const at::Tensor& b,
                                                       const at::Tensor& group_ends, const at::Tensor& out) {
  check_bf16_operand(a, "a", 2), check_bf16_operand(b, "b", 2), check_bf16_operand(out, "out", 3);
  const int64_t height = a.size(1), width = b.size(1);
  TORCH_CHECK(b.size(0) == a.size(0) && out.size(0) == group_ends.numel() && out.size(1) == height &&
                  out.size(2) == width,
              op, ": shapes do not match");
  check_multiple_of_32(height, "the output height"), check_multiple_of_32(width, "the output width");
  return starts_of(group_ends, a.size(0));
}

inline const uint16_t* bf16_bits(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.const_data_ptr<at::BFloat16>());
}
inline uint16_t* bf16_bits(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.mutable_data_ptr<at::BFloat16>()); }

// Zeroes `bytes` bytes at dst. With `streaming` (dst 64-byte aligned) the whole 64-byte lines are
// written with streaming stores, which skip reading the lines first; the caller fences before
// its results are read (an empty expert's weight gradient is the largest write of a skewed call:
// 3/4 of E256's experts empty, 100-200 MiB of zeros).
inline void zero_bytes(void* dst, int64_t bytes, bool streaming) {
  int64_t done = 0;
#if defined(__AVX512F__)
  if (streaming) {
    const __m512i zero = _mm512_setzero_si512();
    auto* lines = static_cast<__m512i*>(dst);
    for (; done + 64 <= bytes; done += 64) _mm512_stream_si512(lines + done / 64, zero);
  }
#endif
  std::memset(static_cast<char*>(dst) + done, 0, bytes - done);
}

// Cuts consecutive tasks into `threads` ranges of about equal cost: thread t runs tasks
// [cut[t], cut[t + 1]). Consecutive, so one expert's tasks mostly stay on one thread.
inline std::vector<int64_t> cut_by_cost(const std::vector<double>& cost, int64_t threads) {
  const auto count = static_cast<int64_t>(cost.size());
  std::vector<int64_t> cut(threads + 1, count);
  cut[0] = 0;
  double total = 0, seen = 0;
  for (double c : cost) total += c;
  int64_t next = 1;
  for (int64_t i = 0; i < count && next < threads; ++i) {
    seen += cost[i];
    while (next < threads && seen >= total * double(next) / double(threads)) cut[next++] = i + 1;
  }
  return cut;
}

#if defined(__AVX512F__)
// Requests a region of the weight in address order, a share of its lines at each step() of the work
// before it: `rows` rows of `row_bytes` bytes, `stride` bytes apart, over `steps` steps, into L2.
// The blocks of the float32 and bfloat16 kernels read the weight in 64-column strips that touch
// each of its rows for a few lines at a time, an order the hardware prefetchers do not follow and
// memory serves at a fraction of the rate of a front-to-back read (docs/cpu_kernels.md); the
// region they read next, requested front to back while they compute, is in the caches when they
// get to it. A prefetch never faults, so a region that runs past the operand is
// harmless.
class ReadAhead {
 public:
  ReadAhead() = default;
  ReadAhead(const void* base, int64_t rows, int64_t row_bytes, int64_t stride, int64_t steps)
      : row_(static_cast<const char*>(base)), lines_per_row_((row_bytes + 63) / 64), rows_left_(rows), stride_(stride) {
    const int64_t lines = rows * lines_per_row_;
    // lines per step in sixteenths, rounded up so that the region is requested by the last step
    per_step_16_ = base != nullptr && steps > 0 && lines > 0 ? (16 * lines + steps - 1) / steps : 0;
    if (per_step_16_ == 0) rows_left_ = 0;
  }
  bool active() const { return rows_left_ > 0; }
  // Inlined into the blocks' loops: a call there would spill their register sums.
  __attribute__((always_inline)) void step() {
    owed_16_ += per_step_16_;
    while (owed_16_ >= 16 && rows_left_ > 0) {
      _mm_prefetch(row_ + 64 * line_, _MM_HINT_T1);
      if (++line_ == lines_per_row_) line_ = 0, row_ += stride_, --rows_left_;
      owed_16_ -= 16;
    }
  }

 private:
  const char* row_ = nullptr;
  int64_t line_ = 0, lines_per_row_ = 0, rows_left_ = 0, stride_ = 0, per_step_16_ = 0, owed_16_ = 0;
};
#endif

// Requests the lines of `rows` rows of `bytes` bytes at p (rows `stride` bytes apart) for writing,
// ahead of the stores that fill them: an output line missing from the caches is read before it is
// written, and a block's stores, all at its end, would otherwise wait for those reads. The blocks
// of nn (both dtypes) request theirs as they start, the dot products of nt a task's at once.
// Streaming stores instead ran the op as fast but its layer slower: the next op then reads the
// output from memory.
inline void prefetch_for_write(const void* p, int64_t stride, int64_t rows, int64_t bytes) {
  const char* row = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r, row += stride)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 1, 3);
}

struct NoScope {};

// A number for each call of an op, so per-thread state can tell calls apart.
inline int64_t next_call() {
  static std::atomic<int64_t> calls{0};
  return ++calls;
}

// Per thread, the expert whose operands it last prepared (packed or spread) and in which call:
// an expert's panels are consecutive tasks, mostly on one thread, so they are prepared once.
struct PreparedExpert {
  int64_t call = 0, expert = -1;
  // whether (call, expert) needs preparing; remembers it as prepared
  bool stale(int64_t now, int64_t e) {
    if (call == now && expert == e) return false;
    call = now, expert = e;
    return true;
  }
};

#if defined(__AVX512F__)
// A run_tasks scope: streaming stores are made visible before a thread's share of the work ends.
struct StreamingStores {
  StreamingStores() = default;
  StreamingStores(const StreamingStores&) = delete;
  StreamingStores& operator=(const StreamingStores&) = delete;
  ~StreamingStores() { _mm_sfence(); }
};
#endif

// A thread's range of tasks [next, end): its owner takes them from the front, a thread that has
// run out of its own from the back. Both ends in one atomic word, so a task is taken once.
class TaskRange {
 public:
  void assign(int64_t begin, int64_t end) { bounds_.store(pack(begin, end), std::memory_order_relaxed); }
  bool take_front(int64_t& task) { return take(task, true); }
  bool take_back(int64_t& task) { return take(task, false); }

 private:
  static uint64_t pack(int64_t next, int64_t end) { return uint64_t(next) | (uint64_t(end) << 32); }
  bool take(int64_t& task, bool front) {
    uint64_t bounds = bounds_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t next = int64_t(bounds & 0xFFFFFFFFu), end = int64_t(bounds >> 32);
      if (next >= end) return false;
      const uint64_t taken = front ? pack(next + 1, end) : pack(next, end - 1);
      if (bounds_.compare_exchange_weak(bounds, taken, std::memory_order_relaxed)) {
        task = front ? next : end - 1;
        return true;
      }
    }
  }
  std::atomic<uint64_t> bounds_{0};
};

// Runs the tasks on torch's intra-op threads: each thread first runs its cut_by_cost range front to
// back (consecutive tasks, so one expert's mostly stay on one thread, and each prefetches its next),
// then takes the others' remaining tasks from the back of their ranges. The cut balances the
// estimated cost; the taking balances what the estimate misses, and a thread the machine slows
// down (on vCPUs shared with other guests one thread could finish well after the other on the same
// cost). Each thread constructs a Scope before its work and destroys it after (per-thread set-up
// such as the AMX tile configuration, or a fence after streaming stores). Which thread runs a task
// changes no result: every output element is one task's.
template <typename Scope, typename Run>
void run_tasks(const std::vector<Task>& tasks, const std::vector<double>& cost, const Run& run) {
  if (tasks.empty()) return;
  TORCH_CHECK(tasks.size() < (size_t(1) << 31), "run_tasks: too many tasks");
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  const std::vector<int64_t> cut = cut_by_cost(cost, threads);
  std::vector<TaskRange> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].assign(cut[t], cut[t + 1]);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scope scope;
    for (int64_t t = begin; t < end; ++t) {
      int64_t i;
      while (ranges[t].take_front(i)) run(tasks[i]);
      for (int64_t k = 1; k < threads; ++k)
        while (ranges[(t + k) % threads].take_back(i)) run(tasks[i]);
    }
  });
}

}  // namespace moe_gmm_gemm
