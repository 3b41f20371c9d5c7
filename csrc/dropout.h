#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace memopt {

// Shared by the CPU and CUDA launchers so both reject the same inputs with the same words.
void check_dropout_add_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p);

}  // namespace memopt
