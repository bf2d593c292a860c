// Fused CPU kernels for the batched runner's decoder layers (runtime/kernels.py loads them).
//
// Every kernel computes each token (a row of the packed batch) on its own, with a fixed
// order of floating-point operations that depends on nothing but that token: its result
// is bitwise the same whatever else shares the pass and however many threads run it.
// Attention reads exactly the keys a query may see (no padding, no masks), so a verify
// pass gives each position a one-token step's logits by construction.
//
// Tensors are float32 or bfloat16; arithmetic is float32 and each output is rounded once.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

// float32 and bfloat16 only
#define DISPATCH(TYPE, NAME, ...)                      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                       \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Tokens a thread takes at least in the per-token kernels (norm, rotary, activation, a
// product's activation codes): a token's work there is well under a microsecond, and a
// parallel region started from a thread other than the process's first can cost tens
// (libgomp counts that first thread as busy, finds more threads than cores and wakes its
// workers from sleep rather than from a spin)
constexpr int64_t kTokenGrain = 128;
constexpr int64_t kLanes = 16;  // independent partial sums of a reduction (one AVX-512 register)

// --- work split across threads ----------------------------------------------------------

// The team of threads a whole-stack pass runs on (LayerStack), as this thread sees it: its
// index and the team's size (size 0: no team, kernels split their work by
// at::parallel_for). A pass of a few tokens makes ~300 short kernel calls; as parallel
// regions each would wake the workers (from sleep, off the main thread), so the stack
// starts one region and the kernels take their share of each call in it, with a spin
// barrier between calls.
struct Team {
  int64_t index = 0, size = 0;
};
thread_local Team team;

// f(lo, hi) over [begin, end) in chunks of at least `grain`: this thread's share in a team,
// else at::parallel_for's split. Every item is computed the same either way.
template <typename F>
void split(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (team.size == 0) return at::parallel_for(begin, end, grain, f);
  if (begin >= end) return;
  const int64_t chunks = std::min(team.size, (end - begin + grain - 1) / grain);
  const int64_t chunk = (end - begin + chunks - 1) / chunks;
  const int64_t lo = begin + team.index * chunk;
  if (team.index < chunks && lo < end) f(lo, std::min(end, lo + chunk));
}

// Threads that run split() work: the team's size, else PyTorch's intra-op threads
inline int64_t split_threads() { return team.size > 0 ? team.size : at::get_num_threads(); }

// All of a team waits here until every member has arrived: a counter that only grows (the
// n-th barrier opens at n * size), spinning, then yielding the core (a member the system
// has descheduled, as when the HTTP loop takes a core, needs one to arrive)
class SpinBarrier {
 public:
  void wait(int64_t& passed) {
    const int64_t open = ++passed * team.size;
    arrived_.fetch_add(1, std::memory_order_acq_rel);
    for (int spins = 0; arrived_.load(std::memory_order_acquire) < open; ++spins) {
      if (spins < 4096) {
#if defined(__AVX512F__) || defined(__AVX2__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  std::atomic<int64_t> arrived_{0};
};

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

// A row of n values as float32 into out (n <= capacity of out).
template <typename T>
inline void widen(const T* x, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = load(x, i);
}

// Sum of a[i] * b[i] in a fixed order: kLanes partial sums, then a fixed tree.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  for (int64_t l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// Bring a row's bytes toward the core ahead of use (a prefetch never faults: a row past
// the end of a buffer is harmless).
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [tokens, n] tensor");
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
}

// --- RMS norm, with the residual addition before it ----------------------------------

template <typename T>
void rms_norm_rows(const T* hidden, const T* delta, const T* weight, T* hidden_out, T* normed,
                   int64_t tokens, int64_t n, double eps) {
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    std::vector<float> x(n), w(n);
    widen(weight, n, w.data());
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
      float mean = dot(x.data(), x.data(), n) / static_cast<float>(n);
      float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
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

// (hidden + delta, rms_norm(hidden + delta) * weight); without delta, (hidden, norm).
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

// --- rotary embedding, and the keys and values into the cache -------------------------

template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, T* keys, T* values, T* q_out,
                     const int64_t* rows, const int64_t* slots, int64_t tokens, int64_t heads,
                     int64_t kv_heads, int64_t dim, int64_t capacity) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* x = qkv + t * width;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      const int64_t row = rows[t], slot = slots[t];
      for (int64_t head = 0; head < heads + kv_heads; ++head) {
        const T* in = x + head * dim;
        T* out = head < heads
                     ? q_out + (t * heads + head) * dim
                     : keys + ((row * kv_heads + (head - heads)) * capacity + slot) * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(in, i), x2 = load(in, i + half);
          const float ci = load(c, i), si = load(s, i);
          store(out, i, x1 * ci - x2 * si);
          store(out, i + half, x2 * ci + x1 * si);
        }
      }
      for (int64_t head = 0; head < kv_heads; ++head) {
        const T* in = x + (heads + kv_heads + head) * dim;
        std::memcpy(values + ((row * kv_heads + head) * capacity + slot) * dim, in,
                    dim * sizeof(T));
      }
    }
  });
}

// The rotated queries [tokens, heads, dim]; the rotated keys and the values go to
// keys/values [rows, kv_heads, capacity, dim] at (rows[t], slots[t]).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& keys, at::Tensor& values, const at::Tensor& rows,
                      const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = qkv.size(0), dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be [tokens, (heads + 2 kv_heads) * dim]");
  TORCH_CHECK(cos.size(0) == tokens && sin.sizes() == cos.sizes(), "cos/sin must be [tokens, dim]");
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() &&
                  keys.sizes() == values.sizes() && keys.size(1) == kv_heads &&
                  keys.size(3) == dim,
              "keys/values must be contiguous [rows, kv_heads, capacity, dim]");
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
    TORCH_CHECK(row[t] >= 0 && row[t] < keys.size(0) && slot[t] >= 0 && slot[t] < keys.size(2),
                "a token's cache row or slot is out of range");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  DISPATCH(qkv.scalar_type(), "rope_store", [&] {
    rope_store_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                              sin.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                              values.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                              row, slot, tokens, heads, kv_heads, dim, keys.size(2));
  });
  return q;
}

