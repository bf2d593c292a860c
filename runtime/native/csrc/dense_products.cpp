// Products of float32 and bfloat16 matrices.
//
// A float32 or bfloat16 [out, in] matrix packed in groups of 64 output rows, each group
// input by input (runtime/matrices/dense.py packs it; rows past `out` are zeros): float32 as
// [groups, in, 64]; bfloat16 as [groups, in / 2, 64, 2], each row's inputs in pairs.
// Output row c of a token is one chain of fused multiply-adds over the inputs in order,
// starting from zero, then the bias; bfloat16 takes each pair's odd input first, as
// AVX512-BF16's vdpbf16ps does for inputs that are not subnormal (that instruction is not
// used: it flushes subnormal inputs, and every build computes the same products). One
// pass over the matrix serves up to kDenseTokens tokens (each weight loaded once for all
// of them), and the 64 rows' chains run side by side, so one token alone keeps the
// multiply-add units busy while the matrix streams through.

#include "common.h"
#include "kernels.h"

namespace specserve {

namespace {

#if defined(SPECSERVE_VEC_AVX512)
constexpr int kDenseTokens = 6;  // 24 accumulators, 4 weights and a broadcast: 29 registers
#else
constexpr int kDenseTokens = 1;  // AVX2: 8 accumulators of 8 rows
#endif

// R tokens (xs [R, k], ldx apart) against one group: [R, 64] float32 into out
template <int R>
inline void dense_group(const float* w, int64_t k, const float* xs, int64_t ldx, float* out) {
  F16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = zero();
  for (int64_t i = 0; i < k; ++i, w += kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 4, kDenseRows * 4);
    F16 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load(w + 16 * j);
    for (int r = 0; r < R; ++r) {
      const F16 x = splat(xs[r * ldx + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = fma(wv[j], x, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) store(out + r * kDenseRows + 16 * j, acc[r][j]);
}

template <int R>
inline void dense_group(const c10::BFloat16* w, int64_t k, const c10::BFloat16* xs, int64_t ldx,
                        float* out) {
  F16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = zero();
  for (int64_t i = 0; i < k; i += 2, w += 2 * kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 2, kDenseRows * 4);
    F16 odd[4], even[4];  // lane c: row c's inputs i + 1 and i
    for (int j = 0; j < 4; ++j) load_pairs(w + 32 * j, odd[j], even[j]);
    for (int r = 0; r < R; ++r) {
      const F16 xo = splat(load(xs + r * ldx, i + 1)), xe = splat(load(xs + r * ldx, i));
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = fma(odd[j], xo, acc[r][j]);
        acc[r][j] = fma(even[j], xe, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) store(out + r * kDenseRows + 16 * j, acc[r][j]);
}

// dense_group for a run-time number of tokens (at most kDenseTokens)
template <typename W, typename X>
void dense_group_rows(int rows, const W* w, int64_t k, const X* xs, int64_t ldx, float* out) {
  static_assert(kDenseTokens <= 6, "a case per token count");
  switch (rows) {
#define SPECSERVE_ROWS(R)         \
  case R:                        \
    if constexpr (R <= kDenseTokens) \
      return dense_group<R>(w, k, xs, ldx, out);
    SPECSERVE_ROWS(1) SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4)
    SPECSERVE_ROWS(5) SPECSERVE_ROWS(6)
#undef SPECSERVE_ROWS
  }
  TORCH_CHECK(false, "dense_group_rows: ", rows, " tokens");
}

}  // namespace

// dense_product's work on checked pointers: xs [tokens, k] (float32 for float32 weights,
// bfloat16 for bfloat16 ones) times a packed [n, k] matrix (+ bias, float32, or null) into
// y [tokens, n]
template <typename T, typename W, typename X>
void dense_product_rows(const X* xs, int64_t tokens, int64_t k, const W* wp, int64_t n,
                        const float* bp, T* yp) {
  const int64_t groups = (n + kDenseRows - 1) / kDenseRows;
  // passes of at most kDenseTokens tokens, evenly filled; a thread's groups are read from
  // memory by the first pass and from its cache by the others (a group is 64 x k weights:
  // 147 KB for k = 576 in float32)
  const int64_t passes = (tokens + kDenseTokens - 1) / kDenseTokens;
  const int64_t per_pass = passes > 0 ? (tokens + passes - 1) / passes : 1;
  split(0, groups, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float buffer[kDenseTokens * kDenseRows];
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t col = g * kDenseRows, width = std::min(n - col, kDenseRows);
      const W* w = wp + g * k * kDenseRows;
      for (int64_t r = 0; r < tokens; r += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, tokens - r));
        dense_group_rows(rows, w, k, xs + r * k, k, buffer);
        for (int i = 0; i < rows; ++i)
          store_row(yp + (r + i) * n + col, buffer + i * kDenseRows,
                    bp != nullptr ? bp + col : nullptr, width);
      }
    }
  });
}

// x [tokens, in] times a packed [out, in] matrix (+ bias): [tokens, out] in x's dtype.
// float32 weights take float32 or bfloat16 activations (multiplied in float32),
// bfloat16 weights bfloat16 ones.
at::Tensor dense_product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features;
  const int64_t groups = (n + kDenseRows - 1) / kDenseRows;
  const bool wide = packed.scalar_type() == at::kFloat;
  TORCH_CHECK(n > 0 && k > 0 && (wide || k % 2 == 0),
              "a [", n, ", ", k, "] matrix: empty, or bfloat16 with an odd input size");
  TORCH_CHECK(packed.numel() == groups * k * kDenseRows && packed.is_contiguous() &&
                  packed.device().is_cpu() && (wide || packed.scalar_type() == at::kBFloat16),
              "packed does not hold a [", n, ", ", k, "] float32 or bfloat16 matrix in groups of ",
              kDenseRows, " rows");
  TORCH_CHECK(wide || x.scalar_type() == at::kBFloat16,
              "a bfloat16 matrix multiplies bfloat16 activations");
  const at::Tensor b32 = float_bias(bias, n);
  at::Tensor y = at::empty({tokens, n}, x.options());
  const float* bp = b32.defined() ? b32.data_ptr<float>() : nullptr;
  DISPATCH(x.scalar_type(), "dense_product", [&] {
    using T = scalar_t;
    if (!wide) {
      const auto* xs = reinterpret_cast<const c10::BFloat16*>(x.data_ptr<T>());
      return dense_product_rows(xs, tokens, k, packed.data_ptr<c10::BFloat16>(), n, bp,
                                y.data_ptr<T>());
    }
    const float* xs = reinterpret_cast<const float*>(x.data_ptr<T>());
    at::Tensor widened;
    if (!std::is_same_v<T, float>) {  // float32 weights multiply float32 activations
      widened = x.to(at::kFloat);
      xs = widened.data_ptr<float>();
    }
    dense_product_rows(xs, tokens, k, packed.data_ptr<float>(), n, bp, y.data_ptr<T>());
  });
  return y;
}

at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [out]");
  return bias->to(at::kFloat).contiguous();
}

template void dense_product_rows<float, float, float>(const float*, int64_t, int64_t,
                                                      const float*, int64_t, const float*,
                                                      float*);
template void dense_product_rows<c10::BFloat16, c10::BFloat16, c10::BFloat16>(
    const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, const float*,
    c10::BFloat16*);

}  // namespace specserve
