// Memory-bound MoE glue on CPU: permute's grouping of rows by expert, the weighted k-way sums of
// permute/unpermute and SwiGLU, each one pass over its rows with float32 arithmetic for 16-bit
// inputs.
//
// Composed from torch ops these were several passes each (gather, widen to float32, reduce,
// narrow back), every pass streaming a temporary through memory; here every row is read once,
// widened in registers and written once. Inputs are contiguous (the Python side checks); rows are
// split between torch's intra-op threads with at::parallel_for.
//
// Ops (namespace moe_gmm_native), all writing into caller-provided outputs:
//   permute_rows(hidden[T,H], expert_ids[T*k] int32/int64, num_experts, permuted[T*k,H],
//                row_id_map[T*k] int64, counts[E] int64)
//       a counting sort of the ids (stable: (token, slot) order inside each expert), then
//       permuted[row_id_map[t*k+j]] = hidden[t]; an id outside [0, E) is an error
//   slot_sum(src[R,H], row_id_map[R], probs[T,k] f32 or None, top_k, out[T,H])
//       out[t] = sum_j p[t,j] * src[row_id_map[t*k+j]]            (p = 1 without probs)
//       a row_id_map value outside [0, R) is an error (here and in unpermute_backward)
// Index errors raise c10::ValueError (Python ValueError), the type the Python boundary raises.
//   unpermute_backward(grad_out[T,H], expert_out[R,H], row_id_map[R], probs[T,k] f32,
//                      grad_expert_out[R,H] or empty, grad_probs[T,k] f32 or empty)
//       grad_expert_out[row_id_map[t*k+j]] = p[t,j] * grad_out[t]
//       grad_probs[t,j] = <grad_out[t], expert_out[row_id_map[t*k+j]]>
//   swiglu(x[R,2I], y[R,I])                  y = silu(x[:, :I]) * x[:, I:]
//   swiglu_backward(dy[R,I], x[R,2I], dx[R,2I])
//
// Sums over k run in slot order j = 0..k-1 and dot products over h in a fixed blocking, so results
// do not depend on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Rows of at least this many elements are handed to a thread at a time: a few KiB each.
constexpr int64_t kGrainElements = 1 << 14;
// Rows are processed in blocks of this many elements through float32 scratch that stays in L1.
constexpr int64_t kBlock = 512;

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, width)); }

