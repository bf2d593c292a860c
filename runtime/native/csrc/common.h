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
// it: its index, the team's size (size 0: no team) and the team's two counters. A pass of
// a few tokens makes ~300 short kernel calls; as parallel regions each would wake the
// workers (from sleep, off the main thread), so the stack starts one region and the
// kernels share out each call's work in it; between calls a member waits until every
// chunk of the calls so far is done (layer_stack.cpp), not for the other members.
struct Team {
  int64_t index = 0, size = 0;
  std::atomic<int64_t>* tickets = nullptr;  // chunks claimed, over the pass: only grows
  std::atomic<int64_t>* done = nullptr;     // chunks finished, over the pass: only grows
  int64_t seen = 0;  // the chunks of every split() call this thread has made
};
extern thread_local Team team;

// Chunks a call's work is cut into, per thread at most: a thread the system preempts (to
// run the HTTP event loop) holds up one chunk, while the others claim the rest
constexpr int64_t kChunksPerThread = 4;

// f(lo, hi) over [begin, end), cut into at most kChunksPerThread chunks a thread of at
// least `grain` items each, which the threads claim one at a time: a team from its shared
// counter (every member makes the same calls in the same order and waits for the earlier
// calls' chunks before the next call, so the n-th call owns the tickets after the earlier
// calls' chunks, and a ticket is only taken while it is this call's), otherwise
// PyTorch's threads from a counter of the call's own. Every item is computed the same
// whichever thread takes it.
template <typename F>
void split(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t threads =
      team.size > 0 ? team.size : at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t items = end - begin;
  const int64_t chunks = std::min((items + grain - 1) / grain, threads * kChunksPerThread);
  const int64_t chunk = (items + chunks - 1) / chunks;
  auto run = [&](int64_t i) {
    const int64_t lo = begin + i * chunk;
    if (lo < end) f(lo, std::min(end, lo + chunk));
  };
  if (team.size > 0) {
    const int64_t first = team.seen, last = first + chunks;
    team.seen = last;
    int64_t ticket = team.tickets->load(std::memory_order_relaxed);
    while (ticket < last) {
      if (!team.tickets->compare_exchange_weak(ticket, ticket + 1, std::memory_order_relaxed))
        continue;  // ticket now holds the counter's value
      run(ticket - first);
      team.done->fetch_add(1, std::memory_order_release);
      ticket = team.tickets->load(std::memory_order_relaxed);
    }
    return;
  }
  if (chunks == 1 || threads == 1) return f(begin, end);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < chunks;
         i = next.fetch_add(1, std::memory_order_relaxed))
      run(i);
  });
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

// y[c] = out[c] (+ bias[c], float32, or null) for c < width, rounded once to T
template <typename T>
inline void store_row(T* y, const float* out, const float* bias, int64_t width) {
  int64_t c = 0;
  for (; c + 16 <= width; c += 16)
    store(y + c, bias != nullptr ? add(load(out + c), load(bias + c)) : load(out + c));
  for (; c < width; ++c) store(y, c, bias != nullptr ? out[c] + bias[c] : out[c]);
}

// Bring a row's bytes toward the core ahead of use (a prefetch never faults: a row past
// the end of a buffer is harmless).
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

// The share-th of `shares` equal parts of the cache lines of [p, p + bytes): a loop that
// takes a long while over each part of a matrix's stream (a pass of many tokens) spreads
// its prefetches over the part's steps rather than issuing them all at once, which the
// core's queue of misses in flight would drop or stall on
inline void prefetch_share(const void* p, int64_t bytes, int64_t share, int64_t shares) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t lo = (base + bytes * share / shares) & ~uintptr_t{63};
  const uintptr_t hi = base + bytes * (share + 1) / shares;
  for (uintptr_t a = lo; a < hi; a += 64) __builtin_prefetch(reinterpret_cast<const char*>(a), 0, 3);
}

inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, " must be a contiguous [tokens, n] tensor");
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace specserve