// --- attention over the cache ----------------------------------------------------------

constexpr int64_t kKeysAhead = 8;  // key rows prefetched ahead of the one scored

// One (token, key/value head) task: the `group` query heads that share that key/value head
// attend to keys [0, limit) and, when extra >= limit, the key at slot `extra` too.
template <typename T>
void attend_task(const T* q, const T* keys, const T* values, T* out, int64_t limit, int64_t extra,
                 int64_t group, int64_t dim, float scale, std::vector<float>& scores,
                 std::vector<float>& row) {
  const int64_t seen = limit + (extra >= limit ? 1 : 0);
  scores.resize(static_cast<size_t>(group * seen));
  row.resize(static_cast<size_t>((group + 2) * dim));
  float* qf = row.data();               // [group, dim]
  float* kf = row.data() + group * dim;  // [dim]
  float* acc = kf + dim;                 // [dim]
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < dim; ++i) qf[g * dim + i] = load(q + g * dim, i) * scale;
  for (int64_t j = 0; j < seen; ++j) {
    const int64_t slot = j < limit ? j : extra;
    // the cache was written a pass ago and the weights have streamed through the caches
    // since: fetch the keys a few rows ahead, and each value row as its key is scored
    // (with AVX-512, a third less time in attention at a 300-token context)
    prefetch_row(keys + (slot + kKeysAhead) * dim, dim * sizeof(T));
    prefetch_row(values + slot * dim, dim * sizeof(T));
    widen(keys + slot * dim, dim, kf);
    for (int64_t g = 0; g < group; ++g) scores[g * seen + j] = dot(qf + g * dim, kf, dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * seen;
    float top = -INFINITY;
    for (int64_t j = 0; j < seen; ++j) top = s[j] > top ? s[j] : top;
    float total[kLanes] = {0};
    int64_t j = 0;
    for (; j + kLanes <= seen; j += kLanes)
      for (int64_t l = 0; l < kLanes; ++l) {
        s[j + l] = std::exp(s[j + l] - top);
        total[l] += s[j + l];
      }
    for (int64_t l = 0; j < seen; ++j, ++l) {
      s[j] = std::exp(s[j] - top);
      total[l] += s[j];
    }
    for (int64_t w = kLanes / 2; w > 0; w /= 2)
      for (int64_t l = 0; l < w; ++l) total[l] += total[l + w];
    const float inv = 1.0f / total[0];
    for (int64_t i = 0; i < dim; ++i) acc[i] = 0.0f;
    for (int64_t jj = 0; jj < seen; ++jj) {
      const T* v = values + (jj < limit ? jj : extra) * dim;
      const float p = s[jj];
      for (int64_t i = 0; i < dim; ++i) acc[i] += p * load(v, i);
    }
    for (int64_t i = 0; i < dim; ++i) store(out + g * dim, i, acc[i] * inv);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// e^x for x <= 0 (softmax after subtracting the maximum; silu's e^-x, clamped): 2^n e^r
// with n = round(x / ln 2) and a degree-6 polynomial for e^r on [-ln2/2, ln2/2] (Cephes'
// expf coefficients), a few ulp from expf; one fixed sequence of instructions
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 first(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// float32 lanes rounded to bfloat16 as c10::BFloat16 rounds a float (to nearest even, a
// NaN to 0x7FC0): the bits in the low half of each 32-bit lane
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 16 values stored to p, each rounded once to p's dtype (as store() does)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256, in chunks of 16
constexpr int64_t kMaxGroup = 8;    // query heads per key/value head

// The sums of each of 16 vectors' lanes, in one vector (lane i: the sum of v[i]'s lanes),
// by a fixed tree of in-lane shuffles and additions: 45 instructions for 16 sums.
inline __m512 sums16(const __m512 (&v)[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128 bits: v[2i] lanes 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: v[4i..4i+3]'s sums over those 128 bits
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit blocks 0 + 1 and 2 + 3, of two quads
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// out[g] = inv[g] * sum_j p[g * stride + j] * values[j] for SUB query heads, 64 dimensions
// at a time with the SUB x 4 sums in registers (a sum kept in memory would wait on its own
// store every key)
template <typename T, int SUB>
void weigh_values(const T* values, int64_t limit, int64_t extra, int64_t seen, int64_t dim,
                  const float* p, int64_t stride, const float* inv, T* out) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(64, dim - d0) / 16);
    __m512 acc[SUB][4];
    for (int g = 0; g < SUB; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; ++j) {
      const T* v = values + (j < limit ? j : extra) * dim + d0;
      __m512 row[4];
      for (int c = 0; c < 4; ++c) row[c] = c < chunks ? load16(v + 16 * c) : _mm512_setzero_ps();
      for (int g = 0; g < SUB; ++g) {
        const __m512 weight = _mm512_set1_ps(p[g * stride + j]);
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(weight, row[c], acc[g][c]);
      }
    }
    for (int g = 0; g < SUB; ++g)
      for (int c = 0; c < chunks; ++c)
        store16(out + g * dim + d0 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
  }
}

// attend_task with AVX-512 (head_dim a multiple of 16): each key and value is read once
// for the whole group (for up to six query heads); every score and every output is one
// fixed sequence of instructions.
template <typename T>
void attend_task_avx512(const T* q, const T* keys, const T* values, T* out, int64_t limit,
                        int64_t extra, int64_t group, int64_t dim, float scale,
                        std::vector<float>& scores) {
  const int64_t chunks = dim / 16;
  const int64_t seen = limit + (extra >= limit ? 1 : 0);
  scores.resize(static_cast<size_t>(group * seen));
  __m512 qv[kMaxGroup][kMaxChunks], kv[kMaxChunks];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < chunks; ++c)
      qv[g][c] = _mm512_mul_ps(load16(q + g * dim + c * 16), _mm512_set1_ps(scale));
  // 16 keys at a time: per key and query head, the products summed per lane; then the
  // lanes of the 16 keys summed together
  __m512 part[kMaxGroup][16];
  for (int64_t j0 = 0; j0 < seen; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, seen - j0);
    for (int64_t jj = 0; jj < 16; ++jj) {
      if (jj >= n) {
        for (int64_t g = 0; g < group; ++g) part[g][jj] = _mm512_setzero_ps();
        continue;
      }
      const int64_t slot = j0 + jj < limit ? j0 + jj : extra;
      const T* k = keys + slot * dim;
      prefetch_row(k + kKeysAhead * dim, dim * sizeof(T));  // as attend_task does
      prefetch_row(values + slot * dim, dim * sizeof(T));
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        part[g][jj] = acc;
      }
    }
    for (int64_t g = 0; g < group; ++g)
      _mm512_mask_storeu_ps(scores.data() + g * seen + j0, first(n), sums16(part[g]));
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * seen;
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < seen; j += 16)
      most = _mm512_max_ps(most, _mm512_mask_loadu_ps(most, first(seen - j), s + j));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(most));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < seen; j += 16) {
      const __mmask16 m = first(seen - j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), top));
      _mm512_mask_storeu_ps(s + j, m, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(total);
  }
  // the query heads in as few even parts of at most six as there can be
  const int64_t parts = (group + 5) / 6, size = (group + parts - 1) / parts;
  for (int64_t g = 0; g < group; g += size) {
    const float* p = scores.data() + g * seen;
    T* o = out + g * dim;
    switch (std::min(size, group - g)) {
#define SPECSERVE_HEADS(N)                                                              \
  case N:                                                                               \
    weigh_values<T, N>(values, limit, extra, seen, dim, p, seen, inv + g, o); \
    break;
      SPECSERVE_HEADS(1) SPECSERVE_HEADS(2) SPECSERVE_HEADS(3)
      SPECSERVE_HEADS(4) SPECSERVE_HEADS(5) SPECSERVE_HEADS(6)
#undef SPECSERVE_HEADS
    }
  }
}
#endif

