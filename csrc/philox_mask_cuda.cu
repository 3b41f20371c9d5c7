// philox_keep_mask, CUDA kernel: one thread per element; the bits equal the CPU kernel's
// (philox.h). Negative indices are not checked here (that would need a device sync); they read as
// their uint64 value, which the CPU kernel rejects.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common.h"
#include "philox.h"
#include "philox_mask.h"

namespace memopt {
namespace {

__global__ void philox_keep_mask_cuda_kernel(const int64_t* __restrict__ index, bool* __restrict__ keep,
                                             int64_t numel,
                                             uint32_t threshold,  // keep iff the random word >= threshold
                                             uint64_t seed, uint64_t offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
    keep[i] = philox_word(seed, offset, static_cast<uint64_t>(index[i])) >= threshold;
  }
}

at::Tensor philox_keep_mask_cuda(const at::Tensor& index, double p, const at::Tensor& rng_key) {
  check_philox_keep_mask_inputs(index, p);
  const auto [seed, offset] = read_rng_key(rng_key, "philox_keep_mask");
  const auto index_contiguous = index.contiguous();
  auto keep = at::empty(index.sizes(), index.options().dtype(at::kBool));
  const int64_t numel = index.numel();
  if (numel == 0) return keep;
  const c10::cuda::CUDAGuard guard(index.device());
  constexpr int threads = 256;
  const int max_blocks = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * 8;
  const int blocks = static_cast<int>(std::min<int64_t>((numel + threads - 1) / threads, max_blocks));
  philox_keep_mask_cuda_kernel<<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      index_contiguous.const_data_ptr<int64_t>(), keep.mutable_data_ptr<bool>(), numel, dropout_threshold(p), seed,
      offset);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return keep;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CUDA, m) { m.impl("philox_keep_mask", &philox_keep_mask_cuda); }

}  // namespace memopt
