// The CPU kernels built for AVX2 + FMA (x86-64, GCC): 8 floats or 4 doubles per vector, with ATen's
// vectorized erf/exp/tanh. The target pragma comes after ATen's core headers (cpu_kernels.h), whose
// inline functions stay baseline code, and before ATen's vector headers, so that its AVX2
// Vectorized (selected by CPU_CAPABILITY_AVX2, in its own at::vec::AVX2 namespace) compiles here
// while the rest of the extension keeps the baseline instruction set. MEMOPT_CPU_KERNEL calls
// into this file only when cpu_kernel_build() says the CPU has AVX2 and FMA.
#include "cpu_kernels.h"

#if MEMOPT_CPU_HAVE_X86_BUILDS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
// g++ does not define the feature macros for a target pragma (gcc does); sleef.h, included by
// ATen's AVX2 Vectorized, declares its 256-bit functions only under them.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define MEMOPT_CPU_ISA avx2
#include "cpu_kernels_impl.h"
#pragma GCC pop_options
#endif
