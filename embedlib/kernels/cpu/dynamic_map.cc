// One shard's step of a dynamic table's id -> row map for XLA:CPU:
// embedlib/dynamic/step.py's train_step, the same results bit for bit.
//
// The XLA step sorts the step's ids by (bucket, hi, lo) so that distinct ids
// are runs and each bucket's candidates come in ascending order; XLA's CPU
// sort calls a comparator per comparison, and that sort and the bucket scan
// cost more than the table's whole update. Here the step's ids are grouped
// by bucket once (a counting sort), and the buckets are stepped in
// contiguous ranges, tasks on XLA's intra-op pool; each bucket's few ids are
// sorted alone, which makes the distinct ids runs, and the policy of
// embedlib/dynamic/policy.py runs on each bucket as the reference does, one
// id at a time. Buckets share nothing, so nothing is serial but a check of
// the ids and their grouping.
//
// No slot is ever freed (the policy only admits, touches and replaces), so a
// bucket's residents are a prefix of its slots and its free slots the
// suffix: a scan of a bucket stops at its first free slot.
//
// Operands: keys_hi u32[R], keys_lo u32[R], score s32[R] (-1: free),
// sketch u8[buckets * depth * width] (any one element when depth is 0),
// hi u32[m], lo u32[m], own pred[m], bucket s32[m] (local, read where own),
// cells s32[m * depth] (each id's sketch cell per row; any one element when
// depth is 0), clock s32[]. Attributes: bucket_size, eviction (0 none,
// 1 LRU, 2 LFU), admit_after, decay_every, depth, width. Results: the four
// state arrays (aliased to the operands), rows s32[m] (local row, -1 where
// not resident or not own), placed pred[m] (true at the first occurrence in
// input order of each id placed this step), stats s32[4] (resident rows,
// admitted, evicted, own ids whose row is -1).
//
// Also the eval lookup (Lookup: each id looks for its first slot among its
// bucket's residents, as the XLA ops' scan finds it), the marking of the
// placed rows' clocks (MarkPlaced: one pass that reads each placed row's old
// mark and writes its new one, where XLA copies the marks around its gather
// and scatter) and the placing of the rows' initial values (SetRows: XLA:CPU's
// scatter of whole rows goes element by element). For the default
// initializer the map's step does the marking and the drawing itself
// (MapStepPlace), as it places each row, and takes the ids' words as the
// step does, finding each id's bucket and owner itself.

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLfu = 2;
constexpr int64_t kNone = 0;
// Buckets ahead of the one stepped whose first slots are fetched.
constexpr int64_t kBucketsAhead = 4;
// A bucket's ids up to this many are sorted by insertion.
constexpr int64_t kInsertionSort = 32;
// A step's ids per worker on XLA's pool, and tasks (bucket ranges) per
// worker, so that a helper that starts late still finds some.
constexpr int64_t kIdsPerWorker = 8192;
constexpr int64_t kTasksPerWorker = 4;
// Ids ahead of the one grouped whose place in the grouping is fetched: each
// id's write lands on a line of its bucket's, the lines of every bucket are
// too many for the L1 cache, and the stores drain in order, so each store
// whose line is not there holds back the ones after it.
constexpr int64_t kGroupAhead = 48;
// The fewest rows (or ids) worth a worker of their own in the lookup, the
// marking and the placing: each a short pass, where a worker's start costs
// about as much as a few thousand rows.
constexpr int64_t kRowsPerWorker = 2048;

int Workers(ffi::ThreadPool& pool, int64_t rows) {
  return embedlib_cpu::PoolWorkers(pool, rows, kRowsPerWorker);
}

// One id of the step: its words as one key, and its input position.
struct Occurrence {
  uint64_t key;    // (hi << 32) | lo
  int32_t position;
  bool operator<(const Occurrence& o) const {
    return key < o.key || (key == o.key && position < o.position);
  }
};

// An Occurrence's 16 bytes as one value, so that the insertion sort moves
// each in one load and one store. Copied field by field, the stores of an
// element just placed were 8 and 4 bytes wide, and the next 16-byte load of
// it, a few instructions later, could not be served from the store buffer:
// it waited for both stores to reach the cache, the sort's main cost.
typedef long long Whole __attribute__((vector_size(16)));
static_assert(sizeof(Occurrence) == sizeof(Whole));

inline Whole Load(const Occurrence* o) {
  Whole w;
  std::memcpy(&w, o, sizeof w);
  return w;
}

inline void Store(Occurrence* o, Whole w) { std::memcpy(o, &w, sizeof w); }

struct Distinct {
  uint64_t key;    // (hi << 32) | lo: ascending keys are ascending unsigned ids
  int32_t bucket;
  int32_t count;   // occurrences in the step
  int32_t first;   // input position of the first occurrence
  int32_t row;     // local row after the step, -1: none
  bool placed;
};

// murmur3's 32-bit finalizer (dynamic/initializers.py's mix32).
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

// One row of HashedUniform's values, `h` the hash of its key and row
// number: a few multiplies and shifts a value, in vectors of the widest
// kind the CPU has.
__attribute__((target_clones("avx512f", "default")))
void DrawHashedUniform(uint32_t h, const uint32_t* column, int64_t features, float step,
                       float* w) {
  for (int64_t c = 0; c < features; ++c) {
    const uint32_t bits = Mix32(h ^ column[c]);
    const int32_t odd = static_cast<int32_t>((bits >> 7) | 1u) - (int32_t{1} << 24);
    w[c] = static_cast<float>(odd) * step;
  }
}

