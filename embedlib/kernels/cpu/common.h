// Helpers shared by embedlib's CPU kernels (XLA FFI handlers).
//
// Both kernels visit rows scattered over a large table, one or a few cache
// lines each: they are bound by memory latency, not bandwidth, so they ask
// for rows a few iterations ahead instead of waiting on each miss, and split
// the work over a few threads.

#ifndef EMBEDLIB_KERNELS_CPU_COMMON_H_
#define EMBEDLIB_KERNELS_CPU_COMMON_H_

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

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

// Threads for `items` rows of work: the CPUs this process may run on, at most
// 8 (latency-bound work gains little beyond), and one per 2,048 rows.
inline int ThreadCount(int64_t items) {
  cpu_set_t set;
  int cpus = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  const int64_t by_work = std::max<int64_t>(1, items / 2048);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({cpus, 8, by_work})));
}

// Runs body(t) for t in [0, threads), body(0) on the calling thread.
template <typename Body>
void ParallelFor(int threads, const Body& body) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { body(t); });
  body(0);
  for (auto& thread : pool) thread.join();
}

// Runs body(begin, end) over [0, items) split into ThreadCount(items)
// contiguous ranges.
template <typename Body>
void ParallelRanges(int64_t items, const Body& body) {
  const int threads = ThreadCount(items);
  ParallelFor(threads, [&](int t) { body(items * t / threads, items * (t + 1) / threads); });
}

// Copies `in` to `out` unless XLA aliased them (a donated input).
template <typename In, typename Out>
void CopyUnlessAliased(const In& in, Out& out) {
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

}  // namespace embedlib_cpu

#endif  // EMBEDLIB_KERNELS_CPU_COMMON_H_
