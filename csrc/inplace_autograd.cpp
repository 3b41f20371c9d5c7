// The Autograd and ADInplaceOrView kernels of the registered in-place ops (bias_act_fwd_inplace,
// bias_act_bwd_inplace, layer_norm_bwd_inplace, rms_norm_bwd_inplace; schemas Tensor(a!) in
// memopt_ops.cpp). They have no derivative: memopt's own callers run them without a graph (the
// block's forward without autograd, the autograd Functions' backwards with grad mode off, the C++
// norm_linear node below ADInplaceOrView). For a direct caller of torch.ops.memopt.*_inplace they
// do what torch's in-place ops do: the overwritten tensor's version counter moves (so a node that
// saved it raises autograd's "modified by an inplace operation" at backward instead of using the
// new values), and with grad mode on a tensor argument that requires grad is an error naming the
// op (torch's x.relu_() refuses a leaf; a graph through an op with no derivative would silently
// drop it), instead of autograd's not-implemented fallback, which did neither.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>

namespace memopt {
namespace {

using OptionalTensor = std::optional<at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

struct NamedArg {
  const char* name;
  const at::Tensor* tensor;  // nullptr: absent
};

const at::Tensor* ptr(const OptionalTensor& t) { return t.has_value() ? &*t : nullptr; }

// With grad mode on, no tensor argument may require grad: the op has no derivative.
void check_no_grad(const char* op, std::initializer_list<NamedArg> args) {
  if (!c10::GradMode::is_enabled()) {
    return;
  }
  for (const NamedArg& arg : args) {
    TORCH_CHECK(arg.tensor == nullptr || !arg.tensor->defined() || !arg.tensor->requires_grad(), "memopt.", op,
                ": ", arg.name, " requires grad; this op has no derivative, call it under torch.no_grad()");
  }
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using BiasActFwdInplace = void(const at::Tensor&, const OptionalTensor&, const std::string&);
using BiasActBwdInplace = Tensor2(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const std::string&,
                                  bool, bool);
using LayerNormBwdInplace = Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                    const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                                    const OptionalTensor&, bool, bool, bool);
using RmsNormBwdInplace = Tensor2(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                                  const OptionalTensor&, bool, bool);

const auto& bias_act_fwd_inplace_op() {
  static const auto op = op_handle<BiasActFwdInplace>("memopt::bias_act_fwd_inplace");
  return op;
}
const auto& bias_act_bwd_inplace_op() {
  static const auto op = op_handle<BiasActBwdInplace>("memopt::bias_act_bwd_inplace");
  return op;
}
const auto& layer_norm_bwd_inplace_op() {
  static const auto op = op_handle<LayerNormBwdInplace>("memopt::layer_norm_bwd_inplace");
  return op;
}
const auto& rms_norm_bwd_inplace_op() {
  static const auto op = op_handle<RmsNormBwdInplace>("memopt::rms_norm_bwd_inplace");
  return op;
}

// Autograd: refuse a tensor that requires grad (grad mode on), then on to ADInplaceOrView.
void bias_act_fwd_inplace_autograd(c10::DispatchKeySet ks, const at::Tensor& x, const OptionalTensor& bias,
                                   const std::string& activation) {
  check_no_grad("bias_act_fwd_inplace", {{"x", &x}, {"bias", ptr(bias)}});
  bias_act_fwd_inplace_op().redispatch(ks & c10::after_autograd_keyset, x, bias, activation);
}

Tensor2 bias_act_bwd_inplace_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                      const OptionalTensor& bias, const std::string& activation, bool return_y,
                                      bool return_grad_bias) {
  check_no_grad("bias_act_bwd_inplace", {{"grad_y", &grad_y}, {"x", &x}, {"bias", ptr(bias)}});
  return bias_act_bwd_inplace_op().redispatch(ks & c10::after_autograd_keyset, grad_y, x, bias, activation,
                                              return_y, return_grad_bias);
}

Tensor3 layer_norm_bwd_inplace_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                        const OptionalTensor& weight, const OptionalTensor& bias,
                                        const at::Tensor& mean, const at::Tensor& rstd,
                                        const OptionalTensor& grad_x_extra, bool return_y, bool return_grad_weight,
                                        bool return_grad_bias) {
  check_no_grad("layer_norm_bwd_inplace", {{"grad_y", &grad_y},
                                           {"x", &x},
                                           {"weight", ptr(weight)},
                                           {"bias", ptr(bias)},
                                           {"mean", &mean},
                                           {"rstd", &rstd},
                                           {"grad_x_extra", ptr(grad_x_extra)}});
  return layer_norm_bwd_inplace_op().redispatch(ks & c10::after_autograd_keyset, grad_y, x, weight, bias, mean,
                                                rstd, grad_x_extra, return_y, return_grad_weight, return_grad_bias);
}