// The default initializer's values (initializers.HashedUniform.rows, bit
// for bit): each a hash of (key, row, column) mapped to an odd integer
// below 2**24 times `step`, one rounded multiply.
struct HashedUniform {
  uint32_t k0;
  std::vector<uint32_t> column;   // each column's hash under the key
  float step;

  HashedUniform(uint32_t k0, uint32_t k1, int64_t features, float step) : k0(k0), step(step) {
    column.resize(features);
    for (int64_t c = 0; c < features; ++c) {
      column[c] = Mix32(Mix32(static_cast<uint32_t>(c) ^ k1) ^ k0);
    }
  }

  // Global row `row` (as int32, then its bits as uint32: jnp's astype) into `w`.
  void Draw(int32_t row, float* w) const {
    DrawHashedUniform(Mix32(static_cast<uint32_t>(row) ^ k0), column.data(),
                      static_cast<int64_t>(column.size()), step, w);
  }
};

// The placing of a step's rows, done by the map's step itself where the
// table is drawn by the default initializer (EmbedlibDynamicMapStepPlace):
// each placed row's clock mark set to the step's, and a row placed again
// (its old mark not `never`) drawn into the table, as MarkPlaced and
// PlaceHashedUniform do after the step. Each bucket's rows are its own,
// so the tasks write disjoint rows.
struct Place {
  int32_t* placed_at;
  int32_t never;
  float* table;
  int64_t features;
  int32_t offset;             // the shard's first global row
  const HashedUniform* init;
};

// One task's placing. A placed row's mark and values are fetched when its
// slot is chosen and written kPlacedAhead placements later, so that the
// task's buckets go on while they arrive: written at once, each row waited
// for its lines, and the step took what the separate passes took.
constexpr int64_t kPlacedAhead = 8;

class Placer {
 public:
  Placer(const Place* place, int32_t stamp) : place_(place), stamp_(stamp) {}

  // Writes the rows still pending: at the end of the task's buckets.
  void Finish() {
    for (int64_t i = std::max<int64_t>(0, count_ - kPlacedAhead); i < count_; ++i) {
      Write(pending_[i % kPlacedAhead]);
    }
    count_ = 0;
  }

  void Push(int64_t row) {
    if (place_ == nullptr) return;
    __builtin_prefetch(place_->placed_at + row, 1);
    embedlib_cpu::PrefetchBytes(place_->table + row * place_->features, place_->features * 4);
    int64_t& slot = pending_[count_ % kPlacedAhead];
    if (count_ >= kPlacedAhead) Write(slot);
    slot = row;
    ++count_;
  }

 private:
  void Write(int64_t row) const {
    int32_t& mark = place_->placed_at[row];
    if (mark != place_->never) {
      place_->init->Draw(static_cast<int32_t>(row) + place_->offset,
                         place_->table + row * place_->features);
    }
    mark = stamp_;
  }

  const Place* place_;
  int32_t stamp_;
  int64_t pending_[kPlacedAhead];
  int64_t count_ = 0;
};

struct Policy {
  int64_t b, eviction, admit_after, depth, width;
  int32_t t;
};

struct Counts {
  int64_t placed = 0, evicted = 0;
};

// Per-bucket buffers, kept across buckets so that a step allocates them once.
struct Scratch {
  std::vector<char> touched;
  std::vector<Distinct*> cand, admitted;
  std::vector<int64_t> found;
  std::vector<uint64_t> keys;
  std::vector<std::pair<int32_t, int32_t>> victims;
};