// Widening and narrowing a block of values. The bfloat16 versions are written on the bits
// (bfloat16 is the top half of a float32; narrowing rounds to nearest even and keeps NaN a NaN,
// like c10's conversion) without branches, so the compiler vectorises them.
inline void widen(const float* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
inline void widen(const c10::BFloat16* __restrict src, float* __restrict dst, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}
inline void widen(const c10::Half* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void narrow(const float* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}
inline void narrow(const float* __restrict src, c10::BFloat16* __restrict dst, int64_t n) {
  auto* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    bits[i] = static_cast<uint16_t>(src[i] != src[i] ? 0x7FC0u : rounded);
  }
}
inline void narrow(const float* __restrict src, c10::Half* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// exp(x) by range reduction to r in [-ln2/2, ln2/2] and a degree-6 polynomial (Cephes' expf
// coefficients), scaled by 2^n through the exponent bits: within 2 ulp of std::exp for
// |x| <= 87, and plain arithmetic, so the compiler vectorises the loops that call it (std::exp
// is a scalar libm call that made SwiGLU slower than torch's vectorised silu).
// The exponent is clamped as an integer to the normal range, so exp never returns a denormal or
// an infinity (|x| > 87 saturates; +-inf give inf and 0, NaN gives NaN). A float clamp of x instead let the
// compiler evaluate the clamped lanes' sigmoid as a denormal constant and multiply every vector by
// it: a microcode assist per instruction that made the forward far slower on random data.
inline float exp_approx(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = std::min(std::max(static_cast<int32_t>(n), -126), 127);
  const float result = p * std::bit_cast<float>((e + 127) << 23);
  // exp(+inf) = inf and exp(-inf) = 0, as silu(+-inf) needs: the reduction alone gives inf - inf
  return x == std::numeric_limits<float>::infinity() ? x : x == -std::numeric_limits<float>::infinity() ? 0.f : result;
}

inline float sigmoid(float v) { return 1.f / (1.f + exp_approx(-v)); }

template <typename T>
void slot_sum_kernel(const T* src, const int64_t* row_id_map, const float* probs, T* out, int64_t num_tokens,
                     int64_t top_k, int64_t hidden) {
  at::parallel_for(0, num_tokens, grain_rows(hidden * top_k), [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[kBlock];
    alignas(64) float row[kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h0 = 0; h0 < hidden; h0 += kBlock) {
        const int64_t n = std::min(kBlock, hidden - h0);
        for (int64_t h = 0; h < n; ++h) acc[h] = 0.f;
        for (int64_t j = 0; j < top_k; ++j) {
          widen(src + row_id_map[t * top_k + j] * hidden + h0, row, n);
          const float p = probs ? probs[t * top_k + j] : 1.f;
          for (int64_t h = 0; h < n; ++h) acc[h] += p * row[h];
        }
        narrow(acc, out + t * hidden + h0, n);
      }
    }
  });
}

template <typename T>
void unpermute_backward_kernel(const T* grad_out, const T* expert_out, const int64_t* row_id_map, const float* probs,
                               T* grad_expert_out, float* grad_probs, int64_t num_tokens, int64_t top_k,
                               int64_t hidden) {
  // Dot products are summed in kLanes partial sums (vectorisable without reassociation flags) and
  // the lanes added in order at the end.
  constexpr int64_t kLanes = 16;
  static_assert(kBlock % kLanes == 0);
  at::parallel_for(0, num_tokens, grain_rows(hidden * top_k), [&](int64_t t0, int64_t t1) {
    std::vector<float> g(hidden);
    alignas(64) float row[kBlock];
    alignas(64) float scaled[kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      float* gw = g.data();
      widen(grad_out + t * hidden, gw, hidden);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t slot = t * top_k + j;
        const int64_t r = row_id_map[slot];
        float lanes[kLanes] = {0.f};
        for (int64_t h0 = 0; h0 < hidden; h0 += kBlock) {
          const int64_t n = std::min(kBlock, hidden - h0);
          if (grad_expert_out) {
            const float p = probs[slot];
            for (int64_t h = 0; h < n; ++h) scaled[h] = p * gw[h0 + h];
            narrow(scaled, grad_expert_out + r * hidden + h0, n);
          }
          if (grad_probs) {
            // Lane l sums positions h0 + h with h % kLanes == l (kBlock is a multiple of kLanes, so
            // that is the row's absolute position): blocking does not change the sum.
            widen(expert_out + r * hidden + h0, row, n);
            const float* gb = gw + h0;
            int64_t h = 0;
            for (; h + kLanes <= n; h += kLanes)
              for (int64_t l = 0; l < kLanes; ++l) lanes[l] += gb[h + l] * row[h + l];
            for (int64_t l = 0; h < n; ++h, ++l) lanes[l] += gb[h] * row[h];
          }
        }
        if (grad_probs) {
          float dot = 0.f;
          for (int64_t l = 0; l < kLanes; ++l) dot += lanes[l];
          grad_probs[slot] = dot;
        }
      }
    }
  });
}

template <typename T>
void swiglu_kernel(const T* x, T* y, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, grain_rows(3 * half), [&](int64_t r0, int64_t r1) {
    alignas(64) float gate[kBlock];
    alignas(64) float up[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
        const int64_t n = std::min(kBlock, half - i0);
        widen(x + r * 2 * half + i0, gate, n);
        widen(x + r * 2 * half + half + i0, up, n);
        for (int64_t i = 0; i < n; ++i) {
          const float gv = gate[i];
          up[i] = up[i] * gv * sigmoid(gv);
        }
        narrow(up, y + r * half + i0, n);
      }
    }
  });
}