// attend's work on checked pointers: q [tokens, heads, dim], keys/values [rows, kv_heads,
// capacity, dim], out [tokens, heads * dim]
template <typename T>
void attend_rows(const T* qp, const T* kp, const T* vp, T* op, const int64_t* row,
                 const int64_t* limit, const int64_t* extra, int64_t tokens, int64_t heads,
                 int64_t kv_heads, int64_t dim, int64_t capacity, float scale) {
  const int64_t group = heads / kv_heads;
  split(0, tokens * kv_heads, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> scores, buffer;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / kv_heads, h = task % kv_heads;
      const int64_t base = (row[t] * kv_heads + h) * capacity * dim;
#if defined(__AVX512F__)
      if (dim % 16 == 0 && dim / 16 <= kMaxChunks && group <= kMaxGroup) {
        attend_task_avx512<T>(qp + (t * heads + h * group) * dim, kp + base, vp + base,
                              op + (t * heads + h * group) * dim, limit[t], extra[t], group, dim,
                              scale, scores);
        continue;
      }
#endif
      attend_task<T>(qp + (t * heads + h * group) * dim, kp + base, vp + base,
                     op + (t * heads + h * group) * dim, limit[t], extra[t], group, dim, scale,
                     scores, buffer);
    }
  });
}

// q [tokens, heads, dim] against keys/values [rows, kv_heads, capacity, dim]: token t sees
// keys [0, limits[t]) of cache row rows[t], and the key at extras[t] when that is >= its limit
// (an alternative's own key). Returns [tokens, heads * dim].
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& rows, const at::Tensor& limits, const at::Tensor& extras,
                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [tokens, heads, dim]");
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() &&
                  keys.sizes() == values.sizes() && keys.size(3) == q.size(2),
              "keys/values must be contiguous [rows, kv_heads, capacity, dim]");
  TORCH_CHECK(keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type(),
              "q, keys and values must share a dtype");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = keys.size(1), capacity = keys.size(2), kv_rows = keys.size(0);
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  for (const at::Tensor* t : {&rows, &limits, &extras})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == tokens && t->is_contiguous(),
                "rows/limits/extras must be contiguous int64 [tokens]");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* limit = limits.data_ptr<int64_t>();
  const int64_t* extra = extras.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(row[t] >= 0 && row[t] < kv_rows && limit[t] >= 1 && limit[t] <= capacity &&
                    extra[t] < capacity,
                "a token's cache row or key range is out of range");
  at::Tensor out = at::empty({tokens, heads * dim}, q.options());
  DISPATCH(q.scalar_type(), "attend", [&] {
    attend_rows<scalar_t>(q.data_ptr<scalar_t>(), keys.data_ptr<scalar_t>(),
                          values.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), row, limit, extra,
                          tokens, heads, kv_heads, dim, capacity, static_cast<float>(scale));
  });
  return out;
}

