// dropout_add: out = residual + dropout(x, p), CUDA kernels. One thread per Philox call (4
// elements); the mask bits are identical to the CPU kernel's (philox.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dropout.h"
#include "philox.h"

namespace memopt {
namespace {

template <typename scalar_t>
__global__ void dropout_add_cuda_kernel(const scalar_t* __restrict__ x,
                                        const scalar_t* __restrict__ residual,  // may be null
                                        scalar_t* __restrict__ out, int64_t numel,
                                        uint32_t threshold,  // drop iff the random word < threshold
                                        at::opmath_type<scalar_t> scale,  // 1 / (1 - p)
                                        uint64_t seed, uint64_t offset) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t groups = (numel + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const PhiloxBlock words = philox4x32_10(offset + static_cast<uint64_t>(g), seed);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * g + j;
      if (i < numel) {
        acc_t value = words.v[j] >= threshold ? static_cast<acc_t>(x[i]) * scale : acc_t(0);
        if (residual != nullptr) value += static_cast<acc_t>(residual[i]);
        out[i] = static_cast<scalar_t>(value);
      }
    }
  }
}

void launch_dropout_add(const at::Tensor& x, const at::Tensor* residual, at::Tensor& out, double p,
                        const at::Tensor& rng_key) {
  // Named values, not a structured binding: the dispatch lambda below captures them, which
  // C++17 (torch 2.11 builds extensions with it) does not allow for bindings.
  const std::pair<uint64_t, uint64_t> key = read_rng_key(rng_key, "dropout_add");
  const uint64_t seed = key.first, offset = key.second;
  const int64_t numel = x.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  constexpr int threads = 256;
  const int64_t groups = (numel + 3) / 4;
  const int max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  const int blocks = static_cast<int>(std::min<int64_t>((groups + threads - 1) / threads, max_blocks));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "dropout_add_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dropout_add_cuda_kernel<scalar_t><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), residual ? residual->const_data_ptr<scalar_t>() : nullptr,
        out.mutable_data_ptr<scalar_t>(), numel, dropout_threshold(p), static_cast<acc_t>(1.0 / (1.0 - p)), seed,
        offset);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor dropout_add_fwd_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p,
                                const at::Tensor& rng_key) {
  check_dropout_add_inputs(x, residual, p);
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  launch_dropout_add(x, residual.has_value() ? &*residual : nullptr, out, p, rng_key);
  return out;
}

at::Tensor dropout_add_bwd_cuda(const at::Tensor& grad_out, double p, const at::Tensor& rng_key) {
  check_dropout_add_inputs(grad_out, std::nullopt, p);
  auto grad_x = at::empty_like(grad_out, at::MemoryFormat::Contiguous);
  launch_dropout_add(grad_out, nullptr, grad_x, p, rng_key);
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CUDA, m) {
  m.impl("dropout_add_fwd", &dropout_add_fwd_cuda);
  m.impl("dropout_add_bwd", &dropout_add_bwd_cuda);
}

}  // namespace memopt
