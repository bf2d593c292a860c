// Products of GGUF's K-quant matrices (Q4_K, Q5_K, Q6_K) with int8 activations, read in
// no more bytes than the file holds them in.
//
// A K-quant row is cut into super-blocks of 256 inputs. Q4_K and Q5_K hold a float16 d and
// dmin, and eight sub-blocks of 32 with a 6-bit scale sc and minimum m each: a weight is
// d*sc*q - dmin*m, q of 4 (or 5) bits. Q6_K holds a float16 d and sixteen sub-blocks of 16
// with an int8 scale sc: a weight is d*sc*(q - 32), q of 6 bits. d*sc and dmin*m are exact
// in float32 (11 by 8 bits at most), so the file's dequantization and these products use
// the same scales, not roundings of them.
//
// Packed per tile of 16 output rows and super-block, in exactly the file's bytes: each
// sub-block of 32 inputs as block_products.cpp packs a 4-bit block (four 64-byte groups of
// nibbles: group j holds inputs 4j..4j+3 of the 16 rows, four a row, its high nibbles
// group j + 4), then the codes' high bits (Q5_K: 8 bytes a group, bit 4r + i the fifth bit
// of row r's input i; Q6_K: two 64-byte vectors, byte 4r + i of vector h holding the two
// high bits of groups 4h..4h+3 in its bit pairs), then the tile's scales: the 16 rows' d
// (and dmin), then Q4_K's and Q5_K's 6-bit sc and m as a byte of low halves a sub-block
// and a byte of high bits per pair of sub-blocks, or Q6_K's int8 scales, 16 rows a vector.
// Rows past the matrix's end are zeros.
//
// Activations are quantize_row's (int8 per block of 32, d = max|x| / 127). A sub-block's
// code x activation products are summed exactly in int32 (AVX512-VNNI's vpdpbusd, AVX2's
// vpmaddubsw and vpmaddwd, or a loop); then, per block of 32 inputs in input order, the
// same float steps at every level:
//   Q4_K, Q5_K:  acc = fma(float(dot), (d*sc) * a, acc);  acc = fma(-(dmin*m), a*sum, acc)
//   Q6_K:        t = sc0*(dot0 - 32 sum0) + sc1*(dot1 - 32 sum1) (int32, per half of 16)
//                acc = fma(float(t), d * a, acc)
// with a the block's activation scale and sum its code sum (a*sum: quantize_row's).
// The amx level takes these vector products (no tile products for K-quants).

#include "common.h"
#include "kernels.h"