// --- the gated activation ---------------------------------------------------------------

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t tokens, int64_t n) {
  split(0, tokens, kTokenGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const T* g = gate_up + t * 2 * n;
      const T* u = g + n;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 silu = _mm512_div_ps(
            x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
        store16(out + t * n + i, _mm512_mul_ps(silu, load16(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float x = load(g, i);
        store(out + t * n, i, x / (1.0f + std::exp(-x)) * load(u, i));
      }
    }
  });
}

// silu(gate) * up of a fused [tokens, 2n] gate/up product: [tokens, n].
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

// --- products of 4- and 8-bit block matrices with int8 activations ------------------------

// A matrix of 4-bit (or 8-bit) codes with a float16 scale and minimum per block of 32 inputs,
// w = code * scale + low (a GGUF's Q4_0/Q4_1/Q4_K blocks, its Q8_0 as code + 128 with
// low = -128 scale), multiplied the way llama.cpp does on a CPU: each token's activations
// are quantized to int8 per block of 32 (scale max|x| / 127), and AVX512-VNNI (or AVX2) sums four
// code * activation products per instruction in int32. A block's sum is exact; the blocks
// add up in float32 in input order. Packed per tile of 16 output rows and block of 32
// inputs: the codes as eight 64-byte groups (group j: inputs 4j..4j+3 of the 16 rows,
// four bytes a row; 4-bit codes hold group j + 4 in the high nibbles of group j's bytes),
// then the 16 scales and the 16 minimums in float16.

constexpr int64_t kTile = 16, kBlock = 32;
// A product streams its matrix once; prefetching this many bytes ahead of the block it
// multiplies keeps more of the stream in flight than the hardware's prefetchers do (one
// core: the layers' products and the head 5-10% faster)
constexpr int64_t kPrefetchBytes = 8192;

inline int64_t block_bytes(int64_t bits) { return (bits == 4 ? 256 : 512) + 64; }

// codes [out, in] uint8 (0..15 for 4 bits), scale/low [out, in / 32] float32 -> the packing
at::Tensor block_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low,
                      int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.device().is_cpu(),
              "codes must be a contiguous uint8 [out, in] CPU tensor");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % kBlock == 0 && k > 0 && n > 0, "the input size must be a multiple of 32");
  const int64_t blocks = k / kBlock, tiles = (n + kTile - 1) / kTile;
  for (const at::Tensor* t : {&scale, &low})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == blocks &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                "scale/low must be contiguous float32 [out, in / 32]");
  const uint8_t* c = codes.data_ptr<uint8_t>();
  if (bits == 4)
    for (int64_t i = 0; i < n * k; ++i) TORCH_CHECK(c[i] < 16, "4-bit codes must be 0..15");
  const int64_t size = block_bytes(bits);
  at::Tensor out = at::zeros({tiles * blocks * size}, codes.options());
  const float* s = scale.data_ptr<float>();
  const float* m = low.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* dst = o + (t * blocks + b) * size;
      for (int64_t r = 0; r < kTile && t * kTile + r < n; ++r) {
        const int64_t row = t * kTile + r;
        const uint8_t* q = c + row * k + b * kBlock;
        for (int64_t j = 0; j < (bits == 4 ? 4 : 8); ++j)
          for (int64_t i = 0; i < 4; ++i)
            dst[j * 64 + 4 * r + i] =
                bits == 4 ? static_cast<uint8_t>(q[4 * j + i] | (q[4 * (j + 4) + i] << 4))
                          : q[4 * j + i];
        const c10::Half d(s[row * blocks + b]), low_(m[row * blocks + b]);
        std::memcpy(dst + size - 64 + 2 * r, &d, 2);
        std::memcpy(dst + size - 32 + 2 * r, &low_, 2);
      }
    }
  return out;
}

// Rows ``ids`` [n] (int64) of a block_pack-ed [out, in] matrix, dequantized: code * scale + low
// in float32, then cast to ``dtype`` (an input embedding read from a tied head's blocks)
at::Tensor block_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t out_features,
                      int64_t in_features, int64_t bits, at::ScalarType dtype) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(in_features % kBlock == 0 && in_features > 0, "the input size must be a multiple of 32");
  const int64_t blocks = in_features / kBlock, size = block_bytes(bits);
  const int64_t tiles = (out_features + kTile - 1) / kTile;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == tiles * blocks * size,
              "packed is not a block_pack-ed matrix of this shape");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be int64 [n]");
  const at::Tensor index = ids.contiguous();
  const int64_t n = index.size(0);
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < out_features, "row ", id[i], " is out of range");
  at::Tensor out = at::empty({n, in_features}, packed.options().dtype(at::kFloat));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t tile = id[i] / kTile, r = id[i] % kTile;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* src = p + (tile * blocks + b) * size;
      c10::Half d, low;
      std::memcpy(&d, src + size - 64 + 2 * r, 2);
      std::memcpy(&low, src + size - 32 + 2 * r, 2);
      const float scale = static_cast<float>(d), minimum = static_cast<float>(low);
      float* dst = o + i * in_features + b * kBlock;
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t k = 0; k < 4; ++k) {
          const uint8_t byte = src[(bits == 4 ? j % 4 : j) * 64 + 4 * r + k];
          const int code = bits == 4 ? (j < 4 ? byte & 15 : byte >> 4) : byte;
          // the product is exact (8 by 11 bits), so this rounds once, fused or not
          dst[4 * j + k] = static_cast<float>(code) * scale + minimum;
        }
    }
  }
  return dtype == at::kFloat ? out : out.to(dtype);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kBlockProducts = true;

// A row's activations per block of 32: int8 codes round(x / d) with d = max|x| / 127, d,
// and d * sum(codes) (what a block's minimums multiply)
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 lo = load16(x + b * kBlock), hi = load16(x + b * kBlock + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    scale[b] = d;
    sum[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
  }
}

