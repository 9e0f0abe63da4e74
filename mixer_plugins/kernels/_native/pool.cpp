// The output pool's statistics and release (OutputPool in common.h), for tests and `mixer-plugins env`.
#include "common.h"

namespace {

using namespace mixer_plugins_native;

// [cached bytes, buffers reused, buffers allocated, cap in bytes]
std::vector<int64_t> pool_stats() { return OutputPool::get().stats(); }

// Frees every cached (idle) buffer; buffers of live tensors return to the pool when those are freed.
void pool_release() { OutputPool::get().release(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(mixer_plugins_native, m) {
  m.def("pool_stats() -> int[]");
  m.def("pool_release() -> ()");
}

TORCH_LIBRARY_IMPL(mixer_plugins_native, CompositeExplicitAutograd, m) {
  m.impl("pool_stats", &pool_stats);
  m.impl("pool_release", &pool_release);
}
