// Attention over the cache: each query reads exactly the keys it may see (no padding, no
// masks), so a verify pass gives each position a one-token step's logits by construction.
// The keys and values lie in blocks of a pool, found through the sequence's block table
// (KvPages): where a key lies changes no operation on it.
//
// A key's score is one sum per lane of 16 (the first of a head's 16-dimension chunks
// multiplied, then each next chunk fused in), the lanes added by vec.h's fixed tree; the
// softmax takes vec.h's e^x; an output dimension is one chain of fused multiply-adds over
// the keys in order, times the inverse of the weights' sum.

#include "common.h"
#include "kernels.h"

namespace specserve {

namespace {

constexpr int64_t kKeysAhead = 8;   // key rows prefetched ahead of the one scored
constexpr int64_t kMaxChunks = 16;  // head_dim up to 256, in chunks of 16
constexpr int64_t kMaxGroup = 8;    // query heads a task holds in registers at most

#if defined(SPECSERVE_VEC_AVX512)
constexpr int kValueHeads = 6, kValueChunks = 4;  // a pass over the values: 24 sums in registers
#elif defined(SPECSERVE_VEC_AVX2)
constexpr int kValueHeads = 2, kValueChunks = 2;  // 8 of the 16 registers
#else
constexpr int kValueHeads = 6, kValueChunks = 4;
#endif

// One sequence's key/value head in the pools: where each of its positions lies
struct HeadCache {
  const KvPages& pages;
  int64_t row, head;
  int64_t at(int64_t position) const { return pages.at(row, head, position); }
};

// s [seen] scores -> e^(s - max) in place; returns 1 / their sum (16 lanes, summed by
// halves)
float softmax(float* s, int64_t seen) {
  float top = -INFINITY;
  for (int64_t j = 0; j < seen; ++j) top = lane_max(s[j], top);
  F16 total = zero();
  for (int64_t j = 0; j < seen; j += 16) {
    const int64_t n = std::min<int64_t>(16, seen - j);
    const F16 e = keep_first(exp(sub(load_first(s + j, n), splat(top))), n);
    store_first(s + j, n, e);
    total = add(total, e);
  }
  return 1.0f / sum_halves(total);
}

// out[g] = inv[g] * sum_j p[g * stride + j] * values[j] for SUB query heads, CH chunks of
// 16 dimensions at a time with the sums in registers (a sum kept in memory would wait on
// its own store every key)
template <typename T, int SUB>
void weigh_values(const T* values, const HeadCache& cache, int64_t limit, int64_t extra, int64_t seen,
                  int64_t dim, const float* p, int64_t stride, const float* inv, T* out) {
  constexpr int CH = kValueChunks;
  for (int64_t d0 = 0; d0 < dim; d0 += 16 * CH) {
    const int chunks = static_cast<int>(std::min<int64_t>(16 * CH, dim - d0) / 16);
    F16 acc[SUB][CH];
    for (int g = 0; g < SUB; ++g)
      for (int c = 0; c < CH; ++c) acc[g][c] = zero();
    for (int64_t j = 0; j < seen; ++j) {
      const T* v = values + cache.at(j < limit ? j : extra) + d0;
      F16 row[CH];
      for (int c = 0; c < CH; ++c) row[c] = c < chunks ? load(v + 16 * c) : zero();
      for (int g = 0; g < SUB; ++g) {
        const F16 weight = splat(p[g * stride + j]);
        for (int c = 0; c < CH; ++c) acc[g][c] = fma(weight, row[c], acc[g][c]);
      }
    }
    for (int g = 0; g < SUB; ++g)
      for (int c = 0; c < chunks; ++c)
        store(out + g * dim + d0 + 16 * c, mul(acc[g][c], splat(inv[g])));
  }
}

// One (token, key/value head) task for `group` (at most kMaxGroup) of the query heads that
// share the key/value head, head_dim a multiple of 16: they attend to keys [0, limit)
// and, when extra >= limit, the key at slot `extra` too. Each key and value is read once
// for the group.
template <typename T>
void attend_task(const T* q, const T* keys, const T* values, const HeadCache& cache, T* out,
                 int64_t limit, int64_t extra, int64_t group, int64_t dim, float scale,
                 std::vector<float>& scores) {
  const int64_t chunks = dim / 16;
  const int64_t seen = limit + (extra >= limit ? 1 : 0);
  scores.resize(static_cast<size_t>(group * seen));
  F16 qv[kMaxGroup][kMaxChunks], kv[kMaxChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c) qv[g][c] = mul(load(q + g * dim + c * 16), splat(scale));
  // 16 keys at a time: per key and query head, the products summed per lane; then the
  // lanes of the 16 keys summed together
  F16 part[kMaxGroup][16];
  for (int64_t j0 = 0; j0 < seen; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, seen - j0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      if (jj >= n) {
        for (int64_t g = 0; g < group; ++g) part[g][jj] = zero();
        continue;
      }
      const int64_t slot = j0 + jj < limit ? j0 + jj : extra;
      const int64_t at = cache.at(slot);
      const T* k = keys + at;
      // the cache was written a pass ago and the weights have streamed through the caches
      // since: fetch the keys a few rows ahead, and each value row as its key is scored
      if (j0 + jj + kKeysAhead < limit)
        prefetch_row(keys + cache.at(j0 + jj + kKeysAhead), dim * sizeof(T));
      prefetch_row(values + at, dim * sizeof(T));
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load(k + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        F16 acc = mul(qv[g][0], kv[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = fma(qv[g][c], kv[c], acc);
        part[g][jj] = acc;
      }
    }
    for (int64_t g = 0; g < group; ++g) store_first(scores.data() + g * seen + j0, n, sums16(part[g]));
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) inv[g] = softmax(scores.data() + g * seen, seen);
  // the query heads in as few even parts of at most kValueHeads as there can be
  const int64_t parts = (group + kValueHeads - 1) / kValueHeads;
  const int64_t size = (group + parts - 1) / parts;
  for (int64_t g = 0; g < group; g += size) {
    const float* p = scores.data() + g * seen;
    T* o = out + g * dim;
    switch (std::min(size, group - g)) {
#define SPECSERVE_HEADS(N)                                                         \
  case N:                                                                          \
    if constexpr (N <= kValueHeads)                                                \
      weigh_values<T, N>(values, cache, limit, extra, seen, dim, p, seen, inv + g, o); \
    break;
      SPECSERVE_HEADS(1) SPECSERVE_HEADS(2) SPECSERVE_HEADS(3)
      SPECSERVE_HEADS(4) SPECSERVE_HEADS(5) SPECSERVE_HEADS(6)
#undef SPECSERVE_HEADS
    }
  }
}

// attend_task for a head_dim that is not a multiple of 16, one query head at a time: the
// same steps with the lanes of each chunk that exist
template <typename T>
void attend_task_any(const T* q, const T* keys, const T* values, const HeadCache& cache, T* out,
                     int64_t limit, int64_t extra, int64_t group, int64_t dim, float scale,
                     std::vector<float>& scores) {
  const int64_t seen = limit + (extra >= limit ? 1 : 0);
  scores.resize(static_cast<size_t>(seen));
  std::vector<float> qf(dim), acc(dim);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t i = 0; i < dim; ++i) qf[i] = load(q + g * dim, i) * scale;
    for (int64_t j = 0; j < seen; ++j) {
      const T* k = keys + cache.at(j < limit ? j : extra);
      float lanes[16];
      for (int l = 0; l < 16; ++l) lanes[l] = l < dim ? qf[l] * load(k, l) : 0.0f;
      for (int64_t i = 16; i < dim; ++i) lanes[i % 16] = std::fma(qf[i], load(k, i), lanes[i % 16]);
      scores[j] = sum_lanes(load(lanes));
    }
    const float inv = softmax(scores.data(), seen);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < seen; ++j) {
      const T* v = values + cache.at(j < limit ? j : extra);
      for (int64_t i = 0; i < dim; ++i) acc[i] = std::fma(scores[j], load(v, i), acc[i]);
    }
    for (int64_t i = 0; i < dim; ++i) store(out + g * dim, i, acc[i] * inv);
  }
}

}  // namespace

