// layer_norm / rms_norm with an optional fused residual add, CUDA kernels. One CTA per row (rows
// strided over the grid), float accumulation, block reductions with warp shuffles. Parameter
// gradients: each CTA sums its rows into a float32 partial row, then a second kernel sums the
// partials in a fixed order, so the result is deterministic.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common.h"
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
__global__ void norm_bwd_cuda_kernel(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ x,
                                     const param_t* __restrict__ weight,  // null: no weight
                                     const param_t* __restrict__ bias,    // only read to rebuild y
                                     const float* __restrict__ mean,      // null for RMSNorm
                                     const float* __restrict__ rstd,
                                     const scalar_t* __restrict__ grad_x_extra,  // null: none
                                     scalar_t* __restrict__ grad_x,
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

// out[j] = sum over b of partials[b, j], b in increasing order.
template <typename param_t>
__global__ void reduce_partials_cuda_kernel(const float* __restrict__ partials, param_t* __restrict__ out,
                                            int64_t blocks, int64_t n) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) total += partials[b * n + j];
  out[j] = static_cast<param_t>(total);
}

// About four elements per thread, a whole number of warps, at most 1024 threads.
int threads_for_row(int64_t n) {
  const int64_t warps = (n + 4 * kWarpSize - 1) / (4 * kWarpSize);
  return static_cast<int>(std::min<int64_t>(warps, kMaxWarps) * kWarpSize);
}

// As many CTAs as fit on the device at once (rows beyond that are strided over them).
int64_t grid_for_rows(int64_t rows, int threads) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t per_sm = std::max(1, std::min(32, props->maxThreadsPerMultiProcessor / threads));
  return std::max<int64_t>(1, std::min<int64_t>(rows, per_sm * props->multiProcessorCount));
}

NormFwdResult norm_fwd_cuda(const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps) {
  const NormForward problem = prepare_norm_fwd(op, rms, x, residual, weight, bias, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor &y = problem.y, &residual_out = problem.residual_out, &mean = problem.mean, &rstd = problem.rstd;
  if (problem.rows == 0) return {y, residual_out, mean, rstd};
  const int threads = threads_for_row(problem.n);
  const int64_t blocks = grid_for_rows(problem.rows, threads);
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "norm_fwd_cuda", [&] {
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      norm_fwd_cuda_kernel<scalar_t, param_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x.const_data_ptr<scalar_t>(), optional_data<scalar_t>(residual), optional_data<param_t>(weight),
          optional_data<param_t>(bias), y.mutable_data_ptr<scalar_t>(),
          residual.has_value() ? residual_out.mutable_data_ptr<scalar_t>() : nullptr,
          rms ? nullptr : mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), problem.rows, problem.n,
          static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, residual_out, mean, rstd};
}

NormBwdResult norm_bwd_cuda(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor* mean, const at::Tensor& rstd,
                            const std::optional<at::Tensor>& grad_x_extra, bool return_y) {
  const NormBackward problem = prepare_norm_bwd(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra, return_y);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor &grad_x = problem.grad_x, &grad_weight = problem.grad_weight, &grad_bias = problem.grad_bias,
                   &y = problem.y;
  if (problem.rows == 0) {
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_x, grad_weight, grad_bias, y};
  }
  const int threads = threads_for_row(problem.n);
  const int64_t blocks = grid_for_rows(problem.rows, threads);
  const auto partial_options = x.options().dtype(at::kFloat);
  auto weight_partials = weight.has_value() ? at::zeros({blocks, problem.n}, partial_options) : at::Tensor();
  auto bias_partials = bias.has_value() ? at::zeros({blocks, problem.n}, partial_options) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "norm_bwd_cuda", [&] {
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      float* weight_partial_data = weight.has_value() ? weight_partials.mutable_data_ptr<float>() : nullptr;
      float* bias_partial_data = bias.has_value() ? bias_partials.mutable_data_ptr<float>() : nullptr;
      norm_bwd_cuda_kernel<scalar_t, param_t><<<blocks, threads, 0, stream>>>(
          grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), optional_data<param_t>(weight),
          optional_data<param_t>(bias), mean ? mean->const_data_ptr<float>() : nullptr,
          rstd.const_data_ptr<float>(), optional_data<scalar_t>(grad_x_extra), grad_x.mutable_data_ptr<scalar_t>(),
          return_y ? y.mutable_data_ptr<scalar_t>() : nullptr, weight_partial_data, bias_partial_data, problem.rows,
          problem.n);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      constexpr int reduce_threads = 256;
      const int64_t reduce_blocks = (problem.n + reduce_threads - 1) / reduce_threads;
      if (weight_partial_data) {
        reduce_partials_cuda_kernel<param_t><<<reduce_blocks, reduce_threads, 0, stream>>>(
            weight_partial_data, grad_weight.mutable_data_ptr<param_t>(), blocks, problem.n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (bias_partial_data) {
        reduce_partials_cuda_kernel<param_t><<<reduce_blocks, reduce_threads, 0, stream>>>(
            bias_partial_data, grad_bias.mutable_data_ptr<param_t>(), blocks, problem.n);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  m.impl("rms_norm_fwd", &CudaNormOps::rms_norm_fwd);
  m.impl("rms_norm_bwd", &CudaNormOps::rms_norm_bwd);
}

}  // namespace memopt
