// The CPU kernels for any CPU: at::vec::Vectorized in ATen's portable build (the compiler's
// baseline instruction set), the build that MEMOPT_CPU_KERNEL falls back to.
#define MEMOPT_CPU_ISA generic
#include "cpu_kernels_impl.h"

#include <ATen/Version.h>

#include <string>

namespace memopt {

CpuKernelBuild cpu_kernel_build() {
#if MEMOPT_CPU_HAVE_X86_BUILDS
  // ATen's own choice ("DEFAULT", "AVX2" or "AVX512" on x86-64: the hardware's, capped by
  // ATEN_CPU_CAPABILITY), checked against the features each build is compiled for.
  static const CpuKernelBuild build = [] {
    const std::string capability = at::get_cpu_capability();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (capability == "AVX512" && avx512) return CpuKernelBuild::kAvx512;
    if ((capability == "AVX2" || capability == "AVX512") && avx2) return CpuKernelBuild::kAvx2;
    return CpuKernelBuild::kGeneric;
  }();
  return build;
#else
  return CpuKernelBuild::kGeneric;
#endif
}

}  // namespace memopt