// How many of a bucket's `b` slots hold residents: they are a prefix (no
// slot is ever freed), so a full bucket, the usual one once the table has
// filled, is told by its last slot, and another by a binary search, where a
// scan read every resident's score, bucket after bucket.
int64_t Residents(const int32_t* score, int64_t b) {
  if (score[b - 1] >= 0) return b;
  int64_t lo = 0, hi = b - 1;   // score[hi] < 0; residents in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (score[mid] >= 0) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The first of a bucket's `residents` slots holding `key`, or -1, in the
// map's step. Most of a step's ids are new (not resident), so every
// resident's low word is compared first, in vectors without an early exit,
// and only an id with a match is looked for slot by slot. Compiled for
// AVX-512, AVX2 and the baseline, chosen when the library loads
// (target_clones): a cache may be shared by different CPUs.
__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t FindResident(const uint32_t* khi, const uint32_t* klo, int64_t residents, uint64_t key) {
  const uint32_t l = static_cast<uint32_t>(key), h = static_cast<uint32_t>(key >> 32);
  uint32_t any = 0;
  for (int64_t s = 0; s < residents; ++s) any |= klo[s] == l;
  if (!any) return -1;
  for (int64_t s = 0; s < residents; ++s) {
    if (klo[s] == l && khi[s] == h) return s;
  }
  return -1;
}

// The same for the eval lookup, whose ids are mostly resident: the low
// words are compared 16 slots at a time into a bit mask, and the search
// stops at the first 16 that hold the id, where a scan slot by slot compared
// both words up to its slot (and the step's search compares them all).
constexpr int64_t kSlotsAMask = 16;

__attribute__((target_clones("avx512f", "avx2", "default")))
int64_t FindResidentEarly(const uint32_t* khi, const uint32_t* klo, int64_t residents,
                          uint64_t key) {
  const uint32_t l = static_cast<uint32_t>(key), h = static_cast<uint32_t>(key >> 32);
  int64_t s = 0;
  for (; s + kSlotsAMask <= residents; s += kSlotsAMask) {
    uint32_t mask = 0;
    for (int64_t j = 0; j < kSlotsAMask; ++j) mask |= static_cast<uint32_t>(klo[s + j] == l) << j;
    for (; mask; mask &= mask - 1) {
      const int64_t at = s + __builtin_ctz(mask);
      if (khi[at] == h) return at;
    }
  }
  for (; s < residents; ++s) {
    if (klo[s] == l && khi[s] == h) return s;
  }
  return -1;
}

// The first `needed` of a bucket's untouched residents in (score, slot)
// order, ascending: the victims, as a full sort of them all would rank them
// ((score, slot) pairs are distinct). A full table's bucket evicts a few of
// its residents a step. Each untouched resident becomes one 64-bit key,
// (score << 32) | slot, which orders as the pair does (a resident's score
// is never negative), and the victims are taken by the least key, one at a
// time, in passes without branches over the bucket's keys. A short sorted
// list filled while reading the residents took a branch a resident,
// mispredicted whenever the list changed: most of a full table's step.
// Past kFewVictims the keys are partially sorted instead.
constexpr int64_t kFewVictims = 16;
constexpr uint64_t kTaken = ~uint64_t{0};

__attribute__((target_clones("avx512f", "avx2", "default")))
void VictimKeys(const int32_t* score, const char* touched, int64_t residents, uint64_t* keys) {
  for (int64_t v = 0; v < residents; ++v) {
    const uint64_t key = (static_cast<uint64_t>(std::min(score[v], INT_MAX - 1)) << 32) |
                         static_cast<uint64_t>(v);
    keys[v] = touched[v] ? kTaken : key;
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
uint64_t LeastKey(const uint64_t* keys, int64_t residents) {
  uint64_t least = kTaken;
  for (int64_t v = 0; v < residents; ++v) least = std::min(least, keys[v]);
  return least;
}

void RankVictims(int64_t needed, int64_t residents, const int32_t* score,
                 const std::vector<char>& touched, std::vector<uint64_t>& keys,
                 std::vector<std::pair<int32_t, int32_t>>& victims) {
  victims.clear();
  keys.resize(residents);
  VictimKeys(score, touched.data(), residents, keys.data());
  if (needed > kFewVictims) {
    std::vector<uint64_t>::iterator end =
        std::partition(keys.begin(), keys.end(), [](uint64_t k) { return k != kTaken; });
    needed = std::min<int64_t>(needed, end - keys.begin());
    std::partial_sort(keys.begin(), keys.begin() + needed, end);
    for (int64_t i = 0; i < needed; ++i) {
      victims.emplace_back(static_cast<int32_t>(keys[i] >> 32), static_cast<int32_t>(keys[i]));
    }
    return;
  }
  for (int64_t i = 0; i < needed; ++i) {
    const uint64_t least = LeastKey(keys.data(), residents);
    if (least == kTaken) break;   // every untouched resident taken
    const int32_t slot = static_cast<int32_t>(least);
    victims.emplace_back(static_cast<int32_t>(least >> 32), slot);
    keys[slot] = kTaken;
  }
}

// One bucket's step: `ids` are its distinct ids, ascending. Returns the
// bucket's residents after the step.
int64_t StepBucket(const Policy& p, int64_t bucket, std::vector<Distinct>& ids, Scratch& w,
                   uint32_t* khi, uint32_t* klo, int32_t* score, uint8_t* sketch,
                   const int32_t* cells, Placer& placer, Counts& counts) {
  const int64_t base = bucket * p.b;
  std::vector<char>& touched = w.touched;
  touched.assign(p.b, 0);
  std::vector<Distinct*>& cand = w.cand;
  cand.clear();
  // Each id's slot: the first of the bucket's residents (its slots up to the
  // first free one) holding it, as the XLA scan's argmax; then the residents
  // are touched: LRU (and no eviction) set the clock, LFU adds.
  std::vector<int64_t>& found = w.found;
  found.resize(ids.size());
  const int64_t residents = Residents(score + base, p.b);
  for (size_t k = 0; k < ids.size(); ++k) {
    found[k] = FindResident(khi + base, klo + base, residents, ids[k].key);
  }
  for (size_t k = 0; k < ids.size(); ++k) {
    Distinct* d = &ids[k];
    const int64_t s = found[k];
    if (s < 0) {
      cand.push_back(d);
      continue;
    }
    int32_t& sc = score[base + s];
    if (p.eviction == kLfu) {
      sc = sc > INT_MAX - d->count ? INT_MAX : sc + d->count;
    } else {
      sc = p.t;
    }
    touched[s] = 1;
    d->row = static_cast<int32_t>(base + s);
  }
  if (cand.empty()) return residents;
  if (p.depth > 0) {
    uint8_t* sk = sketch + bucket * p.depth * p.width;
    // Every addition first (saturating at 255), then the estimates.
    for (Distinct* d : cand) {
      for (int64_t r = 0; r < p.depth; ++r) {
        uint8_t& c = sk[r * p.width + cells[d->first * p.depth + r]];
        c = static_cast<uint8_t>(std::min<int32_t>(c + d->count, 255));
      }
    }
    std::vector<Distinct*>& admitted = w.admitted;
    admitted.clear();
    for (Distinct* d : cand) {
      int32_t est = 255;
      for (int64_t r = 0; r < p.depth; ++r) {
        est = std::min<int32_t>(est, sk[r * p.width + cells[d->first * p.depth + r]]);
      }
      if (est >= p.admit_after) admitted.push_back(d);
    }
    cand.swap(admitted);
  }
  // No slot is ever freed: the free slots are the suffix after the residents.
  const int64_t free = p.b - residents;
  // Victims in (score, slot) order among the untouched residents, taken from
  // the state before any placement (the step's placements count as touched).
  std::vector<std::pair<int32_t, int32_t>>& victims = w.victims;
  victims.clear();
  bool ranked = false;
  int64_t added = 0;   // placed in free slots (an eviction replaces a resident)
  for (int64_t r = 0; r < static_cast<int64_t>(cand.size()); ++r) {
    int64_t s;
    if (r < free) {
      s = residents + r;
      ++added;
    } else {
      if (p.eviction == kNone) break;
      if (!ranked) {
        RankVictims(static_cast<int64_t>(cand.size()) - free, residents, score + base, touched,
                    w.keys, victims);
        ranked = true;
      }
      if (r - free >= static_cast<int64_t>(victims.size())) break;
      s = victims[r - free].second;
      ++counts.evicted;
    }
    Distinct* d = cand[r];
    touched[s] = 1;
    khi[base + s] = static_cast<uint32_t>(d->key >> 32);
    klo[base + s] = static_cast<uint32_t>(d->key);
    score[base + s] = p.eviction == kLfu ? d->count : p.t;
    d->row = static_cast<int32_t>(base + s);
    d->placed = true;
    placer.Push(base + s);
    ++counts.placed;
  }
  return residents + added;
}

// The step's ids as the map's step reads them: id i's words hi[i * stride]
// and lo[i * stride], its local bucket (the shard's bucket count where it
// is not this shard's) and its sketch cells cells[i * depth + r].
struct StepIds {
  int64_t m;
  const uint32_t* hi;
  const uint32_t* lo;
  int64_t stride;
  const int32_t* bucket;
  const int32_t* cells;
};

// StepIds from the ids split by the XLA ops: hi, lo, own, bucket [m], cells
// [m * depth]; `local` holds the buckets.
ffi::Error SplitIds(ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo, ffi::Buffer<ffi::PRED> own,
                    ffi::Buffer<ffi::S32> bucket, ffi::Buffer<ffi::S32> cells, int64_t nbl,
                    int64_t depth, int64_t width, std::vector<int32_t>& local, StepIds& ids) {
  const int64_t m = hi.element_count();
  if (lo.element_count() != m || own.element_count() != m || bucket.element_count() != m ||
      (depth > 0 && cells.element_count() != m * depth)) {
    return ffi::Error::InvalidArgument(
        "embedlib dynamic map step: expected hi, lo, own, bucket [m] and cells [m * depth]");
  }
  const bool* is_own = own.typed_data();
  const int32_t* bk = bucket.typed_data();
  local.resize(m);
  for (int64_t i = 0; i < m; ++i) {
    if (is_own[i] && (bk[i] < 0 || bk[i] >= nbl)) {
      return ffi::Error::InvalidArgument("embedlib dynamic map step: an own id's bucket is "
                                         "outside this shard's buckets");
    }
    local[i] = is_own[i] ? bk[i] : static_cast<int32_t>(nbl);
  }
  const int32_t* c = cells.typed_data();
  for (int64_t i = 0; i < m * depth; ++i) {
    if (is_own[i / depth] && (c[i] < 0 || c[i] >= width)) {
      return ffi::Error::InvalidArgument("embedlib dynamic map step: a sketch cell is "
                                         "outside [0, width)");
    }
  }
  ids = {m, hi.typed_data(), lo.typed_data(), 1, local.data(), c};
  return ffi::Error::Success();
}

// dynamic/ids.py's hash_words: a 32-bit hash of the id (hi, lo).
inline uint32_t HashWords(uint32_t hi, uint32_t lo, uint32_t seed) {
  return Mix32(Mix32(hi ^ seed) ^ lo * 0x27D4EB2Fu);
}

inline uint32_t Reduce(uint32_t h, uint32_t n) { return (n & (n - 1)) == 0 ? h & (n - 1) : h % n; }

// StepIds from the ids' words as the step takes them (words u32[m, 2]),
// with what mapping._own and ids.sketch_cell compute in XLA ops: an id is
// this shard's (shard `index` of buckets [index * nbl, (index + 1) * nbl)
// of `num_buckets`) unless it is padding, whose words are both all ones.
// Here it is one pass over the ids, where the XLA ops were a few loops of
// their own before the kernel.
__attribute__((target_clones("avx512f", "avx2", "default")))
void BucketsOfWords(const uint32_t* words, int64_t m, uint32_t num_buckets, int64_t index,
                    int64_t nbl, int64_t depth, int64_t width, int32_t* local, int32_t* cells) {
  constexpr uint32_t kPad = 0xFFFFFFFFu, kBucketSeed = 0x9E3779B9u;
  for (int64_t i = 0; i < m; ++i) {
    const uint32_t hi = words[2 * i], lo = words[2 * i + 1];
    const int64_t b = static_cast<int64_t>(Reduce(HashWords(hi, lo, kBucketSeed), num_buckets)) -
                      index * nbl;
    const bool own = !(hi == kPad && lo == kPad) && b >= 0 && b < nbl;
    local[i] = static_cast<int32_t>(own ? b : nbl);
    for (int64_t r = 0; r < depth; ++r) {
      const uint32_t seed = 0x5BD1E995u + 0x1000193u * static_cast<uint32_t>(r + 1);
      cells[i * depth + r] =
          static_cast<int32_t>(Reduce(HashWords(hi, lo, seed), static_cast<uint32_t>(width)));
    }
  }
}

// The map's step; `place`, where not null, places the rows too (Place).
// Each row is written as a global row, `row_offset` past the local one;
// stats_out has 4 elements, or 5 with the own ids counted last.
ffi::Error MapStep(ffi::ThreadPool& pool, ffi::Buffer<ffi::U32> keys_hi, ffi::Buffer<ffi::U32> keys_lo,
                   ffi::Buffer<ffi::S32> score_in, ffi::Buffer<ffi::U8> sketch_in,
                   const StepIds& ids, ffi::BufferR0<ffi::S32> clock,
                   ffi::Result<ffi::Buffer<ffi::U32>>& khi_out,
                   ffi::Result<ffi::Buffer<ffi::U32>>& klo_out,
                   ffi::Result<ffi::Buffer<ffi::S32>>& score_out,
                   ffi::Result<ffi::Buffer<ffi::U8>>& sketch_out,
                   ffi::Result<ffi::Buffer<ffi::S32>>& rows_out,
                   ffi::Result<ffi::Buffer<ffi::PRED>>& placed_out,
                   ffi::Result<ffi::Buffer<ffi::S32>>& stats_out, int64_t bucket_size,
                   int64_t eviction, int64_t admit_after, int64_t decay_every, int64_t depth,
                   int64_t width, const Place* place, int32_t row_offset) {
  const int64_t rows_n = score_in.element_count();
  const int64_t m = ids.m;
  const int64_t n_stats = stats_out->element_count();
  if (keys_hi.element_count() != rows_n || keys_lo.element_count() != rows_n ||
      rows_out->element_count() != m || placed_out->element_count() != m ||
      (n_stats != 4 && n_stats != 5) ||
      (depth > 0 && sketch_in.element_count() != rows_n / bucket_size * depth * width)) {
    return ffi::Error::InvalidArgument(
        "embedlib dynamic map step: expected keys_hi, keys_lo, score [rows], sketch "
        "[buckets * depth * width], rows, placed [m] and stats [4] or [5]");
  }
  embedlib_cpu::PrepareInPlace(keys_hi, khi_out);
  embedlib_cpu::PrepareInPlace(keys_lo, klo_out);
  embedlib_cpu::PrepareInPlace(score_in, score_out);
  embedlib_cpu::PrepareInPlace(sketch_in, sketch_out);
  uint32_t* khi = khi_out->typed_data();
  uint32_t* klo = klo_out->typed_data();
  int32_t* score = score_out->typed_data();
  uint8_t* sketch = sketch_out->typed_data();
  const int64_t nbl = rows_n / bucket_size;
  const Policy p{bucket_size, eviction, admit_after, depth, width, *clock.typed_data() + 1};
  const int32_t* bk = ids.bucket;   // nbl: not this shard's
  // The helpers first: their start overlaps the grouping below (pool.h).
  const int workers = embedlib_cpu::PoolWorkers(pool, m, kIdsPerWorker);
  const int64_t tasks = workers <= 1 ? 1 : std::min<int64_t>(nbl, workers * kTasksPerWorker);
  embedlib_cpu::Team team(pool, tasks > 1 ? workers : 1);
  const bool decays = decay_every > 0 && p.t % decay_every == 0;
  const uint32_t* h = ids.hi;
  const uint32_t* l = ids.lo;
  const int64_t stride = ids.stride;
  const int32_t* cl = ids.cells;
  int32_t* rows = rows_out->typed_data();
  bool* placed = placed_out->typed_data();
  // Every own id grouped by bucket, once, on the calling thread (a counting
  // sort, in input order), with its words: (id, input position) pairs, so
  // that a bucket's step reads its ids in one place. A not-own id's row is
  // -1. Then the buckets are stepped in contiguous ranges, tasks on XLA's
  // pool (pool.h), whose helpers were asked for before the grouping: tasks
  // share no bucket, slot, sketch cell or id, so the map after the step is
  // the same for any split. Under load a helper may start late and the
  // caller steps every range itself; grouping on each thread instead read
  // every id on every thread.
  std::vector<int32_t> start(nbl + 2, 0);
  for (int64_t i = 0; i < m; ++i) ++start[bk[i] + 1];
  for (int64_t k = 0; k <= nbl; ++k) start[k + 1] += start[k];
  std::unique_ptr<Occurrence[]> grouped(new Occurrence[std::max<int64_t>(m, 1)]);
  {
    std::vector<int32_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < m; ++i) {
      if (i + kGroupAhead < m) {
        __builtin_prefetch(grouped.get() + next[bk[i + kGroupAhead]], 1);
      }
      grouped[next[bk[i]]++] = {(static_cast<uint64_t>(h[i * stride]) << 32) | l[i * stride],
                                static_cast<int32_t>(i)};
      if (bk[i] == nbl) {
        rows[i] = -1;
        placed[i] = false;
      }
    }
  }
  std::vector<Counts> part(tasks);
  std::vector<int64_t> resident_part(tasks, 0), default_part(tasks, 0);
  team.Run(tasks, [&](int64_t t) {
    const int64_t first = nbl * t / tasks, last = nbl * (t + 1) / tasks;
    if (decays) {
      if (eviction == kLfu) {
        for (int64_t r = first * bucket_size; r < last * bucket_size; ++r) {
          score[r] = score[r] > 0 ? score[r] >> 1 : score[r];
        }
      }
      for (int64_t k = first * depth * width; k < last * depth * width; ++k) sketch[k] >>= 1;
    }
    std::vector<Distinct> ids;
    std::vector<int32_t> which;                       // each occurrence's distinct id
    Scratch scratch;
    Placer placer(place, p.t);
    // Counted here, written once: the tasks' totals share cache lines.
    Counts counts;
    int64_t resident = 0, defaults = 0;
    for (int64_t k = first; k < last; ++k) {
      // A bucket's step waits on its slots' scores and keys, every line of
      // them once the table is full: ask for those of a bucket a few ahead.
      if (k + kBucketsAhead < last) {
        const int64_t ahead = (k + kBucketsAhead) * bucket_size;
        embedlib_cpu::PrefetchBytes(score + ahead, bucket_size * 4);
        embedlib_cpu::PrefetchBytes(klo + ahead, bucket_size * 4);
        embedlib_cpu::PrefetchBytes(khi + ahead, bucket_size * 4);
      }
      Occurrence* occ = grouped.get() + start[k];
      const int64_t n = start[k + 1] - start[k];
      if (n == 0) {
        resident += Residents(score + k * bucket_size, bucket_size);
        continue;
      }
      // Ascending (id, position): each distinct id a run, led by its first
      // occurrence. A group is in input order, so a stable sort by id alone
      // gives that order: an insertion sort for a bucket's usual few ids.
      if (n <= kInsertionSort) {
        for (int64_t j = 1; j < n; ++j) {
          const Whole x = Load(occ + j);
          const uint64_t key = occ[j].key;
          int64_t at = j;
          for (; at > 0 && key < occ[at - 1].key; --at) Store(occ + at, Load(occ + at - 1));
          Store(occ + at, x);
        }
      } else {
        std::sort(occ, occ + n);
      }
      ids.clear();
      which.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        if (j == 0 || occ[j].key != occ[j - 1].key) {
          ids.push_back({occ[j].key, static_cast<int32_t>(k), 0, occ[j].position, -1, false});
        }
        ++ids.back().count;
        which[j] = static_cast<int32_t>(ids.size() - 1);
      }
      resident += StepBucket(p, k, ids, scratch, khi, klo, score, sketch, cl, placer, counts);
      for (int64_t j = 0; j < n; ++j) {
        const Distinct& d = ids[which[j]];
        const int32_t i = occ[j].position;
        rows[i] = d.row < 0 ? -1 : d.row + row_offset;
        placed[i] = d.placed && d.first == i;
        defaults += d.row < 0;
      }
    }
    placer.Finish();
    part[t] = counts;
    resident_part[t] = resident;
    default_part[t] = defaults;
  });
  Counts counts;
  int64_t resident = 0, defaults = 0;
  for (int64_t t = 0; t < tasks; ++t) {
    counts.placed += part[t].placed;
    counts.evicted += part[t].evicted;
    resident += resident_part[t];
    defaults += default_part[t];
  }
  int32_t* stats = stats_out->typed_data();
  stats[0] = static_cast<int32_t>(resident);
  stats[1] = static_cast<int32_t>(counts.placed);
  stats[2] = static_cast<int32_t>(counts.evicted);
  stats[3] = static_cast<int32_t>(defaults);
  if (n_stats == 5) stats[4] = start[nbl];   // the own ids
  return ffi::Error::Success();
}

ffi::Error MapStepImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys_hi, ffi::Buffer<ffi::U32> keys_lo,
                       ffi::Buffer<ffi::S32> score_in, ffi::Buffer<ffi::U8> sketch_in,
                       ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo,
                       ffi::Buffer<ffi::PRED> own, ffi::Buffer<ffi::S32> bucket,
                       ffi::Buffer<ffi::S32> cells, ffi::BufferR0<ffi::S32> clock,
                       ffi::Result<ffi::Buffer<ffi::U32>> khi_out,
                       ffi::Result<ffi::Buffer<ffi::U32>> klo_out,
                       ffi::Result<ffi::Buffer<ffi::S32>> score_out,
                       ffi::Result<ffi::Buffer<ffi::U8>> sketch_out,
                       ffi::Result<ffi::Buffer<ffi::S32>> rows_out,
                       ffi::Result<ffi::Buffer<ffi::PRED>> placed_out,
                       ffi::Result<ffi::Buffer<ffi::S32>> stats_out, int64_t bucket_size,
                       int64_t eviction, int64_t admit_after, int64_t decay_every, int64_t depth,
                       int64_t width) {
  const int64_t rows_n = score_in.element_count();
  if (bucket_size < 1 || rows_n % bucket_size || stats_out->element_count() != 4) {
    return ffi::Error::InvalidArgument(
        "embedlib dynamic map step: expected score [rows], rows a multiple of bucket_size, "
        "and stats [4]");
  }
  std::vector<int32_t> local;
  StepIds ids;
  ffi::Error split = SplitIds(hi, lo, own, bucket, cells, rows_n / bucket_size, depth, width,
                              local, ids);
  if (split.failure()) return split;
  return MapStep(pool, keys_hi, keys_lo, score_in, sketch_in, ids, clock, khi_out, klo_out,
                 score_out, sketch_out, rows_out, placed_out, stats_out, bucket_size, eviction,
                 admit_after, decay_every, depth, width, nullptr, 0);
}

