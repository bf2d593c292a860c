// Sixteen float32 lanes, the one vector type every kernel is written in, and its
// operations, for the instruction set this build was compiled for (its CPU_CAPABILITY):
// one AVX-512 register, two AVX2 registers, or sixteen floats in a loop.
//
// Each operation is the same IEEE operation on every lane at every level (a fused
// multiply-add is fused everywhere, a sum of lanes follows one fixed tree, e^x is one
// polynomial), so a kernel written once in these computes bitwise the same results in
// every build; only the speed differs.

#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace specserve {

#if defined(__AVX512F__)
#define SPECSERVE_VEC_AVX512 1
struct F16 {
  __m512 v;
};
#elif defined(__AVX2__) && defined(__FMA__)
#define SPECSERVE_VEC_AVX2 1
struct F16 {
  __m256 lo, hi;
};
#else
struct F16 {
  float x[16];
};
#endif

// one lane's scalar steps, as the vector instructions define them
inline float lane_max(float a, float b) { return a > b ? a : b; }  // vmaxps: b unless a > b
inline float lane_min(float a, float b) { return a < b ? a : b; }
inline float bf16_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

#if defined(SPECSERVE_VEC_AVX512)
inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
}
inline __mmask16 first_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
inline F16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first_mask(n), p)}; }
inline F16 keep_first(F16 a, int64_t n) { return {_mm512_maskz_mov_ps(first_mask(n), a.v)}; }
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
// rounded to bfloat16 as c10::BFloat16 rounds a float: to nearest even, a NaN to 0x7FC0
inline void store(c10::BFloat16* p, F16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store_first(float* p, int64_t n, F16 a) { _mm512_mask_storeu_ps(p, first_mask(n), a.v); }
inline F16 add(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 sub(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 mul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 div(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 fma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 fnma(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 round_even(F16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// 2^n for whole n in [-126, 127]
inline F16 pow2(F16 n) {
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
// a bfloat16 pair per lane (16 pairs from p): the odd inputs' and the even inputs' values
inline void load_pairs(const c10::BFloat16* p, F16& odd, F16& even) {
  const __m512i bits = _mm512_loadu_si512(p);
  odd = {_mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))};
}
#elif defined(SPECSERVE_VEC_AVX2)
inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline F16 load(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline __m256i first_mask8(int64_t n) {  // lanes below n all ones
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n < 0 ? 0 : n > 16 ? 16 : n)), index);
}
inline F16 load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, first_mask8(n)), _mm256_maskload_ps(p + 8, first_mask8(n - 8))};
}
inline F16 keep_first(F16 a, int64_t n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(first_mask8(n))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(first_mask8(n - 8)))};
}
inline void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline __m128i bf16_bits8(__m256 v) {  // as the AVX-512 store rounds
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // the low 16 bits of each lane, in order (every lane is below 0x10000: no saturation)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store(c10::BFloat16* p, F16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(a.lo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), bf16_bits8(a.hi));
}
inline void store_first(float* p, int64_t n, F16 a) {
  _mm256_maskstore_ps(p, first_mask8(n), a.lo);
  _mm256_maskstore_ps(p + 8, first_mask8(n - 8), a.hi);
}
#define SPECSERVE_BINARY(NAME, OP) \
  inline F16 NAME(F16 a, F16 b) { return {OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
SPECSERVE_BINARY(add, _mm256_add_ps)
SPECSERVE_BINARY(sub, _mm256_sub_ps)
SPECSERVE_BINARY(mul, _mm256_mul_ps)
SPECSERVE_BINARY(div, _mm256_div_ps)
SPECSERVE_BINARY(max, _mm256_max_ps)
SPECSERVE_BINARY(min, _mm256_min_ps)
#undef SPECSERVE_BINARY
inline F16 fma(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fnma(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 round_even(F16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2_8(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline F16 pow2(F16 n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
inline void load_pairs(const c10::BFloat16* p, F16& odd, F16& even) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  odd = {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))};
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
#else
#define SPECSERVE_LANES(EXPR) \
  F16 r;                      \
  for (int i = 0; i < 16; ++i) r.x[i] = EXPR; \
  return r;
inline F16 zero() { SPECSERVE_LANES(0.0f) }
inline F16 splat(float x) { SPECSERVE_LANES(x) }
inline F16 load(const float* p) { SPECSERVE_LANES(p[i]) }
inline F16 load(const c10::BFloat16* p) {
  SPECSERVE_LANES(bf16_float(reinterpret_cast<const uint16_t*>(p)[i]))
}
inline F16 load_first(const float* p, int64_t n) { SPECSERVE_LANES(i < n ? p[i] : 0.0f) }
inline F16 keep_first(F16 a, int64_t n) { SPECSERVE_LANES(i < n ? a.x[i] : 0.0f) }
inline void store(float* p, F16 a) { std::memcpy(p, a.x, sizeof a.x); }
inline void store(c10::BFloat16* p, F16 a) {
  for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(a.x[i]);
}
inline void store_first(float* p, int64_t n, F16 a) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = a.x[i];
}
inline F16 add(F16 a, F16 b) { SPECSERVE_LANES(a.x[i] + b.x[i]) }
inline F16 sub(F16 a, F16 b) { SPECSERVE_LANES(a.x[i] - b.x[i]) }
inline F16 mul(F16 a, F16 b) { SPECSERVE_LANES(a.x[i] * b.x[i]) }
inline F16 div(F16 a, F16 b) { SPECSERVE_LANES(a.x[i] / b.x[i]) }
inline F16 fma(F16 a, F16 b, F16 c) { SPECSERVE_LANES(std::fma(a.x[i], b.x[i], c.x[i])) }
inline F16 fnma(F16 a, F16 b, F16 c) { SPECSERVE_LANES(std::fma(-a.x[i], b.x[i], c.x[i])) }
inline F16 max(F16 a, F16 b) { SPECSERVE_LANES(lane_max(a.x[i], b.x[i])) }
inline F16 min(F16 a, F16 b) { SPECSERVE_LANES(lane_min(a.x[i], b.x[i])) }
inline F16 round_even(F16 a) { SPECSERVE_LANES(std::nearbyint(a.x[i])) }
inline F16 pow2(F16 n) {
  F16 r;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n.x[i]) + 127) << 23;
    std::memcpy(&r.x[i], &bits, sizeof bits);
  }
  return r;
}
inline void load_pairs(const c10::BFloat16* p, F16& odd, F16& even) {
  const auto* bits = reinterpret_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i) {
    even.x[i] = bf16_float(bits[2 * i]);
    odd.x[i] = bf16_float(bits[2 * i + 1]);
  }
}
#undef SPECSERVE_LANES
#endif

