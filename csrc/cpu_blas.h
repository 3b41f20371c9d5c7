// Row-major GEMM on CPU through the BLAS that ATen itself links (MKL in torch's x86-64 wheels), for
// the kernels that multiply small tiles in a loop (attention_cpu_kernels_impl.h): at::mm per tile
// would cost a dispatcher round trip and an output tensor each (~3 us, a tenth of a 64 x 256 x 64
// tile's time).
//
// The BLAS entry points (sgemm_ / dgemm_, the Fortran interface) are weak references, resolved when
// the extension loads: a torch build that does not export them leaves cpu_blas_available() false
// and memopt.attention's "auto" then runs ATen's kernels instead of the ones that need it.
#pragma once

#include <cstdint>

namespace memopt {

bool cpu_blas_available();

// C (m x n, leading dimension ldc) = alpha * op(A) op(B) + beta * C, all row-major: op(A) is
// m x k (A^T when trans_a; A stored with leading dimension lda), op(B) is k x n.
void cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
              const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

}  // namespace memopt