namespace specserve {

namespace {

constexpr int64_t kSubBlocks = kSuper / kBlock;  // blocks of 32 a super-block

constexpr int64_t file_bytes(int64_t type) {
  return type == kQ4K ? 144 : type == kQ5K ? 176 : 210;
}
// a sub-block's code bytes for 16 rows: nibbles, then the high bits
constexpr int64_t code_bytes(int64_t type) {
  return type == kQ4K ? 256 : type == kQ5K ? 320 : 384;
}
// bytes of a tile's super-block: 16 rows' file bytes
constexpr int64_t chunk_bytes(int64_t type) { return kTile * file_bytes(type); }

bool known(int64_t type) { return type == kQ4K || type == kQ5K || type == kQ6K; }

// One row's super-block, decoded: codes 0..63 and the scales as integers
struct Super {
  uint8_t q[kSuper];
  uint8_t sc[8], m[8];  // Q4_K, Q5_K
  int8_t sc16[16];      // Q6_K
  uint16_t d = 0, dmin = 0;
};

// a super-block of the file (``type``'s bytes at b) -> s
void decode(const uint8_t* b, int64_t type, Super& s) {
  if (type == kQ6K) {
    const uint8_t* ql = b;  // 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d
    const uint8_t* qh = b + 128;
    for (int n = 0; n < kSuper; ++n) {
      const int h = n / 128, p = n % 128;
      const int low = (ql[64 * h + p % 64] >> (4 * (p / 64))) & 15;
      const int high = (qh[32 * h + p % 32] >> (2 * (p / 32))) & 3;
      s.q[n] = static_cast<uint8_t>(low | (high << 4));
    }
    std::memcpy(s.sc16, b + 192, 16);
    std::memcpy(&s.d, b + 208, 2);
    return;
  }
  std::memcpy(&s.d, b, 2);
  std::memcpy(&s.dmin, b + 2, 2);
  const uint8_t* k = b + 4;  // 12 bytes of 6-bit scales and minimums
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      s.sc[j] = k[j] & 63;
      s.m[j] = k[j + 4] & 63;
    } else {
      s.sc[j] = static_cast<uint8_t>((k[j + 4] & 15) | ((k[j - 4] >> 6) << 4));
      s.m[j] = static_cast<uint8_t>((k[j + 4] >> 4) | ((k[j] >> 6) << 4));
    }
  }
  const uint8_t* qh = b + 16;  // Q5_K: 32 bytes, bit j of byte e: sub-block j's input e
  const uint8_t* qs = b + (type == kQ5K ? 48 : 16);
  for (int j = 0; j < 8; ++j)
    for (int e = 0; e < 32; ++e) {
      int q = (qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 15;
      if (type == kQ5K) q |= ((qh[e] >> j) & 1) << 4;
      s.q[32 * j + e] = static_cast<uint8_t>(q);
    }
}

// Row r's code of group g, input i, in a sub-block's packed bytes cw
template <int64_t TYPE>
inline int code_at(const uint8_t* cw, int g, int r, int i) {
  int q = (cw[64 * (g % 4) + 4 * r + i] >> (4 * (g / 4))) & 15;
  if constexpr (TYPE == kQ5K) {
    uint64_t bits;
    std::memcpy(&bits, cw + 256 + 8 * g, 8);
    q |= static_cast<int>((bits >> (4 * r + i)) & 1) << 4;
  } else if constexpr (TYPE == kQ6K) {
    q |= ((cw[256 + 64 * (g / 4) + 4 * r + i] >> (2 * (g % 4))) & 3) << 4;
  }
  return q;
}

// Row r's 6-bit scale and minimum of sub-block j from a tile's scale bytes sa (Q4_K, Q5_K)
inline void scale_min(const uint8_t* sa, int j, int r, int& sc, int& m) {
  const int low = sa[64 + 16 * j + r], high = sa[192 + 16 * (j % 4) + r] >> (4 * (j / 4));
  sc = (low & 15) | ((high & 3) << 4);
  m = (low >> 4) | (((high >> 2) & 3) << 4);
}

// s into row r of a tile's super-block chunk (dst, zeroed before)
void pack_super(const Super& s, int64_t type, int r, uint8_t* dst) {
  const int64_t cb = code_bytes(type);
  for (int j = 0; j < 8; ++j) {
    uint8_t* cw = dst + j * cb;
    for (int g = 0; g < 8; ++g)
      for (int i = 0; i < 4; ++i) {
        const int q = s.q[32 * j + 4 * g + i];
        cw[64 * (g % 4) + 4 * r + i] |= static_cast<uint8_t>((q & 15) << (4 * (g / 4)));
        if (type == kQ5K && (q >> 4)) cw[256 + 8 * g + (4 * r + i) / 8] |=
            static_cast<uint8_t>(1 << ((4 * r + i) % 8));
        if (type == kQ6K)
          cw[256 + 64 * (g / 4) + 4 * r + i] |= static_cast<uint8_t>((q >> 4) << (2 * (g % 4)));
      }
  }
  uint8_t* sa = dst + 8 * cb;
  std::memcpy(sa + 2 * r, &s.d, 2);
  if (type == kQ6K) {
    for (int j = 0; j < 8; ++j) {
      sa[32 + 32 * j + r] = static_cast<uint8_t>(s.sc16[2 * j]);
      sa[48 + 32 * j + r] = static_cast<uint8_t>(s.sc16[2 * j + 1]);
    }
    return;
  }
  std::memcpy(sa + 32 + 2 * r, &s.dmin, 2);
  for (int j = 0; j < 8; ++j) {
    sa[64 + 16 * j + r] = static_cast<uint8_t>((s.sc[j] & 15) | ((s.m[j] & 15) << 4));
    sa[192 + 16 * (j % 4) + r] |= static_cast<uint8_t>(
        ((s.sc[j] >> 4) | ((s.m[j] >> 4) << 2)) << (4 * (j / 4)));
  }
}

inline float half(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// Row r of a tile's super-block chunk w, dequantized into dst [256] as GGUF defines it:
// (d*sc)*q - dmin*m, or (d*sc)*(q - 32), in float32 (d*sc, dmin*m and (d*sc)*q exact)
template <int64_t TYPE>
void dequantize_super(const uint8_t* w, int r, float* dst) {
  constexpr int64_t cb = code_bytes(TYPE);
  const uint8_t* sa = w + 8 * cb;
  const float d = half(sa + 2 * r);
  for (int j = 0; j < 8; ++j) {
    const uint8_t* cw = w + j * cb;
    for (int g = 0; g < 8; ++g)
      for (int i = 0; i < 4; ++i) {
        const int q = code_at<TYPE>(cw, g, r, i);
        float value;
        if constexpr (TYPE == kQ6K) {
          const int sc = static_cast<int8_t>(sa[32 + 32 * j + 16 * (g / 4) + r]);
          value = (d * static_cast<float>(sc)) * static_cast<float>(q - 32);
        } else {
          int sc, m;
          scale_min(sa, j, r, sc, m);
          const float dmin = half(sa + 32 + 2 * r);
          value = (d * static_cast<float>(sc)) * static_cast<float>(q) -
                  dmin * static_cast<float>(m);
        }
        dst[32 * j + 4 * g + i] = value;
      }
  }
}

void dequantize_row(const uint8_t* w, int64_t type, int64_t supers, int r, float* dst) {
  const int64_t chunk = chunk_bytes(type);
  for (int64_t s = 0; s < supers; ++s, w += chunk, dst += kSuper) {
    if (type == kQ4K) dequantize_super<kQ4K>(w, r, dst);
    else if (type == kQ5K) dequantize_super<kQ5K>(w, r, dst);
    else dequantize_super<kQ6K>(w, r, dst);
  }
}

// A segment of a K-quant matrix's rows, all of one type
struct Segment {
  int64_t type, rows, offset, col;  // col: its first output
};

std::vector<Segment> segments_of(const int64_t* layout, int64_t count) {
  std::vector<Segment> out;
  int64_t col = 0;
  for (int64_t s = 0; s < count; ++s) {
    out.push_back({layout[3 * s], layout[3 * s + 1], layout[3 * s + 2], col});
    col += layout[3 * s + 1];
  }
  return out;
}

// --- a tile's product: R tokens against one tile of 16 output rows of one type, over
// ``supers`` super-blocks: [R, 16] float32 into out (rows ldo apart). codes: the tokens'
// int8 codes (rows k apart); scale, sum: quantize_row's per block (rows blocks apart);
// halves: each 16 inputs' code sum (rows k / 16 apart)

inline int32_t four_codes(const int8_t* a) {
  int32_t four;
  std::memcpy(&four, a, 4);
  return four;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int64_t TYPE>
inline __m512i group_codes(const uint8_t* cw, int g) {
  const __m512i bytes = _mm512_loadu_si512(cw + 64 * (g % 4));
  __m512i q = _mm512_and_si512(g < 4 ? bytes : _mm512_srli_epi16(bytes, 4),
                               _mm512_set1_epi8(0x0F));
  if constexpr (TYPE == kQ5K) {
    uint64_t bits;
    std::memcpy(&bits, cw + 256 + 8 * g, 8);
    q = _mm512_mask_add_epi8(q, static_cast<__mmask64>(bits), q, _mm512_set1_epi8(16));
  } else if constexpr (TYPE == kQ6K) {
    const __m512i h = _mm512_loadu_si512(cw + 256 + 64 * (g / 4));
    const int shift = 2 * (g % 4);  // the pair's bits to bits 4 and 5 of each byte
    const __m512i moved = shift == 0   ? _mm512_slli_epi16(h, 4)
                          : shift == 2 ? _mm512_slli_epi16(h, 2)
                          : shift == 4 ? h
                                       : _mm512_srli_epi16(h, 2);
    q = _mm512_or_si512(q, _mm512_and_si512(moved, _mm512_set1_epi8(0x30)));
  }
  return q;
}

template <int R, int64_t TYPE>
inline void kquant_tile(const uint8_t* w, int64_t supers, const int8_t* codes, const float* scale,
                        const float* sum, const int32_t* halves, int64_t k, float* out,
                        int64_t ldo) {
  constexpr int64_t cb = code_bytes(TYPE), chunk = chunk_bytes(TYPE);
  // few tokens leave the core waiting on one chain of sums: C chains a token (added at
  // the end: integer sums, the same in any order); Q6_K's two halves are two chains
  // (at least about 8 chains in all, the VNNI unit's latency times its rate)
  constexpr int C = TYPE == kQ6K ? 2 : R == 1 ? 4 : R == 2 ? 4 : R == 3 ? 3 : R == 4 ? 2 : 1;
  const int64_t blocks = supers * kSubBlocks, hk = k / 16;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s, w += chunk) {
    const uint8_t* sa = w + 8 * cb;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa)));
    for (int j = 0; j < 8; ++j) {
      const uint8_t* cw = w + j * cb;
      prefetch_share(w + kPrefetchBytes, chunk, j, 8);
      const int64_t b = s * kSubBlocks + j;
      __m512i dots[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dots[r][c] = _mm512_setzero_si512();
      // unrolled, so each group's chain is known and every sum stays in a register
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i group = group_codes<TYPE>(cw, g);
        const int c = TYPE == kQ6K ? g / 4 : g % C;
        for (int r = 0; r < R; ++r)
          dots[r][c] = _mm512_dpbusd_epi32(
              dots[r][c], group, _mm512_set1_epi32(four_codes(codes + r * k + b * kBlock + 4 * g)));
      }
      if constexpr (TYPE == kQ6K) {
        const __m512i sc0 = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sa + 32 + 32 * j)));
        const __m512i sc1 = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sa + 48 + 32 * j)));
        for (int r = 0; r < R; ++r) {
          const int32_t* h = halves + r * hk + 2 * b;
          const __m512i t = _mm512_add_epi32(
              _mm512_mullo_epi32(_mm512_sub_epi32(dots[r][0], _mm512_set1_epi32(32 * h[0])), sc0),
              _mm512_mullo_epi32(_mm512_sub_epi32(dots[r][1], _mm512_set1_epi32(32 * h[1])), sc1));
          const __m512 da = _mm512_mul_ps(d, _mm512_set1_ps(scale[r * blocks + b]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), da, acc[r]);
        }
      } else {
        const __m512i three = _mm512_set1_epi32(3), fifteen = _mm512_set1_epi32(15);
        const __m512i low = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sa + 64 + 16 * j)));
        __m512i high = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sa + 192 + 16 * (j % 4))));
        if (j >= 4) high = _mm512_srli_epi32(high, 4);
        const __m512i sc = _mm512_or_si512(_mm512_and_si512(low, fifteen),
                                           _mm512_slli_epi32(_mm512_and_si512(high, three), 4));
        const __m512i m = _mm512_or_si512(
            _mm512_srli_epi32(low, 4),
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2), three), 4));
        const __m512 dmin = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sa + 32)));
        const __m512 dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));  // exact
        const __m512 dm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));  // exact
        for (int r = 0; r < R; ++r) {
          __m512i dot = dots[r][0];
          for (int c = 1; c < C; ++c) dot = _mm512_add_epi32(dot, dots[r][c]);
          const __m512 da = _mm512_mul_ps(dsc, _mm512_set1_ps(scale[r * blocks + b]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), da, acc[r]);
          acc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(sum[r * blocks + b]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

// the most tokens a pass over the matrix serves: Q6_K's two chains a token hold 3 vectors a
// token in registers, Q4_K's and Q5_K's one chain 2
constexpr int kBlockRows = 12;
constexpr int rows_of(int64_t type) { return type == kQ6K ? 8 : kBlockRows; }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Half a tile (8 rows) at a time; vpmaddubsw and vpmaddwd sum four code x activation
// products per int32 lane as vpdpbusd does (codes below 64: no 16-bit sum saturates)
inline __m256i dot4(__m256i dot, __m256i codes, __m256i four, __m256i ones) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, four), ones));
}