// Lanes that hold whole numbers in [-128, 127] stored as 16 int8s; returns their sum
// (integers: exact in any order)
inline int32_t store_int8(int8_t* p, F16 a) {
#if defined(SPECSERVE_VEC_AVX512)
  const __m512i i = _mm512_cvtps_epi32(a.v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
#elif defined(SPECSERVE_VEC_AVX2)
  const __m256i lo = _mm256_cvtps_epi32(a.lo), hi = _mm256_cvtps_epi32(a.hi);
  // int16s in lane order lo 0-3, hi 0-3, lo 4-7, hi 4-7; then in order; then bytes
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
  int32_t lanes[8];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi32(lo, hi));
  int32_t total = 0;
  for (int i = 0; i < 8; ++i) total += lanes[i];
  return total;
#else
  int32_t total = 0;
  for (int i = 0; i < 16; ++i) {
    const int c = static_cast<int>(a.x[i]);
    p[i] = static_cast<int8_t>(c);
    total += c;
  }
  return total;
#endif
}

// e^x, for the x a softmax (after its maximum) and silu take: 2^n e^r with
// n = round(x / ln 2) and a degree-6 polynomial for e^r on [-ln2/2, ln2/2] (Cephes'
// expf coefficients), a few ulp from expf; x clamped to [-87, 88]
inline F16 exp(F16 x) {
  x = min(max(x, splat(-87.0f)), splat(88.0f));
  const F16 n = round_even(mul(x, splat(1.44269504088896341f)));
  F16 r = fnma(n, splat(0.693359375f), x);
  r = fnma(n, splat(-2.12194440e-4f), r);
  F16 p = splat(1.9875691500e-4f);
  p = fma(p, r, splat(1.3981999507e-3f));
  p = fma(p, r, splat(8.3334519073e-3f));
  p = fma(p, r, splat(4.1665795894e-2f));
  p = fma(p, r, splat(1.6666665459e-1f));
  p = fma(p, r, splat(5.0000001201e-1f));
  p = fma(p, mul(r, r), add(r, splat(1.0f)));
  return mul(p, pow2(n));
}

