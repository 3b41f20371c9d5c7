// layer_norm / rms_norm with an optional fused residual add, CUDA kernels. One CTA per row (rows
// strided over the grid), float accumulation, block reductions with warp shuffles; rows that allow
// it take the vectorized kernels (16-byte accesses, the row held in registers; see below). Parameter
// gradients: each CTA sums its rows into a float32 partial row, then a second kernel sums the
// partials in a fixed order, so the result is deterministic.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>

#include "column_sum.cuh"
#include "common.h"
#include "vector_pack.cuh"
#include "norm.h"

namespace memopt {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxWarps = 32;  // 1024 threads

// Sum of v over the CTA, returned to every thread. blockDim.x is a multiple of 32. Every thread
// adds the per-warp sums in the same order, so all threads agree bit for bit.
__device__ __forceinline__ float block_sum(float v, float* shared /* [kMaxWarps] */) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = blockDim.x / kWarpSize;
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// Two sums at once (one pair of barriers).
__device__ __forceinline__ float2 block_sum2(float a, float b, float* shared /* [2 * kMaxWarps] */) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, offset);
    b += __shfl_xor_sync(0xffffffffu, b, offset);
  }
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  __syncthreads();
  if (lane == 0) {
    shared[warp] = a;
    shared[kMaxWarps + warp] = b;
  }
  __syncthreads();
  float2 total = make_float2(0.f, 0.f);
  const int warps = blockDim.x / kWarpSize;
  for (int w = 0; w < warps; ++w) {
    total.x += shared[w];
    total.y += shared[kMaxWarps + w];
  }
  return total;
}

// residual_out = x + residual, rounded to scalar_t; that rounded sum is what gets normalised, so
// the backward (which reads residual_out) sees the same input. Each thread reads back only the
// elements it wrote itself, so no barrier is needed between the two.
template <typename scalar_t, typename param_t>
__global__ void norm_fwd_cuda_kernel(const scalar_t* __restrict__ x,
                                     const scalar_t* __restrict__ residual,  // null: no residual
                                     const param_t* __restrict__ weight,     // null: no weight
                                     const param_t* __restrict__ bias,       // null: no bias
                                     scalar_t* __restrict__ y,
                                     scalar_t* residual_out,  // [rows, n] when residual, read back
                                     float* __restrict__ mean,  // [rows]; null for RMSNorm
                                     float* __restrict__ rstd,  // [rows]
                                     int64_t rows, int64_t n, float eps) {
  __shared__ float shared[kMaxWarps];
  const float inv_n = 1.f / static_cast<float>(n);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * n;
    const scalar_t* src = x + offset;
    if (residual != nullptr) {
      scalar_t* sum = residual_out + offset;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
        sum[j] = static_cast<scalar_t>(static_cast<float>(src[j]) + static_cast<float>(residual[offset + j]));
      }
      src = sum;
    }
    float row_mean = 0.f;
    if (mean != nullptr) {
      float partial = 0.f;
      for (int64_t j = threadIdx.x; j < n; j += blockDim.x) partial += static_cast<float>(src[j]);
      row_mean = block_sum(partial, shared) * inv_n;
      if (threadIdx.x == 0) mean[row] = row_mean;
    }
    float square_partial = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float centred = static_cast<float>(src[j]) - row_mean;
      square_partial += centred * centred;
    }
    const float row_rstd = 1.f / sqrtf(block_sum(square_partial, shared) * inv_n + eps);
    if (threadIdx.x == 0) rstd[row] = row_rstd;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      float value = (static_cast<float>(src[j]) - row_mean) * row_rstd;
      if (weight != nullptr) value *= static_cast<float>(weight[j]);
      if (bias != nullptr) value += static_cast<float>(bias[j]);
      y[offset + j] = static_cast<scalar_t>(value);
    }
  }
}

// grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + grad_x_extra, g = grad_y * weight;
// RMSNorm (mean == null) drops the mean(g) term. Thread t owns columns t, t + blockDim.x, ...
// in every row, so it alone updates those entries of its CTA's partial rows.
template <typename scalar_t, typename param_t>
__global__ void norm_bwd_cuda_kernel(const scalar_t* grad_y, const scalar_t* __restrict__ x,
                                     const param_t* __restrict__ weight,  // null: no weight
                                     const param_t* __restrict__ bias,    // only read to rebuild y
                                     const float* __restrict__ mean,      // null for RMSNorm
                                     const float* __restrict__ rstd,
                                     const scalar_t* __restrict__ grad_x_extra,  // null: none
                                     scalar_t* grad_x,  // may be grad_y (*_bwd_inplace)
                                     scalar_t* __restrict__ y,                 // null unless return_y
                                     float* __restrict__ weight_partials,  // [gridDim.x, n] or null
                                     float* __restrict__ bias_partials,    // [gridDim.x, n] or null
                                     int64_t rows, int64_t n) {
  __shared__ float shared[2 * kMaxWarps];
  const float inv_n = 1.f / static_cast<float>(n);
  float* weight_partial = weight_partials ? weight_partials + static_cast<int64_t>(blockIdx.x) * n : nullptr;
  float* bias_partial = bias_partials ? bias_partials + static_cast<int64_t>(blockIdx.x) * n : nullptr;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * n;
    const float row_mean = mean ? mean[row] : 0.f;
    const float row_rstd = rstd[row];
    float g_partial = 0.f;
    float g_xhat_partial = 0.f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float x_hat = (static_cast<float>(x[offset + j]) - row_mean) * row_rstd;
      const float dy = static_cast<float>(grad_y[offset + j]);
      const float g = weight ? dy * static_cast<float>(weight[j]) : dy;
      g_partial += g;
      g_xhat_partial += g * x_hat;
      if (weight_partial) weight_partial[j] += dy * x_hat;
      if (bias_partial) bias_partial[j] += dy;
      if (y) {
        float value = weight ? x_hat * static_cast<float>(weight[j]) : x_hat;
        if (bias) value += static_cast<float>(bias[j]);
        y[offset + j] = static_cast<scalar_t>(value);
      }
    }
    const float2 sums = block_sum2(g_partial, g_xhat_partial, shared);
    const float g_mean = mean ? sums.x * inv_n : 0.f;
    const float g_xhat_mean = sums.y * inv_n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float x_hat = (static_cast<float>(x[offset + j]) - row_mean) * row_rstd;
      const float dy = static_cast<float>(grad_y[offset + j]);
      const float g = weight ? dy * static_cast<float>(weight[j]) : dy;
      float dx = row_rstd * (g - g_mean - x_hat * g_xhat_mean);
      if (grad_x_extra) dx += static_cast<float>(grad_x_extra[offset + j]);
      grad_x[offset + j] = static_cast<scalar_t>(dx);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The vectorized path (the design of PyTorch's and Apex's vectorized layer norm): a row is split
// into chunks of 16 bytes (kVec elements: 4 float32, 8 float16/bfloat16), each read and written
// with one 16-byte access; thread t of the CTA owns chunks t, t + blockDim.x, ... (at most
// kChunks, kChunks * kVec = 16 elements) and holds them in registers across the passes, so x is
// read from memory once per kernel. It runs where n is a multiple of kVec, every row pointer is
// 16-byte aligned and n <= kMaxVecThreads * 16; other shapes take the kernels above. The
// backward holds the row's x, grad_y and grad_x_extra in their own dtype and two 16-element float
// accumulators per thread (about 100-128 registers by dtype, measured with -Xptxas -v for sm_90):
// __launch_bounds__ keeps it within what 512 threads per CTA may use (128 registers each).

constexpr int kVecElementsPerThread = 16;
constexpr int kMaxVecThreads = 512;

template <typename scalar_t>
struct VecShape {
  static constexpr int kVec = kPack16<scalar_t>;
  static constexpr int kChunks = kVecElementsPerThread / kVec;
};

