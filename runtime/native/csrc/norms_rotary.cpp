// The per-token elementwise kernels: the RMS norm with the residual addition before it,
// the rotary embedding with the keys' and values' cache writes, and the gated activation.

#include "common.h"
#include "kernels.h"

namespace specserve {

namespace {

// Sum of x[i]^2 in a fixed order: sixteen lanes of fused multiply-adds (lane l takes the
// inputs l, l + 16, ...), then the lanes halved into each other (l + 8, l + 4, l + 2, l + 1)
float sum_of_squares(const float* x, int64_t n) {
  F16 acc = zero();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const F16 v = load(x + i);
    acc = fma(v, v, acc);
  }
  if (i < n) {
    const F16 v = load_first(x + i, n - i);
    acc = fma(v, v, acc);
  }
  float lanes[16];
  store(lanes, acc);
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

}  // namespace

template <typename T>
void rms_norm_rows(const T* hidden, const T* delta, const T* weight, T* hidden_out, T* normed,
                   int64_t tokens, int64_t n, double eps) {
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> x(n), w(n);
    for (int64_t i = 0; i < n; ++i) w[i] = load(weight, i);
    for (int64_t t = lo; t < hi; ++t) {
      const T* h = hidden + t * n;
      for (int64_t i = 0; i < n; ++i) {
        float v = load(h, i);
        if (delta != nullptr) {
          // the residual stream is held in the activation dtype: round the sum
          store(hidden_out + t * n, i, v + load(delta + t * n, i));
          v = load(hidden_out + t * n, i);
        }
        x[i] = v;
      }
      const float mean = sum_of_squares(x.data(), n) / static_cast<float>(n);
      const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      T* out = normed + t * n;
      for (int64_t i = 0; i < n; ++i) {
        // as the model's norm does: x * rsqrt(mean(x^2) + eps) in the activation dtype,
        // then times the weight
        store(out, i, x[i] * scale);
        store(out, i, w[i] * load(out, i));
      }
    }
  });
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& weight, double eps) {
  check_rows(hidden, "hidden");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == hidden.scalar_type(),
              "weight must be a contiguous [n] tensor of hidden's dtype");
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) {
    check_rows(*delta, "delta");
    TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->scalar_type() == hidden.scalar_type(),
                "delta must match hidden");
  }
  at::Tensor out = has_delta ? at::empty_like(hidden) : hidden;
  at::Tensor normed = at::empty_like(hidden);
  const int64_t tokens = hidden.size(0), n = hidden.size(1);
  DISPATCH(hidden.scalar_type(), "add_rms_norm", [&] {
    rms_norm_rows<scalar_t>(hidden.data_ptr<scalar_t>(),
                            has_delta ? delta->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(),
                            has_delta ? out.data_ptr<scalar_t>() : nullptr,
                            normed.data_ptr<scalar_t>(), tokens, n, eps);
  });
  return {out, normed};
}

template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, T* keys, T* values, T* q_out,
                     const KvPages& pages, const int64_t* rows, const int64_t* slots,
                     int64_t tokens, int64_t heads) {
  const int64_t kv_heads = pages.kv_heads, dim = pages.dim;
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* x = qkv + t * width;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      const int64_t row = rows[t], slot = slots[t];
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const T* in = x + head * dim;
        T* out = head < heads ? q_out + (t * heads + head) * dim
                              : keys + pages.at(row, head - heads, slot);
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(in, i), x2 = load(in, i + half);
          const float ci = load(c, i), si = load(s, i);
          // the second product rounded, the first fused into the sum (as the kernels have
          // always rotated: a fused multiply-add is written as one, never left to the build)
          store(out, i, std::fma(x1, ci, -(x2 * si)));
          store(out, i + half, std::fma(x2, ci, x1 * si));
        }
      }
      for (int64_t head = 0; head < kv_heads; ++head) {
        const T* in = x + (heads + kv_heads + head) * dim;
        std::memcpy(values + pages.at(row, head, slot), in, dim * sizeof(T));
      }
    }
  });
}