// R rows (tokens) against one tile of 16 output rows: [R, 16] float32 into out (rows ldo apart)
template <int R, int BITS>
inline void block_tile(const uint8_t* w, int64_t blocks, const int8_t* codes, const float* scale,
                       const float* sum, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t size = (BITS == 4 ? 256 : 512) + 64;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, w += size) {
    prefetch_row(w + kPrefetchBytes, size);
    __m512i group[8];
    if (BITS == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(w + 64 * j);
        group[j] = _mm512_and_si512(bytes, nibble);
        group[j + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      }
    } else {
      for (int j = 0; j < 8; ++j) group[j] = _mm512_loadu_si512(w + 64 * j);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 64)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 32)));
    for (int r = 0; r < R; ++r) {
      const int8_t* a = codes + r * k + b * kBlock;
      // few rows leave the core waiting on one chain of sums: C chains, added at the end
      // (integer sums: the same result in any order)
      constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
      __m512i dots[C];
      for (int c = 0; c < C; ++c) dots[c] = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, a + 4 * j, 4);
        dots[j % C] = _mm512_dpbusd_epi32(dots[j % C], group[j], _mm512_set1_epi32(four));
      }
      __m512i dot = dots[0];
      for (int c = 1; c < C; ++c) dot = _mm512_add_epi32(dot, dots[c]);
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(scale[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, acc[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(sum[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

#define SPECSERVE_BLOCK_PRODUCTS 1
constexpr int kBlockRows = 6;  // the most tokens a pass over the matrix serves
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The same products with AVX2 (the container image's x86-64-v3 build): vpmaddubsw and
// vpmaddwd sum the same four code x activation products per int32 lane as vpdpbusd
// (8-bit codes as two nibbles, so no 16-bit sum saturates), the float steps are the same
// per lane: bitwise the AVX512-VNNI build's results, half a tile (8 rows) at a time.
constexpr bool kBlockProducts = true;

template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const T* v = x + b * kBlock;
    float top = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(load(v, i)));
    const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
    int total = 0;
    for (int64_t i = 0; i < kBlock; ++i) {
      // round half to even, as the AVX-512 conversion does; saturated to int8 as it is
      const float q = std::nearbyint(load(v, i) * inv);
      const int c = q >= 127.0f ? 127 : q <= -128.0f ? -128 : static_cast<int>(q);
      codes[b * kBlock + i] = static_cast<int8_t>(c);
      total += c;
    }
    scale[b] = d;
    sum[b] = d * static_cast<float>(total);
  }
}

// four code x activation products per int32 lane, summed into dot
inline __m256i dot4(__m256i dot, __m256i codes, __m256i four, __m256i ones) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, four), ones));
}

template <int R, int BITS>
inline void block_tile(const uint8_t* w0, int64_t blocks, const int8_t* codes, const float* scale,
                       const float* sum, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t size = (BITS == 4 ? 256 : 512) + 64;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {  // rows 0-7, then 8-15 of the tile
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    for (int64_t b = 0; b < blocks; ++b, w += size) {
      if (half == 0) prefetch_row(w + kPrefetchBytes, size);
      __m256i group[8];
      if (BITS == 4)
        for (int j = 0; j < 4; ++j) {
          const __m256i bytes =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * half));
          group[j] = _mm256_and_si256(bytes, nibble);
          group[j + 4] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        }
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + size - 64 + 16 * half)));
      const __m256 low = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + size - 32 + 16 * half)));
      for (int r = 0; r < R; ++r) {
        const int8_t* a = codes + r * k + b * kBlock;
        __m256i dot = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
          int32_t four;
          std::memcpy(&four, a + 4 * j, 4);
          const __m256i spread = _mm256_set1_epi32(four);
          if (BITS == 4) {
            dot = dot4(dot, group[j], spread, ones);
          } else {  // 16 x (high nibbles' sum) + the low nibbles' sum: the bytes' sum
            const __m256i bytes =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * half));
            const __m256i high = dot4(_mm256_setzero_si256(),
                                      _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble),
                                      spread, ones);
            dot = dot4(_mm256_add_epi32(dot, _mm256_slli_epi32(high, 4)),
                       _mm256_and_si256(bytes, nibble), spread, ones);
          }
        }
        const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(scale[r * blocks + b]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ds, acc[r]);
        acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(sum[r * blocks + b]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * half, acc[r]);
  }
}

#define SPECSERVE_BLOCK_PRODUCTS 1
constexpr int kBlockRows = 4;  // the most tokens a pass over the matrix serves (16 registers)
#else
constexpr bool kBlockProducts = false;
constexpr int kBlockRows = 1;
#endif

#if defined(SPECSERVE_BLOCK_PRODUCTS)
// block_tile for a run-time number of rows (at most kBlockRows)
template <int BITS>
void block_tile_rows(int rows, const uint8_t* w, int64_t blocks, const int8_t* codes,
                     const float* scale, const float* sum, int64_t k, float* out, int64_t ldo) {
  static_assert(kBlockRows <= 6, "a case per row count");
  switch (rows) {
#define SPECSERVE_ROWS(R)      \
  case R:                     \
    if constexpr (R <= kBlockRows) \
      return block_tile<R, BITS>(w, blocks, codes, scale, sum, k, out, ldo);
    SPECSERVE_ROWS(1) SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4)
    SPECSERVE_ROWS(5) SPECSERVE_ROWS(6)
#undef SPECSERVE_ROWS
  }
  TORCH_CHECK(false, "block_tile_rows: ", rows, " rows");
}
#endif

constexpr int64_t kGroupTiles = 16;  // tiles whose results are stored together

