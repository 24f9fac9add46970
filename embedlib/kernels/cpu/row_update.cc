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
// uses), and runs the rule on that row in place: the table and its slots are
// aliased to the outputs, so a donated table is never copied.
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

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using embedlib_cpu::CopyUnlessAliased;

void PrefetchFloats(const void* p, int64_t count) { embedlib_cpu::PrefetchBytes(p, count * 4); }

// Each distinct row of the shard that the ids touch, in order of first
// appearance, and for each id the index of its row in that list (-1 when
// the id is not in the shard).
struct Touched {
  std::vector<int32_t> rows;
  std::vector<int32_t> of_id;
};

// An open-addressing hash table over the ids (2n to 4n slots: never the
// table's size), on one thread: partitioning it over threads by a hash of
// the row made the whole update slower in benchmarks/sparse_step.py.
Touched FindTouchedRows(const int32_t* ids, int64_t n, int64_t first_row,
                        int64_t shard_rows) {
  Touched out;
  out.of_id.assign(n, -1);
  out.rows.reserve(std::min<int64_t>(n, shard_rows));
  int64_t capacity = 2;
  while (capacity < 2 * n) capacity <<= 1;
  const uint64_t mask = capacity - 1;
  std::vector<int32_t> key(capacity, -1), slot(capacity);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = static_cast<int64_t>(ids[i]) - first_row;
    if (ids[i] < 0 || row < 0 || row >= shard_rows) continue;
    uint64_t h = (static_cast<uint64_t>(row) * 0x9E3779B97F4A7C15ull) >> 20 & mask;
    while (key[h] != -1 && key[h] != row) h = (h + 1) & mask;
    if (key[h] == -1) {
      key[h] = static_cast<int32_t>(row);
      slot[h] = static_cast<int32_t>(out.rows.size());
      out.rows.push_back(static_cast<int32_t>(row));
    }
    out.of_id[i] = slot[h];
  }
  return out;
}

// Sums the gradients of touched rows [begin, end) into `sums` (their rows of
// it, zeroed) in input order and calls update(row, summed_gradient) once per
// row. Disjoint ranges touch disjoint rows, so ranges run on separate
// threads without locks.
template <typename Update>
void SumAndUpdate(const Touched& touched, const float* grads, int64_t n,
                  int64_t features, int64_t begin, int64_t end, float* sums,
                  const Update& update) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = touched.of_id[i];
    if (k < begin || k >= end) continue;
    float* sum = sums + k * features;
    const float* g = grads + i * features;
    for (int64_t c = 0; c < features; ++c) sum[c] += g[c];
  }
  for (int64_t k = begin; k < end; ++k) {
    // The rows are scattered over the table: fetching a few rows ahead
    // overlaps their cache misses (common.h).
    if (k + embedlib_cpu::kAhead < end) update.Prefetch(touched.rows[k + embedlib_cpu::kAhead]);
    update(touched.rows[k], sums + k * features);
  }
}

