// Large tables backed by 2 MiB pages (Linux's transparent huge pages).
//
// A lookup or an update visits rows scattered over the whole table. With
// 4 KiB pages a table past a few MiB outgrows the TLB, so nearly every row
// costs a page-table walk on top of its cache miss; with 2 MiB pages a
// 1.2 GiB table needs 640 entries, and the walks all but vanish. XLA:CPU
// allocates with malloc, whose pages are 4 KiB unless the process asked
// otherwise (THP in "madvise" mode, the common default), so the kernels ask
// for a table's pages themselves: MADV_HUGEPAGE, then MADV_COLLAPSE (Linux
// 6.1+), which copies the pages already there into huge ones, once.
//
// Only a buffer seen a second time is collapsed: a donated table in a train
// step (its lookup and its update see the same buffer), or a parameter that
// eval or serving reads call after call. A buffer that lives for one call
// is not worth the copy. Each address is collapsed at most once, so a loop
// that copies its table every step (not donated) pays once per address its
// allocator hands out, not once per step; a later buffer of the same size
// at an address already collapsed keeps the pages malloc gave it.
//
// Advice only: where the kernel lacks either call, THP is "never", or
// EMBEDLIB_HUGE_PAGES is 0 (options.SWITCHED_OFF), nothing changes. The values
// never do: the kernel moves the bytes as they are.

#ifndef EMBEDLIB_KERNELS_CPU_HUGE_PAGES_H_
#define EMBEDLIB_KERNELS_CPU_HUGE_PAGES_H_

#include <sys/mman.h>

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif

namespace embedlib_cpu {

// Buffers smaller than this stay as malloc made them: a table this small
// mostly fits the TLB's reach, and the collapse would buy little.
constexpr size_t kHugePagesFrom = size_t{32} << 20;
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

// Whether EMBEDLIB_HUGE_PAGES turns the advice off: options.switched_off's
// rule (0, false, off or no, in any case, spaces around ignored).
inline bool HugePagesSwitchedOff() {
  const char* v = std::getenv("EMBEDLIB_HUGE_PAGES");
  if (v == nullptr) return false;
  std::string s;
  for (const char* c = v; *c; ++c) {
    if (!std::isspace(static_cast<unsigned char>(*c))) {
      s += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    }
  }
  return s == "0" || s == "false" || s == "off" || s == "no";
}

// Notes that a kernel is about to visit rows of [data, data + bytes); backs
// the 2 MiB pages inside it with huge pages the second time it is seen.
inline void AdviseHugePages(const void* data, size_t bytes) {
  if (bytes < kHugePagesFrom || HugePagesSwitchedOff()) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return;
  // Buffers by their first huge page: where they end, and how many times
  // they were seen (2: collapsed). Bounded: cleared when full.
  struct Seen {
    uintptr_t end = 0;
    int times = 0;
  };
  static std::mutex mu;
  static auto* seen = new std::unordered_map<uintptr_t, Seen>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (seen->size() >= 4096) seen->clear();
    Seen& s = (*seen)[begin];
    if (s.end != end) s = Seen{end, 0};
    if (s.times >= 2 || ++s.times < 2) return;
  }
  void* start = reinterpret_cast<void*>(begin);
  if (madvise(start, end - begin, MADV_HUGEPAGE) == 0) madvise(start, end - begin, MADV_COLLAPSE);
}

}  // namespace embedlib_cpu

#endif  // EMBEDLIB_KERNELS_CPU_HUGE_PAGES_H_