#if defined(SPECSERVE_BLOCK_PRODUCTS)
// block_product's work on checked pointers: x [tokens, k] times a [n, k] block matrix
// (+ bias, float32, or null) into y [tokens, n]
template <typename T>
void block_product_rows(const T* xp, int64_t tokens, int64_t k, const uint8_t* wp, int64_t n,
                        int64_t bits, const float* bp, T* yp) {
  const int64_t blocks = k / kBlock, tiles = (n + kTile - 1) / kTile;
  // the activations' codes and block scales: scratch this thread keeps between calls (two
  // tensors a call cost more than a one-token product of a small matrix takes to read)
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> stats;
  codes.resize(static_cast<size_t>(tokens * k));
  stats.resize(static_cast<size_t>(2 * tokens * blocks));
  int8_t* cp = codes.data();
  float* scale = stats.data();
  float* sum = scale + tokens * blocks;
  const int64_t size = block_bytes(bits);
  auto quantize = [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      quantize_row(xp + t * k, k, cp + t * k, scale + t * blocks, sum + t * blocks);
  };
  if (team.size > 0)
    quantize(0, tokens);  // every member its own copy (a pass of a few tokens: < 1 us each)
  else
    at::parallel_for(0, tokens, kTokenGrain, quantize);
  // tiles in groups whose results are written out a token's row at a time (rows of
  // a wide output lie a multiple of 4 KiB apart: tile by tile, the stores alias); at
  // most kBlockRows tokens a pass over the matrix, the passes evenly filled (7 or 8
  // tokens in one pass measured 2-3x two passes of 4 for the 49152-row head). Groups of
  // at most kGroupTiles tiles, as many as fill the threads evenly (a layer's 36-tile
  // matrix in groups of 16, 16 and 4 left one of two threads idle most of it)
  const int64_t threads = split_threads();
  int64_t groups = (tiles + kGroupTiles - 1) / kGroupTiles;
  if (groups < 8 * threads) groups = std::min(tiles, (groups + threads - 1) / threads * threads);
  const int64_t group_tiles = (tiles + groups - 1) / groups;
  groups = (tiles + group_tiles - 1) / group_tiles;
  const int64_t passes = (tokens + kBlockRows - 1) / kBlockRows;
  const int64_t per_pass = passes > 0 ? (tokens + passes - 1) / passes : 1;
  // one parallel region for all passes; each group's tiles (at most ~250 KB) stay in the
  // core's cache from one pass to the next
  split(0, groups, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float buffer[kBlockRows * kGroupTiles * kTile];
    constexpr int64_t ldo = kGroupTiles * kTile;
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t first = g * group_tiles, last = std::min(tiles, first + group_tiles);
      const int64_t col = first * kTile, width = std::min(n, last * kTile) - col;
      for (int64_t r = 0; r < tokens; r += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, tokens - r));
        for (int64_t t = first; t < last; ++t) {
          const uint8_t* w = wp + t * blocks * size;
          float* out = buffer + (t - first) * kTile;
          if (bits == 4)
            block_tile_rows<4>(rows, w, blocks, cp + r * k, scale + r * blocks,
                               sum + r * blocks, k, out, ldo);
          else
            block_tile_rows<8>(rows, w, blocks, cp + r * k, scale + r * blocks,
                               sum + r * blocks, k, out, ldo);
        }
        for (int i = 0; i < rows; ++i)
          for (int64_t c = 0; c < width; ++c)
            store(yp + (r + i) * n + col, c,
                  bp != nullptr ? buffer[i * ldo + c] + bp[col + c] : buffer[i * ldo + c]);
      }
    }
  });
}
#endif

// A product's bias [out] in float32 (undefined: none)
at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [out]");
  return bias->to(at::kFloat).contiguous();
}

// x [tokens, in] (float32 or bfloat16) times a block_pack-ed [out, in] matrix (+ bias): [tokens, out]
at::Tensor block_product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         int64_t bits, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kBlockProducts, "these kernels were built without block products (AVX512-VNNI or AVX2)");
  check_rows(x, "x");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(k % kBlock == 0 && n > 0, "the input size must be a multiple of 32");
  const int64_t blocks = k / kBlock, tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == tiles * blocks * block_bytes(bits),
              "packed does not hold a [", n, ", ", k, "] ", bits, "-bit block matrix");
  const at::Tensor b32 = float_bias(bias, n);
  at::Tensor y = at::empty({tokens, n}, x.options());
#if defined(SPECSERVE_BLOCK_PRODUCTS)
  DISPATCH(x.scalar_type(), "block_product", [&] {
    block_product_rows<scalar_t>(x.data_ptr<scalar_t>(), tokens, k, packed.data_ptr<uint8_t>(), n,
                                 bits, b32.defined() ? b32.data_ptr<float>() : nullptr,
                                 y.data_ptr<scalar_t>());
  });
#endif
  return y;
}

bool has_block_products() { return kBlockProducts; }

// --- products of float32 and bfloat16 matrices --------------------------------------------

// A float32 or bfloat16 [out, in] matrix packed in groups of 64 output rows, each group
// input by input (runtime/dense.py packs it; rows past `out` are zeros): float32 as
// [groups, in, 64]; bfloat16 as [groups, in / 2, 64, 2], each row's inputs in pairs.
// Output row c of a token is one chain of fused multiply-adds over the inputs in order,
// starting from zero, then the bias; bfloat16 takes each pair's odd input first, as
// AVX512-BF16's vdpbf16ps does (checked on this hardware: bitwise two fused multiply-adds,
// odd then even, for inputs that are not subnormal). A fixed sequence that depends on
// nothing but the token, the same in every build below. One pass over the matrix serves
// up to kDenseTokens tokens (each weight loaded once for all of them), and the 64 rows'
// chains run side by side, so one token alone keeps the multiply-add units busy while
// the matrix streams through.

constexpr int64_t kDenseRows = 64;

#if defined(__AVX512F__)
constexpr int kDenseTokens = 6;  // 24 accumulators, 4 weights and a broadcast: 29 registers

// R tokens (xs [R, k], ldx apart) against one group: [R, 64] float32 into out
template <int R>
inline void dense_group(const float* w, int64_t k, const float* xs, int64_t ldx, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i, w += kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 4, kDenseRows * 4);
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(xs[r * ldx + i]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], x, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kDenseRows + 16 * j, acc[r][j]);
}

template <int R>
inline void dense_group(const c10::BFloat16* w, int64_t k, const c10::BFloat16* xs, int64_t ldx,
                        float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 2, w += 2 * kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 2, kDenseRows * 4);
    __m512i wv[4];  // lane c: row c's inputs i (low half) and i + 1 (high half)
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_si512(w + 32 * j);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, xs + r * ldx + i, 4);
      const __m512i x = _mm512_set1_epi32(pair);
