// The first of the largest scores of each row: what torch's argmax gives over a row of
// float32 or bfloat16 scores (a NaN counts as the largest, so a row holding one gives its
// first), without widening the row into a copy first. Two passes over a row that stays in
// cache: its largest value, then the first place it holds it.

#include "common.h"
#include "kernels.h"

#include <limits>

namespace specserve {

namespace {

inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

#if defined(__AVX512F__)
inline __m512 wide(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 wide(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#elif defined(__AVX2__)
inline __m256 wide(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 wide(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

template <typename T>
int64_t first_largest(const T* p, int64_t n) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
  bool unordered = false;
#if defined(__AVX512F__)
  __m512 most = _mm512_set1_ps(top);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = wide(p + i);
    most = _mm512_max_ps(x, most);  // a NaN lane keeps the maximum so far
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  top = _mm512_reduce_max_ps(most);
  unordered = nan != 0;
#elif defined(__AVX2__)
  __m256 most = _mm256_set1_ps(top), nan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = wide(p + i);
    most = _mm256_max_ps(x, most);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, most);
  for (float x : lanes) top = x > top ? x : top;
  unordered = _mm256_movemask_ps(nan) != 0;
#endif
  for (; i < n; ++i) {
    const float x = value(p, i);
    unordered = unordered || std::isnan(x);
    top = x > top ? x : top;
  }
  if (unordered) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(value(p, j))) return j;
  }
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 want = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(wide(p + j), want, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(__AVX2__)
  const __m256 want = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(wide(p + j), want, _CMP_EQ_OQ));
    if (hit != 0) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < n; ++j)
    if (value(p, j) == top) return j;
  return 0;  // (a row of -inf's largest is at 0: found above)
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0 && scores.device().is_cpu() &&
                  (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kBFloat16),
              "scores must be a float32 or bfloat16 [rows, n > 0] CPU tensor");
  const at::Tensor s = scores.contiguous();
  const int64_t rows = s.size(0), n = s.size(1);
  at::Tensor out = at::empty({rows}, s.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    o[r] = s.scalar_type() == at::kFloat
               ? first_largest(s.data_ptr<float>() + r * n, n)
               : first_largest(s.data_ptr<c10::BFloat16>() + r * n, n);
  return out;
}

}  // namespace specserve
