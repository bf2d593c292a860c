// Products of 4- and 8-bit block matrices with int8 activations.
//
// A matrix of 4-bit (or 8-bit) codes with a float16 scale and minimum per block of 32 inputs,
// w = code * scale + low (a GGUF's Q4_0/Q4_1/Q4_K blocks, its Q8_0 as code + 128 with
// low = -128 scale), multiplied the way llama.cpp does on a CPU: each token's activations
// are quantized to int8 per block of 32 (scale max|x| / 127), and a block's code x
// activation products are summed in int32, exactly (AVX512-VNNI's vpdpbusd, AVX2's
// vpmaddubsw and vpmaddwd, or a loop: the same integers). Each output row then adds its
// blocks up in float32 in input order, two fused multiply-adds a block, the same steps in
// every build. Packed per tile of 16 output rows and block of 32 inputs: the codes as
// eight 64-byte groups (group j: inputs 4j..4j+3 of the 16 rows, four bytes a row; 4-bit
// codes hold group j + 4 in the high nibbles of group j's bytes), then the 16 scales and
// the 16 minimums in float16.
//
// Built for the amx level, a pass of 2 to 16 tokens takes each tile's block as one AMX
// tile product (TDPBSUD: the tokens' int8 codes by the block's eight groups, which are
// a B tile's rows as they lie; 4-bit codes unpacked to bytes first), whose 16 x 16 int32
// sums are stored and scaled by the same float steps as every other level's.

#include "common.h"
#include "kernels.h"
#include "tiles.h"

namespace specserve {

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

// Row ``id`` of a block_pack-ed matrix of ``blocks`` blocks a row, dequantized into dst
// [blocks * 32]: code * scale + low in float32
void block_row(const uint8_t* p, int64_t id, int64_t blocks, int64_t bits, float* dst) {
  const int64_t size = block_bytes(bits), tile = id / kTile, r = id % kTile;
  for (int64_t b = 0; b < blocks; ++b, dst += kBlock) {
    const uint8_t* src = p + (tile * blocks + b) * size;
    c10::Half d, low;
    std::memcpy(&d, src + size - 64 + 2 * r, 2);
    std::memcpy(&low, src + size - 32 + 2 * r, 2);
    const float scale = static_cast<float>(d), minimum = static_cast<float>(low);
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t k = 0; k < 4; ++k) {
        const uint8_t byte = src[(bits == 4 ? j % 4 : j) * 64 + 4 * r + k];
        const int code = bits == 4 ? (j < 4 ? byte & 15 : byte >> 4) : byte;
        // the product is exact (8 by 11 bits), so this rounds once, fused or not
        dst[4 * j + k] = static_cast<float>(code) * scale + minimum;
      }
  }
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
  for (int64_t i = 0; i < n; ++i) block_row(p, id[i], blocks, bits, o + i * in_features);
  return dtype == at::kFloat ? out : out.to(dtype);
}

// A row's activations per block of 32: int8 codes round(x / d) with d = max|x| / 127, d,
// and d * sum(codes) (what a block's minimums multiply); in vec.h's lanes, so each code
// is one multiply and one rounding to even at every level
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const F16 lo = load(x + b * kBlock), hi = load(x + b * kBlock + 16);
    const float top = max_lanes(max(max(lo, sub(zero(), lo)), max(hi, sub(zero(), hi))));
    const float d = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
    // saturated to int8 (as the vector conversions do), then converted: exact integers
    const F16 least = splat(-128.0f), most = splat(127.0f);
    const int total =
        store_int8(codes + b * kBlock, min(max(round_even(mul(lo, splat(inv))), least), most)) +
        store_int8(codes + b * kBlock + 16, min(max(round_even(mul(hi, splat(inv))), least), most));
    scale[b] = d;
    sum[b] = d * static_cast<float>(total);
  }
}

