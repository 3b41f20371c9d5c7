// The ADInplaceOrView kernels of the registered in-place ops (bias_act_fwd_inplace,
// bias_act_bwd_inplace, layer_norm_bwd_inplace, rms_norm_bwd_inplace; schemas Tensor(a!) in
// memopt_ops.cpp). memopt's own callers run them without a graph (the block's forward without
// autograd, the autograd Functions' backwards with grad mode off, the C++ norm_linear node below
// ADInplaceOrView). For a direct caller of torch.ops.memopt.*_inplace they do what torch's in-place
// ops do: the overwritten tensor's version counter moves, so a node that saved it raises autograd's
// "modified by an inplace operation" at backward instead of using the new values. Their Autograd
// kernel, which refuses a tensor argument that requires grad, is no_derivative.cpp's, shared with
// the out-of-place kernel ops.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

namespace memopt {
namespace {

using OptionalTensor = std::optional<at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

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

TORCH_LIBRARY_IMPL(memopt, ADInplaceOrView, m) {
  m.impl("bias_act_fwd_inplace", &bias_act_fwd_inplace_view);
  m.impl("bias_act_bwd_inplace", &bias_act_bwd_inplace_view);
  m.impl("layer_norm_bwd_inplace", &layer_norm_bwd_inplace_view);
  m.impl("rms_norm_bwd_inplace", &rms_norm_bwd_inplace_view);
}

}  // namespace memopt