template <typename Update>
void ForEachTouchedRow(const int32_t* ids, int64_t n, int64_t first_row, int64_t shard_rows,
                       const float* grads, int64_t features, const Update& update) {
  const Touched touched = FindTouchedRows(ids, n, first_row, shard_rows);
  const int64_t rows = touched.rows.size();
  // Allocated here, on XLA's (long-lived) thread: glibc then reuses the
  // block from step to step, where a new thread's arena would hand back
  // fresh pages, a page fault each.
  std::vector<float> sums(rows * features, 0.0f);
  embedlib_cpu::ParallelRanges(rows, [&](int64_t begin, int64_t end) {
    SumAndUpdate(touched, grads, n, features, begin, end, sums.data(), update);
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
    float squares = 0.0f;
    for (int64_t j = 0; j < features; ++j) squares += g[j] * g[j];
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
ffi::Error Run(const ffi::Buffer<ffi::F32>& table, const ffi::Buffer<ffi::S32>& ids,
               const ffi::Buffer<ffi::F32>& grads, const ffi::Buffer<ffi::S32>& offsets,
               int64_t features, const MakeRule& make) {
  if (auto e = CheckShapes(table, ids, grads, features); !e.success()) return e;
  const int64_t rows = table.dimensions()[0], cols = table.dimensions()[1];
  const int32_t* off = offsets.typed_data();
  ForEachTouchedRow(ids.typed_data(), ids.element_count(), off[0], rows, grads.typed_data(),
                    features, make(cols, LogicalColumns(off[1], cols, features)));
  return ffi::Error::Success();
}

ffi::Error SgdImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                   ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> offsets,
                   ffi::Buffer<ffi::F32> lr, int64_t features,
                   ffi::ResultBuffer<ffi::F32> table_out) {
  CopyUnlessAliased(table, table_out);
  return Run(table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Sgd{table_out->typed_data(), cols, c, -lr.typed_data()[0]};
  });
}

ffi::Error AdagradImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> acc,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                       ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> lr,
                       int64_t features, float eps,
                       ffi::ResultBuffer<ffi::F32> table_out,
                       ffi::ResultBuffer<ffi::F32> acc_out) {
  CopyUnlessAliased(table, table_out);
  CopyUnlessAliased(acc, acc_out);
  return Run(table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adagrad{table_out->typed_data(), acc_out->typed_data(), cols, features, c,
                   lr.typed_data()[0], eps};
  });
}

ffi::Error AdamRowImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> m,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> count,
                       ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                       ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::F32> lr,
                       int64_t features, float b1, float one_minus_b1, float b2,
                       float one_minus_b2, float eps,
                       ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> m_out,
                       ffi::ResultBuffer<ffi::F32> v_out, ffi::ResultBuffer<ffi::S32> count_out) {
  CopyUnlessAliased(table, table_out);
  CopyUnlessAliased(m, m_out);
  CopyUnlessAliased(v, v_out);
  CopyUnlessAliased(count, count_out);
  return Run(table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adam{table_out->typed_data(), m_out->typed_data(), v_out->typed_data(),
                count_out->typed_data(), cols, c, -lr.typed_data()[0], b1, one_minus_b1,
                b2, one_minus_b2, eps, 0.0f};
  });
}

ffi::Error AdamGlobalImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> m,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> offsets,
                          ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::S32> step,
                          int64_t features, float b1, float one_minus_b1, float b2,
                          float one_minus_b2, float eps,
                          ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> m_out,
                          ffi::ResultBuffer<ffi::F32> v_out) {
  CopyUnlessAliased(table, table_out);
  CopyUnlessAliased(m, m_out);
  CopyUnlessAliased(v, v_out);
  const float global_t = static_cast<float>(step.typed_data()[0]) + 1.0f;
  return Run(table, ids, grads, offsets, features, [&](int64_t cols, Columns c) {
    return Adam{table_out->typed_data(), m_out->typed_data(), v_out->typed_data(), nullptr,
                cols, c, -lr.typed_data()[0], b1, one_minus_b1, b2, one_minus_b2, eps,
                global_t};
  });
}

}  // namespace

namespace {

using F32 = ffi::Buffer<ffi::F32>;
using S32 = ffi::Buffer<ffi::S32>;

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
                              BatchArgs(ffi::Ffi::Bind().Arg<F32>())
                                  .Attr<int64_t>("features")
                                  .Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibAdagrad, AdagradImpl,
                              BatchArgs(ffi::Ffi::Bind().Arg<F32>().Arg<F32>())
                                  .Attr<int64_t>("features")
                                  .Attr<float>("eps")
                                  .Ret<F32>()
                                  .Ret<F32>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EmbedlibAdamRow, AdamRowImpl,
    AdamAttrs(BatchArgs(ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>().Arg<S32>()))
        .Ret<F32>()
        .Ret<F32>()
        .Ret<F32>()
        .Ret<S32>());

// The optimizer's step follows lr.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    EmbedlibAdamGlobal, AdamGlobalImpl,
    AdamAttrs(BatchArgs(ffi::Ffi::Bind().Arg<F32>().Arg<F32>().Arg<F32>()).Arg<S32>())
        .Ret<F32>()
        .Ret<F32>()
        .Ret<F32>());