// The map's step with its rows placed (Place), on the ids' words as the
// step takes them: keys_hi, keys_lo, score, sketch as the step's, words
// u32[m, 2], clock, placed_at s32[R] and table f32[R, features] (both
// aliased to results), key u32[2] (initializers.key_words) and index s32[]
// (this shard's among num_buckets / (R / bucket_size)). Each id's bucket,
// ownership and sketch cells are computed here (BucketsOfWords). Results:
// the step's, with global rows (index * R past the local ones) and stats [5]
// (the own ids last, as mapping._local counts them), then placed_at and
// table. Attributes: the step's, `num_buckets` (the whole table's), `never`
// (the mark of a row never placed) and `step` (HashedUniform.step).
ffi::Error MapStepPlaceImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys_hi, ffi::Buffer<ffi::U32> keys_lo,
    ffi::Buffer<ffi::S32> score_in, ffi::Buffer<ffi::U8> sketch_in, ffi::Buffer<ffi::U32> words,
    ffi::BufferR0<ffi::S32> clock, ffi::Buffer<ffi::S32> placed_at_in,
    ffi::Buffer<ffi::F32> table_in, ffi::Buffer<ffi::U32> key, ffi::BufferR0<ffi::S32> index,
    ffi::Result<ffi::Buffer<ffi::U32>> khi_out, ffi::Result<ffi::Buffer<ffi::U32>> klo_out,
    ffi::Result<ffi::Buffer<ffi::S32>> score_out, ffi::Result<ffi::Buffer<ffi::U8>> sketch_out,
    ffi::Result<ffi::Buffer<ffi::S32>> rows_out, ffi::Result<ffi::Buffer<ffi::PRED>> placed_out,
    ffi::Result<ffi::Buffer<ffi::S32>> stats_out,
    ffi::Result<ffi::Buffer<ffi::S32>> placed_at_out, ffi::Result<ffi::Buffer<ffi::F32>> table_out,
    int64_t bucket_size, int64_t eviction, int64_t admit_after, int64_t decay_every,
    int64_t depth, int64_t width, int64_t num_buckets, int64_t never, float step) {
  const auto dims = table_in.dimensions();
  const auto word_dims = words.dimensions();
  const int64_t rows_n = score_in.element_count();
  const int64_t shard = *index.typed_data();
  if (bucket_size < 1 || rows_n % bucket_size || dims.size() != 2 || dims[0] != rows_n ||
      placed_at_in.element_count() != rows_n || key.element_count() != 2 ||
      word_dims.size() != 2 || word_dims[1] != 2 || stats_out->element_count() != 5 ||
      num_buckets < 1 || num_buckets > UINT32_MAX || width < 1 || width > UINT32_MAX ||
      shard < 0 || (shard + 1) * (rows_n / bucket_size) > num_buckets ||
      (shard + 1) * rows_n > INT32_MAX) {
    return ffi::Error::InvalidArgument(
        "embedlib dynamic map step with placing: expected words u32[m, 2], placed_at "
        "s32[rows], table f32[rows, features], key u32[2] (initializers.key_words), stats "
        "[5], and shard index's buckets within num_buckets, besides the step's operands");
  }
  const int64_t m = word_dims[0];
  const int64_t nbl = rows_n / bucket_size;
  std::vector<int32_t> local(m), cells(std::max<int64_t>(1, m * depth));
  BucketsOfWords(words.typed_data(), m, static_cast<uint32_t>(num_buckets), shard, nbl, depth,
                 width, local.data(), cells.data());
  const StepIds ids{m, words.typed_data(), words.typed_data() + 1, 2, local.data(), cells.data()};
  const int32_t offset = static_cast<int32_t>(shard * rows_n);
  embedlib_cpu::PrepareInPlace(placed_at_in, placed_at_out);
  embedlib_cpu::PrepareInPlace(table_in, table_out);
  const HashedUniform init(key.typed_data()[0], key.typed_data()[1], dims[1], step);
  const Place place{placed_at_out->typed_data(), static_cast<int32_t>(never),
                    table_out->typed_data(), dims[1], offset, &init};
  return MapStep(pool, keys_hi, keys_lo, score_in, sketch_in, ids, clock, khi_out, klo_out,
                 score_out, sketch_out, rows_out, placed_out, stats_out, bucket_size, eviction,
                 admit_after, decay_every, depth, width, &place, offset);
}

