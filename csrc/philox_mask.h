#pragma once

#include <ATen/ATen.h>

namespace memopt {

// Shared by the CPU and CUDA launchers so both reject the same inputs with the same words.
void check_philox_keep_mask_inputs(const at::Tensor& index, double p);

}  // namespace memopt
