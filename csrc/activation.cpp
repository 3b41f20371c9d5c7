// bias_act (y = act(x + bias)) and swiglu (y = silu(gate + b_gate) * (up + b_up)), CPU launchers;
// the kernels are in cpu_kernels_impl.h, the checks in activation_common.cpp. The forward keeps
// nothing; the backward recomputes act and act' from x and can hand back the rebuilt y.
#include <torch/library.h>

#include "activation.h"
#include "common.h"
#include "cpu_kernels.h"

namespace memopt {
namespace {

at::Tensor bias_act_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                            const std::string& activation) {
  ActForward call = prepare_bias_act_fwd(x, bias, activation);
  MEMOPT_CPU_KERNEL(bias_act_fwd_kernel)(call.activation, x, cpu_param(bias, x), call.y);
  return call.y;
}

// y written over x: the kernel loads each vector of x before it stores y's at the same place, and
// no element reads another's x, so the bits are bias_act_fwd's.
void bias_act_fwd_inplace_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                              const std::string& activation) {
  const ActForward call = prepare_bias_act_fwd(x, bias, activation, /*y_in_x=*/true);
  MEMOPT_CPU_KERNEL(bias_act_fwd_kernel)(call.activation, x, cpu_param(bias, x), call.y);
}

// The kernel reads grad_y[i] and x[i] before it writes grad_x[i] and y[i], element by element, so
// call.grad_x may be grad_y itself (bias_act_bwd_inplace). A bias gradient not asked for is an
// undefined kernel output: the kernel does not compute it.
void run_bias_act_bwd_cpu(const ActBackward& call, const at::Tensor& grad_y, const at::Tensor& x,
                          const std::optional<at::Tensor>& bias, bool return_y) {
  const CpuParamGrad grad_bias(call.grad_bias, call.has_grad_bias ? bias : std::nullopt, x);
  MEMOPT_CPU_KERNEL(bias_act_bwd_kernel)(call.activation, grad_y, x, cpu_param(bias, x), call.grad_x,
                                         return_y ? call.y : at::Tensor(), grad_bias.kernel_output());
  grad_bias.finish();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                const std::optional<at::Tensor>& bias,
                                                                const std::string& activation, bool return_y,
                                                                bool return_grad_bias) {
  const ActBackward call = prepare_bias_act_bwd(grad_y, x, bias, activation, return_y, return_grad_bias);
  run_bias_act_bwd_cpu(call, grad_y, x, bias, return_y);
  return {call.grad_x, call.grad_bias, call.y};
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_inplace_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                            const std::optional<at::Tensor>& bias,
                                                            const std::string& activation, bool return_y,
                                                            bool return_grad_bias) {
  const ActBackward call =
      prepare_bias_act_bwd(grad_y, x, bias, activation, return_y, return_grad_bias, /*grad_x_in_grad_y=*/true);
  run_bias_act_bwd_cpu(call, grad_y, x, bias, return_y);
  return {call.grad_bias, call.y};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  ActForward call = prepare_swiglu_fwd(x, bias);
  MEMOPT_CPU_KERNEL(swiglu_fwd_kernel)(x, cpu_param(bias, x), call.y);
  return call.y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& bias,
                                                              bool return_y, bool return_grad_bias) {
  ActBackward call = prepare_swiglu_bwd(grad_y, x, bias, return_y, return_grad_bias);
  const CpuParamGrad grad_bias(call.grad_bias, call.has_grad_bias ? bias : std::nullopt, x);
  MEMOPT_CPU_KERNEL(swiglu_bwd_kernel)(grad_y, x, cpu_param(bias, x), call.grad_x, return_y ? call.y : at::Tensor(),
                                       grad_bias.kernel_output());
  grad_bias.finish();
  return {call.grad_x, call.grad_bias, call.y};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("bias_act_fwd", &bias_act_fwd_cpu);
  m.impl("bias_act_fwd_inplace", &bias_act_fwd_inplace_cpu);
  m.impl("bias_act_bwd", &bias_act_bwd_cpu);
  m.impl("bias_act_bwd_inplace", &bias_act_bwd_inplace_cpu);
  m.impl("swiglu_fwd", &swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &swiglu_bwd_cpu);
}

}  // namespace memopt