// The eval lookup: each own id's local row (the first slot of its bucket
// holding it), -1 where it is not resident or not own; nothing changes.
ffi::Error LookupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> keys_hi,
                      ffi::Buffer<ffi::U32> keys_lo, ffi::Buffer<ffi::S32> score,
                      ffi::Buffer<ffi::U32> hi, ffi::Buffer<ffi::U32> lo,
                      ffi::Buffer<ffi::PRED> own,
                      ffi::Buffer<ffi::S32> bucket, ffi::Result<ffi::Buffer<ffi::S32>> rows_out,
                      int64_t bucket_size) {
  const int64_t rows_n = score.element_count();
  const int64_t m = hi.element_count();
  if (bucket_size < 1 || rows_n % bucket_size || keys_hi.element_count() != rows_n ||
      keys_lo.element_count() != rows_n || lo.element_count() != m ||
      own.element_count() != m || bucket.element_count() != m ||
      rows_out->element_count() != m) {
    return ffi::Error::InvalidArgument(
        "embedlib dynamic map lookup: expected keys_hi, keys_lo, score [rows] and hi, lo, "
        "own, bucket, rows [m]");
  }
  const int64_t nbl = rows_n / bucket_size;
  const uint32_t* khi = keys_hi.typed_data();
  const uint32_t* klo = keys_lo.typed_data();
  const int32_t* sc = score.typed_data();
  const uint32_t* h = hi.typed_data();
  const uint32_t* l = lo.typed_data();
  const bool* is_own = own.typed_data();
  const int32_t* bk = bucket.typed_data();
  int32_t* rows = rows_out->typed_data();
  embedlib_cpu::PoolRanges(pool, Workers(pool, m), m, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rows[i] = -1;
      if (!is_own[i]) continue;
      const int64_t base = std::min<int64_t>(std::max<int32_t>(bk[i], 0), nbl - 1) * bucket_size;
      const int64_t s = FindResidentEarly(khi + base, klo + base,
                                          Residents(sc + base, bucket_size),
                                          (static_cast<uint64_t>(h[i]) << 32) | l[i]);
      if (s >= 0) rows[i] = static_cast<int32_t>(base + s);
    }
  });
  return ffi::Error::Success();
}

