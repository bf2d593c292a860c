// A whole decoder stack in one call (LayerStack, kernels.h): every layer's kernels in
// order on one buffer, on one team of threads for a short pass.

#include "common.h"
#include "kernels.h"

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <thread>

namespace specserve {

thread_local Team team;

namespace {

// the most tokens a stack pass runs as one team (more: each kernel call splits on its own)
constexpr int64_t kTeamTokens = 64;

// A team member waits here until every chunk of the calls it has made is done (split()
// counts them), spinning, then yielding the core: a member the system has descheduled
// holds the others up only while it holds a chunk, and catches up without work
inline void wait_for_chunks() {
  for (int spins = 0; team.done->load(std::memory_order_acquire) < team.seen; ++spins) {
    if (spins < 4096) {
#if defined(__x86_64__) || defined(__i386__)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace

LayerStack::LayerStack(std::vector<at::Tensor> packed, std::vector<at::Tensor> scales_zeros,
           std::vector<int64_t> out_features, std::vector<c10::optional<at::Tensor>> biases,
           std::vector<at::Tensor> norms, std::vector<double> eps, int64_t group,
           int64_t heads, int64_t kv_heads, double scale, std::vector<int64_t> kinds)
    : packed_(std::move(packed)), scales_zeros_(std::move(scales_zeros)),
      out_(std::move(out_features)), biases_(std::move(biases)), norms_(std::move(norms)),
      eps_(std::move(eps)), group_(group), heads_(heads), kv_heads_(kv_heads), scale_(scale),
      kinds_(std::move(kinds)) {
  const size_t n = packed_.size();
  TORCH_CHECK(n > 0 && n % 4 == 0 && scales_zeros_.size() == n && out_.size() == n &&
                  biases_.size() == n && kinds_.size() == n && norms_.size() == n / 2 + 1 &&
                  eps_.size() == norms_.size(),
              "at least one layer: four matrices a layer, two norms a layer and the final one");
  native_ = kinds_[0] != kTorchInt4;
  dtype_ = native_ ? norms_[0].scalar_type() : at::kBFloat16;
  TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat,
              "the layers run in bfloat16 or float32");
  const int64_t dense = dtype_ == at::kFloat ? kDenseF32 : kDenseBf16;
  const int64_t hidden = norms_[0].numel(), dim = out_[0] / (heads_ + 2 * kv_heads_);
  for (size_t i = 0; i < n; ++i) {
    const int64_t kind = kinds_[i];
    TORCH_CHECK(native_ ? (kind == 4 || kind == 8 || kind == kKQuant || kind == dense)
                        : kind == kTorchInt4,
                "matrix ", i, ": kind ", kind, " (all PyTorch's int4, or 4, 8, ", kKQuant,
                " and ", dense, " for a model in ", dtype_, ")");
    if (!native_) continue;
    // each matrix's input: the hidden state, attention's output, the hidden state, the
    // gated activation
    const int64_t in = i % 4 == 1 ? heads_ * dim : i % 4 == 3 ? out_[i - 1] / 2 : hidden;
    TORCH_CHECK(out_[i] == (i % 4 == 0 ? (heads_ + 2 * kv_heads_) * dim
                            : i % 4 == 2 ? out_[2] : hidden) && packed_[i].is_contiguous(),
                "matrix ", i, " is not of its layer's shape");
    if (kind == kKQuant) {  // scales_zeros holds the segments' layout
      TORCH_CHECK(packed_[i].scalar_type() == at::kByte &&
                      kquant_check(scales_zeros_[i], packed_[i].numel(), in) == out_[i],
                  "matrix ", i, " is not a K-quant matrix of its layer's shape");
    } else if (kind == dense) {
      const int64_t groups = (out_[i] + kDenseRows - 1) / kDenseRows;
      TORCH_CHECK((dtype_ == at::kFloat || in % 2 == 0) && packed_[i].scalar_type() == dtype_ &&
                      packed_[i].numel() == groups * in * kDenseRows,
                  "matrix ", i, " is not a dense ", dtype_, " matrix of its layer's shape");
    } else {
      const int64_t tiles = (out_[i] + kTile - 1) / kTile;
      TORCH_CHECK(in % kBlock == 0 && packed_[i].scalar_type() == at::kByte &&
                      packed_[i].numel() == tiles * (in / kBlock) * block_bytes(kind),
                  "matrix ", i, " is not a ", kind, "-bit block matrix of its layer's shape");
    }
    bias32_.push_back(biases_[i].has_value() && biases_[i]->defined()
                          ? biases_[i]->to(at::kFloat).contiguous() : at::Tensor());
  }
  if (!native_) return;
  for (const at::Tensor& w : norms_)
    TORCH_CHECK(w.numel() == hidden && w.is_contiguous() && w.scalar_type() == dtype_,
                "norm weights must be contiguous [hidden], in the model's dtype");
}

// forward with native matrices: the same kernels in the same order on one buffer that
// holds every intermediate, reused layer by layer, with the checks made once (a tensor
// per kernel call cost ~0.5 us, ten a layer); T: the model's dtype
template <typename T>
at::Tensor LayerStack::forward_native(const at::Tensor& embedded, const at::Tensor& cos,
                          const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                          const std::vector<at::Tensor>& values, const at::Tensor& tables,
                          const at::Tensor& rows, const at::Tensor& slots,
                          const at::Tensor& limits, const at::Tensor& extras) const {
  check_rows(embedded, "hidden");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = embedded.size(0), hidden = norms_[0].numel();
  const int64_t width = out_[0], dim = width / (heads_ + 2 * kv_heads_);
  const int64_t attended = heads_ * dim, gate_up = out_[2], inner = gate_up / 2;
  TORCH_CHECK(embedded.size(1) == hidden, "hidden must be [tokens, ", hidden, "]");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == dim &&
                  cos.scalar_type() == dtype_ && sin.scalar_type() == dtype_,
              "cos/sin must be [tokens, ", dim, "] in the model's dtype");
  const at::Tensor& first = keys[0];
  const KvPages pages = kv_pages(first, values[0], tables);
  TORCH_CHECK(pages.kv_heads == kv_heads_ && pages.dim == dim,
              "keys/values must be pools [blocks, kv_heads, block, dim]");
  for (size_t l = 0; l < keys.size(); ++l)
    for (const at::Tensor* t : {&keys[l], &values[l]})
      TORCH_CHECK(t->sizes() == first.sizes() && t->is_contiguous() &&
                      t->scalar_type() == dtype_,
                  "every layer's keys/values must be contiguous, of one shape, in the "
                  "model's dtype");
  for (const at::Tensor* t : {&rows, &slots, &limits, &extras})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == tokens && t->is_contiguous(),
                "rows/slots/limits/extras must be contiguous int64 [tokens]");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* limit = limits.data_ptr<int64_t>();
  const int64_t* extra = extras.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(row[t] >= 0 && row[t] < tables.size(0) && slot[t] >= 0 &&
                    slot[t] < pages.positions() && limit[t] >= 1 &&
                    limit[t] <= pages.positions() && extra[t] < pages.positions(),
                "a token's table row, slot or key range is out of range");
  // hidden (updated in place), normed, q/k/v, q rotated, attention's output, a product's
  // output before the residual addition, gate/up, the gated activation
  at::Tensor buffer = at::empty(
      {tokens * (3 * hidden + width + 2 * attended + gate_up + inner)}, embedded.options());
  T* h = buffer.data_ptr<T>();
  T* x = h + tokens * hidden;
  T* qkv = x + tokens * hidden;
  T* q = qkv + tokens * width;
  T* out = q + tokens * attended;
  T* delta = out + tokens * attended;
  T* gu = delta + tokens * hidden;
  T* gated = gu + tokens * gate_up;
  std::memcpy(h, embedded.contiguous().data_ptr<T>(), tokens * hidden * sizeof(T));
  auto norm = [&](size_t i, const T* add) {  // h += add (if any); x = norm i of h
    rms_norm_rows<T>(h, add, norms_[i].data_ptr<T>(), add != nullptr ? h : nullptr, x, tokens,
                     hidden, eps_[i]);
  };
  auto product = [&](const T* in, int64_t k, size_t i, T* y) {
    const float* bias = bias32_[i].defined() ? bias32_[i].data_ptr<float>() : nullptr;
    if (kinds_[i] == kDenseBf16 || kinds_[i] == kDenseF32)
      return dense_product_rows(in, tokens, k, packed_[i].data_ptr<T>(), out_[i], bias, y);
    if (kinds_[i] == kKQuant)
      return kquant_product_rows<T>(in, tokens, k, packed_[i].data_ptr<uint8_t>(),
                                    scales_zeros_[i].data_ptr<int64_t>(),
                                    scales_zeros_[i].size(0), bias, y);
    block_product_rows<T>(in, tokens, k, packed_[i].data_ptr<uint8_t>(), out_[i], kinds_[i],
                          bias, y);
  };
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  // every kernel call in order; `sync` between calls whose output the next one reads
  auto layers = [&](const auto& sync) {
    norm(0, nullptr);
    sync();
    for (size_t l = 0; l < keys.size(); ++l) {
      T* kp = keys[l].data_ptr<T>();
      T* vp = values[l].data_ptr<T>();
      product(x, hidden, 4 * l, qkv);
      sync();
      rope_store_rows<T>(qkv, cp, sp, kp, vp, q, pages, row, slot, tokens, heads_);
      sync();
      attend_rows<T>(q, kp, vp, out, pages, row, limit, extra, tokens, heads_,
                     static_cast<float>(scale_));
      sync();
      product(out, attended, 4 * l + 1, delta);
      sync();
      norm(2 * l + 1, delta);
      sync();
      product(x, hidden, 4 * l + 2, gu);
      sync();
      silu_mul_rows<T>(gu, gated, tokens, inner);
      sync();
      product(gated, inner, 4 * l + 3, delta);
      sync();
      norm(2 * l + 2, delta);
      sync();
    }
  };
  bool as_team = false;
#if defined(_OPENMP)
  // one parallel region for the pass (a decoding pass of a few tokens: the bulk products
  // of long prompt chunks do not come here)
  as_team = at::get_num_threads() > 1 && !at::in_parallel_region() && tokens <= kTeamTokens;
  if (as_team) {
    std::atomic<int64_t> tickets{0}, done{0};
#pragma omp parallel
    {
      team = Team{omp_get_thread_num(), omp_get_num_threads(), &tickets, &done};
      layers([] { wait_for_chunks(); });
      team = Team{};
    }
  }
#endif
  if (!as_team) layers([] {});
  return buffer.narrow(0, tokens * hidden, tokens * hidden).view({tokens, hidden});
}


// hidden [T, H] (the model's dtype) -> the final norm of the last layer's output, [T, H]
at::Tensor LayerStack::forward(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                   std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                   const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& slots,
                   const at::Tensor& limits, const at::Tensor& extras) const {
  const size_t layers = packed_.size() / 4;
  TORCH_CHECK(keys.size() == layers && values.size() == layers, "one cache per layer");
  TORCH_CHECK(embedded.scalar_type() == dtype_, "these layers take ", dtype_);
  if (native_ && dtype_ == at::kFloat)
    return forward_native<float>(embedded, cos, sin, keys, values, tables, rows, slots, limits,
                                 extras);
  if (native_)
    return forward_native<c10::BFloat16>(embedded, cos, sin, keys, values, tables, rows, slots,
                                         limits, extras);
  std::vector<at::Tensor> state = add_rms_norm(embedded.contiguous(), c10::nullopt, norms_[0], eps_[0]);
  at::Tensor hidden = state[0], x = state[1];
  for (size_t l = 0; l < layers; ++l) {
    at::Tensor q = rope_store(product(x, 4 * l), cos, sin, keys[l], values[l], tables, rows,
                              slots, heads_, kv_heads_);
    at::Tensor out = attend(q, keys[l], values[l], tables, rows, limits, extras, scale_);
    state = add_rms_norm(hidden, product(out, 4 * l + 1), norms_[2 * l + 1], eps_[2 * l + 1]);
    hidden = state[0];
    at::Tensor gated = silu_mul(product(state[1], 4 * l + 2));
    state = add_rms_norm(hidden, product(gated, 4 * l + 3), norms_[2 * l + 2], eps_[2 * l + 2]);
    hidden = state[0];
    x = state[1];
  }
  return x;
}


// PyTorch's int4 matrices (native ones run in forward_native), as
// runtime/matrices/quantized.py Int4Matrix.__call__ and runtime/runner/fused.py product do
at::Tensor LayerStack::product(const at::Tensor& x, size_t i) const {
  at::Tensor y = at::_weight_int4pack_mm_for_cpu(x, packed_[i], group_, scales_zeros_[i]);
  if (y.size(1) != out_[i]) y = y.narrow(1, 0, out_[i]);
  if (biases_[i].has_value() && biases_[i]->defined()) y = y + *biases_[i];
  return y.contiguous();
}


}  // namespace specserve