#if defined(__AVX512BF16__)
      for (int j = 0; j < 4; ++j)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], (__m512bh)x);
#else
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(wv[j], high)), odd,
                                    acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wv[j], 16)), even,
                                    acc[r][j]);
      }
#endif
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kDenseRows + 16 * j, acc[r][j]);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kDenseTokens = 1;  // 8 accumulators of 8 rows

template <int R>
inline void dense_group(const float* w, int64_t k, const float* xs, int64_t, float* out) {
  static_assert(R == 1, "one token a pass");
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i, w += kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 4, kDenseRows * 4);
    const __m256 x = _mm256_set1_ps(xs[i]);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * j), x, acc[j]);
  }
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

template <int R>
inline void dense_group(const c10::BFloat16* w, int64_t k, const c10::BFloat16* xs, int64_t,
                        float* out) {
  static_assert(R == 1, "one token a pass");
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t i = 0; i < k; i += 2, w += 2 * kDenseRows) {
    prefetch_row(w + kPrefetchBytes / 2, kDenseRows * 4);
    int32_t pair;
    std::memcpy(&pair, xs + i, 4);
    const __m256i x = _mm256_set1_epi32(pair);
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(x, high));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    for (int j = 0; j < 8; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
      acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(wv, high)), odd, acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), even, acc[j]);
    }
  }
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + 8 * j, acc[j]);
}
#else
constexpr int kDenseTokens = 1;

template <int R>
inline void dense_group(const float* w, int64_t k, const float* xs, int64_t, float* out) {
  static_assert(R == 1, "one token a pass");
  float acc[kDenseRows] = {0};
  for (int64_t i = 0; i < k; ++i, w += kDenseRows)
    for (int64_t c = 0; c < kDenseRows; ++c) acc[c] = std::fma(w[c], xs[i], acc[c]);
  std::memcpy(out, acc, sizeof acc);
}

template <int R>
inline void dense_group(const c10::BFloat16* w, int64_t k, const c10::BFloat16* xs, int64_t,
                        float* out) {
  static_assert(R == 1, "one token a pass");
  float acc[kDenseRows] = {0};
  for (int64_t i = 0; i < k; i += 2, w += 2 * kDenseRows) {
    const float odd = load(xs, i + 1), even = load(xs, i);
    for (int64_t c = 0; c < kDenseRows; ++c)
      acc[c] = std::fma(load(w, 2 * c), even, std::fma(load(w, 2 * c + 1), odd, acc[c]));
  }
  std::memcpy(out, acc, sizeof acc);
}
#endif

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
          for (int64_t c = 0; c < width; ++c)
            store(yp + (r + i) * n + col, c,
                  bp != nullptr ? buffer[i * kDenseRows + c] + bp[col + c]
                                : buffer[i * kDenseRows + c]);
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

// --- a whole decoder stack in one call -----------------------------------------------------

// the most tokens a stack pass runs as one team (more: each kernel call splits on its own)
constexpr int64_t kTeamTokens = 64;

// What a stack's matrix is: PyTorch's packed int4 (every matrix of the stack, then), a
// 4- or 8-bit block matrix (block_product), or a bfloat16 or float32 one packed for
// dense_product
constexpr int64_t kTorchInt4 = 0, kDenseBf16 = 16, kDenseF32 = 32;