template void quantize_row<float>(const float*, int64_t, int8_t*, float*, float*);
template void quantize_row<c10::BFloat16>(const c10::BFloat16*, int64_t, int8_t*, float*,
                                          float*);

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// R rows (tokens) against one tile of 16 output rows: [R, 16] float32 into out (rows ldo apart).
// Each 64-byte group of a block's codes is loaded once and multiplied into every row's
// sums, so the R rows' chains of vpdpbusd run side by side
template <int R, int BITS>
inline void block_tile(const uint8_t* w, int64_t blocks, const int8_t* codes, const float* scale,
                       const float* sum, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t size = (BITS == 4 ? 256 : 512) + 64;
  // few rows leave the core waiting on one chain of sums: C chains a row, added at the end
  // (integer sums: the same result in any order)
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, w += size) {
    prefetch_row(w + kPrefetchBytes, size);
    const int8_t* a = codes + b * kBlock;
    __m512i dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dots[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i group;
      if (BITS == 4) {
        const __m512i bytes = _mm512_loadu_si512(w + 64 * (j % 4));
        group = _mm512_and_si512(j < 4 ? bytes : _mm512_srli_epi16(bytes, 4), nibble);
      } else {
        group = _mm512_loadu_si512(w + 64 * j);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a + r * k + 4 * j, 4);
        dots[r][j % C] = _mm512_dpbusd_epi32(dots[r][j % C], group, _mm512_set1_epi32(four));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 64)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 32)));
    for (int r = 0; r < R; ++r) {
      __m512i dot = dots[r][0];
      for (int c = 1; c < C; ++c) dot = _mm512_add_epi32(dot, dots[r][c]);
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(scale[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), ds, acc[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(sum[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

constexpr int kBlockRows = 8;  // the most tokens a pass over the matrix serves: 8 x 2 sums and a group in registers

#if defined(SPECSERVE_TILES)
constexpr int kTileRows = 16;  // the most tokens a tile product takes (a tile's 16 rows)

// The tiles of a pass of `rows` tokens: C (tile 0) their [rows, 16] int32 sums, A (tile 1)
// their 32 activation codes of a block, B (tile 2) a block's eight 64-byte code groups
inline void configure_tiles(int rows) {
  amx::Config config;
  config.rows[0] = static_cast<uint8_t>(rows);
  config.colsb[0] = kTile * 4;
  config.rows[1] = static_cast<uint8_t>(rows);
  config.colsb[1] = kBlock;
  config.rows[2] = kBlock / 4;
  config.colsb[2] = 64;
  amx::load_config(&config);
}

// block_tile's result by tile products (on tiles configure_tiles(R) shaped): per block, the
// R x 16 int32 sums of one TDPBSUD, then block_tile's float steps in its order
template <int R, int BITS>
inline void block_tile_amx(const uint8_t* w, int64_t blocks, const int8_t* codes,
                           const float* scale, const float* sum, int64_t k, float* out,
                           int64_t ldo) {
  constexpr int64_t size = (BITS == 4 ? 256 : 512) + 64;
  alignas(64) uint8_t unpacked[8 * 64];  // a 4-bit block's groups, a byte a code
  alignas(64) int32_t dots[R][kTile];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, w += size) {
    prefetch_row(w + kPrefetchBytes, size);
    const uint8_t* groups = w;
    if (BITS == 4) {
      for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(w + 64 * j);
        _mm512_store_si512(unpacked + 64 * j, _mm512_and_si512(bytes, nibble));
        _mm512_store_si512(unpacked + 64 * (j + 4),
                           _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
      }
      groups = unpacked;
    }
    amx::zero<0>();
    amx::load<1>(codes + b * kBlock, k);
    amx::load<2>(groups, 64);
    amx::dpbsud<0, 1, 2>();
    amx::store<0>(dots, sizeof dots[0]);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 64)));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + size - 32)));
    for (int r = 0; r < R; ++r) {
      const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(scale[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[r])), ds, acc[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(sum[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// With AVX2: vpmaddubsw and vpmaddwd sum the same four code x activation products per
// int32 lane as vpdpbusd (8-bit codes as two nibbles, so no 16-bit sum saturates), half a
// tile (8 rows) at a time.
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

constexpr int kBlockRows = 4;  // the most tokens a pass over the matrix serves (16 registers)
#else
template <int R, int BITS>
inline void block_tile(const uint8_t* w, int64_t blocks, const int8_t* codes, const float* scale,
                       const float* sum, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t size = (BITS == 4 ? 256 : 512) + 64;
  float acc[R][kTile] = {};
  for (int64_t b = 0; b < blocks; ++b, w += size) {
    for (int64_t row = 0; row < kTile; ++row) {
      c10::Half d, low;
      std::memcpy(&d, w + size - 64 + 2 * row, 2);
      std::memcpy(&low, w + size - 32 + 2 * row, 2);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = codes + r * k + b * kBlock;
        int32_t dot = 0;
        for (int64_t j = 0; j < 8; ++j)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = w[(BITS == 4 ? j % 4 : j) * 64 + 4 * row + i];
            const int code = BITS == 4 ? (j < 4 ? byte & 15 : byte >> 4) : byte;
            dot += code * a[4 * j + i];
          }
        const float ds = static_cast<float>(d) * scale[r * blocks + b];
        acc[r][row] = std::fma(static_cast<float>(dot), ds, acc[r][row]);
        acc[r][row] = std::fma(static_cast<float>(low), sum[r * blocks + b], acc[r][row]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, acc[r], sizeof acc[r]);
}

constexpr int kBlockRows = 4;
#endif

// block_tile for a run-time number of rows (at most kBlockRows)
template <int BITS>
void block_tile_rows(int rows, const uint8_t* w, int64_t blocks, const int8_t* codes,
                     const float* scale, const float* sum, int64_t k, float* out, int64_t ldo) {
  static_assert(kBlockRows <= 8, "a case per row count");
  switch (rows) {
#define SPECSERVE_ROWS(R)      \
  case R:                     \
    if constexpr (R <= kBlockRows) \
      return block_tile<R, BITS>(w, blocks, codes, scale, sum, k, out, ldo);
    SPECSERVE_ROWS(1) SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4)
    SPECSERVE_ROWS(5) SPECSERVE_ROWS(6) SPECSERVE_ROWS(7) SPECSERVE_ROWS(8)
#undef SPECSERVE_ROWS
  }
  TORCH_CHECK(false, "block_tile_rows: ", rows, " rows");
}

#if defined(SPECSERVE_TILES)
// block_tile_amx for a run-time number of rows (2 to kTileRows)
template <int BITS>
void block_tile_amx_rows(int rows, const uint8_t* w, int64_t blocks, const int8_t* codes,
                         const float* scale, const float* sum, int64_t k, float* out,
                         int64_t ldo) {
  switch (rows) {
#define SPECSERVE_ROWS(R) \
  case R:                 \
    return block_tile_amx<R, BITS>(w, blocks, codes, scale, sum, k, out, ldo);
    SPECSERVE_ROWS(2) SPECSERVE_ROWS(3) SPECSERVE_ROWS(4) SPECSERVE_ROWS(5)
    SPECSERVE_ROWS(6) SPECSERVE_ROWS(7) SPECSERVE_ROWS(8) SPECSERVE_ROWS(9)
    SPECSERVE_ROWS(10) SPECSERVE_ROWS(11) SPECSERVE_ROWS(12) SPECSERVE_ROWS(13)
    SPECSERVE_ROWS(14) SPECSERVE_ROWS(15) SPECSERVE_ROWS(16)
#undef SPECSERVE_ROWS
  }
  TORCH_CHECK(false, "block_tile_amx_rows: ", rows, " rows");
}
#endif

constexpr int64_t kGroupTiles = 16;  // tiles whose results are stored together
#if defined(SPECSERVE_TILES)
constexpr int64_t kPassRows = kTileRows;  // the most tokens a pass over the matrix takes
#else
constexpr int64_t kPassRows = kBlockRows;
#endif

}  // namespace

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
  // in a team, every member that takes a chunk makes its own copy first (a pass of a few
  // tokens: < 1 us each)
  bool quantized = team.size == 0;
  if (quantized) split(0, tokens, kTokenGrain, quantize);
  // tiles in groups whose results are written out a token's row at a time (rows of
  // a wide output lie a multiple of 4 KiB apart: tile by tile, the stores alias); at
  // most kBlockRows tokens a pass over the matrix (kTileRows with tile products), the
  // passes evenly filled. Groups of at most kGroupTiles tiles, and at least
  // kChunksPerThread a thread where the matrix has the tiles, which the threads claim one
  // at a time (split)
  const int64_t threads = split_threads();
  int64_t groups = std::max((tiles + kGroupTiles - 1) / kGroupTiles,
                            std::min(tiles, threads * kChunksPerThread));
  const int64_t group_tiles = (tiles + groups - 1) / groups;
  groups = (tiles + group_tiles - 1) / group_tiles;
#if defined(SPECSERVE_TILES)
  // passes of up to 16 tokens as tile products where this process may use tiles; a token
  // alone keeps the vector path (its product is bound by reading the matrix, and a tile
  // product would leave 15 of its 16 rows idle)
  const bool tiled = tokens > 1 && amx::permitted();
  const int64_t most = tiled ? kTileRows : kBlockRows;
#else
  const int64_t most = kBlockRows;
#endif
  const int64_t passes = (tokens + most - 1) / most;
  const int64_t per_pass = passes > 0 ? (tokens + passes - 1) / passes : 1;
  // one parallel region for all passes; each group's tiles (at most ~250 KB) stay in the
  // core's cache from one pass to the next
  split(0, groups, 1, [&](int64_t lo, int64_t hi) {
    if (!quantized) {
      quantize(0, tokens);
      quantized = true;
    }
    alignas(64) float buffer[kPassRows * kGroupTiles * kTile];
    constexpr int64_t ldo = kGroupTiles * kTile;
    for (int64_t g = lo; g < hi; ++g) {
      const int64_t first = g * group_tiles, last = std::min(tiles, first + group_tiles);
      const int64_t col = first * kTile, width = std::min(n, last * kTile) - col;
      for (int64_t r = 0; r < tokens; r += per_pass) {
        const int rows = static_cast<int>(std::min<int64_t>(per_pass, tokens - r));
#if defined(SPECSERVE_TILES)
        // whichever thread claims this chunk configures its own tiles (and releases them
        // below): a tile instruction on a thread without a configuration faults
        const bool tile_pass = tiled && rows > 1;
        if (tile_pass) configure_tiles(rows);
#endif
        for (int64_t t = first; t < last; ++t) {
          const uint8_t* w = wp + t * blocks * size;
          float* out = buffer + (t - first) * kTile;
#if defined(SPECSERVE_TILES)
          if (tile_pass) {
            if (bits == 4)
              block_tile_amx_rows<4>(rows, w, blocks, cp + r * k, scale + r * blocks,
                                     sum + r * blocks, k, out, ldo);
            else
              block_tile_amx_rows<8>(rows, w, blocks, cp + r * k, scale + r * blocks,
                                     sum + r * blocks, k, out, ldo);
            continue;
          }
#endif
          if (bits == 4)
            block_tile_rows<4>(rows, w, blocks, cp + r * k, scale + r * blocks,
                               sum + r * blocks, k, out, ldo);
          else
            block_tile_rows<8>(rows, w, blocks, cp + r * k, scale + r * blocks,
                               sum + r * blocks, k, out, ldo);
        }
        for (int i = 0; i < rows; ++i)
          store_row(yp + (r + i) * n + col, buffer + i * ldo, bp != nullptr ? bp + col : nullptr,
                    width);
      }
    }
#if defined(SPECSERVE_TILES)
    if (tiled) amx::release();
#endif
  });
}

// x [tokens, in] (float32 or bfloat16) times a block_pack-ed [out, in] matrix (+ bias): [tokens, out]
at::Tensor block_product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         int64_t bits, const c10::optional<at::Tensor>& bias) {
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
  DISPATCH(x.scalar_type(), "block_product", [&] {
    block_product_rows<scalar_t>(x.data_ptr<scalar_t>(), tokens, k, packed.data_ptr<uint8_t>(), n,
                                 bits, b32.defined() ? b32.data_ptr<float>() : nullptr,
                                 y.data_ptr<scalar_t>());
  });
  return y;
}

template void block_product_rows<float>(const float*, int64_t, int64_t, const uint8_t*, int64_t,
                                        int64_t, const float*, float*);
template void block_product_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, int64_t,
                                                const uint8_t*, int64_t, int64_t, const float*,
                                                c10::BFloat16*);

}  // namespace specserve
