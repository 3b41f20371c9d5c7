// dropout_add: out = residual + dropout(x, p), CUDA kernels. One thread per Philox call (4
// elements, one 8- or 16-byte access per tensor where aligned); the mask bits are identical to the
// CPU kernel's (philox.h).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"
#include "dropout.h"
#include "philox.h"
#include "vector_pack.cuh"

namespace memopt {
namespace {

// The 4 elements of one Philox call, loaded and stored as one 8- or 16-byte access.
template <typename scalar_t>
using Pack4 = Pack<scalar_t, 4>;

// out = x * factor (+ residual), factor = scale where kept, 0 where dropped: torch's x * mask *
// scale, so NaN or inf at a dropped position gives NaN. kAligned: x, residual and out are aligned
// to Pack4, and every full group of 4 goes through one vector load/store per tensor; the last,
// partial group (numel % 4 elements) element by element.
template <typename scalar_t, bool kAligned>
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
    if (kAligned && 4 * g + 4 <= numel) {
      const Pack4<scalar_t> x4 = load_pack<4>(x, g);
      Pack4<scalar_t> r4;
      if (residual != nullptr) r4 = load_pack<4>(residual, g);
      Pack4<scalar_t> out4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const acc_t factor = words.v[j] >= threshold ? scale : acc_t(0);
        acc_t value = static_cast<acc_t>(x4.v[j]) * factor;
        if (residual != nullptr) value += static_cast<acc_t>(r4.v[j]);
        out4.v[j] = static_cast<scalar_t>(value);
      }
      store_pack<4>(out, g, out4);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * g + j;
      if (i < numel) {
        const acc_t factor = words.v[j] >= threshold ? scale : acc_t(0);
        acc_t value = static_cast<acc_t>(x[i]) * factor;
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
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    const scalar_t* residual_data = residual ? residual->const_data_ptr<scalar_t>() : nullptr;
    scalar_t* out_data = out.mutable_data_ptr<scalar_t>();
    const bool aligned = all_aligned(sizeof(Pack4<scalar_t>), {x_data, residual_data, out_data});
    const auto kernel = aligned ? dropout_add_cuda_kernel<scalar_t, true> : dropout_add_cuda_kernel<scalar_t, false>;
    kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x_data, residual_data, out_data, numel, dropout_threshold(p), static_cast<acc_t>(1.0 / (1.0 - p)), seed,
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
