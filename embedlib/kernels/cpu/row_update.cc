// Fused row-wise updates for XLA:CPU: dedup, sum, rule and write in one pass.
// (embedlib/optim/fused_cpu.py calls them.)
//
// The XLA ops of apply.py materialise the row gradients' per-row sums as an
// [ids, features] array and scatter the rule's increment into the table with
// a second [ids, features] array beside it; on CPU those two buffers, their
// zeroing and the page faults of the temporary block that holds them (fresh
// pages every step once it passes glibc's mmap threshold) are a large part
// of the step. Here each handler finds every distinct row of the
// shard among the ids (a hash table over the ids, never the table's size),
// sums each row's gradients in input order (the order XLA's scatter-add
// uses) straight from the gradients, with no [ids, features] buffer of
// sums, and runs the rule on that row in place: the table and its slots are
// aliased to the outputs, so a donated table is never copied.
//
// Both cores do the per-id work (pool.h: XLA's intra-op threads). The ids
// are grouped by row range, a pass over the ids split between the threads;
// each range (a part) is then one task: its hash table, its rows' sums and
// their updates. No two threads touch a row, and a row's result does not
// depend on how many threads ran: the results are the same on any machine.
//
// Every handler takes the same leading operands:
//   table   f32[rows, cols]   this rank's shard (outputs alias it)
//   ...     the rule's slots  (outputs alias them, in order)
//   ids     s32[n]            global ids; anything outside the shard skipped
//   grads   f32[n, features]  one gradient row per id, all logical columns
//   offsets s32[2]            first global row and column of the shard
//   lr      f32[]             this step's learning rate
// and the attribute `features`: logical columns (the mean of squares is over
// them; padded columns of the shard are never written).
//
// The arithmetic follows rules.py operation by operation (no fused
// multiply-adds: built with -ffp-contract=off); only the order of the sum of
// squares, and powf, may round differently from XLA's, by an ulp or so.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using embedlib_cpu::PrepareInPlace;

void PrefetchFloats(const void* p, int64_t count) { embedlib_cpu::PrefetchBytes(p, count * 4); }

// How many ids a worker takes at least, and how many row ranges (parts)
// each worker's share of the shard is cut into: more parts than workers, so
// that a helper that starts late still finds parts to take.
constexpr int64_t kIdsPerWorker = 4096;
constexpr int64_t kPartsPerWorker = 8;

// The shard's valid ids grouped by row range: part p holds, in input order,
// the ids whose row lies in the p-th of `count` consecutive ranges of about
// rows / count rows each.
struct Parts {
  int64_t count = 1;
  std::vector<int64_t> start;  // [count + 1]: part p is [start[p], start[p + 1])
  std::vector<int32_t> pos;    // each grouped id's index in the input
  std::vector<int32_t> row;    // and its row in the shard
};

// Groups the ids by part: a count per (input slice, part), then each slice
// writes its ids to their parts, slices in input order, on `workers` threads.
Parts GroupByPart(xla::ffi::ThreadPool& pool, int workers, const int32_t* ids, int64_t n,
                  int64_t first_row, int64_t shard_rows) {
  Parts out;
  out.count = workers <= 1 ? 1 : workers * kPartsPerWorker;
  const int64_t parts = out.count;
  const int64_t slices = workers <= 1 ? 1 : workers * 2;
  // floor(row * parts / shard_rows) in 32-bit fixed point: a multiply where a
  // 64-bit division per id, twice over the ids, was most of this grouping.
  // Any monotone split would do (a row's part never changes its result).
  const uint64_t scale = (static_cast<uint64_t>(parts) << 32) / static_cast<uint64_t>(shard_rows);
  auto part_of = [&](int64_t row) {
    return static_cast<int64_t>((static_cast<uint64_t>(row) * scale) >> 32);
  };
  auto row_of = [&](int64_t i) -> int64_t {
    const int64_t row = static_cast<int64_t>(ids[i]) - first_row;
    return ids[i] < 0 || row < 0 || row >= shard_rows ? -1 : row;
  };
  std::vector<int64_t> at(slices * parts, 0);
  embedlib_cpu::ParallelTasks(pool, workers, slices, [&](int64_t s) {
    int64_t* c = at.data() + s * parts;
    for (int64_t i = n * s / slices, end = n * (s + 1) / slices; i < end; ++i) {
      const int64_t row = row_of(i);
      if (row >= 0) ++c[part_of(row)];
    }
  });
  out.start.assign(parts + 1, 0);
  int64_t total = 0;
  for (int64_t p = 0; p < parts; ++p) {
    out.start[p] = total;
    for (int64_t s = 0; s < slices; ++s) {
      const int64_t c = at[s * parts + p];
      at[s * parts + p] = total;
      total += c;
    }
  }
  out.start[parts] = total;
  out.pos.resize(total);
  out.row.resize(total);
  embedlib_cpu::ParallelTasks(pool, workers, slices, [&](int64_t s) {
    int64_t* next = at.data() + s * parts;
    for (int64_t i = n * s / slices, end = n * (s + 1) / slices; i < end; ++i) {
      const int64_t row = row_of(i);
      if (row < 0) continue;
      const int64_t j = next[part_of(row)]++;
      out.pos[j] = static_cast<int32_t>(i);
      out.row[j] = static_cast<int32_t>(row);
    }
  });
  return out;
}

