// AMX tiles for the block products (block_products.cpp): the few tile instructions they use
// (load a configuration, load, zero, TDPBSUD, store, release), and whether this process may
// use them.
//
// Built for the amx level (-mamx-tile -mamx-int8) these are the instructions themselves.
// Built with SPECSERVE_AMX_EMULATE (on an AVX512-VNNI host, for tests only: the
// "amx_emulated" build of runtime/native/kernels.py) each is a small function doing what Intel's
// documentation says the instruction does, on arrays a thread of its own holds, so the
// same tile code runs and is checked bitwise on a host without AMX: a thread that has not
// loaded a configuration, or shapes the instruction would fault on, are an error.
//
// Linux lets a process use tile data only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XTILEDATA); runtime/native/kernels.py asks before it loads the amx level, and the tiles are
// used here only where the permission is held, so a build loaded without it runs the
// AVX512-VNNI path instead of faulting. A thread loads the configuration itself before its
// tiles are used (every chunk of work does, on whichever thread claims it) and releases
// the tiles after.

#pragma once

#if defined(SPECSERVE_AMX_EMULATE) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
#error "the emulated tiles are built on the avx512_vnni level's flags"
#endif
#if defined(SPECSERVE_AMX_EMULATE) || (defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
                                       defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define SPECSERVE_TILES 1
#endif

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(SPECSERVE_TILES) && !defined(SPECSERVE_AMX_EMULATE)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specserve::amx {

// The 64 bytes ldtilecfg reads (palette 1): each tile's rows and bytes a row
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(Config) == 64, "ldtilecfg reads 64 bytes");

#if defined(SPECSERVE_AMX_EMULATE)
constexpr int kTiles = 8, kRows = 16, kRowBytes = 64;  // palette 1's eight 1 KiB tiles

struct State {  // what the tile registers and TILECFG hold, per thread
  bool configured = false;
  Config config;
  alignas(64) uint8_t data[kTiles][kRows][kRowBytes];
};
inline thread_local State state;
inline std::atomic<int64_t> products{0};  // TDPBSUDs run, all threads (tests count them)

inline State& configured() {
  TORCH_CHECK(state.configured, "tile instruction on a thread without a tile configuration");
  return state;
}

// LDTILECFG: the configuration, every tile zeroed
inline void load_config(const Config* c) {
  TORCH_CHECK(c->palette == 1 && c->start_row == 0, "tile palette must be 1");
  for (int t = 0; t < kTiles; ++t)
    TORCH_CHECK(c->rows[t] <= kRows && c->colsb[t] <= kRowBytes, "tile ", t, " too large");
  state.config = *c;
  std::memset(state.data, 0, sizeof state.data);
  state.configured = true;
}

// TILELOADD: rows[T] rows of colsb[T] bytes, `stride` bytes apart; the rest of the tile zero
template <int T>
inline void load(const void* base, int64_t stride) {
  State& s = configured();
  std::memset(s.data[T], 0, sizeof s.data[T]);
  for (int r = 0; r < s.config.rows[T]; ++r)
    std::memcpy(s.data[T][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
}

// TILEZERO
template <int T>
inline void zero() {
  std::memset(configured().data[T], 0, sizeof state.data[T]);
}

// TDPBSUD: C[m][n] += sum over k < colsb[A] / 4 and i < 4 of A[m][4k + i] (signed bytes) *
// B[k][4n + i] (unsigned bytes), in int32 that wraps, for m < rows[C] and n < colsb[C] / 4;
// the shapes must agree (rows[A] = rows[C], rows[B] = colsb[A] / 4, colsb[B] = colsb[C])
template <int C, int A, int B>
inline void dpbsud() {
  State& s = configured();
  const Config& c = s.config;
  TORCH_CHECK(c.rows[A] == c.rows[C] && c.rows[B] * 4 == c.colsb[A] && c.colsb[B] == c.colsb[C] &&
                  c.colsb[A] % 4 == 0 && c.colsb[C] % 4 == 0,
              "TDPBSUD on tiles of shapes that do not agree");
  for (int m = 0; m < c.rows[C]; ++m)
    for (int n = 0; n < c.colsb[C] / 4; ++n) {
      uint32_t dot;
      std::memcpy(&dot, s.data[C][m] + 4 * n, 4);
      for (int k = 0; k < c.colsb[A] / 4; ++k)
        for (int i = 0; i < 4; ++i)
          dot += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(s.data[A][m][4 * k + i])) *
                                       static_cast<int32_t>(s.data[B][k][4 * n + i]));
      std::memcpy(s.data[C][m] + 4 * n, &dot, 4);
    }
  products.fetch_add(1, std::memory_order_relaxed);
}

// TILESTORED: rows[T] rows of colsb[T] bytes to base, `stride` bytes apart
template <int T>
inline void store(void* base, int64_t stride) {
  State& s = configured();
  for (int r = 0; r < s.config.rows[T]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[T][r], s.config.colsb[T]);
}

// TILERELEASE: tiles and configuration back to their initial state
inline void release() {
  state.configured = false;
  state.config = Config{};
}

inline bool permitted() { return true; }
inline const char* kind() { return "amx_emulated"; }
#elif defined(SPECSERVE_TILES)
// The instructions as inline assembly (AT&T operand order) naming the tile by number, each
// a compiler barrier: a tile load reads bytes the compiler must have stored (a 4-bit
// block's unpacked codes), and a store writes bytes read after it
inline void load_config(const Config* c) { _tile_loadconfig(c); }
template <int T>
inline void load(const void* base, int64_t stride) {
  static_assert(T >= 0 && T < 8, "tiles 0 to 7");
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
template <int T>
inline void zero() {
  static_assert(T >= 0 && T < 8, "tiles 0 to 7");
  asm volatile("tilezero %%tmm%c0" ::"i"(T));
}
template <int C, int A, int B>
inline void dpbsud() {  // C += A (signed) x B (unsigned)
  static_assert(C >= 0 && C < 8 && A >= 0 && A < 8 && B >= 0 && B < 8, "tiles 0 to 7");
  asm volatile("tdpbsud %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}
template <int T>
inline void store(void* base, int64_t stride) {
  static_assert(T >= 0 && T < 8, "tiles 0 to 7");
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
}
inline void release() { _tile_release(); }

// Whether Linux lets this process use tile data: asked for (the same request
// runtime/native/kernels.py makes before loading this level; asking again is harmless) and
// checked once
inline bool permitted() {
  static const bool held = [] {
    constexpr long kGetPermission = 0x1022, kRequestPermission = 0x1023, kTileData = 18;
    syscall(SYS_arch_prctl, kRequestPermission, kTileData);
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, kGetPermission, &features) == 0 &&
           ((features >> kTileData) & 1) != 0;
  }();
  return held;
}
inline const char* kind() { return permitted() ? "amx" : "none"; }
#else
inline bool permitted() { return false; }
inline const char* kind() { return "none"; }
#endif

}  // namespace specserve::amx