// The layers of a Llama-family model whose matrices are all PyTorch's packed int4 (in
// bfloat16), or all native ones (4- and 8-bit block matrices, dense ones in the model's
// dtype, mixed as a GGUF file mixes its tensor types): the same calls runtime/fused.py makes per layer, in
// the same order, without a Python round trip per op. Its output is bitwise the Python
// loop's.
class LayerStack {
 public:
  LayerStack(std::vector<at::Tensor> packed, std::vector<at::Tensor> scales_zeros,
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
      TORCH_CHECK(native_ ? (kind == 4 || kind == 8 || kind == dense) : kind == kTorchInt4,
                  "matrix ", i, ": kind ", kind, " (all PyTorch's int4, or 4, 8 and ", dense,
                  " for a model in ", dtype_, ")");
      if (!native_) continue;
      // each matrix's input: the hidden state, attention's output, the hidden state, the
      // gated activation
      const int64_t in = i % 4 == 1 ? heads_ * dim : i % 4 == 3 ? out_[i - 1] / 2 : hidden;
      TORCH_CHECK(out_[i] == (i % 4 == 0 ? (heads_ + 2 * kv_heads_) * dim
                              : i % 4 == 2 ? out_[2] : hidden) && packed_[i].is_contiguous(),
                  "matrix ", i, " is not of its layer's shape");
      if (kind == dense) {
        const int64_t groups = (out_[i] + kDenseRows - 1) / kDenseRows;
        TORCH_CHECK((dtype_ == at::kFloat || in % 2 == 0) && packed_[i].scalar_type() == dtype_ &&
                        packed_[i].numel() == groups * in * kDenseRows,
                    "matrix ", i, " is not a dense ", dtype_, " matrix of its layer's shape");
      } else {
        TORCH_CHECK(kBlockProducts,
                    "these kernels were built without block products (AVX512-VNNI or AVX2)");
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

  // hidden [T, H] (the model's dtype) -> the final norm of the last layer's output, [T, H]
  at::Tensor forward(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                     std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& limits,
                     const at::Tensor& extras) const {
    const size_t layers = packed_.size() / 4;
    TORCH_CHECK(keys.size() == layers && values.size() == layers, "one cache per layer");
    TORCH_CHECK(embedded.scalar_type() == dtype_, "these layers take ", dtype_);
    if (native_ && dtype_ == at::kFloat)
      return forward_native<float>(embedded, cos, sin, keys, values, rows, slots, limits, extras);
    if (native_)
      return forward_native<c10::BFloat16>(embedded, cos, sin, keys, values, rows, slots, limits,
                                           extras);
    std::vector<at::Tensor> state = add_rms_norm(embedded.contiguous(), c10::nullopt, norms_[0], eps_[0]);
    at::Tensor hidden = state[0], x = state[1];
    for (size_t l = 0; l < layers; ++l) {
      at::Tensor q = rope_store(product(x, 4 * l), cos, sin, keys[l], values[l], rows, slots,
                                heads_, kv_heads_);
      at::Tensor out = attend(q, keys[l], values[l], rows, limits, extras, scale_);
      state = add_rms_norm(hidden, product(out, 4 * l + 1), norms_[2 * l + 1], eps_[2 * l + 1]);
      hidden = state[0];
      at::Tensor gated = silu_mul(product(state[1], 4 * l + 2));
      state = add_rms_norm(hidden, product(gated, 4 * l + 3), norms_[2 * l + 2], eps_[2 * l + 2]);
      hidden = state[0];
      x = state[1];
    }
    return x;
  }

 private:
  // forward with native matrices: the same kernels in the same order on one buffer that
  // holds every intermediate, reused layer by layer, with the checks made once (a tensor
  // per kernel call cost ~0.5 us, ten a layer); T: the model's dtype
  template <typename T>
  at::Tensor forward_native(const at::Tensor& embedded, const at::Tensor& cos,
                            const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, const at::Tensor& rows,
                            const at::Tensor& slots, const at::Tensor& limits,
                            const at::Tensor& extras) const {
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
    TORCH_CHECK(first.dim() == 4 && first.size(1) == kv_heads_ && first.size(3) == dim,
                "keys/values must be [rows, kv_heads, capacity, dim]");
    for (size_t l = 0; l < keys.size(); ++l)
      for (const at::Tensor* t : {&keys[l], &values[l]})
        TORCH_CHECK(t->sizes() == first.sizes() && t->is_contiguous() &&
                        t->scalar_type() == dtype_,
                    "every layer's keys/values must be contiguous, of one shape, in the "
                    "model's dtype");
    const int64_t kv_rows = first.size(0), capacity = first.size(2);
    for (const at::Tensor* t : {&rows, &slots, &limits, &extras})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == tokens && t->is_contiguous(),
                  "rows/slots/limits/extras must be contiguous int64 [tokens]");
    const int64_t* row = rows.data_ptr<int64_t>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* limit = limits.data_ptr<int64_t>();
    const int64_t* extra = extras.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(row[t] >= 0 && row[t] < kv_rows && slot[t] >= 0 && slot[t] < capacity &&
                      limit[t] >= 1 && limit[t] <= capacity && extra[t] < capacity,
                  "a token's cache row, slot or key range is out of range");
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
#if defined(SPECSERVE_BLOCK_PRODUCTS)
      block_product_rows<T>(in, tokens, k, packed_[i].data_ptr<uint8_t>(), out_[i], kinds_[i],
                            bias, y);
#endif
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
        rope_store_rows<T>(qkv, cp, sp, kp, vp, q, row, slot, tokens, heads_, kv_heads_, dim,
                           capacity);
        sync();
        attend_rows<T>(q, kp, vp, out, row, limit, extra, tokens, heads_, kv_heads_, dim,
                       capacity, static_cast<float>(scale_));
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
      SpinBarrier barrier;
#pragma omp parallel
      {
        team = Team{omp_get_thread_num(), omp_get_num_threads()};
        int64_t passed = 0;
        layers([&] { barrier.wait(passed); });
        team = Team{};
      }
    }
#endif
    if (!as_team) layers([] {});
    return buffer.narrow(0, tokens * hidden, tokens * hidden).view({tokens, hidden});
  }

  // PyTorch's int4 matrices (native ones run in forward_native), as
  // runtime/quantized.py Int4Matrix.__call__ and runtime/fused.py product do
  at::Tensor product(const at::Tensor& x, size_t i) const {
    at::Tensor y = at::_weight_int4pack_mm_for_cpu(x, packed_[i], group_, scales_zeros_[i]);
    if (y.size(1) != out_[i]) y = y.narrow(1, 0, out_[i]);
    if (biases_[i].has_value() && biases_[i]->defined()) y = y + *biases_[i];
    return y.contiguous();
  }

  std::vector<at::Tensor> packed_, scales_zeros_;
  std::vector<int64_t> out_;
  std::vector<c10::optional<at::Tensor>> biases_;
  std::vector<at::Tensor> bias32_;  // block matrices' biases in float32 (undefined: none)
  std::vector<at::Tensor> norms_;
  std::vector<double> eps_;
  int64_t group_, heads_, kv_heads_;
  double scale_;
  std::vector<int64_t> kinds_;  // each matrix's kind (kTorchInt4, 4, 8, kDenseBf16)
  bool native_ = false;          // native matrices (forward_native), else PyTorch's int4
  at::ScalarType dtype_;         // the activations', norms' and cache's dtype
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;  // the HTTP loop runs meanwhile
  m.def("add_rms_norm", &add_rms_norm, "(hidden + delta, RMS norm of it times weight)",
        release());
  m.def("rope_store", &rope_store, "rotary embedding; keys and values into the cache",
        release());
  m.def("attend", &attend, "attention of each token over the keys it may see", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("block_pack", &block_pack, "a 4- or 8-bit block matrix packed for block_product");
  m.def("block_rows", &block_rows, "rows of a block matrix, dequantized");
  m.def("block_product", &block_product, "x times a block matrix, with int8 activations",
        release());
  m.def("dense_product", &dense_product,
        "x times a float32 or bfloat16 matrix packed in groups of 64 rows", release());
  m.def("has_block_products", &has_block_products,
        "whether block_product runs (built for AVX512-VNNI or AVX2)");
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<double>, int64_t, int64_t, int64_t, double,
                    std::vector<int64_t>>())
      .def("forward", &LayerStack::forward, release());
}