// placed_at[rows[i]] = stamp for each placed id (placed[i], rows[i] in
// [0, n): distinct, the first occurrence of each id placed in a step), and
// drawn[i] = rows[i] where that row's mark was not `never` before (a row
// placed again, whose initial value is drawn), else n. placed_at is updated
// in place when XLA aliases it.
ffi::Error MarkPlacedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> placed_at,
                          ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::PRED> placed,
                          ffi::BufferR0<ffi::S32> stamp,
                          ffi::Result<ffi::Buffer<ffi::S32>> placed_at_out,
                          ffi::Result<ffi::Buffer<ffi::S32>> drawn_out, int64_t never) {
  const int64_t n = placed_at.element_count();
  const int64_t m = rows.element_count();
  if (placed.element_count() != m || drawn_out->element_count() != m ||
      placed_at_out->element_count() != n) {
    return ffi::Error::InvalidArgument(
        "embedlib mark placed: expected placed_at [n], rows, placed [m], stamp []");
  }
  embedlib_cpu::PrepareInPlace(placed_at, placed_at_out);
  int32_t* at = placed_at_out->typed_data();
  const int32_t* r = rows.typed_data();
  const bool* is_placed = placed.typed_data();
  const int32_t t = *stamp.typed_data();
  int32_t* drawn = drawn_out->typed_data();
  embedlib_cpu::PoolRanges(pool, Workers(pool, m), m, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + embedlib_cpu::kAhead < end) {
        const int32_t ahead = r[i + embedlib_cpu::kAhead];
        if (is_placed[i + embedlib_cpu::kAhead] && ahead >= 0 && ahead < n) {
          __builtin_prefetch(at + ahead, 1);
        }
      }
      drawn[i] = static_cast<int32_t>(n);
      if (!is_placed[i] || r[i] < 0 || r[i] >= n) continue;
      if (at[r[i]] != never) drawn[i] = r[i];
      at[r[i]] = t;
    }
  });
  return ffi::Error::Success();
}