Tensor2 rms_norm_bwd_inplace_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                      const OptionalTensor& weight, const at::Tensor& rstd,
                                      const OptionalTensor& grad_x_extra, bool return_y, bool return_grad_weight) {
  check_no_grad("rms_norm_bwd_inplace", {{"grad_y", &grad_y},
                                         {"x", &x},
                                         {"weight", ptr(weight)},
                                         {"rstd", &rstd},
                                         {"grad_x_extra", ptr(grad_x_extra)}});
  return rms_norm_bwd_inplace_op().redispatch(ks & c10::after_autograd_keyset, grad_y, x, weight, rstd,
                                              grad_x_extra, return_y, return_grad_weight);
}

// ADInplaceOrView: run the kernel below, then bump the overwritten tensor's version counter.
void bias_act_fwd_inplace_view(c10::DispatchKeySet ks, const at::Tensor& x, const OptionalTensor& bias,
                               const std::string& activation) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    bias_act_fwd_inplace_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, x, bias, activation);
  }
  torch::autograd::increment_version(x);
}

Tensor2 bias_act_bwd_inplace_view(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                  const OptionalTensor& bias, const std::string& activation, bool return_y,
                                  bool return_grad_bias) {
  Tensor2 out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = bias_act_bwd_inplace_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grad_y, x, bias,
                                               activation, return_y, return_grad_bias);
  }
  torch::autograd::increment_version(grad_y);
  return out;
}

Tensor3 layer_norm_bwd_inplace_view(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                    const OptionalTensor& weight, const OptionalTensor& bias, const at::Tensor& mean,
                                    const at::Tensor& rstd, const OptionalTensor& grad_x_extra, bool return_y,
                                    bool return_grad_weight, bool return_grad_bias) {
  Tensor3 out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = layer_norm_bwd_inplace_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grad_y, x, weight, bias,
                                                 mean, rstd, grad_x_extra, return_y, return_grad_weight,
                                                 return_grad_bias);
  }
  torch::autograd::increment_version(grad_y);
  return out;
}

Tensor2 rms_norm_bwd_inplace_view(c10::DispatchKeySet ks, const at::Tensor& grad_y, const at::Tensor& x,
                                  const OptionalTensor& weight, const at::Tensor& rstd,
                                  const OptionalTensor& grad_x_extra, bool return_y, bool return_grad_weight) {
  Tensor2 out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = rms_norm_bwd_inplace_op().redispatch(ks & c10::after_ADInplaceOrView_keyset, grad_y, x, weight, rstd,
                                               grad_x_extra, return_y, return_grad_weight);
  }
  torch::autograd::increment_version(grad_y);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  m.impl("bias_act_fwd_inplace", &bias_act_fwd_inplace_autograd);
  m.impl("bias_act_bwd_inplace", &bias_act_bwd_inplace_autograd);
  m.impl("layer_norm_bwd_inplace", &layer_norm_bwd_inplace_autograd);
  m.impl("rms_norm_bwd_inplace", &rms_norm_bwd_inplace_autograd);
}

TORCH_LIBRARY_IMPL(memopt, ADInplaceOrView, m) {
  m.impl("bias_act_fwd_inplace", &bias_act_fwd_inplace_view);
  m.impl("bias_act_bwd_inplace", &bias_act_bwd_inplace_view);
  m.impl("layer_norm_bwd_inplace", &layer_norm_bwd_inplace_view);
  m.impl("rms_norm_bwd_inplace", &rms_norm_bwd_inplace_view);
}

}  // namespace memopt
