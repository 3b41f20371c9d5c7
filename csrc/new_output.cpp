// The outputs of memopt's elementwise and norm kernels (norm_common.cpp, activation_common.cpp,
// dropout.cpp).
//
// Note: on CPU a buffer of 32 MiB or more comes from its own mmap (glibc's allocator; 32 MiB is
// its largest dynamic threshold on 64-bit hosts), and the kernel's first write faults in every
// 4 KiB page of it. Measured on this project's development host (Linux, transparent huge pages in
// "madvise" mode), one thread: copying 64 MiB of floats into a fresh buffer took 30.7 ms, and
// 10.4 ms when the buffer was first advised MADV_HUGEPAGE (2 MiB pages: 512 times fewer faults).
// At that size the faults were most of a memory-bound kernel's time. So a large CPU output is
// advised before it is written: the 2 MiB-aligned part of it (a huge page never reaches past the
// buffer). This is what PyTorch's opt-in THP_MEM_ALLOC_ENABLE=1 does for every allocation of the
// process; here only for these outputs. Smaller buffers come from the heap, whose pages are
// mostly faulted in already, and are left alone. Where THP is off ("never") or on for everything
// ("always"), madvise changes nothing; its errors are ignored (the advice is only a hint).
// MEMOPT_CPU_HUGE_PAGES=0 turns the advice off (a huge page's first fault may wait for the kernel
// to compact memory on a fragmented host: "defrag" in /sys/kernel/mm/transparent_hugepage).
#include "new_output.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace memopt {
namespace {

constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

bool advice_on() {
  static const bool on = [] {
    const char* env = std::getenv("MEMOPT_CPU_HUGE_PAGES");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return on;
}

at::Tensor advised(at::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (t.is_cpu() && static_cast<int64_t>(t.nbytes()) >= kFreshMappingBytes && advice_on()) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t last = (begin + t.nbytes()) & ~(kHugePage - 1);
    if (last > first) {
      (void)madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
    }
  }
#endif
  return t;
}

}  // namespace

at::Tensor new_output_like(const at::Tensor& like) {
  return advised(at::empty_like(like, at::MemoryFormat::Contiguous));
}

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return advised(at::empty(sizes, options));
}

}  // namespace memopt
