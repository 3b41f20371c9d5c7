// cpu_blas.h: row-major GEMM through the Fortran BLAS interface of the library ATen links.
#include "cpu_blas.h"

#include <c10/util/Exception.h>

#include <limits>

extern "C" {
// LP64 Fortran BLAS (32-bit integers), as MKL and OpenBLAS export it; weak, so that a torch build
// without them still loads the extension (the pointers are then null).
__attribute__((weak)) void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                  const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                                  const float* beta, float* c, const int* ldc);
__attribute__((weak)) void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                                  const double* alpha, const double* a, const int* lda, const double* b,
                                  const int* ldb, const double* beta, double* c, const int* ldc);
}

namespace memopt {
namespace {

int as_blas_int(int64_t value) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), "memopt cpu_gemm: dimension ", value,
              " does not fit the BLAS's 32-bit integers");
  return static_cast<int>(value);
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the same buffers, the operands
// swapped, each read as its column-major transpose.
template <typename T, typename Gemm>
void row_major_gemm(Gemm gemm, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                    int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) {
    return;
  }
  const char op_b = trans_b ? 'T' : 'N', op_a = trans_a ? 'T' : 'N';
  const int m_ = as_blas_int(n), n_ = as_blas_int(m), k_ = as_blas_int(k);
  const int lda_ = as_blas_int(ldb), ldb_ = as_blas_int(lda), ldc_ = as_blas_int(ldc);
  gemm(&op_b, &op_a, &m_, &n_, &k_, &alpha, b, &lda_, a, &ldb_, &beta, c, &ldc_);
}

}  // namespace

bool cpu_blas_available() { return sgemm_ != nullptr && dgemm_ != nullptr; }

void cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  row_major_gemm<float>(sgemm_, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cpu_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
              const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  row_major_gemm<double>(dgemm_, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace memopt