template <typename T>
void swiglu_backward_kernel(const T* dy, const T* x, T* dx, int64_t rows, int64_t half) {
  at::parallel_for(0, rows, grain_rows(5 * half), [&](int64_t r0, int64_t r1) {
    alignas(64) float gate[kBlock];
    alignas(64) float up[kBlock];
    alignas(64) float d[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
        const int64_t n = std::min(kBlock, half - i0);
        widen(x + r * 2 * half + i0, gate, n);
        widen(x + r * 2 * half + half + i0, up, n);
        widen(dy + r * half + i0, d, n);
        for (int64_t i = 0; i < n; ++i) {
          const float gv = gate[i], s = sigmoid(gv);
          // d silu(g)/dg = s * (1 + g * (1 - s)); the up half's gradient is dy * silu(g).
          gate[i] = d[i] * up[i] * s * (1.f + gv * (1.f - s));
          up[i] = d[i] * gv * s;
        }
        narrow(gate, dx + r * 2 * half + i0, n);
        narrow(up, dx + r * 2 * half + half + i0, n);
      }
    }
  });
}

// The maps come from callers: one pass over R ints (cheap next to the R * H rows it guards) keeps a
// bad value from reading or writing outside the rows, whatever the Python side checked.
void check_row_ids(const int64_t* row_id_map, int64_t num_rows, const char* op) {
  int64_t bad = -1;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (static_cast<uint64_t>(row_id_map[r]) >= static_cast<uint64_t>(num_rows)) {
      bad = r;
      break;
    }
  }
  TORCH_CHECK_VALUE(bad < 0, op, ": row_id_map[", bad, "] = ", bad < 0 ? 0 : row_id_map[bad], " outside [0, ", num_rows,
              ")");
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename Fn>
void dispatch_float(at::ScalarType dtype, const char* op, Fn&& fn) {
  switch (dtype) {
    case at::kFloat:
      fn(float{});
      break;
    case at::kBFloat16:
      fn(c10::BFloat16{});
      break;
    case at::kHalf:
      fn(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", dtype, " (float32, bfloat16, float16)");
  }
}

template <typename Id>
void permute_rows_kernel(const char* hidden, const Id* ids, int64_t num_rows, int64_t top_k, int64_t num_experts,
                         int64_t row_bytes, int64_t grain, char* permuted, int64_t* row_id_map,
                         int64_t* counts) {
  std::fill(counts, counts + num_experts, int64_t{0});
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t e = static_cast<int64_t>(ids[r]);
    TORCH_CHECK_VALUE(e >= 0 && e < num_experts, "permute_rows: expert id ", e, " outside [0, ", num_experts, ")");
    ++counts[e];
  }
  std::vector<int64_t> next(num_experts);
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) next[e] = start, start += counts[e];
  for (int64_t r = 0; r < num_rows; ++r) row_id_map[r] = next[ids[r]]++;
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      std::memcpy(permuted + row_id_map[r] * row_bytes, hidden + (r / top_k) * row_bytes, row_bytes);
  });
}