KvPages kv_pages(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() &&
                  keys.sizes() == values.sizes() && keys.scalar_type() == values.scalar_type(),
              "keys/values must be contiguous pools [blocks, kv_heads, block, dim] of one dtype");
  const int64_t block = keys.size(2), blocks = keys.size(0);
  TORCH_CHECK(block > 0 && (block & (block - 1)) == 0, "a block's positions must be a power of two");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous() &&
                  tables.size(1) > 0,
              "tables must be contiguous int64 [rows, width]");
  const int64_t* entry = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(entry[i] >= 0 && entry[i] < blocks, "a block table names block ", entry[i],
                " of a pool of ", blocks);
  KvPages pages;
  pages.tables = entry;
  pages.width = tables.size(1);
  while ((int64_t{1} << pages.shift) < block) ++pages.shift;
  pages.kv_heads = keys.size(1);
  pages.dim = keys.size(3);
  return pages;
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& keys, at::Tensor& values, const at::Tensor& tables,
                      const at::Tensor& rows, const at::Tensor& slots, int64_t heads,
                      int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = qkv.size(0), dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be [tokens, (heads + 2 kv_heads) * dim]");
  TORCH_CHECK(cos.size(0) == tokens && sin.sizes() == cos.sizes(), "cos/sin must be [tokens, dim]");
  const KvPages pages = kv_pages(keys, values, tables);
  TORCH_CHECK(pages.kv_heads == kv_heads && pages.dim == dim,
              "keys/values must be pools [blocks, kv_heads, block, dim]");
  for (const at::Tensor* t : {&cos, &sin, static_cast<const at::Tensor*>(&keys),
                              static_cast<const at::Tensor*>(&values)})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "every tensor must have qkv's dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  rows.numel() == tokens && slots.numel() == tokens && rows.is_contiguous() &&
                  slots.is_contiguous(),
              "rows/slots must be contiguous int64 [tokens]");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(row[t] >= 0 && row[t] < tables.size(0) && slot[t] >= 0 &&
                    slot[t] < pages.positions(),
                "a token's table row or position is out of range");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  DISPATCH(qkv.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                              sin.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                              values.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), pages,
                              row, slot, tokens, heads);
  });
  return q;
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t tokens, int64_t n) {
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* g = gate_up + t * 2 * n;
      const T* u = g + n;
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {  // silu(x) = x / (1 + e^-x)
        const F16 x = load(g + i);
        const F16 silu = div(x, add(splat(1.0f), exp(sub(zero(), x))));
        store(out + t * n + i, mul(silu, load(u + i)));
      }
      if (i < n) {  // the last lanes through a float32 row, so they take the same steps
        float x[16], up[16], y[16];
        for (int64_t j = 0; j < 16; ++j) {
          x[j] = i + j < n ? load(g, i + j) : 0.0f;
          up[j] = i + j < n ? load(u, i + j) : 0.0f;
        }
        const F16 v = load(x);
        store(y, mul(div(v, add(splat(1.0f), exp(sub(zero(), v)))), load(up)));
        for (int64_t j = 0; i + j < n; ++j) store(out + t * n, i + j, y[j]);
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t tokens = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({tokens, n}, gate_up.options());
  DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), tokens, n);
  });
  return out;
}

#define SPECSERVE_INSTANTIATE(T)                                                            \
  template void rms_norm_rows<T>(const T*, const T*, const T*, T*, T*, int64_t, int64_t,    \
                                 double);                                                   \
  template void rope_store_rows<T>(const T*, const T*, const T*, T*, T*, T*, const KvPages&, \
                                   const int64_t*, const int64_t*, int64_t, int64_t);        \
  template void silu_mul_rows<T>(const T*, T*, int64_t, int64_t);
SPECSERVE_INSTANTIATE(float)
SPECSERVE_INSTANTIATE(c10::BFloat16)
#undef SPECSERVE_INSTANTIATE

}  // namespace specserve