template <typename scalar_t, typename param_t>
__global__ void __launch_bounds__(kMaxVecThreads) norm_fwd_vec_cuda_kernel(const scalar_t* __restrict__ x,
                                         const scalar_t* __restrict__ residual,  // null: no residual
                                         const param_t* __restrict__ weight,     // null: no weight
                                         const param_t* __restrict__ bias,       // null: no bias
                                         scalar_t* __restrict__ y,
                                         scalar_t* __restrict__ residual_out,  // [rows, n] when residual
                                         float* __restrict__ mean,  // [rows]; null for RMSNorm
                                         float* __restrict__ rstd,  // [rows]
                                         int64_t rows, int64_t n, float eps) {
  constexpr int kVec = VecShape<scalar_t>::kVec;
  constexpr int kChunks = VecShape<scalar_t>::kChunks;
  __shared__ float shared[kMaxWarps];
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t chunks = n / kVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * n;
    // Every load of the row is issued before any of it is used, so a row costs one memory round
    // trip, not one per chunk (as words: see Words16).
    Words16 x_words[kChunks], residual_words[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (chunk >= chunks) continue;
      x_words[c] = load_words(x + offset, chunk);
      if (residual != nullptr) residual_words[c] = load_words(residual + offset, chunk);
    }
    float v[kChunks][kVec];
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[c][k] = 0.f;
      if (chunk >= chunks) continue;
      if (residual != nullptr) {
        Pack<scalar_t, kVec> src;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          // rounded to scalar_t: the stored sum is what gets normalised (and what the backward reads)
          src.v[k] = static_cast<scalar_t>(word_element<scalar_t>(x_words[c], k) +
                                           word_element<scalar_t>(residual_words[c], k));
          v[c][k] = static_cast<float>(src.v[k]);
        }
        store_pack<kVec>(residual_out + offset, chunk, src);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) v[c][k] = word_element<scalar_t>(x_words[c], k);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum += mean != nullptr ? v[c][k] : v[c][k] * v[c][k];
    }
    float row_mean = 0.f;
    float square_sum;
    if (mean != nullptr) {
      row_mean = block_sum(sum, shared) * inv_n;
      float squares = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (threadIdx.x + static_cast<int64_t>(c) * blockDim.x >= chunks) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float centred = v[c][k] - row_mean;
          squares += centred * centred;
        }
      }
      square_sum = block_sum(squares, shared);
    } else {
      square_sum = block_sum(sum, shared);
    }
    const float row_rstd = 1.f / sqrtf(square_sum * inv_n + eps);
    if (threadIdx.x == 0) {
      if (mean != nullptr) mean[row] = row_mean;
      rstd[row] = row_rstd;
    }
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (chunk >= chunks) continue;
      Pack<param_t, kVec> w, b;
      if (weight != nullptr) w = load_pack<kVec>(weight, chunk);
      if (bias != nullptr) b = load_pack<kVec>(bias, chunk);
      Pack<scalar_t, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float value = (v[c][k] - row_mean) * row_rstd;
        if (weight != nullptr) value *= static_cast<float>(w.v[k]);
        if (bias != nullptr) value += static_cast<float>(b.v[k]);
        out.v[k] = static_cast<scalar_t>(value);
      }
      store_pack<kVec>(y + offset, chunk, out);
    }
  }
}