// write(i, row) for each rows[i] in [0, n), `row` the start of that row of
// `table` (rows of `row_bytes`), a few rows ahead fetched; rows distinct, so
// the pool's threads write disjoint rows.
template <typename Write>
void ForEachRow(ffi::ThreadPool& pool, const int32_t* rows, int64_t k, int64_t n, char* table,
                int64_t row_bytes, const Write& write) {
  embedlib_cpu::PoolRanges(pool, Workers(pool, k), k, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + embedlib_cpu::kAhead < end) {
        const int32_t ahead = rows[i + embedlib_cpu::kAhead];
        if (ahead >= 0 && ahead < n) {
          embedlib_cpu::PrefetchBytes(table + static_cast<int64_t>(ahead) * row_bytes, row_bytes);
        }
      }
      if (rows[i] >= 0 && rows[i] < n) {
        write(i, table + static_cast<int64_t>(rows[i]) * row_bytes);
      }
    }
  });
}

// table[rows[i]] = values[i] for each rows[i] in [0, n) (distinct: the rows
// placed in a step), the table updated in place when XLA aliases it.
ffi::Error SetRowsImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> rows,
                       ffi::AnyBuffer values, ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = table.dimensions();
  const int64_t k = rows.element_count();
  if (dims.size() != 2 || values.element_type() != table.element_type() ||
      out->element_type() != table.element_type() ||
      values.element_count() != k * static_cast<size_t>(dims[1])) {
    return ffi::Error::InvalidArgument(
        "embedlib set rows: expected table [n, features], rows [k] and values "
        "[k, features] of the table's dtype");
  }
  embedlib_cpu::PrepareInPlace(table, out);
  const int64_t n = dims[0];
  const int64_t row_bytes = dims[1] * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  char* t = static_cast<char*>(out->untyped_data());
  const char* v = static_cast<const char*>(values.untyped_data());
  const int32_t* r = rows.typed_data();
  ForEachRow(pool, r, k, n, t, row_bytes, [&](int64_t i, char* row) {
    std::memcpy(row, v + i * row_bytes, row_bytes);
  });
  return ffi::Error::Success();
}

