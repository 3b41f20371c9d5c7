// New tensors that a kernel is about to write in full (new_output.cpp).
#pragma once

#include <ATen/ATen.h>

namespace memopt {

// glibc maps a CPU buffer of this size or more afresh (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
// hosts), and its first write faults in every page; smaller ones come back from the heap.
constexpr int64_t kFreshMappingBytes = int64_t(32) << 20;

// at::empty_like(like, contiguous), its pages advised huge where that saves page faults.
at::Tensor new_output_like(const at::Tensor& like);

// at::empty(sizes, options), the same.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace memopt
