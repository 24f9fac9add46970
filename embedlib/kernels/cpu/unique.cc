// Distinct ids with their inverse for XLA:CPU: strategies/unique.py's
// unique_with_inverse, the same three results bit for bit.
//
// XLA's CPU sort of n ids costs tens of nanoseconds an id (a comparator call
// per comparison), far more than looking the ids' rows up. This kernel never
// sorts the ids: when the largest id is within a few times n, a mark per
// possible id gives the distinct ids in order in one pass over the marks;
// otherwise a hash table over the ids (2n to 4n slots) finds the distinct
// ids and only they are sorted (a radix sort: they are non-negative int32).
//
// Operands: ids s32[n] (negative, or 2^31 - 1, which no table of int32 ids
// reaches: padding or invalid). Results: unique
// s32[capacity] (the distinct non-negative ids in increasing order, -1 past
// them), inverse s32[n] (each id's index in that order, -1 for a negative
// id; past `capacity` when the distinct ids overflow it), count s32[] (the
// number of distinct ids, which may exceed `capacity`).

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A mark array holds max_id + 1 entries: used while that is at most this many
// times the ids (and a few pages), so that its zeroing and its scan cost
// about as much as a pass over the ids.
constexpr int64_t kMarksPerId = 4;
constexpr int64_t kMarksAlways = 1 << 16;

// An id the sort of strategies/unique.py counts: non-negative and not the
// key it reserves for "none".
inline bool Valid(int32_t id) { return id >= 0 && id != INT32_MAX; }

// Writes the distinct ids in increasing order and each id's rank, through a
// mark per id in [0, max_id].
int64_t ByMarks(const int32_t* ids, int64_t n, int32_t max_id, int32_t* unique,
                int64_t capacity, int32_t* inverse) {
  std::vector<int32_t> rank(static_cast<size_t>(max_id) + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (Valid(ids[i])) rank[ids[i]] = 1;
  }
  int64_t count = 0;
  for (int64_t r = 0; r <= max_id; ++r) {
    if (rank[r]) {
      if (count < capacity) unique[count] = static_cast<int32_t>(r);
      rank[r] = static_cast<int32_t>(count++);
    }
  }
  for (int64_t i = 0; i < n; ++i) inverse[i] = Valid(ids[i]) ? rank[ids[i]] : -1;
  return count;
}

// Sorts non-negative int32 keys in place: least significant digit first,
// 11 bits a pass, only as many passes as `max_key` has digits.
void RadixSort(std::vector<int32_t>& keys, int32_t max_key) {
  constexpr int kBits = 11;
  constexpr int kBuckets = 1 << kBits;
  std::vector<int32_t> other(keys.size());
  for (int shift = 0; shift < 31 && (max_key >> shift) > 0; shift += kBits) {
    int64_t start[kBuckets + 1] = {0};
    for (int32_t k : keys) ++start[((k >> shift) & (kBuckets - 1)) + 1];
    for (int b = 0; b < kBuckets; ++b) start[b + 1] += start[b];
    for (int32_t k : keys) other[start[(k >> shift) & (kBuckets - 1)]++] = k;
    keys.swap(other);
  }
}

// The same results through a hash table over the ids: for ids spread over a
// range much larger than their number.
int64_t ByHash(const int32_t* ids, int64_t n, int32_t max_id, int32_t* unique,
               int64_t capacity, int32_t* inverse) {
  int64_t size = 2;
  while (size < 2 * n) size <<= 1;
  const uint64_t mask = size - 1;
  std::vector<int32_t> key(size, -1), rank(size);
  std::vector<int32_t> distinct;
  // inverse holds each id's hash slot until the ranks are known.
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids[i];
    if (!Valid(id)) {
      inverse[i] = -1;
      continue;
    }
    uint64_t h = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> 20 & mask;
    while (key[h] != -1 && key[h] != id) h = (h + 1) & mask;
    if (key[h] == -1) {
      key[h] = id;
      distinct.push_back(id);
    }
    inverse[i] = static_cast<int32_t>(h);
  }
  RadixSort(distinct, max_id);
  const int64_t count = distinct.size();
  for (int64_t k = 0; k < count; ++k) {
    const int32_t id = distinct[k];
    if (k < capacity) unique[k] = id;
    uint64_t h = (static_cast<uint64_t>(id) * 0x9E3779B97F4A7C15ull) >> 20 & mask;
    while (key[h] != id) h = (h + 1) & mask;
    rank[h] = static_cast<int32_t>(k);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (inverse[i] >= 0) inverse[i] = rank[inverse[i]];
  }
  return count;
}

ffi::Error UniqueImpl(ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::Buffer<ffi::S32>> unique,
                      ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                      ffi::Result<ffi::BufferR0<ffi::S32>> count) {
  const int64_t n = ids.element_count();
  const int64_t capacity = unique->element_count();
  if (inverse->element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument(
        "embedlib unique: expected ids [n], unique [capacity], inverse [n], count []");
  }
  const int32_t* id = ids.typed_data();
  int32_t* u = unique->typed_data();
  std::fill(u, u + capacity, -1);
  int32_t max_id = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (Valid(id[i])) max_id = std::max(max_id, id[i]);
  }
  int64_t distinct = 0;
  if (max_id < 0) {
    std::fill(inverse->typed_data(), inverse->typed_data() + n, -1);
  } else if (static_cast<int64_t>(max_id) < std::max(kMarksPerId * n, kMarksAlways)) {
    distinct = ByMarks(id, n, max_id, u, capacity, inverse->typed_data());
  } else {
    distinct = ByHash(id, n, max_id, u, capacity, inverse->typed_data());
  }
  *count->typed_data() = static_cast<int32_t>(distinct);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibUnique, UniqueImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::BufferR0<ffi::S32>>());
