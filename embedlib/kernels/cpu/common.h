// Helpers shared by embedlib's CPU kernels (XLA FFI handlers).
//
// The kernels visit rows scattered over a large table, one or a few cache
// lines each: they are bound by memory latency, not bandwidth, so they ask
// for rows a few iterations ahead instead of waiting on each miss (and split
// the work over XLA's threads: pool.h).

#ifndef EMBEDLIB_KERNELS_CPU_COMMON_H_
#define EMBEDLIB_KERNELS_CPU_COMMON_H_

#include <cstdint>
#include <cstring>

#include "huge_pages.h"

namespace embedlib_cpu {

// How many rows ahead of the one being processed to prefetch.
constexpr int64_t kAhead = 8;

// Asks for `bytes` bytes at `p` (a row about to be read or written) to be cached.
inline void PrefetchBytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 1);
}

// The dot product of a[0, n) and b[0, n) in kLanes running sums (element j in
// lane j % kLanes), added pairwise at the end: a fixed order, the same on any
// machine and any number of threads. One running sum would be a chain of n
// dependent additions; lanes let the compiler vectorize it (no fast-math:
// each lane keeps its own order).
constexpr int64_t kLanes = 16;

__attribute__((always_inline)) inline float LaneDot(const float* a, const float* b, int64_t n) {
  float lane[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) lane[k] += a[j + k] * b[j + k];
  }
  for (int64_t k = 0; j < n; ++j, ++k) lane[k] += a[j] * b[j];
  for (int64_t half = kLanes / 2; half > 0; half /= 2) {
    for (int64_t k = 0; k < half; ++k) lane[k] += lane[k + half];
  }
  return lane[0];
}

// Readies `out`, a result the kernel updates in place of `in`: a copy of
// `in` unless XLA aliased them (a donated input), on huge pages if it is
// large and lives on (huge_pages.h).
template <typename In, typename Out>
void PrepareInPlace(const In& in, Out& out) {
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  AdviseHugePages(out->untyped_data(), in.size_bytes());
}

}  // namespace embedlib_cpu

#endif  // EMBEDLIB_KERNELS_CPU_COMMON_H_