// byte i all ones where bit i of bits is set
inline __m256i expand_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                       3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

template <int64_t TYPE>
inline __m256i group_codes(const uint8_t* cw, int g, int half) {
  const __m256i bytes =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cw + 64 * (g % 4) + 32 * half));
  __m256i q = _mm256_and_si256(g < 4 ? bytes : _mm256_srli_epi16(bytes, 4),
                               _mm256_set1_epi8(0x0F));
  if constexpr (TYPE == kQ5K) {
    uint64_t bits;
    std::memcpy(&bits, cw + 256 + 8 * g, 8);
    q = _mm256_or_si256(q, _mm256_and_si256(expand_bits(static_cast<uint32_t>(bits >> (32 * half))),
                                            _mm256_set1_epi8(16)));
  } else if constexpr (TYPE == kQ6K) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cw + 256 + 64 * (g / 4) + 32 * half));
    const int shift = 2 * (g % 4);
    const __m256i moved = shift == 0   ? _mm256_slli_epi16(h, 4)
                          : shift == 2 ? _mm256_slli_epi16(h, 2)
                          : shift == 4 ? h
                                       : _mm256_srli_epi16(h, 2);
    q = _mm256_or_si256(q, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
  }
  return q;
}

inline __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i load8_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8_half(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int R, int64_t TYPE>
inline void kquant_tile(const uint8_t* w0, int64_t supers, const int8_t* codes, const float* scale,
                        const float* sum, const int32_t* halves, int64_t k, float* out,
                        int64_t ldo) {
  constexpr int64_t cb = code_bytes(TYPE), chunk = chunk_bytes(TYPE);
  const int64_t blocks = supers * kSubBlocks, hk = k / 16;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int part = 0; part < 2; ++part) {  // rows 0-7, then 8-15 of the tile
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    for (int64_t s = 0; s < supers; ++s, w += chunk) {
      const uint8_t* sa = w + 8 * cb;
      const __m256 d = load8_half(sa + 16 * part);
      for (int j = 0; j < 8; ++j) {
        const uint8_t* cw = w + j * cb;
        if (part == 0) prefetch_share(w + kPrefetchBytes, chunk, j, 8);
        const int64_t b = s * kSubBlocks + j;
        __m256i group[8];
        for (int g = 0; g < 8; ++g) group[g] = group_codes<TYPE>(cw, g, part);
        if constexpr (TYPE == kQ6K) {
          const __m256i sc0 = load8_i8(sa + 32 + 32 * j + 8 * part);
          const __m256i sc1 = load8_i8(sa + 48 + 32 * j + 8 * part);
          for (int r = 0; r < R; ++r) {
            const int8_t* a = codes + r * k + b * kBlock;
            __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int g = 0; g < 8; ++g)
              dot[g / 4] = dot4(dot[g / 4], group[g], _mm256_set1_epi32(four_codes(a + 4 * g)), ones);
            const int32_t* h = halves + r * hk + 2 * b;
            const __m256i t = _mm256_add_epi32(
                _mm256_mullo_epi32(_mm256_sub_epi32(dot[0], _mm256_set1_epi32(32 * h[0])), sc0),
                _mm256_mullo_epi32(_mm256_sub_epi32(dot[1], _mm256_set1_epi32(32 * h[1])), sc1));
            const __m256 da = _mm256_mul_ps(d, _mm256_set1_ps(scale[r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), da, acc[r]);
          }
        } else {
          const __m256i three = _mm256_set1_epi32(3), fifteen = _mm256_set1_epi32(15);
          const __m256i low = load8_u8(sa + 64 + 16 * j + 8 * part);
          __m256i high = load8_u8(sa + 192 + 16 * (j % 4) + 8 * part);
          if (j >= 4) high = _mm256_srli_epi32(high, 4);
          const __m256i sc = _mm256_or_si256(_mm256_and_si256(low, fifteen),
                                             _mm256_slli_epi32(_mm256_and_si256(high, three), 4));
          const __m256i m = _mm256_or_si256(
              _mm256_srli_epi32(low, 4),
              _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(high, 2), three), 4));
          const __m256 dsc = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
          const __m256 dm = _mm256_mul_ps(load8_half(sa + 32 + 16 * part), _mm256_cvtepi32_ps(m));
          for (int r = 0; r < R; ++r) {
            const int8_t* a = codes + r * k + b * kBlock;
            __m256i dot = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g)
              dot = dot4(dot, group[g], _mm256_set1_epi32(four_codes(a + 4 * g)), ones);
            const __m256 da = _mm256_mul_ps(dsc, _mm256_set1_ps(scale[r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), da, acc[r]);
            acc[r] = _mm256_fnmadd_ps(dm, _mm256_set1_ps(sum[r * blocks + b]), acc[r]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo + 8 * part, acc[r]);
  }
}

constexpr int kBlockRows = 4;
constexpr int rows_of(int64_t) { return kBlockRows; }
#else
template <int R, int64_t TYPE>
inline void kquant_tile(const uint8_t* w, int64_t supers, const int8_t* codes, const float* scale,
                        const float* sum, const int32_t* halves, int64_t k, float* out,
                        int64_t ldo) {
  constexpr int64_t cb = code_bytes(TYPE), chunk = chunk_bytes(TYPE);
  const int64_t blocks = supers * kSubBlocks, hk = k / 16;
  float acc[R][kTile] = {};
  for (int64_t s = 0; s < supers; ++s, w += chunk) {
    const uint8_t* sa = w + 8 * cb;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* cw = w + j * cb;
      const int64_t b = s * kSubBlocks + j;
      for (int row = 0; row < kTile; ++row) {
        const float d = half(sa + 2 * row);
        int q[32];
        for (int g = 0; g < 8; ++g)
          for (int i = 0; i < 4; ++i) q[4 * g + i] = code_at<TYPE>(cw, g, row, i);
        for (int r = 0; r < R; ++r) {
          const int8_t* a = codes + r * k + b * kBlock;
          int32_t dot[2] = {0, 0};
          for (int i = 0; i < 32; ++i) dot[i / 16] += q[i] * a[i];
          if constexpr (TYPE == kQ6K) {
            const int32_t* h = halves + r * hk + 2 * b;
            const int32_t sc0 = static_cast<int8_t>(sa[32 + 32 * j + row]);
            const int32_t sc1 = static_cast<int8_t>(sa[48 + 32 * j + row]);
            const int32_t t = (dot[0] - 32 * h[0]) * sc0 + (dot[1] - 32 * h[1]) * sc1;
            const float da = d * scale[r * blocks + b];
            acc[r][row] = std::fma(static_cast<float>(t), da, acc[r][row]);
          } else {
            int sc, m;
            scale_min(sa, j, row, sc, m);
            const float dsc = d * static_cast<float>(sc);
            const float dm = half(sa + 32 + 2 * row) * static_cast<float>(m);
            acc[r][row] = std::fma(static_cast<float>(dot[0] + dot[1]), dsc * scale[r * blocks + b],
                                   acc[r][row]);
            acc[r][row] = std::fma(-dm, sum[r * blocks + b], acc[r][row]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, acc[r], sizeof acc[r]);
}

constexpr int kBlockRows = 4;
constexpr int rows_of(int64_t) { return kBlockRows; }
#endif

// kquant_tile for a run-time type and number of rows (at most kBlockRows)
template <int64_t TYPE>
void tile_rows(int rows, const uint8_t* w, int64_t supers, const int8_t* codes,
               const float* scale, const float* sum, const int32_t* halves, int64_t k, float* out,
               int64_t ldo) {
  static_assert(kBlockRows <= 12, "a case per row count");
  switch (rows) {
#define SPECSERVE_ROWS(R)          \
  case R:                         \
    if constexpr (R <= rows_of(TYPE)) \
      return kquant_tile<R, TYPE>(w, supers, codes, scale, sum, halves, k, out, ldo);
    SPECSERVE_ROWS(1) SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4)
    SPECSERVE_ROWS(5) SPECSERVE_ROWS(6) SPECSERVE_ROWS(7) SPECSERVE_ROWS(8)
    SPECSERVE_ROWS(9) SPECSERVE_ROWS(10) SPECSERVE_ROWS(11) SPECSERVE_ROWS(12)
#undef SPECSERVE_ROWS
  }
  TORCH_CHECK(false, "kquant tile: ", rows, " rows");
}

void typed_tile_rows(int64_t type, int rows, const uint8_t* w, int64_t supers, const int8_t* codes,
                     const float* scale, const float* sum, const int32_t* halves, int64_t k,
                     float* out, int64_t ldo) {
  if (type == kQ4K) return tile_rows<kQ4K>(rows, w, supers, codes, scale, sum, halves, k, out, ldo);
  if (type == kQ5K) return tile_rows<kQ5K>(rows, w, supers, codes, scale, sum, halves, k, out, ldo);
  tile_rows<kQ6K>(rows, w, supers, codes, scale, sum, halves, k, out, ldo);
}

constexpr int64_t kGroupTiles = 16;  // tiles whose results are stored together

// A run of tiles of one segment, which one thread computes and stores
struct Group {
  const Segment* segment;
  int64_t first, last;  // tiles of the segment
};

}  // namespace

int64_t kquant_block_bytes(int64_t type) {
  TORCH_CHECK(known(type), "GGML type ", type, " is not Q4_K (12), Q5_K (13) or Q6_K (14)");
  return file_bytes(type);
}

at::Tensor kquant_pack(const at::Tensor& raw, int64_t type) {
  const int64_t size = kquant_block_bytes(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.device().is_cpu(),
              "raw must be a contiguous uint8 [out, bytes a row] CPU tensor");
  const int64_t n = raw.size(0), row_bytes = raw.size(1);
  TORCH_CHECK(n > 0 && row_bytes > 0 && row_bytes % size == 0,
              "a row must be whole super-blocks of ", size, " bytes");
  const int64_t supers = row_bytes / size, tiles = (n + kTile - 1) / kTile;
  const int64_t chunk = chunk_bytes(type);
  at::Tensor out = at::zeros({tiles * supers * chunk}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t lo, int64_t hi) {
    Super s;
    for (int64_t t = lo; t < hi; ++t)
      for (int64_t r = 0; r < kTile && t * kTile + r < n; ++r)
        for (int64_t b = 0; b < supers; ++b) {
          decode(src + (t * kTile + r) * row_bytes + b * size, type, s);
          pack_super(s, type, static_cast<int>(r), dst + (t * supers + b) * chunk);
        }
  });
  return out;
}

int64_t kquant_check(const at::Tensor& layout, int64_t bytes, int64_t in) {
  TORCH_CHECK(layout.dim() == 2 && layout.size(1) == 3 && layout.size(0) > 0 &&
                  layout.scalar_type() == at::kLong && layout.is_contiguous(),
              "layout must be a contiguous int64 [segments, 3] (type, rows, offset)");
  TORCH_CHECK(in % kSuper == 0 && in > 0, "the input size must be a multiple of 256");
  const int64_t* l = layout.data_ptr<int64_t>();
  int64_t offset = 0, rows = 0;
  for (int64_t s = 0; s < layout.size(0); ++s) {
    const int64_t type = l[3 * s], n = l[3 * s + 1];
    TORCH_CHECK(known(type) && n > 0 && l[3 * s + 2] == offset,
                "segment ", s, " of the layout is not a packing of its type and rows");
    offset += (n + kTile - 1) / kTile * (in / kSuper) * chunk_bytes(type);
    rows += n;
  }
  TORCH_CHECK(offset == bytes, "the layout describes ", offset, " bytes; the packing has ",
              bytes);
  return rows;
}

at::Tensor kquant_rows(const at::Tensor& packed, const at::Tensor& layout, const at::Tensor& ids,
                       int64_t in_features, at::ScalarType dtype) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be a contiguous uint8 tensor");
  const int64_t n = kquant_check(layout, packed.numel(), in_features);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be int64 [n]");
  const at::Tensor index = ids.contiguous();
  const int64_t count = index.size(0), supers = in_features / kSuper;
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "row ", id[i], " is out of range");
  const std::vector<Segment> segments = segments_of(layout.data_ptr<int64_t>(), layout.size(0));
  at::Tensor out = at::empty({count, in_features}, packed.options().dtype(at::kFloat));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, count, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      size_t s = 0;
      while (id[i] >= segments[s].col + segments[s].rows) ++s;
      const Segment& seg = segments[s];
      const int64_t row = id[i] - seg.col, tile = row / kTile;
      dequantize_row(p + seg.offset + tile * supers * chunk_bytes(seg.type), seg.type, supers,
                     static_cast<int>(row % kTile), o + i * in_features);
    }
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// kquant_product's work on checked pointers
template <typename T>
void kquant_product_rows(const T* xp, int64_t tokens, int64_t k, const uint8_t* wp,
                         const int64_t* layout, int64_t count, const float* bp, T* yp) {
  const int64_t blocks = k / kBlock, supers = k / kSuper, hk = k / 16;
  const std::vector<Segment> segments = segments_of(layout, count);
  const int64_t n = segments.back().col + segments.back().rows;
  // the activations' codes, block scales and sums, and code sums per 16: scratch this
  // thread keeps between calls
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<float> stats;
  thread_local std::vector<int32_t> halves;
  codes.resize(static_cast<size_t>(tokens * k));
  stats.resize(static_cast<size_t>(2 * tokens * blocks));
  halves.resize(static_cast<size_t>(tokens * hk));
  int8_t* cp = codes.data();
  float* scale = stats.data();
  float* sum = scale + tokens * blocks;
  int32_t* hp = halves.data();
  auto quantize = [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      quantize_row(xp + t * k, k, cp + t * k, scale + t * blocks, sum + t * blocks);
      for (int64_t h = 0; h < hk; ++h) {
        int32_t total = 0;
        for (int64_t i = 0; i < 16; ++i) total += cp[t * k + 16 * h + i];
        hp[t * hk + h] = total;
      }
    }
  };
  // in a team, every member that takes a chunk makes its own copy first
  bool quantized = team.size == 0;
  if (quantized) split(0, tokens, kTokenGrain, quantize);
  // tiles in groups of one segment each, at most kGroupTiles tiles and at least
  // kChunksPerThread a thread where the matrix has the tiles (as block_product_rows)
  int64_t tiles = 0;
  for (const Segment& s : segments) tiles += (s.rows + kTile - 1) / kTile;
  const int64_t threads = split_threads();
  const int64_t wanted = std::max((tiles + kGroupTiles - 1) / kGroupTiles,
                                  std::min(tiles, threads * kChunksPerThread));
  const int64_t group_tiles = (tiles + wanted - 1) / wanted;
  thread_local std::vector<Group> groups;
  groups.clear();
  for (const Segment& s : segments) {
    const int64_t st = (s.rows + kTile - 1) / kTile;
    for (int64_t first = 0; first < st; first += group_tiles)
      groups.push_back({&s, first, std::min(st, first + group_tiles)});
  }
  const Group* gp = groups.data();
  split(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t lo, int64_t hi) {
    if (!quantized) {
      quantize(0, tokens);
      quantized = true;
    }
    alignas(64) float buffer[kBlockRows * kGroupTiles * kTile];
    constexpr int64_t ldo = kGroupTiles * kTile;
    for (int64_t g = lo; g < hi; ++g) {
      const Segment& seg = *gp[g].segment;
      const int64_t first = gp[g].first, last = gp[g].last, chunk = chunk_bytes(seg.type);
      const int64_t col = seg.col + first * kTile;
      const int64_t width = std::min(seg.rows, last * kTile) - first * kTile;
      // passes of at most rows_of(type) tokens, as even as they go
      const int64_t passes = (tokens + rows_of(seg.type) - 1) / rows_of(seg.type);
      const int64_t per_pass = passes > 0 ? (tokens + passes - 1) / passes : 1;
      for (int64_t r = 0; r < tokens; r += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, tokens - r));
        for (int64_t t = first; t < last; ++t)
          typed_tile_rows(seg.type, rows, wp + seg.offset + t * supers * chunk, supers,
                          cp + r * k, scale + r * blocks, sum + r * blocks, hp + r * hk, k,
                          buffer + (t - first) * kTile, ldo);
        for (int i = 0; i < rows; ++i)
          store_row(yp + (r + i) * n + col, buffer + i * ldo, bp != nullptr ? bp + col : nullptr,
                    width);
      }
    }
  });
}

at::Tensor kquant_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& layout,
                          const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "packed must be a contiguous uint8 tensor");
  const int64_t tokens = x.size(0), k = x.size(1);
  const int64_t n = kquant_check(layout, packed.numel(), k);
  const at::Tensor b32 = float_bias(bias, n);
  at::Tensor y = at::empty({tokens, n}, x.options());
  DISPATCH(x.scalar_type(), "kquant_product", [&] {
    kquant_product_rows<scalar_t>(x.data_ptr<scalar_t>(), tokens, k, packed.data_ptr<uint8_t>(),
                                  layout.data_ptr<int64_t>(), layout.size(0),
                                  b32.defined() ? b32.data_ptr<float>() : nullptr,
                                  y.data_ptr<scalar_t>());
  });
  return y;
}

template void kquant_product_rows<float>(const float*, int64_t, int64_t, const uint8_t*,
                                         const int64_t*, int64_t, const float*, float*);
template void kquant_product_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t,
                                                 const uint8_t*, const int64_t*, int64_t,
                                                 const float*, c10::BFloat16*);

}  // namespace specserve
