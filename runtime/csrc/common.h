// What every kernel file shares: the dtype dispatch, the split of a call's work across
// threads, scalar loads and stores, and argument checks.
//
// Every kernel computes each token (a row of the packed batch) on its own, with a fixed
// order of floating-point operations that depends on nothing but that token: its result
// is bitwise the same whatever else shares the pass, however many threads run it, and
// whichever instruction set the build has (vec.h). Tensors are float32 or bfloat16;
// arithmetic is float32 and each output is rounded once.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

namespace specserve {

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

// The team of threads a whole-stack pass runs on (layer_stack.cpp), as this thread sees
// it: its index and the team's size (size 0: no team, kernels split their work by
// at::parallel_for). A pass of a few tokens makes ~300 short kernel calls; as parallel
// regions each would wake the workers (from sleep, off the main thread), so the stack
// starts one region and the kernels take their share of each call in it, with a spin
// barrier between calls.
struct Team {
  int64_t index = 0, size = 0;
};
extern thread_local Team team;

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

// A product streams its matrix once; prefetching this many bytes ahead of the part it
// multiplies keeps more of the stream in flight than the hardware's prefetchers do (one
// core: the layers' products and the head 5-10% faster)
constexpr int64_t kPrefetchBytes = 8192;

// Threads that run split() work: the team's size, else PyTorch's intra-op threads
inline int64_t split_threads() { return team.size > 0 ? team.size : at::get_num_threads(); }

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) {
  return bf16_float(reinterpret_cast<const uint16_t*>(p)[i]);
}
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline void store(c10::BFloat16* p, int64_t i, float v) { p[i] = c10::BFloat16(v); }

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

}  // namespace specserve
