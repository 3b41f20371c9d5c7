// The CPU kernels for any CPU: at::vec::Vectorized in ATen's portable build (the compiler's
// baseline instruction set), the build that MEMOPT_CPU_KERNEL falls back to.
#define MEMOPT_CPU_ISA generic
#include "cpu_kernels_impl.h"

#include <ATen/Version.h>

#include <string>

namespace memopt {

bool cpu_use_avx2_kernels() {
#if MEMOPT_CPU_HAVE_AVX2
  // ATen's own choice ("DEFAULT", "AVX2" or "AVX512" on x86-64: the hardware's, capped by
  // ATEN_CPU_CAPABILITY), and FMA, which the AVX2 build uses.
  static const bool use = [] {
    const std::string capability = at::get_cpu_capability();
    return (capability == "AVX2" || capability == "AVX512") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
  }();
  return use;
#else
  return false;
#endif
}

}  // namespace memopt
