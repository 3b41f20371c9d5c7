// The Autograd kernel of the registered ops that have no derivative of their own: the kernels'
// forward and backward ops (layer_norm_fwd, bias_act_bwd, cpu_flash_attention_fwd, ...) and their
// in-place forms (bias_act_fwd_inplace, ...; their version counters: inplace_version_counter.cpp),
// which memopt's differentiable ops and autograd Functions call below autograd or with grad mode off.
// Without an Autograd kernel a direct caller's graph went through torch's not-implemented
// fallback: a deprecation warning, then no gradient at all for the inputs (x.grad stayed None).
// With grad mode on, a tensor argument that requires grad is now an error naming the op and its
// differentiable counterpart (torch's x.relu_() refuses a leaf the same way); otherwise the call
// goes on below autograd: to the in-place ops' ADInplaceOrView kernel, or straight to the backend.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <utility>

namespace memopt {
namespace {

// The public function that differentiates through an op of this family.
const char* differentiable_counterpart(const std::string& op) {
  static const std::pair<const char*, const char*> families[] = {
      {"dropout_add_", "memopt.dropout_add"}, {"layer_norm_", "memopt.layer_norm"},
      {"rms_norm_", "memopt.rms_norm"},       {"bias_act_", "memopt.bias_act"},
      {"swiglu_", "memopt.swiglu"},           {"cpu_flash_attention_", "memopt.attention"},
  };
  for (const auto& [prefix, function] : families) {
    if (op.rfind(prefix, 0) == 0) return function;
  }
  return "memopt's public function";
}

void refuse_grad_then_redispatch(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    const auto& arguments = op.schema().arguments();
    const auto values = torch::jit::last(*stack, arguments.size());
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& value = values[i];
      if (value.isTensor() && value.toTensor().defined() && value.toTensor().requires_grad()) {
        const std::string name = op.schema().name().substr(std::strlen("memopt::"));
        TORCH_CHECK(false, "memopt.", name, ": ", arguments[i].name(), " requires grad; this op has no derivative: ",
                    "differentiate through ", differentiable_counterpart(name), ", or call it under torch.no_grad()");
      }
    }
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  for (const char* op : {"dropout_add_fwd", "dropout_add_bwd", "layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd",
                         "rms_norm_bwd", "bias_act_fwd", "bias_act_bwd", "swiglu_fwd", "swiglu_bwd",
                         "cpu_flash_attention_fwd", "cpu_flash_attention_bwd", "cpu_flash_attention_bwd_packed",
                         "bias_act_fwd_inplace", "bias_act_bwd_inplace", "layer_norm_bwd_inplace",
                         "rms_norm_bwd_inplace"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&refuse_grad_then_redispatch>());
  }
}

}  // namespace memopt