// Thread t owns the same chunks in every row, so it sums their parameter gradients over its
// CTA's rows in registers and writes them once, to its CTA's partial row, at the end (every CTA
// writes all of its partial row, zeros where it had no rows, so the partials need no memset).
template <typename scalar_t, typename param_t>
__global__ void __launch_bounds__(kMaxVecThreads) norm_bwd_vec_cuda_kernel(const scalar_t* grad_y, const scalar_t* __restrict__ x,
                                         const param_t* __restrict__ weight,  // null: no weight
                                         const param_t* __restrict__ bias,    // only read to rebuild y
                                         const float* __restrict__ mean,      // null for RMSNorm
                                         const float* __restrict__ rstd,
                                         const scalar_t* __restrict__ grad_x_extra,  // null: none
                                         scalar_t* grad_x,  // may be grad_y (*_bwd_inplace)
                                         scalar_t* __restrict__ y,             // null unless return_y
                                         float* __restrict__ weight_partials,  // [gridDim.x, n] or null
                                         float* __restrict__ bias_partials,    // [gridDim.x, n] or null
                                         int64_t rows, int64_t n) {
  constexpr int kVec = VecShape<scalar_t>::kVec;
  constexpr int kChunks = VecShape<scalar_t>::kChunks;
  __shared__ float shared[2 * kMaxWarps];
  const float inv_n = 1.f / static_cast<float>(n);
  const int64_t chunks = n / kVec;
  float weight_grad[kChunks][kVec];
  float bias_grad[kChunks][kVec];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) weight_grad[c][k] = bias_grad[c][k] = 0.f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * n;
    const float row_mean = mean ? mean[row] : 0.f;
    const float row_rstd = rstd[row];
    // Every load of the row is issued before any of it is used (grad_x_extra too, which is only
    // needed after the reduction), so a row costs one memory round trip, not two. The row stays
    // in its input dtype, as words (Words16: two 16-bit elements to a register); x_hat and g are
    // recomputed from it after the reduction, and the weight packs come again from L1.
    Words16 x_words[kChunks], dy_words[kChunks], extra_words[kChunks];
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (chunk >= chunks) continue;
      x_words[c] = load_words(x + offset, chunk);
      dy_words[c] = load_words(grad_y + offset, chunk);
      if (grad_x_extra != nullptr) extra_words[c] = load_words(grad_x_extra + offset, chunk);
    }
    float g_partial = 0.f;  // g = grad_y * weight
    float g_xhat_partial = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (chunk >= chunks) continue;
      Pack<param_t, kVec> w, b;
      if (weight != nullptr) w = load_pack<kVec>(weight, chunk);
      if (y != nullptr && bias != nullptr) b = load_pack<kVec>(bias, chunk);
      Pack<scalar_t, kVec> y_pack;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xh = (word_element<scalar_t>(x_words[c], k) - row_mean) * row_rstd;
        const float dy = word_element<scalar_t>(dy_words[c], k);
        const float wk = weight != nullptr ? static_cast<float>(w.v[k]) : 1.f;
        const float g = weight != nullptr ? dy * wk : dy;
        g_partial += g;
        g_xhat_partial += g * xh;
        weight_grad[c][k] += dy * xh;
        bias_grad[c][k] += dy;
        if (y != nullptr) {
          float value = weight != nullptr ? xh * wk : xh;
          if (bias != nullptr) value += static_cast<float>(b.v[k]);
          y_pack.v[k] = static_cast<scalar_t>(value);
        }
      }
      if (y != nullptr) store_pack<kVec>(y + offset, chunk, y_pack);
    }
    const float2 sums = block_sum2(g_partial, g_xhat_partial, shared);
    const float g_mean = mean ? sums.x * inv_n : 0.f;
    const float g_xhat_mean = sums.y * inv_n;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
      if (chunk >= chunks) continue;
      Pack<param_t, kVec> w;
      if (weight != nullptr) w = load_pack<kVec>(weight, chunk);
      Pack<scalar_t, kVec> dx_pack;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        // x_hat and g by the first pass's expressions (rebuilt rather than held in float registers)
        const float xh = (word_element<scalar_t>(x_words[c], k) - row_mean) * row_rstd;
        const float dy = word_element<scalar_t>(dy_words[c], k);
        const float g = weight != nullptr ? dy * static_cast<float>(w.v[k]) : dy;
        float dx = row_rstd * (g - g_mean - xh * g_xhat_mean);
        if (grad_x_extra != nullptr) dx += word_element<scalar_t>(extra_words[c], k);
        dx_pack.v[k] = static_cast<scalar_t>(dx);
      }
      store_pack<kVec>(grad_x + offset, chunk, dx_pack);
    }
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t chunk = threadIdx.x + static_cast<int64_t>(c) * blockDim.x;
    if (chunk >= chunks) continue;
    const int64_t base = static_cast<int64_t>(blockIdx.x) * n + chunk * kVec;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (weight_partials != nullptr) weight_partials[base + k] = weight_grad[c][k];
      if (bias_partials != nullptr) bias_partials[base + k] = bias_grad[c][k];
    }
  }
}

