// Work split over XLA's intra-op thread pool (the FFI's ThreadPool context).
//
// A handler's work is cut into tasks; the calling thread and up to
// `workers - 1` helpers scheduled on XLA's pool claim them from one counter
// until none is left, and the call returns once every claimed task is done.
// The calling thread never waits for a helper to start: XLA runs independent
// thunks on the same pool, so a helper may start late or, with every pool
// thread busy, after the caller has done all the work alone. That is also
// why a helper never waits on the caller for long: it waits only until the
// caller, which waits on nothing, hands out the tasks, so nothing here can
// deadlock on a full pool. A helper that starts after the last task was
// claimed touches only the shared counters (heap-allocated, kept alive by
// the helper), not the caller's stack.
//
// A helper's start is a sleeping pool thread woken: tens of microseconds
// where the scheduler wakes it on an idle CPU, and milliseconds where it
// queues it behind the caller on the caller's CPU until that CPU's load is
// balanced, as a kernel that packs woken threads onto busy CPUs does
// (benchmarks/README.md, "The helper's late start"). A handler with serial
// work before its tasks asks for its helpers first (Team), so that their
// start overlaps that work.
//
// Results must not depend on which thread runs a task: tasks write disjoint
// outputs, so the results are the same for any number of workers.

#ifndef EMBEDLIB_KERNELS_CPU_POOL_H_
#define EMBEDLIB_KERNELS_CPU_POOL_H_

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace embedlib_cpu {

// Threads worth using for `items` units of work at `grain` units a thread:
// at most the pool's threads and the CPUs this process may run on.
inline int PoolWorkers(xla::ffi::ThreadPool& pool, int64_t items, int64_t grain) {
  cpu_set_t set;
  int64_t cpus = 1;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t by_work = std::max<int64_t>(1, items / std::max<int64_t>(1, grain));
  return static_cast<int>(std::min<int64_t>({threads, cpus, by_work, 8}));
}

namespace internal {

struct TaskCounter {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> ready{false};   // count, body and run are set
  int64_t count = 0;
  const void* body = nullptr;
  void (*run)(const void* body, int64_t task) = nullptr;

  // Runs tasks until none is left to claim. `body` is read only after a
  // successful claim, while the caller still waits for that task.
  void Work() {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      run(body, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace internal

// Helpers asked for before the tasks are known (the header's last
// paragraph). Each waits until Run hands out the tasks, or until the team
// ends without them, then claims tasks as the calling thread does. Run at
// most once.
class Team {
 public:
  Team(xla::ffi::ThreadPool& pool, int workers)
      : counter_(std::make_shared<internal::TaskCounter>()) {
    for (int w = 1; w < workers; ++w) {
      pool.Schedule([counter = counter_] {
        while (!counter->ready.load(std::memory_order_acquire)) std::this_thread::yield();
        counter->Work();
      });
    }
  }
  // Releases the helpers still waiting: with no tasks, they return.
  ~Team() { counter_->ready.store(true, std::memory_order_release); }
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  // Runs body(task) for every task in [0, tasks), on the calling thread and
  // the helpers that have started; returns when all are done.
  template <typename Body>
  void Run(int64_t tasks, const Body& body) {
    internal::TaskCounter& c = *counter_;
    c.count = tasks;
    c.body = &body;
    c.run = [](const void* b, int64_t i) { (*static_cast<const Body*>(b))(i); };
    c.ready.store(true, std::memory_order_release);
    c.Work();
    while (c.done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  }

 private:
  std::shared_ptr<internal::TaskCounter> counter_;
};

// Runs body(task) for every task in [0, tasks), on the calling thread and
// up to `workers - 1` helpers from `pool`; returns when all are done.
template <typename Body>
void ParallelTasks(xla::ffi::ThreadPool& pool, int workers, int64_t tasks, const Body& body) {
  if (workers <= 1 || tasks <= 1) {
    for (int64_t i = 0; i < tasks; ++i) body(i);
    return;
  }
  Team(pool, workers).Run(tasks, body);
}

// Runs body(begin, end) over [0, items) cut into `workers * split` contiguous
// ranges (more ranges than workers, so that a late helper still finds work).
template <typename Body>
void PoolRanges(xla::ffi::ThreadPool& pool, int workers, int64_t items, const Body& body,
                    int64_t split = 4) {
  const int64_t tasks = workers <= 1 ? 1 : std::min<int64_t>(items, workers * split);
  ParallelTasks(pool, workers, tasks, [&](int64_t t) {
    body(items * t / tasks, items * (t + 1) / tasks);
  });
}

}  // namespace embedlib_cpu

#endif  // EMBEDLIB_KERNELS_CPU_POOL_H_