template <typename T>
void attend_rows(const T* qp, const T* kp, const T* vp, T* op, const KvPages& pages,
                 const int64_t* row, const int64_t* limit, const int64_t* extra,
                 int64_t tokens, int64_t heads, float scale) {
  const int64_t kv_heads = pages.kv_heads, dim = pages.dim;
  const int64_t group = heads / kv_heads;
  const bool chunked = dim % 16 == 0 && dim / 16 <= kMaxChunks;
  // a task: a token's query heads of one key/value head, or an even part of them where
  // that makes kChunksPerThread tasks a thread (one token's 3 tasks left one of two
  // threads idle a third of the time); each query head's result is the same either way
  const int64_t wanted = split_threads() * kChunksPerThread;
  int64_t parts = std::min(group, (wanted + tokens * kv_heads - 1) / (tokens * kv_heads));
  parts = std::max(parts, (group + kMaxGroup - 1) / kMaxGroup);
  const int64_t part = (group + parts - 1) / parts;
  parts = (group + part - 1) / part;
  split(0, tokens * kv_heads * parts, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> scores;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / (kv_heads * parts), h = task / parts % kv_heads;
      const int64_t g0 = task % parts * part, size = std::min(part, group - g0);
      const HeadCache cache{pages, row[t], h};
      const int64_t at = (t * heads + h * group + g0) * dim;
      if (chunked)
        attend_task<T>(qp + at, kp, vp, cache, op + at, limit[t], extra[t], size, dim, scale,
                       scores);
      else
        attend_task_any<T>(qp + at, kp, vp, cache, op + at, limit[t], extra[t], size, dim, scale,
                           scores);
    }
  });
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& limits,
                  const at::Tensor& extras, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [tokens, heads, dim]");
  const KvPages pages = kv_pages(keys, values, tables);
  TORCH_CHECK(pages.dim == q.size(2), "keys/values must be pools [blocks, kv_heads, block, dim]");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type(), "q, keys and values must share a dtype");
  const int64_t tokens = q.size(0), heads = q.size(1);
  TORCH_CHECK(heads % pages.kv_heads == 0, "heads must be a multiple of kv_heads");
  for (const at::Tensor* t : {&rows, &limits, &extras})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == tokens && t->is_contiguous(),
                "rows/limits/extras must be contiguous int64 [tokens]");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* limit = limits.data_ptr<int64_t>();
  const int64_t* extra = extras.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(row[t] >= 0 && row[t] < tables.size(0) && limit[t] >= 1 &&
                    limit[t] <= pages.positions() && extra[t] < pages.positions(),
                "a token's table row or key range is out of range");
  at::Tensor out = at::empty({tokens, heads * pages.dim}, q.options());
  DISPATCH(q.scalar_type(), "attend", [&] {
    attend_rows<scalar_t>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                          values.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), pages, row,
                          limit, extra, tokens, heads, static_cast<float>(scale));
  });
  return out;
}

template void attend_rows<float>(const float*, const float*, const float*, float*,
                                 const KvPages&, const int64_t*, const int64_t*, const int64_t*,
                                 int64_t, int64_t, float);
template void attend_rows<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*,
                                         const c10::BFloat16*, c10::BFloat16*, const KvPages&,
                                         const int64_t*, const int64_t*, const int64_t*,
                                         int64_t, int64_t, float);

}  // namespace specserve
