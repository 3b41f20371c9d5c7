// The CPU kernels built for AVX-512 (F, BW, VL, DQ; x86-64, GCC): 16 floats or 8 doubles per
// vector, with ATen's AVX-512 Vectorized. Built like cpu_kernels_avx2.cpp (see there why the
// pragma sits after cpu_kernels.h); MEMOPT_CPU_KERNEL calls into this file only when
// cpu_kernel_build() says ATen runs AVX-512 on this CPU.
#include "cpu_kernels.h"

#if MEMOPT_CPU_HAVE_X86_BUILDS
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq")
// g++ does not define the feature macros for a target pragma; sleef.h declares its 512-bit (and
// 256-bit) functions only under them.
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define MEMOPT_CPU_ISA avx512
#include "cpu_kernels_impl.h"
#pragma GCC pop_options
#endif