// Scratch for one part's ids, slices of arrays allocated once per call.
struct PartScratch {
  int32_t* key;     // hash slots' rows (-1: empty)
  int32_t* slot;    // hash slots' distinct index
  uint64_t mask;    // hash slots - 1
  int32_t* of_id;   // each of the part's ids: its distinct row's index
  int32_t* rows;    // the distinct rows, in order of first appearance
  int32_t* bounds;  // [distinct + 1]: counts, then where each row's ids end
  int32_t* order;   // the part's input indices grouped by distinct row
  float* sum;       // [features]
};

// Finds the part's distinct rows (an open-addressing hash table over its
// ids, 2x to 4x their number: never the table's size) and calls
// update(row, summed_gradient) once for each: first for the rows met once,
// in input order, then for the others, whose ids it groups by row keeping
// input order, summing each row's gradients in input order (the order of
// XLA's scatter-add, from zero).
template <typename Update>
void UpdatePart(const int32_t* pos, const int32_t* part_rows, int64_t len, const float* grads,
                int64_t features, const PartScratch& s, const Update& update) {
  std::fill(s.key, s.key + s.mask + 1, -1);
  int32_t distinct = 0;
  for (int64_t j = 0; j < len; ++j) {
    const int32_t row = part_rows[j];
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 20 & s.mask;
    while (s.key[h] != -1 && s.key[h] != row) h = (h + 1) & s.mask;
    if (s.key[h] == -1) {
      s.key[h] = row;
      s.slot[h] = distinct;
      s.rows[distinct] = row;
      s.bounds[distinct++] = 0;
    }
    s.of_id[j] = s.slot[h];
    ++s.bounds[s.slot[h]];
  }
  // Rows met once (most of a Zipf batch's): updated in input order, so that
  // their gradient rows are read at ascending addresses, a few ids ahead.
  // The sum from zero, as below: 0 + g, the bits of a sum of one.
  for (int64_t j = 0; j < len; ++j) {
    if (j + embedlib_cpu::kAhead < len && s.bounds[s.of_id[j + embedlib_cpu::kAhead]] == 1) {
      update.Prefetch(part_rows[j + embedlib_cpu::kAhead]);
      PrefetchFloats(grads + static_cast<int64_t>(pos[j + embedlib_cpu::kAhead]) * features,
                     features);
    }
    if (s.bounds[s.of_id[j]] != 1) continue;
    const float* g = grads + static_cast<int64_t>(pos[j]) * features;
    for (int64_t c = 0; c < features; ++c) s.sum[c] = 0.0f + g[c];
    update(part_rows[j], s.sum);
  }
  // The rows met more than once: their indices into `multi` (the hash
  // slots, done with), and bounds[k] becomes row k's first place in
  // `order`, then, once its ids are placed, its end (and so row k + 1's
  // start).
  int32_t* multi = s.key;
  int32_t multis = 0, total = 0;
  for (int32_t k = 0; k < distinct; ++k) {
    const int32_t c = s.bounds[k];
    if (c > 1) multi[multis++] = k;
    s.bounds[k] = total;
    total += c;
  }
  for (int64_t j = 0; j < len; ++j) s.order[s.bounds[s.of_id[j]]++] = pos[j];
  for (int32_t i = 0; i < multis; ++i) {
    // The rows are scattered over the table, and their gradients over the
    // [ids, features] gradients: fetching a few rows ahead overlaps their
    // cache misses (common.h).
    if (i + embedlib_cpu::kAhead < multis) {
      const int32_t ahead = multi[i + embedlib_cpu::kAhead];
      update.Prefetch(s.rows[ahead]);
      // Its first few gradients (a hot row's many are fetched as its sum runs).
      const int32_t first = ahead ? s.bounds[ahead - 1] : 0;
      for (int32_t j = first; j < s.bounds[ahead] && j < first + 2; ++j) {
        PrefetchFloats(grads + static_cast<int64_t>(s.order[j]) * features, features);
      }
    }
    const int32_t k = multi[i];
    std::fill(s.sum, s.sum + features, 0.0f);
    for (int32_t j = k ? s.bounds[k - 1] : 0; j < s.bounds[k]; ++j) {
      const float* g = grads + static_cast<int64_t>(s.order[j]) * features;
      for (int64_t c = 0; c < features; ++c) s.sum[c] += g[c];
    }
    update(s.rows[k], s.sum);
  }
}

