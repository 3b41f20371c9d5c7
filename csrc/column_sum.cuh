// The column sums that finish a parameter gradient on CUDA: the backward kernels of norm and
// bias + activation write one row of partial sums per CTA (or row chunk), [rows, n] row-major, and
// column_sum adds them up into the [n] gradient.
//
// A CTA owns kColumnSumCols adjacent columns (a warp reads one coalesced 128-byte segment of a
// row) and kColumnSumGroups row groups; group g adds rows g, g + kColumnSumGroups, ... in
// increasing order, then thread row 0 adds the groups' sums in group order. The order is fixed,
// so the result is the same on every run (a policy or a recompute changes no bit of it). One
// thread per column walking all rows, as before, left a 2048-wide norm gradient on 8 CTAs of an
// H200 for 0.22 ms (measured, bench/results/h200-20261204b).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

namespace memopt {

constexpr int kColumnSumCols = 32;
constexpr int kColumnSumGroups = 16;

template <typename acc_t, typename out_t>
__global__ void __launch_bounds__(kColumnSumCols * kColumnSumGroups)
    column_sum_cuda_kernel(const acc_t* __restrict__ partials, int64_t rows, int64_t n, out_t* __restrict__ out) {
  __shared__ acc_t group_sums[kColumnSumGroups][kColumnSumCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  acc_t total = 0;
  if (col < n) {
#pragma unroll 4
    for (int64_t r = threadIdx.y; r < rows; r += kColumnSumGroups) total += partials[r * n + col];
  }
  group_sums[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    acc_t sum = 0;
#pragma unroll
    for (int g = 0; g < kColumnSumGroups; ++g) sum += group_sums[g][threadIdx.x];
    out[col] = static_cast<out_t>(sum);
  }
}

// How many CTAs of `kernel` (launched with `threads` threads, no dynamic shared memory) are
// resident on the current device at once, by its occupancy: registers decide it as much as
// threads. The kernels that write partial rows size their grids by it, since a CTA that would only
// wait for a slot adds a partial row to write and sum but no parallelism.
template <typename Kernel>
int64_t resident_ctas(Kernel kernel, int threads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return static_cast<int64_t>(per_sm > 1 ? per_sm : 1) * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// out[j] = sum over r of partials[r * n + j], on the current stream.
template <typename acc_t, typename out_t>
void launch_column_sum(const acc_t* partials, int64_t rows, int64_t n, out_t* out) {
  const dim3 threads(kColumnSumCols, kColumnSumGroups);
  const auto blocks = static_cast<unsigned>((n + kColumnSumCols - 1) / kColumnSumCols);
  column_sum_cuda_kernel<acc_t, out_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(partials, rows, n, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace memopt