void permute_rows(const at::Tensor& hidden, const at::Tensor& expert_ids, int64_t num_experts, at::Tensor& permuted,
                  at::Tensor& row_id_map, at::Tensor& counts) {
  for (auto* t : {&hidden, &expert_ids}) check_cpu_contiguous(*t, "permute_rows input");
  for (auto* t : {&permuted, &row_id_map, &counts}) check_cpu_contiguous(*t, "permute_rows output");
  TORCH_CHECK(hidden.dim() == 2 && num_experts > 0, "permute_rows: hidden must be [T, H], num_experts > 0");
  const int64_t num_tokens = hidden.size(0), num_rows = expert_ids.numel();
  TORCH_CHECK(num_tokens > 0 && num_rows % num_tokens == 0, "permute_rows: expert_ids must hold T * k ids");
  TORCH_CHECK(permuted.scalar_type() == hidden.scalar_type() && permuted.numel() == num_rows * hidden.size(1),
              "permute_rows: permuted must be [T * k, H] in hidden's dtype");
  TORCH_CHECK(row_id_map.scalar_type() == at::kLong && row_id_map.numel() == num_rows, "permute_rows: row_id_map");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.numel() == num_experts, "permute_rows: counts");
  const int64_t row_bytes = hidden.size(1) * hidden.element_size();
  const auto* src = static_cast<const char*>(hidden.data_ptr());
  auto* dst = static_cast<char*>(permuted.data_ptr());
  const int64_t top_k = num_rows / num_tokens, grain = grain_rows(hidden.size(1));
  if (expert_ids.scalar_type() == at::kLong) {
    permute_rows_kernel(src, expert_ids.data_ptr<int64_t>(), num_rows, top_k, num_experts, row_bytes, grain, dst,
                        row_id_map.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(expert_ids.scalar_type() == at::kInt, "permute_rows: expert_ids must be int32 or int64");
    permute_rows_kernel(src, expert_ids.data_ptr<int32_t>(), num_rows, top_k, num_experts, row_bytes, grain, dst,
                        row_id_map.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  }
}

void slot_sum(const at::Tensor& src, const at::Tensor& row_id_map, const std::optional<at::Tensor>& probs,
              int64_t top_k, at::Tensor& out) {
  check_cpu_contiguous(src, "src");
  check_cpu_contiguous(row_id_map, "row_id_map");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(top_k > 0 && src.dim() == 2 && src.size(0) % top_k == 0, "slot_sum: src must be [T*k, H]");
  TORCH_CHECK(row_id_map.scalar_type() == at::kLong && row_id_map.numel() == src.size(0), "slot_sum: row_id_map");
  const int64_t num_tokens = src.size(0) / top_k, hidden = src.size(1);
  TORCH_CHECK(out.scalar_type() == src.scalar_type() && out.numel() == num_tokens * hidden, "slot_sum: out");
  const float* p = nullptr;
  if (probs.has_value()) {
    check_cpu_contiguous(*probs, "probs");
    TORCH_CHECK(probs->scalar_type() == at::kFloat && probs->numel() == src.size(0), "slot_sum: probs");
    p = probs->data_ptr<float>();
  }
  check_row_ids(row_id_map.data_ptr<int64_t>(), row_id_map.numel(), "slot_sum");
  dispatch_float(src.scalar_type(), "slot_sum", [&](auto tag) {
    using T = decltype(tag);
    slot_sum_kernel<T>(src.data_ptr<T>(), row_id_map.data_ptr<int64_t>(), p, out.data_ptr<T>(), num_tokens, top_k,
                       hidden);
  });
}

void unpermute_backward(const at::Tensor& grad_out, const at::Tensor& expert_out, const at::Tensor& row_id_map,
                        const at::Tensor& probs, at::Tensor& grad_expert_out, at::Tensor& grad_probs) {
  for (auto* t : {&grad_out, &expert_out, &row_id_map, &probs}) check_cpu_contiguous(*t, "unpermute_backward input");
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat, "unpermute_backward: probs must be [T, k] f32");
  const int64_t num_tokens = probs.size(0), top_k = probs.size(1), hidden = grad_out.size(-1);
  TORCH_CHECK(grad_out.numel() == num_tokens * hidden, "unpermute_backward: grad_out must be [T, H]");
  TORCH_CHECK(row_id_map.scalar_type() == at::kLong && row_id_map.numel() == num_tokens * top_k,
              "unpermute_backward: row_id_map");
  const bool want_expert = grad_expert_out.numel() > 0, want_probs = grad_probs.numel() > 0;
  if (want_expert) {
    check_cpu_contiguous(grad_expert_out, "grad_expert_out");
    TORCH_CHECK(grad_expert_out.scalar_type() == grad_out.scalar_type() &&
                    grad_expert_out.numel() == num_tokens * top_k * hidden,
                "unpermute_backward: grad_expert_out");
  }
  if (want_probs) {
    check_cpu_contiguous(grad_probs, "grad_probs");
    check_cpu_contiguous(expert_out, "expert_out");
    TORCH_CHECK(grad_probs.scalar_type() == at::kFloat && grad_probs.numel() == num_tokens * top_k,
                "unpermute_backward: grad_probs");
    TORCH_CHECK(expert_out.scalar_type() == grad_out.scalar_type() && expert_out.numel() == num_tokens * top_k * hidden,
                "unpermute_backward: expert_out");
  }
  check_row_ids(row_id_map.data_ptr<int64_t>(), row_id_map.numel(), "unpermute_backward");
  dispatch_float(grad_out.scalar_type(), "unpermute_backward", [&](auto tag) {
    using T = decltype(tag);
    unpermute_backward_kernel<T>(grad_out.data_ptr<T>(), want_probs ? expert_out.data_ptr<T>() : nullptr,
                                 row_id_map.data_ptr<int64_t>(), probs.data_ptr<float>(),
                                 want_expert ? grad_expert_out.data_ptr<T>() : nullptr,
                                 want_probs ? grad_probs.data_ptr<float>() : nullptr, num_tokens, top_k, hidden);
  });
}