// Runs update(row, summed_gradient) once for every distinct row of the
// shard among the ids. Rows are split into parts by range, each part on one
// thread, so no two threads touch a row; a row's result does not depend on
// the number of threads.
template <typename Update>
void ForEachTouchedRow(xla::ffi::ThreadPool& pool, const int32_t* ids, int64_t n,
                       int64_t first_row, int64_t shard_rows, const float* grads,
                       int64_t features, const Update& update) {
  if (n == 0 || shard_rows == 0) return;
  const int workers = embedlib_cpu::PoolWorkers(pool, n, kIdsPerWorker);
  const Parts parts = GroupByPart(pool, workers, ids, n, first_row, shard_rows);
  const int64_t total = parts.start[parts.count];
  // Each part's hash slots: a power of two, at least twice its ids.
  std::vector<int64_t> slots_at(parts.count + 1, 0);
  for (int64_t p = 0; p < parts.count; ++p) {
    int64_t capacity = 2;
    while (capacity < 2 * (parts.start[p + 1] - parts.start[p])) capacity <<= 1;
    slots_at[p + 1] = slots_at[p] + capacity;
  }
  // Allocated here, on XLA's (long-lived) thread: glibc then reuses the
  // blocks from step to step, where a new thread's arena would hand back
  // fresh pages, a page fault each.
  // Not zeroed: every part writes its slices before it reads them.
  const int64_t slots = slots_at[parts.count];
  std::unique_ptr<int32_t[]> key(new int32_t[slots]), slot(new int32_t[slots]),
      of_id(new int32_t[total]), rows(new int32_t[total]), order(new int32_t[total]),
      bounds(new int32_t[total + parts.count]);
  std::unique_ptr<float[]> sums(new float[parts.count * features]);
  embedlib_cpu::ParallelTasks(pool, workers, parts.count, [&](int64_t p) {
    const int64_t begin = parts.start[p], len = parts.start[p + 1] - begin;
    if (len == 0) return;
    const PartScratch s{key.get() + slots_at[p], slot.get() + slots_at[p],
                        static_cast<uint64_t>(slots_at[p + 1] - slots_at[p] - 1),
                        of_id.get() + begin, rows.get() + begin, bounds.get() + begin + p,
                        order.get() + begin, sums.get() + p * features};
    UpdatePart(parts.pos.data() + begin, parts.row.data() + begin, len, grads, features, s,
               update);
  });
}

// The shard's columns [0, cols) are logical columns [first_col, ...); only
// those below `features` exist (the rest pad the last hidden shard).
struct Columns {
  int64_t first, count;
};

