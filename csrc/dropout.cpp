// dropout_add: out = residual + dropout(x, p), CPU launchers; the kernel is in cpu_kernels_impl.h.
// The mask is regenerated from (seed, offset) in the backward (philox.h), so nothing but the
// 16-byte key is kept.
#include <torch/library.h>

#include "common.h"
#include "new_output.h"
#include "cpu_kernels.h"
#include "dropout.h"

namespace memopt {

void check_dropout_add_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p) {
  constexpr const char* op = "dropout_add";
  check_float_dtype(x, op, "x");
  check_contiguous(x, op, "x");
  check_dropout_p(p, op);
  if (residual.has_value()) {
    check_same_shape(*residual, x, op, "residual", "x");
    check_same_dtype(*residual, x, op, "residual", "x");
    check_same_device(*residual, x, op, "residual", "x");
    check_contiguous(*residual, op, "residual");
  }
}

namespace {

at::Tensor dropout_add_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p,
                               const at::Tensor& rng_key) {
  check_dropout_add_inputs(x, residual, p);
  const auto [seed, offset] = read_rng_key(rng_key, "dropout_add");
  auto out = new_output_like(x);
  MEMOPT_CPU_KERNEL(dropout_add_kernel)(x, residual.value_or(at::Tensor()), out, p, seed, offset);
  return out;
}

// The gradient of x is dropout of grad_out under the same mask; residual's is grad_out itself.
at::Tensor dropout_add_bwd_cpu(const at::Tensor& grad_out, double p, const at::Tensor& rng_key) {
  check_dropout_add_inputs(grad_out, std::nullopt, p);
  const auto [seed, offset] = read_rng_key(rng_key, "dropout_add");
  auto grad_x = new_output_like(grad_out);
  MEMOPT_CPU_KERNEL(dropout_add_kernel)(grad_out, at::Tensor(), grad_x, p, seed, offset);
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("dropout_add_fwd", &dropout_add_fwd_cpu);
  m.impl("dropout_add_bwd", &dropout_add_bwd_cpu);
}

}  // namespace memopt