// table[rows[i]] = the default initializer's values of global row rows[i] +
// offset, for each rows[i] in [0, n) (distinct: the rows a step places
// again), the table updated in place when XLA aliases it. The values are
// initializers.HashedUniform.rows', bit for bit: each a hash of (key, row,
// column) mapped to an odd integer below 2**24 times `step`, one rounded
// multiply. Drawn straight into the rows, on the pool's threads: XLA drew
// them chunk by chunk into a block and then copied the block in.
ffi::Error PlaceHashedUniformImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table,
                                  ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::U32> key,
                                  ffi::BufferR0<ffi::S32> offset,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out, float step) {
  const auto dims = table.dimensions();
  if (dims.size() != 2 || key.element_count() != 2) {
    return ffi::Error::InvalidArgument(
        "embedlib place hashed uniform: expected table f32[n, features], rows s32[k] and "
        "key u32[2] (initializers.key_words)");
  }
  embedlib_cpu::PrepareInPlace(table, out);
  const int64_t n = dims[0], features = dims[1], k = rows.element_count();
  const HashedUniform init(key.typed_data()[0], key.typed_data()[1], features, step);
  const int32_t first = *offset.typed_data();
  const int32_t* r = rows.typed_data();
  ForEachRow(pool, r, k, n, reinterpret_cast<char*>(out->typed_data()), features * 4,
             [&](int64_t i, char* row) {
               init.Draw(r[i] + first, reinterpret_cast<float*>(row));
             });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibDynamicMapLookup, LookupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibMarkPlaced, MarkPlacedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("never"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibSetRows, SetRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibDynamicMapStep, MapStepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("eviction")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("decay_every")
                                  .Attr<int64_t>("depth")
                                  .Attr<int64_t>("width"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibDynamicMapStepPlace, MapStepPlaceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("eviction")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("decay_every")
                                  .Attr<int64_t>("depth")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("num_buckets")
                                  .Attr<int64_t>("never")
                                  .Attr<float>("step"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibPlaceHashedUniform, PlaceHashedUniformImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("step"));