// Whether a row of n scalar_t, with these pointers, takes the vectorized kernels; the threads
// they run with (at least two warps, each thread at most kVecElementsPerThread elements).
template <typename scalar_t, typename param_t>
int vec_threads(int64_t n, std::initializer_list<const void*> row_pointers, std::initializer_list<const void*> params) {
  constexpr int kVec = VecShape<scalar_t>::kVec;
  constexpr int kChunks = VecShape<scalar_t>::kChunks;
  if (n % kVec != 0 || n > static_cast<int64_t>(kMaxVecThreads) * kVecElementsPerThread) return 0;
  if (!all_aligned(16, row_pointers) || !all_aligned(sizeof(Pack<param_t, kVec>), params)) return 0;
  const int64_t chunks = n / kVec;
  const int64_t warps = (chunks + kChunks * kWarpSize - 1) / (kChunks * kWarpSize);
  return static_cast<int>(std::max<int64_t>(2, std::min<int64_t>(warps, kMaxVecThreads / kWarpSize)) * kWarpSize);
}

// About four elements per thread, a whole number of warps, at most 1024 threads.
int threads_for_row(int64_t n) {
  const int64_t warps = (n + 4 * kWarpSize - 1) / (4 * kWarpSize);
  return static_cast<int>(std::min<int64_t>(warps, kMaxWarps) * kWarpSize);
}

// As many CTAs of `kernel` as are resident on the device at once (resident_ctas: the vectorized
// backward holds about 128 registers a thread, so 4 CTAs of 128 threads fit on an SM where the
// thread count alone would allow 16), at most one per row; rows beyond them are strided over them.
template <typename Kernel>
int64_t grid_for_rows(Kernel kernel, int64_t rows, int threads) {
  return std::max<int64_t>(1, std::min<int64_t>(rows, resident_ctas(kernel, threads)));
}

