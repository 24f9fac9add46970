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
//   bare_floor VOCAB WIDTH IDS_FILE BATCH COPY_BYTES ROUNDS THREADS
//
// IDS_FILE: batches of BATCH ids each, int32, native byte order; round r
// takes batch r modulo their number, as the benchmark's steps take a new
// batch each (one batch over and over would find its rows in the caches
// from the round before). COPY_BYTES: what the copy reads and writes in all
// (an in-place x + 1 over COPY_BYTES / 2).
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
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s VOCAB WIDTH IDS_FILE BATCH COPY_BYTES ROUNDS THREADS\n",
                 argv[0]);
    return 2;
  }
  const int64_t vocab = std::atoll(argv[1]), width = std::atoll(argv[2]);
  const int64_t n = std::atoll(argv[4]), copy_bytes = std::atoll(argv[5]);
  const int rounds = std::atoi(argv[6]), threads = std::max(1, std::atoi(argv[7]));
  std::vector<int32_t> all_ids;
  if (FILE* f = std::fopen(argv[3], "rb")) {
    int32_t buf[4096];
    for (size_t got; (got = std::fread(buf, 4, 4096, f)) > 0;) {
      all_ids.insert(all_ids.end(), buf, buf + got);
    }
    std::fclose(f);
  } else {
    std::fprintf(stderr, "bare_floor: cannot read the ids file %s\n", argv[3]);
    return 2;
  }
  if (n < 1 || all_ids.empty() || all_ids.size() % n != 0) {
    std::fprintf(stderr, "bare_floor: %zu ids are not whole batches of %lld\n", all_ids.size(),
                 static_cast<long long>(n));
    return 2;
  }
  const int64_t batches = static_cast<int64_t>(all_ids.size()) / n;
  for (int32_t id : all_ids) {
    if (id < 0 || id >= vocab) {
      std::fprintf(stderr, "bare_floor: id %d outside [0, %lld): pass valid ids only\n", id,
                   static_cast<long long>(vocab));
      return 2;
    }
  }
  // Each batch's distinct rows, ascending.
  std::vector<std::vector<int32_t>> batch_rows(batches);
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<int32_t>& rows = batch_rows[b];
    rows.assign(all_ids.begin() + b * n, all_ids.begin() + (b + 1) * n);
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  const int64_t distinct = static_cast<int64_t>(batch_rows[0].size());

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

  auto two_passes = [&](Barrier& barrier, int64_t batch) {
    return [&, batch](int t) {
      const int32_t* ids = all_ids.data() + batch * n;
      const std::vector<int32_t>& rows = batch_rows[batch];
      const int64_t count = static_cast<int64_t>(rows.size());
      const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
      for (int64_t i = begin; i < end; ++i) {
        if (i + kAhead < end) Prefetch(table + ids[i + kAhead] * width, row_bytes, 0);
        std::memcpy(&out[i * width], table + ids[i] * width, row_bytes);
      }
      barrier.Wait(threads);
      const int64_t first = count * t / threads, last = count * (t + 1) / threads;
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
    const double p = Timed(threads, two_passes(barrier, r % batches));
    const double c = Timed(threads, copy_pass);
    if (r >= warm) {
      passes_ms.push_back(p);
      copy_ms.push_back(c);
    }
  }
  // Each distinct row was raised by 1 per round, every other row is 0, and
  // the last gather read each id's row as it stood before the last round.
  // Each row raised once in every round whose batch holds it; the last
  // round's gathered rows read before its raise.
  std::vector<int32_t> raised(vocab, 0);
  for (int r = 0; r < warm + rounds; ++r) {
    for (int32_t row : batch_rows[r % batches]) ++raised[row];
  }
  bool ok = true;
  for (int64_t row = 0; row < vocab && ok; ++row) {
    const float want = static_cast<float>(raised[row]);
    for (int64_t c = 0; c < width; ++c) ok &= table[row * width + c] == want;
  }
  const int32_t* last_ids = all_ids.data() + ((warm + rounds - 1) % batches) * n;
  for (int64_t i = 0; i < n && ok; ++i) {
    ok &= out[i * width] == static_cast<float>(raised[last_ids[i]] - 1);
  }
  std::printf("{\"ids\": %lld, \"batches\": %lld, \"distinct\": %lld, \"threads\": %d, ",
              static_cast<long long>(n), static_cast<long long>(batches),
              static_cast<long long>(distinct), threads);
  PrintList("two_passes_ms", passes_ms);
  std::printf(", ");
  PrintList("copy_ms", copy_ms);
  std::printf(", \"copy_bytes\": %lld, \"verified\": %s}\n",
              static_cast<long long>(copy_len * 8), ok ? "true" : "false");
  munmap(mapped, table_bytes);
  return ok ? 0 : 1;
}