void swiglu(const at::Tensor& x, at::Tensor& y) {
  check_cpu_contiguous(x, "x");
  check_cpu_contiguous(y, "y");
  const int64_t width = x.size(-1), half = width / 2, rows = width ? x.numel() / width : 0;
  TORCH_CHECK(width % 2 == 0 && y.numel() == rows * half && y.scalar_type() == x.scalar_type(), "swiglu: shapes");
  dispatch_float(x.scalar_type(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    swiglu_kernel<T>(x.data_ptr<T>(), y.data_ptr<T>(), rows, half);
  });
}

void swiglu_backward(const at::Tensor& dy, const at::Tensor& x, at::Tensor& dx) {
  for (auto* t : {&dy, &x}) check_cpu_contiguous(*t, "swiglu_backward input");
  check_cpu_contiguous(dx, "dx");
  const int64_t width = x.size(-1), half = width / 2, rows = width ? x.numel() / width : 0;
  TORCH_CHECK(width % 2 == 0 && dy.numel() == rows * half && dx.numel() == x.numel(), "swiglu_backward: shapes");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type() && dx.scalar_type() == x.scalar_type(), "swiglu_backward: dtypes");
  dispatch_float(x.scalar_type(), "swiglu_backward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T>(dy.data_ptr<T>(), x.data_ptr<T>(), dx.data_ptr<T>(), rows, half);
  });
}

}  // namespace

TORCH_LIBRARY(moe_gmm_native, m) {
  m.def(
      "permute_rows(Tensor hidden, Tensor expert_ids, int num_experts, Tensor(a!) permuted, Tensor(b!) row_id_map, "
      "Tensor(c!) counts) -> ()");
  m.def("slot_sum(Tensor src, Tensor row_id_map, Tensor? probs, int top_k, Tensor(a!) out) -> ()");
  m.def(
      "unpermute_backward(Tensor grad_out, Tensor expert_out, Tensor row_id_map, Tensor probs, "
      "Tensor(a!) grad_expert_out, Tensor(b!) grad_probs) -> ()");
  m.def("swiglu(Tensor x, Tensor(a!) y) -> ()");
  m.def("swiglu_backward(Tensor dy, Tensor x, Tensor(a!) dx) -> ()");
}

TORCH_LIBRARY_IMPL(moe_gmm_native, CPU, m) {
  m.impl("permute_rows", permute_rows);
  m.impl("slot_sum", slot_sum);
  m.impl("unpermute_backward", unpermute_backward);
  m.impl("swiglu", swiglu);
  m.impl("swiglu_backward", swiglu_backward);
}
