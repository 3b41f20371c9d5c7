// New tensors that a kernel is about to write in full (new_output.cpp).
#pragma once

#include <ATen/ATen.h>

namespace memopt {

// at::empty_like(like, contiguous), its pages advised huge where that saves page faults.
at::Tensor new_output_like(const at::Tensor& like);

// at::empty(sizes, options), the same.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace memopt