Columns LogicalColumns(int64_t first_col, int64_t cols, int64_t features) {
  return {first_col, std::max<int64_t>(0, std::min(cols, features - first_col))};
}

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& table,
                       const ffi::Buffer<ffi::S32>& ids,
                       const ffi::Buffer<ffi::F32>& grads, int64_t features) {
  if (table.dimensions().size() != 2 || grads.dimensions().size() != 2 ||
      grads.dimensions()[0] != static_cast<int64_t>(ids.element_count()) ||
      grads.dimensions()[1] != features) {
    return ffi::Error::InvalidArgument(
        "embedlib fused CPU update: expected table [rows, cols], ids [n] and "
        "grads [n, features]");
  }
  return ffi::Error::Success();
}

// The rules, each a row update (`operator()`: the touched row's index in the
// shard and its summed gradient, all `features` logical columns) and the
// prefetch of the memory it is about to update.

struct Sgd {
  float* table;
  int64_t cols;
  Columns c;
  float neg_lr;

  void Prefetch(int64_t row) const { PrefetchFloats(table + row * cols, c.count); }
  void operator()(int64_t row, const float* g) const {
    float* w = table + row * cols;
    for (int64_t j = 0; j < c.count; ++j) w[j] += neg_lr * g[c.first + j];
  }
};

struct Adagrad {
  float* table;
  float* acc;
  int64_t cols, features;
  Columns c;
  float lr, eps;

  void Prefetch(int64_t row) const {
    PrefetchFloats(table + row * cols, c.count);
    __builtin_prefetch(acc + row, 1);
  }
  void operator()(int64_t row, const float* g) const {
    // In lanes (common.h): one running sum would be a chain of `features`
    // dependent additions, the longest part of a row's update.
    const float squares = embedlib_cpu::LaneDot(g, g, features);
    const float new_acc = acc[row] + squares / static_cast<float>(features);
    acc[row] = new_acc;
    const float neg_scale = -(lr / (std::sqrt(new_acc) + eps));
    float* w = table + row * cols;
    for (int64_t j = 0; j < c.count; ++j) w[j] += neg_scale * g[c.first + j];
  }
};

// LazyAdam; `count` is the per-row step count (bias_correction="row"), or
// null to use `global_t`, the optimizer's step + 1 ("global").
struct Adam {
  float *table, *m, *v;
  int32_t* count;
  int64_t cols;
  Columns c;
  float neg_lr, b1, one_minus_b1, b2, one_minus_b2, eps, global_t;

  void Prefetch(int64_t row) const {
    PrefetchFloats(table + row * cols, c.count);
    PrefetchFloats(m + row * cols, c.count);
    PrefetchFloats(v + row * cols, c.count);
    if (count) __builtin_prefetch(count + row, 1);
  }
  void operator()(int64_t row, const float* g) const {
    const float t = count ? static_cast<float>(count[row] += 1) : global_t;
    const float m_fix = 1.0f - std::pow(b1, t);
    const float v_fix = 1.0f - std::pow(b2, t);
    float* w = table + row * cols;
    float* mr = m + row * cols;
    float* vr = v + row * cols;
    for (int64_t j = 0; j < c.count; ++j) {
      const float gj = g[c.first + j];
      const float m_new = b1 * mr[j] + one_minus_b1 * gj;
      const float v_new = b2 * vr[j] + one_minus_b2 * gj * gj;
      mr[j] = m_new;
      vr[j] = v_new;
      w[j] += neg_lr * (m_new / m_fix) / (std::sqrt(v_new / v_fix) + eps);
    }
  }
};

// The shared part of every handler: shape checks, copies where XLA did not
// alias, the touched rows, and the rule built for this shard by `make`.
template <typename MakeRule>
ffi::Error Run(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& table,
               const ffi::Buffer<ffi::S32>& ids, const ffi::Buffer<ffi::F32>& grads,
               const ffi::Buffer<ffi::S32>& offsets, int64_t features, const MakeRule& make) {
  if (auto e = CheckShapes(table, ids, grads, features); !e.success()) return e;
  const int64_t rows = table.dimensions()[0], cols = table.dimensions()[1];
  const int32_t* off = offsets.typed_data();
  ForEachTouchedRow(pool, ids.typed_data(), ids.element_count(), off[0], rows, grads.typed_data(),
                    features, make(cols, LogicalColumns(off[1], cols, features)));
  return ffi::Error::Success();
}

