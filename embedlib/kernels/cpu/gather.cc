// Row gather for XLA:CPU: out[i] = table[ids[i]], zeros for invalid ids.
//
// The same result as kernels/reference.py's gather_reference, bit for bit
// (a copy of each row's bytes, so any dtype). Unlike XLA's gather it
// prefetches rows ahead and runs on XLA's intra-op threads (pool.h).
//
// Operands: table [rows, features] (any dtype), ids s32[n] (anything outside
// [0, rows) is invalid). Result: [n, features] of the table's dtype.

#include <cstdint>
#include <cstring>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The fewest ids worth a worker of their own.
constexpr int64_t kIdsPerWorker = 2048;

// Copies rows of `Bytes` bytes (a constant: the compiler inlines the copy;
// a memcpy call per row made narrow rows, such as a hidden shard's 8
// columns, slower than XLA's gather), or of `row_bytes` when Bytes is 0.
template <int64_t Bytes>
void CopyRows(const char* table, int64_t rows, int64_t row_bytes, const int32_t* ids,
              int64_t begin, int64_t end, char* out) {
  const int64_t width = Bytes ? Bytes : row_bytes;
  for (int64_t i = begin; i < end; ++i) {
    if (i + embedlib_cpu::kAhead < end) {
      const int32_t ahead = ids[i + embedlib_cpu::kAhead];
      if (ahead >= 0 && ahead < rows) embedlib_cpu::PrefetchBytes(table + ahead * width, width);
    }
    const int32_t r = ids[i];
    if (r >= 0 && r < rows) {
      std::memcpy(out + i * width, table + r * width, width);
    } else {
      std::memset(out + i * width, 0, width);
    }
  }
}

ffi::Error GatherImpl(ffi::ThreadPool pool, ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                      ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = table.dimensions();
  if (dims.size() != 2 || out->element_type() != table.element_type() ||
      out->element_count() != ids.element_count() * static_cast<size_t>(dims[1])) {
    return ffi::Error::InvalidArgument(
        "embedlib gather: expected table [rows, features], ids [n] and a result "
        "[n, features] of the table's dtype");
  }
  const int64_t rows = dims[0];
  const int64_t row_bytes = dims[1] * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  const char* t = static_cast<const char*>(table.untyped_data());
  char* o = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  const int64_t n = ids.element_count();
  embedlib_cpu::AdviseHugePages(t, table.size_bytes());
  const int workers = embedlib_cpu::PoolWorkers(pool, n, kIdsPerWorker);
  embedlib_cpu::PoolRanges(pool, workers, n, [&](int64_t begin, int64_t end) {
    switch (row_bytes) {
      case 16: return CopyRows<16>(t, rows, row_bytes, id, begin, end, o);
      case 32: return CopyRows<32>(t, rows, row_bytes, id, begin, end, o);
      case 64: return CopyRows<64>(t, rows, row_bytes, id, begin, end, o);
      case 128: return CopyRows<128>(t, rows, row_bytes, id, begin, end, o);
      case 256: return CopyRows<256>(t, rows, row_bytes, id, begin, end, o);
      case 512: return CopyRows<512>(t, rows, row_bytes, id, begin, end, o);
      default: return CopyRows<0>(t, rows, row_bytes, id, begin, end, o);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmbedlibGather, GatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
