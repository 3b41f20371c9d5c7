// layer_norm / rms_norm with an optional fused residual add, CPU launchers; the kernels are in
// cpu_kernels_impl.h, the checks in norm_common.cpp. The forward returns per-row statistics; the
// backward rebuilds the normalised input from x and the statistics (and, with return_y, the
// normalised output too) instead of keeping it.
#include <torch/library.h>

#include "common.h"
#include "cpu_kernels.h"
#include "norm.h"

namespace memopt {
namespace {

NormFwdResult norm_fwd_cpu(const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           double eps) {
  NormForward call = prepare_norm_fwd(op, rms, x, residual, weight, bias, eps);
  MEMOPT_CPU_KERNEL(norm_fwd_kernel)(x, residual.value_or(at::Tensor()), cpu_param(weight, x), cpu_param(bias, x),
                                     call.y, residual.has_value() ? call.residual_out : at::Tensor(), call.mean,
                                     call.rstd, eps);
  return {call.y, call.residual_out, call.mean, call.rstd};
}

NormBwdResult norm_bwd_cpu(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const at::Tensor* mean, const at::Tensor& rstd,
                           const std::optional<at::Tensor>& grad_x_extra, NormBwdOutputs outputs,
                           bool grad_x_in_grad_y) {
  NormBackward call =
      prepare_norm_bwd(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra, outputs, grad_x_in_grad_y);
  // A gradient not asked for is an undefined kernel output: the kernel does not compute it.
  const CpuParamGrad grad_weight(call.grad_weight, call.has_grad_weight ? weight : std::nullopt, x);
  const CpuParamGrad grad_bias(call.grad_bias, call.has_grad_bias ? bias : std::nullopt, x);
  MEMOPT_CPU_KERNEL(norm_bwd_kernel)(grad_y, x, cpu_param(weight, x), cpu_param(bias, x),
                                     mean != nullptr ? *mean : at::Tensor(), rstd, grad_x_extra.value_or(at::Tensor()),
                                     call.grad_x, outputs.y ? call.y : at::Tensor(), grad_weight.kernel_output(),
                                     grad_bias.kernel_output());
  grad_weight.finish();
  grad_bias.finish();
  return {call.grad_x, call.grad_weight, call.grad_bias, call.y};
}

using CpuNormOps = NormOps<norm_fwd_cpu, norm_bwd_cpu>;

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("layer_norm_fwd", &CpuNormOps::layer_norm_fwd);
  m.impl("layer_norm_bwd", &CpuNormOps::layer_norm_bwd);
  m.impl("layer_norm_bwd_inplace", &CpuNormOps::layer_norm_bwd_inplace);
  m.impl("rms_norm_fwd", &CpuNormOps::rms_norm_fwd);
  m.impl("rms_norm_bwd", &CpuNormOps::rms_norm_bwd);
  m.impl("rms_norm_bwd_inplace", &CpuNormOps::rms_norm_bwd_inplace);
}

}  // namespace memopt
