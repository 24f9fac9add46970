// DLRM's dot interaction for XLA:CPU, forward and backward.
//
// models/blocks.py's dot_interaction: for n vectors v_0 .. v_{n-1}, each
// [batch, width], out[b, p] = <v_i[b], v_j[b]> for the pairs p = (i, j),
// i < j, in row-major order. XLA runs that as one small fusion per pair
// (n (n - 1) / 2 passes over the batch, 351 for DLRM's 27 vectors) and its
// gradient as one fusion per vector reading all the others again; here one
// pass over the batch reads each example's n rows once, while they are in
// the core's cache, the examples split over XLA's intra-op threads (pool.h).
//
// Forward: each dot in LaneDot's lanes (common.h), a fixed order, so the
// result is the same for any number of threads and on any machine.
// Backward: grad_i[b] = sum over j != i, in increasing j, of
// dout[b, p(i, j)] * v_j[b], element by element (built with
// -ffp-contract=off: a product, then a sum). Both differ from XLA's sums only
// in their order (tests/kernels/test_interaction.py bounds it).
//
// Forward operands: the n vectors f32[batch, width]; result f32[batch, pairs].
// Backward operands: dout f32[batch, pairs], then the n vectors; results the
// n gradients f32[batch, width].

#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The fewest multiply-adds worth a worker of their own.
constexpr int64_t kWorkPerWorker = 1 << 20;

template <int64_t Width>
__attribute__((always_inline)) inline void ForwardRows(const std::vector<const float*>& v,
                                                       int64_t width, float* out, int64_t begin,
                                                       int64_t end) {
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t pairs = n * (n - 1) / 2;
  const int64_t w = Width ? Width : width;
  for (int64_t b = begin; b < end; ++b) {
    float* o = out + b * pairs;
    const int64_t row = b * w;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = i + 1; j < n; ++j) *o++ = embedlib_cpu::LaneDot(v[i] + row, v[j] + row, w);
    }
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void ForwardRange(const std::vector<const float*>& v, int64_t width, float* out,
                  int64_t begin, int64_t end) {
  switch (width) {
    case 16: return ForwardRows<16>(v, width, out, begin, end);
    case 32: return ForwardRows<32>(v, width, out, begin, end);
    case 64: return ForwardRows<64>(v, width, out, begin, end);
    case 128: return ForwardRows<128>(v, width, out, begin, end);
    default: return ForwardRows<0>(v, width, out, begin, end);
  }
}

// `Width`: the vectors' width when a constant (each gradient row is then
// summed in registers), else 0.
template <int64_t Width>
__attribute__((always_inline)) inline void BackwardRows(
    const float* dout, const std::vector<const float*>& v, const std::vector<float*>& grads,
    const std::vector<int64_t>& first, int64_t width, int64_t begin, int64_t end) {
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t pairs = n * (n - 1) / 2;
  const int64_t w = Width ? Width : width;
  for (int64_t b = begin; b < end; ++b) {
    const float* g = dout + b * pairs;
    const int64_t row = b * w;
    for (int64_t i = 0; i < n; ++i) {
      float local[Width ? Width : 1];
      float* acc = Width ? local : grads[i] + row;
      for (int64_t d = 0; d < w; ++d) acc[d] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        if (j == i) continue;
        const float s = j > i ? g[first[i] + j - i - 1] : g[first[j] + i - j - 1];
        const float* x = v[j] + row;
        for (int64_t d = 0; d < w; ++d) acc[d] += s * x[d];
      }
      if (Width) std::memcpy(grads[i] + row, local, w * sizeof(float));
    }
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void BackwardRange(const float* dout, const std::vector<const float*>& v,
                   const std::vector<float*>& grads, int64_t width, int64_t begin, int64_t end) {
  // first[i]: the index of pair (i, i + 1); pair (i, j) is first[i] + j - i - 1.
  const int64_t n = static_cast<int64_t>(v.size());
  std::vector<int64_t> first(n);
  for (int64_t i = 0, p = 0; i < n; p += n - 1 - i, ++i) first[i] = p;
  switch (width) {
    case 16: return BackwardRows<16>(dout, v, grads, first, width, begin, end);
    case 32: return BackwardRows<32>(dout, v, grads, first, width, begin, end);
    case 64: return BackwardRows<64>(dout, v, grads, first, width, begin, end);
    case 128: return BackwardRows<128>(dout, v, grads, first, width, begin, end);
    default: return BackwardRows<0>(dout, v, grads, first, width, begin, end);
  }
}

// The n vectors' data, after checking each is [batch, width] like the first.
ffi::Error Vectors(const ffi::RemainingArgs& args, std::vector<const float*>* v,
                   int64_t* batch, int64_t* width) {
  const int64_t n = static_cast<int64_t>(args.size());
  if (n < 2) return ffi::Error::InvalidArgument("embedlib interaction: expected 2 or more vectors");
  for (int64_t i = 0; i < n; ++i) {
    auto x = args.get<ffi::Buffer<ffi::F32>>(i);
    if (x.has_error()) return x.error();
    const auto dims = x->dimensions();
    if (dims.size() != 2 || (i > 0 && (dims[0] != *batch || dims[1] != *width))) {
      return ffi::Error::InvalidArgument(
          "embedlib interaction: expected every vector f32[batch, width], all of one shape");
    }
    *batch = dims[0];
    *width = dims[1];
    v->push_back(x->typed_data());
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::RemainingArgs args,
                       ffi::ResultBuffer<ffi::F32> out) {
  std::vector<const float*> v;
  int64_t batch = 0, width = 0;
  if (auto e = Vectors(args, &v, &batch, &width); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t pairs = n * (n - 1) / 2;
  if (out->element_count() != static_cast<size_t>(batch * pairs)) {
    return ffi::Error::InvalidArgument("embedlib interaction: expected a result [batch, pairs]");
  }
  float* o = out->typed_data();
  const int workers = embedlib_cpu::PoolWorkers(pool, batch * pairs * width, kWorkPerWorker);
  embedlib_cpu::PoolRanges(pool, workers, batch, [&](int64_t begin, int64_t end) {
    ForwardRange(v, width, o, begin, end);
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dout, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  std::vector<const float*> v;
  int64_t batch = 0, width = 0;
  if (auto e = Vectors(args, &v, &batch, &width); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(v.size());
  const int64_t pairs = n * (n - 1) / 2;
  if (dout.dimensions().size() != 2 || dout.dimensions()[0] != batch ||
      dout.dimensions()[1] != pairs || static_cast<int64_t>(rets.size()) != n) {
    return ffi::Error::InvalidArgument(
        "embedlib interaction backward: expected dout [batch, pairs] and one gradient a vector");
  }
  std::vector<float*> grads;
  for (int64_t i = 0; i < n; ++i) {
    auto g = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (g.has_error()) return g.error();
    if ((*g)->element_count() != static_cast<size_t>(batch * width)) {
      return ffi::Error::InvalidArgument(
          "embedlib interaction backward: expected each gradient [batch, width]");
    }
    grads.push_back((*g)->typed_data());
  }
  const float* d = dout.typed_data();
  const int workers = embedlib_cpu::PoolWorkers(pool, batch * n * n * width, kWorkPerWorker);
  embedlib_cpu::PoolRanges(pool, workers, batch, [&](int64_t begin, int64_t end) {
    BackwardRange(d, v, grads, width, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibInteraction, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibInteractionBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