ffi::Error SgdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table,
                   ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                   ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> lr, int64_t features,
                   ffi::ResultBuffer<ffi::F32> table_out) {
  PrepareInPlace(table, table_out);
  return Run(pool, table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Sgd{table_out->typed_data(), cols, c, -lr.typed_data()[0]};
  });
}

ffi::Error AdagradImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table,
                       ffi::Buffer<ffi::F32> acc, ffi::Buffer<ffi::S32> ids,
                       ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> offsets,
                       ffi::Buffer<ffi::F32> lr, int64_t features, float eps,
                       ffi::ResultBuffer<ffi::F32> table_out,
                       ffi::ResultBuffer<ffi::F32> acc_out) {
  PrepareInPlace(table, table_out);
  PrepareInPlace(acc, acc_out);
  return Run(pool, table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adagrad{table_out->typed_data(), acc_out->typed_data(), cols, features, c,
                   lr.typed_data()[0], eps};
  });
}

ffi::Error AdamRowImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> m,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> count,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                       ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> lr,
                       int64_t features, float b1, float one_minus_b1, float b2,
                       float one_minus_b2, float eps,
                       ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> m_out,
                       ffi::ResultBuffer<ffi::F32> v_out, ffi::ResultBuffer<ffi::S32> count_out) {
  PrepareInPlace(table, table_out);
  PrepareInPlace(m, m_out);
  PrepareInPlace(v, v_out);
  PrepareInPlace(count, count_out);
  return Run(pool, table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adam{table_out->typed_data(), m_out->typed_data(), v_out->typed_data(),
                count_out->typed_data(), cols, c, -lr.typed_data()[0], b1, one_minus_b1,
                b2, one_minus_b2, eps, 0.0f};
  });
}

ffi::Error AdamGlobalImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table,
                          ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                          ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> lr,
                          ffi::Buffer<ffi::S32> step,
                          int64_t features, float b1, float one_minus_b1, float b2,
                          float one_minus_b2, float eps,
                          ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> m_out,
                          ffi::ResultBuffer<ffi::F32> v_out) {
  PrepareInPlace(table, table_out);
  PrepareInPlace(m, m_out);
  PrepareInPlace(v, v_out);
  const float global_t = static_cast<float>(step.typed_data()[0]) + 1.0f;
  return Run(pool, table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adam{table_out->typed_data(), m_out->typed_data(), v_out->typed_data(), nullptr,
                cols, c, -lr.typed_data()[0], b1, one_minus_b1, b2, one_minus_b2, eps,
                global_t};
  });
}

}  // namespace

namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

// Every handler splits its rows over XLA's intra-op threads (pool.h).
auto Bind() { return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>(); }

// The operands after the state: ids, grads, offsets, lr.
template <typename Binding>
auto BatchArgs(Binding b) {
  return std::move(b).template Arg<S32>().template Arg<F32>().template Arg<S32>().template Arg<F32>();
}

template <typename Binding>
auto AdamAttrs(Binding b) {
  return std::move(b)
      .template Attr<int64_t>("features")
      .template Attr<float>("b1")
      .template Attr<float>("one_minus_b1")
      .template Attr<float>("b2")
      .template Attr<float>("one_minus_b2")
      .template Attr<float>("eps");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibSgd, SgdImpl,
                              BatchArgs(Bind().Arg<F32>())
                                  .Attr<int64_t>("features")
                                  .Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibAdagrad, AdagradImpl,
                              BatchArgs(Bind().Arg<F32>().Arg<F32>())
                                  .Attr<int64_t>("features")
                                  .Attr<float>("eps")
                                  .Ret<F32>()
                                  .Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EmbedlibAdamRow, AdamRowImpl,
    AdamAttrs(BatchArgs(Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<S32>()))
        .Ret<F32>()
        .Ret<F32>()
        .Ret<F32>()
        .Ret<S32>());

// The optimizer's step follows lr.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EmbedlibAdamGlobal, AdamGlobalImpl,
    AdamAttrs(BatchArgs(Bind().Arg<F32>().Arg<F32>().Arg<F32>()).Arg<S32>())
        .Ret<F32>()
        .Ret<F32>()
        .Ret<F32>());
