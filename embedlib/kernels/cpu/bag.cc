// Pooled bags for XLA:CPU: out[b] = sum_l c[b, l] * table[ids[b, l]].
//
// kernels/reference.py's bag_reference. The factors c are either given
// (`coef`: bag_coefficients, with per-id weights) or, for unweighted bags,
// made here as bag_coefficients makes them: 1 for sum, 1 / n for mean and
// 1 / sqrt(n) for sqrtn over a bag's n valid ids (n is exact in float32, so
// these are the reference's factors bit for bit). Each bag's terms are
// rounded products (no product for an unweighted sum: 1 * x is x) summed
// slot by slot from zero in float32, as the reference's segment sum adds
// them (built with -ffp-contract=off: no fused multiply-adds), so the
// result is the reference's. An invalid id's term is skipped, not added as
// a zero: only the sign of a zero sum can differ.
//
// Unlike XLA's gather it never writes the [batch * bag, features] rows:
// each bag is summed in registers while the rows of ids a few slots ahead
// are fetched, the bags split over XLA's intra-op threads (pool.h). The
// loops are compiled for AVX-512, AVX2 and the baseline, chosen when the
// library loads (target_clones): a cache may be shared by different CPUs.
//
// Operands: table f32[rows, features], ids s32[batch, bag] (anything
// outside [0, rows) is padding), coef f32[batch, bag], or f32[0] for
// unweighted bags. Attribute: combiner (0 sum, 1 mean, 2 sqrtn; read for
// unweighted bags only). Result: f32[batch, features].

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The fewest ids worth a worker of their own.
constexpr int64_t kIdsPerWorker = 4096;
// Tables up to this size stay in the core's cache: their rows are not
// fetched ahead (the prefetches would only take issue slots).
constexpr int64_t kCachedBytes = 1 << 20;
constexpr int64_t kSum = 0, kMean = 1;

struct Bags {
  const float* table;
  int64_t rows, width;
  const int32_t* ids;
  const float* coef;  // null: unweighted
  int64_t combiner, bag;
  float* out;
};

// An unweighted bag's factor for each of its `valid` ids (bag_coefficients).
inline float Factor(int64_t combiner, int64_t valid) {
  if (combiner == kSum || valid == 0) return 1.0f;
  const float n = static_cast<float>(valid);
  return 1.0f / (combiner == kMean ? n : std::sqrt(n));
}

// Sums bags [begin, end). `Width`: the row's floats when a constant (the
// sum then stays in registers), else 0. `Scaled`: whether terms are
// products (weights, mean, sqrtn) or the rows themselves (unweighted sum).
// `Ahead`: whether to fetch rows a few ids ahead (a table past the caches).
template <int64_t Width, bool Scaled, bool Ahead>
__attribute__((always_inline)) inline void PoolBags(const Bags& a, int64_t begin, int64_t end) {
  const int64_t f = Width ? Width : a.width;
  const int64_t last = end * a.bag;
  float local[Width ? Width : 1];
  for (int64_t b = begin; b < end; ++b) {
    float* acc = Width ? local : a.out + b * f;
    for (int64_t c = 0; c < f; ++c) acc[c] = 0.0f;
    const int32_t* ids = a.ids + b * a.bag;
    float factor = 1.0f;
    if (Scaled && !a.coef) {
      int64_t valid = 0;
      for (int64_t l = 0; l < a.bag; ++l) valid += ids[l] >= 0 && ids[l] < a.rows;
      factor = Factor(a.combiner, valid);
    }
    for (int64_t l = 0; l < a.bag; ++l) {
      const int64_t i = b * a.bag + l;
      if (Ahead && i + embedlib_cpu::kAhead < last) {
        const int32_t ahead = a.ids[i + embedlib_cpu::kAhead];
        if (ahead >= 0 && ahead < a.rows) {
          embedlib_cpu::PrefetchBytes(a.table + static_cast<int64_t>(ahead) * f, f * 4);
        }
      }
      const int32_t r = ids[l];
      if (r < 0 || r >= a.rows) continue;
      const float* row = a.table + static_cast<int64_t>(r) * f;
      if (Scaled) {
        const float k = a.coef ? a.coef[i] : factor;
        for (int64_t c = 0; c < f; ++c) acc[c] += k * row[c];
      } else {
        for (int64_t c = 0; c < f; ++c) acc[c] += row[c];
      }
    }
    if (Width) std::memcpy(a.out + b * f, local, f * 4);
  }
}

template <bool Scaled, bool Ahead>
__attribute__((always_inline)) inline void PoolWidth(const Bags& a, int64_t begin, int64_t end) {
  switch (a.width) {
    case 16: return PoolBags<16, Scaled, Ahead>(a, begin, end);
    case 32: return PoolBags<32, Scaled, Ahead>(a, begin, end);
    case 64: return PoolBags<64, Scaled, Ahead>(a, begin, end);
    case 128: return PoolBags<128, Scaled, Ahead>(a, begin, end);
    default: return PoolBags<0, Scaled, Ahead>(a, begin, end);
  }
}

template <bool Scaled>
__attribute__((always_inline)) inline void PoolCached(const Bags& a, int64_t begin, int64_t end) {
  if (a.rows * a.width * static_cast<int64_t>(sizeof(float)) > kCachedBytes) {
    PoolWidth<Scaled, true>(a, begin, end);
  } else {
    PoolWidth<Scaled, false>(a, begin, end);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void PoolRange(const Bags& a, int64_t begin, int64_t end) {
  if (a.coef || a.combiner != kSum) {
    PoolCached<true>(a, begin, end);
  } else {
    PoolCached<false>(a, begin, end);
  }
}

ffi::Error BagImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> ids,
                   ffi::Buffer<ffi::F32> coef, int64_t combiner,
                   ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = table.dimensions();
  const auto bags = ids.dimensions();
  const bool weighted = coef.element_count() > 0;
  if (dims.size() != 2 || bags.size() != 2 ||
      (weighted && coef.element_count() != ids.element_count()) || combiner < 0 ||
      combiner > 2 || out->element_count() != static_cast<size_t>(bags[0] * dims[1])) {
    return ffi::Error::InvalidArgument(
        "embedlib bag: expected table [rows, features], ids [batch, bag], coef [batch, bag] "
        "or [0], combiner 0, 1 or 2, and a result [batch, features]");
  }
  const Bags a{table.typed_data(), dims[0], dims[1], ids.typed_data(),
               weighted ? coef.typed_data() : nullptr, combiner, bags[1], out->typed_data()};
  const int64_t batch = bags[0];
  embedlib_cpu::AdviseHugePages(a.table, table.size_bytes());
  if (a.bag == 0) {
    std::memset(a.out, 0, batch * a.width * sizeof(float));
    return ffi::Error::Success();
  }
  const int workers = embedlib_cpu::PoolWorkers(pool, batch * a.bag, kIdsPerWorker);
  embedlib_cpu::PoolRanges(pool, workers, batch,
                           [&](int64_t begin, int64_t end) { PoolRange(a, begin, end); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibBag, BagImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("combiner")
                                  .Ret<ffi::Buffer<ffi::F32>>());