// The sum of a vector's lanes by one fixed tree: per four lanes (l0 + l2) + (l1 + l3),
// then (quarters 0 + 1) + (quarters 2 + 3)
inline float sum_lanes(F16 a) {
  float x[16];
  store(x, a);
  float q[4];
  for (int k = 0; k < 4; ++k) q[k] = (x[4 * k] + x[4 * k + 2]) + (x[4 * k + 1] + x[4 * k + 3]);
  return (q[0] + q[1]) + (q[2] + q[3]);
}

// The lanes summed by halves: lane i + lane i+8, then i + i+4, then i + i+2, then the
// two left (the order of GCC's _mm512_reduce_add_ps, which the softmax's total has kept)
inline float sum_halves(F16 a) {
  float x[16];
  store(x, a);
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = x[i + 8] + x[i];
  for (int i = 0; i < 4; ++i) q[i] = h[i + 4] + h[i];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

inline float max_lanes(F16 a) {  // exact in any order
  float x[16];
  store(x, a);
  float top = x[0];
  for (int i = 1; i < 16; ++i) top = lane_max(top, x[i]);
  return top;
}

// Lane i: sum_lanes(v[i]), for 16 vectors at once (the same tree, by in-lane shuffles)
inline F16 sums16(const F16 (&v)[16]) {
#if defined(SPECSERVE_VEC_AVX512)
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128 bits: v[2i] lanes 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v),
                             _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {  // per 128 bits: v[4i..4i+3]'s sums over those 128 bits
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit blocks 0 + 1 and 2 + 3, of two quads
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                        _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD))};
#elif defined(SPECSERVE_VEC_AVX2)
  // each half as the AVX-512 steps do per 128 bits: quarters' sums of four vectors a
  // register, then quarters 0 + 1 (the low half) and 2 + 3 (the high half)
  __m128 sums[2][4];
  for (int h = 0; h < 2; ++h) {
    __m256 pairs[8], quads[4];
    for (int i = 0; i < 8; ++i) {
      const __m256 a = h == 0 ? v[2 * i].lo : v[2 * i].hi, b = h == 0 ? v[2 * i + 1].lo : v[2 * i + 1].hi;
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    }
    for (int i = 0; i < 4; ++i) {
      const __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
      quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                               _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
      sums[h][i] = _mm_add_ps(_mm256_castps256_ps128(quads[i]), _mm256_extractf128_ps(quads[i], 1));
    }
  }
  F16 r;
  r.lo = _mm256_set_m128(_mm_add_ps(sums[0][1], sums[1][1]), _mm_add_ps(sums[0][0], sums[1][0]));
  r.hi = _mm256_set_m128(_mm_add_ps(sums[0][3], sums[1][3]), _mm_add_ps(sums[0][2], sums[1][2]));
  return r;
#else
  F16 r;
  for (int i = 0; i < 16; ++i) r.x[i] = sum_lanes(v[i]);
  return r;
#endif
}

}  // namespace specserve