NormFwdResult norm_fwd_cuda(const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps) {
  const NormForward problem = prepare_norm_fwd(op, rms, x, residual, weight, bias, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor &y = problem.y, &residual_out = problem.residual_out, &mean = problem.mean, &rstd = problem.rstd;
  if (problem.rows == 0) return {y, residual_out, mean, rstd};
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "norm_fwd_cuda", [&] {
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      const scalar_t* x_data = x.const_data_ptr<scalar_t>();
      const scalar_t* residual_data = optional_data<scalar_t>(residual);
      const param_t* weight_data = optional_data<param_t>(weight);
      const param_t* bias_data = optional_data<param_t>(bias);
      scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
      scalar_t* residual_out_data = residual.has_value() ? residual_out.mutable_data_ptr<scalar_t>() : nullptr;
      float* mean_data = rms ? nullptr : mean.mutable_data_ptr<float>();
      float* rstd_data = rstd.mutable_data_ptr<float>();
      const auto stream = at::cuda::getCurrentCUDAStream();
      const int vec = vec_threads<scalar_t, param_t>(problem.n, {x_data, residual_data, y_data, residual_out_data},
                                                     {weight_data, bias_data});
      const int threads = vec > 0 ? vec : threads_for_row(problem.n);
      const auto kernel = vec > 0 ? norm_fwd_vec_cuda_kernel<scalar_t, param_t> : norm_fwd_cuda_kernel<scalar_t, param_t>;
      const int64_t blocks = grid_for_rows(kernel, problem.rows, threads);
      kernel<<<blocks, threads, 0, stream>>>(x_data, residual_data, weight_data, bias_data, y_data, residual_out_data,
                                             mean_data, rstd_data, problem.rows, problem.n, static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, residual_out, mean, rstd};
}

NormBwdResult norm_bwd_cuda(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor* mean, const at::Tensor& rstd,
                            const std::optional<at::Tensor>& grad_x_extra, NormBwdOutputs outputs,
                            bool grad_x_in_grad_y) {
  const NormBackward problem =
      prepare_norm_bwd(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra, outputs, grad_x_in_grad_y);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor &grad_x = problem.grad_x, &grad_weight = problem.grad_weight, &grad_bias = problem.grad_bias,
                   &y = problem.y;
  if (problem.rows == 0) {
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_x, grad_weight, grad_bias, y};
  }
  const auto partial_options = x.options().dtype(at::kFloat);
  const auto stream = at::cuda::getCurrentCUDAStream();
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "norm_bwd_cuda", [&] {
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      const scalar_t* grad_y_data = grad_y.const_data_ptr<scalar_t>();
      const scalar_t* x_data = x.const_data_ptr<scalar_t>();
      const param_t* weight_data = optional_data<param_t>(weight);
      const param_t* bias_data = optional_data<param_t>(bias);
      const scalar_t* extra_data = optional_data<scalar_t>(grad_x_extra);
      scalar_t* grad_x_data = grad_x.mutable_data_ptr<scalar_t>();
      scalar_t* y_data = outputs.y ? y.mutable_data_ptr<scalar_t>() : nullptr;
      const int vec = vec_threads<scalar_t, param_t>(problem.n, {grad_y_data, x_data, extra_data, grad_x_data, y_data},
                                                     {weight_data, bias_data});
      const int threads = vec > 0 ? vec : threads_for_row(problem.n);
      const auto kernel = vec > 0 ? norm_bwd_vec_cuda_kernel<scalar_t, param_t> : norm_bwd_cuda_kernel<scalar_t, param_t>;
      const int64_t blocks = grid_for_rows(kernel, problem.rows, threads);
      // The vectorized kernel writes every entry of its partial rows; the other one adds into them.
      const auto make_partials = [&] {
        return vec > 0 ? at::empty({blocks, problem.n}, partial_options) : at::zeros({blocks, problem.n}, partial_options);
      };
      // No partials (and no column sum) for a gradient not asked for: a frozen or absent parameter.
      at::Tensor weight_partials = problem.has_grad_weight ? make_partials() : at::Tensor();
      at::Tensor bias_partials = problem.has_grad_bias ? make_partials() : at::Tensor();
      float* weight_partial_data = problem.has_grad_weight ? weight_partials.mutable_data_ptr<float>() : nullptr;
      float* bias_partial_data = problem.has_grad_bias ? bias_partials.mutable_data_ptr<float>() : nullptr;
      kernel<<<blocks, threads, 0, stream>>>(grad_y_data, x_data, weight_data, bias_data,
                                             mean ? mean->const_data_ptr<float>() : nullptr,
                                             rstd.const_data_ptr<float>(), extra_data, grad_x_data, y_data,
                                             weight_partial_data, bias_partial_data, problem.rows, problem.n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (weight_partial_data) {
        launch_column_sum(weight_partial_data, blocks, problem.n, grad_weight.mutable_data_ptr<param_t>());
      }
      if (bias_partial_data) {
        launch_column_sum(bias_partial_data, blocks, problem.n, grad_bias.mutable_data_ptr<param_t>());
      }
    });
  });
  return {grad_x, grad_weight, grad_bias, y};
}

using CudaNormOps = NormOps<norm_fwd_cuda, norm_bwd_cuda>;

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CUDA, m) {
  m.impl("layer_norm_fwd", &CudaNormOps::layer_norm_fwd);
  m.impl("layer_norm_bwd", &CudaNormOps::layer_norm_bwd);
  m.impl("layer_norm_bwd_inplace", &CudaNormOps::layer_norm_bwd_inplace);
  m.impl("rms_norm_fwd", &CudaNormOps::rms_norm_fwd);
  m.impl("rms_norm_bwd", &CudaNormOps::rms_norm_bwd);
  m.impl("rms_norm_bwd_inplace", &CudaNormOps::rms_norm_bwd_inplace);
}

}  // namespace memopt
