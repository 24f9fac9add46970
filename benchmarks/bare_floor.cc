// The two passes over the table every sparse step makes, in bare C++ loops,
// beside a streamed copy of the step's bytes, timed in the same process.
//
// No XLA, no dedup, no gradient, no rule: the gather of every id's row into
// an [ids, width] output, then a barrier (a step's update needs the gradient
// of what the gather looked up), then each distinct row read and written
// back plus 1, in place, in ascending row order (the cheapest order for that
// pass). Both cores, rows prefetched a few ids ahead, the table on 2 MiB
// pages as embedlib's kernels put it. Whatever a sparse step does beyond
// this is its own overhead; what this costs over the copy is the price of
// random rows against a stream on this machine (bandwidth.py calls it).
//
//   bare_floor VOCAB WIDTH IDS_FILE COPY_BYTES ROUNDS THREADS
//
// IDS_FILE: the step's ids, int32, native byte order. COPY_BYTES: what the
// copy reads and writes in all (an in-place x + 1 over COPY_BYTES / 2).
// Prints one JSON object: the milliseconds of each round's two passes and
// copy, and whether the table was left as the passes must leave it.

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kAhead = 8;  // rows fetched ahead, as embedlib's kernels do

double NowMs() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void Prefetch(const void* p, int64_t bytes, int write) {
  for (int64_t b = 0; b < bytes; b += 64) {
    if (write) {
      __builtin_prefetch(static_cast<const char*>(p) + b, 1);
    } else {
      __builtin_prefetch(static_cast<const char*>(p) + b, 0);
    }
  }
}

// Runs body(thread) on `threads` threads (the caller is thread 0) and
// returns the milliseconds until all are done.
template <typename Body>
double Timed(int threads, const Body& body) {
  const double start = NowMs();
  std::vector<std::thread> helpers;
  for (int t = 1; t < threads; ++t) helpers.emplace_back(body, t);
  body(0);
  for (auto& h : helpers) h.join();
  return NowMs() - start;
}

// A barrier for one use by `threads` threads.
struct Barrier {
  std::atomic<int> arrived{0};
  void Wait(int threads) {
    arrived.fetch_add(1);
    while (arrived.load() < threads) std::this_thread::yield();
  }
};

void PrintList(const char* name, const std::vector<double>& ms) {
  std::printf("\"%s\": [", name);
  for (size_t i = 0; i < ms.size(); ++i) std::printf(i ? ", %.4f" : "%.4f", ms[i]);
  std::printf("]");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s VOCAB WIDTH IDS_FILE COPY_BYTES ROUNDS THREADS\n", argv[0]);
    return 2;
  }
  const int64_t vocab = std::atoll(argv[1]), width = std::atoll(argv[2]);
  const int64_t copy_bytes = std::atoll(argv[4]);
  const int rounds = std::atoi(argv[5]), threads = std::max(1, std::atoi(argv[6]));
  std::vector<int32_t> ids;
  if (FILE* f = std::fopen(argv[3], "rb")) {
    int32_t buf[4096];
    for (size_t got; (got = std::fread(buf, 4, 4096, f)) > 0;) ids.insert(ids.end(), buf, buf + got);
    std::fclose(f);
  } else {
    std::fprintf(stderr, "bare_floor: cannot read the ids file %s\n", argv[3]);
    return 2;
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) {
      std::fprintf(stderr, "bare_floor: id %d outside [0, %lld): pass valid ids only\n", id,
                   static_cast<long long>(vocab));
      return 2;
    }
  }
  std::vector<int32_t> rows(ids);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const int64_t distinct = static_cast<int64_t>(rows.size());

  const int64_t row_bytes = width * 4, table_bytes = vocab * row_bytes;
  void* mapped = mmap(nullptr, table_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                      -1, 0);
  if (mapped == MAP_FAILED) {
    std::fprintf(stderr, "bare_floor: cannot map a table of %lld bytes\n",
                 static_cast<long long>(table_bytes));
    return 2;
  }
  float* table = static_cast<float*>(mapped);
#ifdef MADV_HUGEPAGE
  madvise(table, table_bytes, MADV_HUGEPAGE);
#endif
  std::memset(table, 0, table_bytes);
  std::vector<float> out(n * width, 0.0f);
  std::vector<float> copy(std::max<int64_t>(1, copy_bytes / 8), 0.0f);
  const int64_t copy_len = static_cast<int64_t>(copy.size());

  auto two_passes = [&](Barrier& barrier) {
    return [&](int t) {
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end) Prefetch(table + ids[i + kAhead] * width, row_bytes, 0);
        std::memcpy(&out[i * width], table + ids[i] * width, row_bytes);
      }
      barrier.Wait(threads);
      const int64_t first = distinct * t / threads, last = distinct * (t + 1) / threads;
      for (int64_t k = first; k < last; ++k) {
        if (k + kAhead < last) Prefetch(table + rows[k + kAhead] * width, row_bytes, 1);
        float* w = table + rows[k] * width;
        for (int64_t c = 0; c < width; ++c) w[c] += 1.0f;
      }
    };
  };
  auto copy_pass = [&](int t) {
    float* x = copy.data();
    for (int64_t i = copy_len * t / threads, end = copy_len * (t + 1) / threads; i < end; ++i) {
      x[i] += 1.0f;
    }
  };

  std::vector<double> passes_ms, copy_ms;
  const int warm = 2;  // untimed rounds: the pages touched, the table moved to 2 MiB pages
  for (int r = 0; r < warm + rounds; ++r) {
    Barrier barrier;
    const double p = Timed(threads, two_passes(barrier));
    const double c = Timed(threads, copy_pass);
    if (r >= warm) {
      passes_ms.push_back(p);
      copy_ms.push_back(c);
    }
  }
  // Each distinct row was raised by 1 per round, every other row is 0, and
  // the last gather read each id's row as it stood before the last round.
  const float done = static_cast<float>(warm + rounds);
  bool ok = true;
  std::vector<char> touched(vocab, 0);
  for (int32_t row : rows) touched[row] = 1;
  for (int64_t row = 0; row < vocab && ok; ++row) {
    const float want = touched[row] ? done : 0.0f;
    for (int64_t c = 0; c < width; ++c) ok &= table[row * width + c] == want;
  }
  for (int64_t i = 0; i < n && ok; ++i) ok &= out[i * width] == done - 1.0f;
  std::printf("{\"ids\": %lld, \"distinct\": %lld, \"threads\": %d, ",
              static_cast<long long>(n), static_cast<long long>(distinct), threads);
  PrintList("two_passes_ms", passes_ms);
  std::printf(", ");
  PrintList("copy_ms", copy_ms);
  std::printf(", \"copy_bytes\": %lld, \"verified\": %s}\n",
              static_cast<long long>(copy_len * 8), ok ? "true" : "false");
  munmap(mapped, table_bytes);
  return ok ? 0 : 1;
}
