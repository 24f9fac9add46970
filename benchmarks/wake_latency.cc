// Whether a woken thread works beside the thread that woke it, or after
// it: what a CPU kernel's helper on XLA's pool does once the kernel's
// calling thread asks for it (embedlib/kernels/cpu/pool.h).
//
// One helper thread sleeps on a condition variable, as an idle pool thread
// does. Each round the main thread lets it sleep SLEEP_US, wakes it, and
// both then spin for BUSY_US of work each (iterations counted beforehand on
// one thread), as a kernel's caller and helper step their tasks. The round's
// time is from the wake to the later of the two ends: BUSY_US where the
// helper started at once on another CPU, up to twice that where the
// scheduler ran it on the waker's CPU and moved it only later. Two ways:
// with both threads free to run on any CPU, and with each pinned to its own
// CPU (where the process may use two).
//
//   wake_latency ROUNDS SLEEP_US BUSY_US
//
// Prints one JSON object: each round's microseconds, both ways ("pinned_us"
// empty on one CPU), and where the helper started ("start_any_us").

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// The CPUs this process may run on, in order.
std::vector<int> AllowedCpus() {
  cpu_set_t set;
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

void Pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

void Unpin(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  sched_setaffinity(0, sizeof set, &set);
}

// `iterations` of a loop the compiler keeps, in registers: a loop through
// memory (a volatile counter) ran at half speed on two threads here, so it
// would not tell a shared CPU from two.
uint64_t Spin(uint64_t iterations) {
  uint64_t x = iterations;
  for (uint64_t i = 0; i < iterations; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    asm volatile("" : "+r"(x));
  }
  return x;
}

// Iterations of Spin in `us` microseconds on this thread, alone.
uint64_t IterationsIn(int us) {
  const uint64_t probe = 1 << 22;
  double best = 1e30;
  for (int k = 0; k < 5; ++k) {
    const Clock::time_point t = Clock::now();
    Spin(probe);
    best = std::min(best, std::chrono::duration<double, std::micro>(Clock::now() - t).count());
  }
  return static_cast<uint64_t>(probe * (us / best));
}

struct Rounds {
  std::vector<double> total_us;   // wake to both ends
  std::vector<double> start_us;   // wake to the helper's start
};

// `rounds` wake-ups of one helper; `waker_cpu` / `helper_cpu` < 0: unpinned.
Rounds Measure(int rounds, int sleep_us, uint64_t work, int waker_cpu, int helper_cpu,
               const std::vector<int>& cpus) {
  std::mutex mu;
  std::condition_variable cv;
  int wakes = 0, done = 0;
  bool stop = false;
  Clock::time_point started, ended;
  std::thread helper([&] {
    if (helper_cpu >= 0) Pin(helper_cpu);
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return stop || wakes > done; });
      if (stop) return;
      started = Clock::now();
      lock.unlock();
      Spin(work);
      lock.lock();
      ended = Clock::now();
      done = wakes;
    }
  });
  if (waker_cpu >= 0) Pin(waker_cpu);
  Rounds out;
  for (int r = 0; r < rounds; ++r) {
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    Clock::time_point woken;
    {
      std::lock_guard<std::mutex> lock(mu);
      ++wakes;
      woken = Clock::now();
    }
    cv.notify_one();
    Spin(work);
    const Clock::time_point mine = Clock::now();
    while (true) {
      std::lock_guard<std::mutex> lock(mu);
      if (done == wakes) {
        const Clock::time_point last = std::max(mine, ended);
        out.total_us.push_back(std::chrono::duration<double, std::micro>(last - woken).count());
        out.start_us.push_back(std::chrono::duration<double, std::micro>(started - woken).count());
        break;
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  helper.join();
  Unpin(cpus);
  return out;
}

void PrintList(const char* name, const std::vector<double>& v, bool last) {
  std::printf("\"%s\": [", name);
  for (size_t i = 0; i < v.size(); ++i) std::printf("%s%.1f", i ? ", " : "", v[i]);
  std::printf("]%s", last ? "" : ", ");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: wake_latency ROUNDS SLEEP_US BUSY_US\n");
    return 2;
  }
  const int rounds = std::atoi(argv[1]), sleep_us = std::atoi(argv[2]),
            busy_us = std::atoi(argv[3]);
  if (rounds < 1 || sleep_us < 0 || busy_us < 0) {
    std::fprintf(stderr, "wake_latency: ROUNDS must be at least 1, SLEEP_US and BUSY_US >= 0\n");
    return 2;
  }
  const std::vector<int> cpus = AllowedCpus();
  const uint64_t work = IterationsIn(busy_us);
  const Rounds any = Measure(rounds, sleep_us, work, -1, -1, cpus);
  Rounds pinned;
  if (cpus.size() >= 2) pinned = Measure(rounds, sleep_us, work, cpus[0], cpus[1], cpus);
  std::printf("{\"cpus\": %zu, \"busy_us\": %d, ", cpus.size(), busy_us);
  PrintList("any_cpu_us", any.total_us, false);
  PrintList("start_any_us", any.start_us, false);
  PrintList("pinned_us", pinned.total_us, true);
  std::printf("}\n");
  return 0;
}
