// The differentiable activation ops, their autograd nodes in C++: memopt.bias_act and
// memopt.swiglu (torch.ops.memopt.{bias_act,swiglu}).
//
// The kernels (bias_act_fwd / _bwd, swiglu_fwd / _bwd; activation.cpp, activation_cuda.cu) make
// one pass where eager bias + activation makes two each way, but a Python autograd Function around
// them cost ~25-40 us per forward + backward, which at 512 x 512 left bias + ReLU at parity with
// eager. These nodes are C++, as the norms' are (norm_autograd.cpp). They save x and the bias,
// nothing of y's size; the backward kernel recomputes act' from them. A backward under
// create_graph=True (or with batched gradients) runs as differentiable ATen ops
// (threshold_backward, gelu_backward, silu's formula), so second derivatives are exact. Checks: the kernels' (activation_common.cpp); memopt/ops/activation.py
// runs its own (the same conditions, in Python's words) only when a call fails.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <numeric>
#include <string>
#include <vector>

#include "autograd_common.h"

namespace memopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

at::Tensor bias_act_forward(const at::Tensor& x, const OptionalTensor& bias, const std::string& activation) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::bias_act_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const OptionalTensor&, const std::string&)>();
  return op.call(x, bias, activation);
}

at::Tensor swiglu_forward(const at::Tensor& x, const OptionalTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::swiglu_fwd", "")
                       .typed<at::Tensor(const at::Tensor&, const OptionalTensor&)>();
  return op.call(x, bias);
}

// (grad_x, grad_bias) from the registered backward op; grad_bias undefined unless asked for.
std::tuple<at::Tensor, at::Tensor> bias_act_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& bias, const std::string& activation,
                                                     bool need_bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::bias_act_bwd", "")
                       .typed<Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const std::string&,
                                      bool, bool)>();
  auto [grad_x, grad_bias, y] = op.call(grad_y, x, optional(bias), activation, false, need_bias);
  return {grad_x, if_asked(grad_bias, need_bias)};
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                   const at::Tensor& bias, bool need_bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::swiglu_bwd", "")
                       .typed<Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool, bool)>();
  auto [grad_x, grad_bias, y] = op.call(grad_y, x, optional(bias), false, need_bias);
  return {grad_x, if_asked(grad_bias, need_bias)};
}

// h = x + bias in the kernels' compute dtype, as a differentiable op of x and bias.
at::Tensor pre_activation_math(const at::Tensor& x, const at::Tensor& bias) {
  const at::Tensor h = x.to(compute_dtype(x));
  return bias.defined() ? h + bias.to(h.scalar_type()) : h;
}

// silu'(h) * dy = dy * s * (1 + h * (1 - s)), s = sigmoid(h), in differentiable ops (ATen's
// silu_backward has no derivative of its own; autograd's silu formula is this one under grad mode).
at::Tensor silu_backward_math(const at::Tensor& dy, const at::Tensor& h) {
  const at::Tensor s = at::sigmoid(h);
  return dy * s * (1 + h * (1 - s));
}

// grad_h for grad_y through act at h, in differentiable ops: ATen's threshold_backward and
// gelu_backward, whose own derivatives make a second backward exact, and silu's formula.
// swiglu's h is [gate | up]: y = silu(gate) * up.
at::Tensor activation_backward_math(const at::Tensor& dy, const at::Tensor& h, const std::string& activation) {
  if (activation == "relu") return at::threshold_backward(dy, h, 0);
  if (activation == "gelu") return at::gelu_backward(dy, h, "none");
  if (activation == "gelu_tanh") return at::gelu_backward(dy, h, "tanh");
  if (activation == "silu") return silu_backward_math(dy, h);
  TORCH_INTERNAL_ASSERT(activation == "swiglu", "memopt: unknown activation ", activation);
  const std::vector<at::Tensor> halves = h.chunk(2, -1);
  const at::Tensor &gate = halves[0], &up = halves[1];
  return at::cat({silu_backward_math(dy * up, gate), dy * at::silu(gate)}, -1);
}

// (grad_x, grad_bias) as differentiable ATen ops, in the compute dtype, returned in x's and the
// bias's dtypes; grad_bias undefined unless asked for.
std::tuple<at::Tensor, at::Tensor> act_backward_math(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& bias, const std::string& activation,
                                                     bool need_bias) {
  const at::Tensor h = pre_activation_math(x, bias);
  const at::Tensor grad_h = activation_backward_math(grad_y.to(h.scalar_type()), h, activation);
  at::Tensor grad_bias;
  if (need_bias) {
    std::vector<int64_t> rows(x.dim() - 1);
    std::iota(rows.begin(), rows.end(), 0);
    grad_bias = grad_h.sum(rows).to(bias.scalar_type());
  }
  return {grad_h.to(x.scalar_type()), grad_bias};
}

// swiglu (x = [gate | up]) when `swiglu`, else bias_act with `activation` (which the kernel checks:
// "swiglu" is not one of its names, so memopt::bias_act(x, bias, "swiglu") is refused there).
struct ActivationFunction : public torch::autograd::Function<ActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& bias, bool swiglu,
                            const std::string& activation) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor y = swiglu ? swiglu_forward(x, bias) : bias_act_forward(x, bias, activation);
    ctx->save_for_backward({x, bias.value_or(at::Tensor())});
    ctx->saved_data["activation"] = swiglu ? std::string("swiglu") : activation;
    ctx->set_materialize_grads(false);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &bias = saved[1];
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const at::Tensor& grad_y = grads[0];
    if (!grad_y.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // A bias that is present has the second edge; a frozen one gets no column sum.
    const bool need_bias = bias.defined() && ctx->needs_input_grad(1);
    at::Tensor grad_x, grad_bias;
    if (differentiable_backward(grad_y)) {
      std::tie(grad_x, grad_bias) = act_backward_math(grad_y, x, bias, activation, need_bias);
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(grad_x, grad_bias) = activation == "swiglu"
                                        ? swiglu_backward(grad_y.contiguous(), x, bias, need_bias)
                                        : bias_act_backward(grad_y.contiguous(), x, bias, activation, need_bias);
    }
    return {grad_x, grad_bias, at::Tensor(), at::Tensor()};
  }
};

at::Tensor bias_act_autograd(const at::Tensor& x, const OptionalTensor& bias, const std::string& activation) {
  return ActivationFunction::apply(x.contiguous(), contiguous(bias), false, activation);
}

at::Tensor swiglu_autograd(const at::Tensor& x, const OptionalTensor& bias) {
  return ActivationFunction::apply(x.contiguous(), contiguous(bias), true, std::string());
}

// Below autograd (no grad needed, or inside another node): the forward op's y.
at::Tensor bias_act_values(const at::Tensor& x, const OptionalTensor& bias, const std::string& activation) {
  return bias_act_forward(x.contiguous(), contiguous(bias), activation);
}

at::Tensor swiglu_values(const at::Tensor& x, const OptionalTensor& bias) {
  return swiglu_forward(x.contiguous(), contiguous(bias));
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  m.impl("bias_act", &bias_act_autograd);
  m.impl("swiglu", &swiglu_autograd);
}

TORCH_LIBRARY_IMPL(memopt, CompositeExplicitAutograd, m) {
  m.impl("bias_act", &bias_act_values);
  m.impl("swiglu", &swiglu_values);
}

}  // namespace memopt
