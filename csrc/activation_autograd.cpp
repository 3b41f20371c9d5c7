// The differentiable activation ops, their autograd nodes in C++: memopt.bias_act and
// memopt.swiglu (torch.ops.memopt.{bias_act,swiglu}), and memopt.act_linear
// (torch.ops.memopt.act_linear, below).
//
// The kernels (bias_act_fwd / _bwd, swiglu_fwd / _bwd; activation.cpp, activation_cuda.cu) make
// one pass where eager bias + activation makes two each way, but a Python autograd Function around
// them cost ~25-40 us per forward + backward, which at 512 x 512 left bias + ReLU at parity with
// eager. These nodes are C++, as the norms' are (norm_autograd.cpp). They save x and the bias,
// nothing of y's size; the backward kernel recomputes act' from them. A backward under
// create_graph=True (or with batched gradients) runs as differentiable ATen ops
// (threshold_backward, gelu_backward, silu's formula), so second derivatives are exact.
// Checks: the kernels' (activation_common.cpp) and, for act_linear's linear, check_linear_params
// (autograd_common.h); memopt/ops/activation.py runs its own (the same conditions, in Python's
// words) only when a call fails.
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

using BiasActBwd = Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const std::string&, bool,
                           bool);
using BiasActBwdInplace = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const OptionalTensor&, const std::string&, bool, bool);
using SwigluBwd = Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool, bool);

const c10::TypedOperatorHandle<BiasActBwd>& bias_act_bwd_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("memopt::bias_act_bwd", "").typed<BiasActBwd>();
  return op;
}

const c10::TypedOperatorHandle<BiasActBwdInplace>& bias_act_bwd_inplace_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memopt::bias_act_bwd_inplace", "")
                             .typed<BiasActBwdInplace>();
  return op;
}

const c10::TypedOperatorHandle<SwigluBwd>& swiglu_bwd_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("memopt::swiglu_bwd", "").typed<SwigluBwd>();
  return op;
}

// act(x + bias) by the forward kernel: swiglu's for "swiglu" (x = [gate | up]), else bias_act's.
bool is_swiglu(const std::string& activation) { return activation == "swiglu"; }

at::Tensor act_forward(const at::Tensor& x, const OptionalTensor& bias, const std::string& activation) {
  return is_swiglu(activation) ? swiglu_forward(x, bias) : bias_act_forward(x, bias, activation);
}

// (grad_x, grad_bias) from the registered backward op; grad_bias undefined unless asked for.
std::tuple<at::Tensor, at::Tensor> bias_act_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& bias, const std::string& activation,
                                                     bool need_bias) {
  auto [grad_x, grad_bias, y] = bias_act_bwd_op().call(grad_y, x, optional(bias), activation, false, need_bias);
  return {grad_x, if_asked(grad_bias, need_bias)};
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                   const at::Tensor& bias, bool need_bias) {
  auto [grad_x, grad_bias, y] = swiglu_bwd_op().call(grad_y, x, optional(bias), false, need_bias);
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

// act(x + bias) as differentiable ATen ops in the compute dtype, returned in x's dtype: the
// activation a backward under create_graph=True differentiates through (act_linear's y).
at::Tensor activation_value_math(const at::Tensor& x, const at::Tensor& bias, const std::string& activation) {
  const at::Tensor h = pre_activation_math(x, bias);
  at::Tensor y;
  if (activation == "relu") {
    y = at::relu(h);
  } else if (activation == "gelu" || activation == "gelu_tanh") {
    y = at::gelu(h, activation == "gelu" ? "none" : "tanh");
  } else if (activation == "silu") {
    y = at::silu(h);
  } else {
    TORCH_INTERNAL_ASSERT(activation == "swiglu", "memopt: unknown activation ", activation);
    const std::vector<at::Tensor> halves = h.chunk(2, -1);
    y = at::silu(halves[0]) * halves[1];
  }
  return y.to(x.scalar_type());
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
    // Not act_forward(x, bias, activation): bias_act's "swiglu" must reach bias_act's kernel.
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
      std::tie(grad_x, grad_bias) = is_swiglu(activation)
                                        ? swiglu_backward(grad_y.contiguous(), x, bias, need_bias)
                                        : bias_act_backward(grad_y.contiguous(), x, bias, activation, need_bias);
    }
    return {grad_x, grad_bias, at::Tensor(), at::Tensor()};
  }
};

// ---------------------------------------------------------------------------------------------
// act_linear: F.linear(act(x + bias), linear_weight, linear_bias) keeping no activation output.
// Saves x, the bias and linear_weight. The backward allocates one activation-sized buffer: the
// forward kernel rebuilds y in it (the forward's bits), grad_W = grad_out^T @ y, then
// grad_act = grad_out @ W is written over y (or into the memory it frees: cpu_mm_over) and the
// in-place activation backward writes grad_x over grad_act (swiglu's grad_x is twice as wide: a
// new tensor). Eager act + F.linear peaks at three (x + bias and y kept from the forward, and
// grad_act); rebuilding y inside the activation's backward kernel held two. Where the matmuls run
// in another dtype (autocast, or a weight of another dtype) y is cast anyway, so the backward
// kernel rebuilds it beside a new grad_act. A C++ node, as norm_linear's: the Python
// autograd.Function it replaces cost ~0.2 ms a call at 512 x 512 in a profile.

// The linear's parameters, with memopt.act_linear's words (x and the bias: the activation kernel's
// checks, activation_common.cpp).
void check_act_linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& linear_bias,
                      const std::string& activation) {
  constexpr const char* op = "act_linear";
  const c10::SymInt width = x.dim() > 0 ? x.sym_size(-1) : c10::SymInt(0);
  check_linear_params(op, x, is_swiglu(activation) ? width / 2 : width, weight, linear_bias);
}

struct ActLinearFunction : public torch::autograd::Function<ActLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& bias,
                            const at::Tensor& weight, const OptionalTensor& linear_bias,
                            const std::string& activation) {
    check_act_linear(x, weight, linear_bias, activation);
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor y = act_forward(x, bias, activation);
    // Under torch.autocast the linear runs in the autocast dtype, as F.linear would.
    at::Tensor out = linear_as_autocast(y, weight, linear_bias);
    ctx->save_for_backward({x, bias.value_or(at::Tensor()), weight});
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["linear_bias_dtype"] =
        linear_bias.has_value() ? static_cast<int64_t>(linear_bias->scalar_type()) : int64_t(-1);
    ctx->set_materialize_grads(false);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &bias = saved[1], &weight = saved[2];
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const int64_t linear_bias_dtype = ctx->saved_data["linear_bias_dtype"].toInt();
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    // needs_input_grad counts the tensor arguments given (an absent optional has no edge): x,
    // then bias where present, then linear_weight and linear_bias where present.
    const size_t weight_edge = 1 + size_t(bias.defined());
    const bool need_bias = bias.defined() && ctx->needs_input_grad(1);
    const bool need_weight = ctx->needs_input_grad(weight_edge);
    const bool need_linear_bias = linear_bias_dtype >= 0 && ctx->needs_input_grad(weight_edge + 1);
    // The casts are the ones autocast made in the forward (to grad_out's dtype, the output's),
    // and nothing may recast: autocast is off here even when backward() runs inside it.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::ScalarType compute = grad_out.scalar_type();
    const c10::SymInt width = x.sym_size(-1);
    const c10::SymInt rows = x.sym_numel() / width;
    const c10::SymInt act_width = is_swiglu(activation) ? width / 2 : width;
    std::vector<c10::SymInt> act_sizes(x.sym_sizes().begin(), x.sym_sizes().end());
    act_sizes.back() = act_width;
    const at::Tensor grad_out_2d = grad_out.reshape_symint({rows, weight.sym_size(0)});
    const at::Tensor weight_c = weight.to(compute);
    at::Tensor grad_x, grad_bias, grad_weight, grad_linear_bias;
    if (need_linear_bias) {
      grad_linear_bias = grad_out_2d.sum(0).to(static_cast<at::ScalarType>(linear_bias_dtype));
    }
    if (differentiable_backward(grad_out)) {
      // create_graph=True or batched gradients: every gradient as differentiable ops of x, the
      // parameters and grad_out.
      const at::Tensor grad_act = at::mm(grad_out_2d, weight_c).to(x.scalar_type()).reshape_symint(act_sizes);
      std::tie(grad_x, grad_bias) = act_backward_math(grad_act, x, bias, activation, need_bias);
      if (need_weight) {
        const at::Tensor y = activation_value_math(x, bias, activation).reshape_symint({rows, act_width});
        grad_weight = at::mm(grad_out_2d.t(), y.to(compute)).to(weight.scalar_type());
      }
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      const bool rebuild_y_first = need_weight && compute == x.scalar_type() && weight.scalar_type() == x.scalar_type();
      at::Tensor grad_act;
      at::Tensor y;  // rebuilt by the backward kernel, where it is not rebuilt first
      if (rebuild_y_first) {
        // One buffer: y (the forward's bits), grad_W from it, grad_act written over it.
        at::Tensor rebuilt = act_forward(x, optional(bias), activation);
        grad_weight = at::mm(grad_out_2d.t(), rebuilt.view_symint({rows, act_width}));
        grad_act = cpu_mm_over(std::move(rebuilt), grad_out_2d, weight_c).view_symint(act_sizes);
      } else {
        // A new buffer (the matmul's, or its cast's): grad_x is written over it.
        grad_act = cpu_mm(grad_out_2d, weight_c).to(x.scalar_type()).contiguous().view_symint(act_sizes);
      }
      const bool rebuild_y_in_backward = need_weight && !rebuild_y_first;
      if (is_swiglu(activation)) {
        std::tie(grad_x, grad_bias, y) = swiglu_bwd_op().call(grad_act, x, optional(bias), rebuild_y_in_backward,
                                                               need_bias);
      } else {
        std::tie(grad_bias, y) = bias_act_bwd_inplace_op().call(grad_act, x, optional(bias), activation,
                                                                rebuild_y_in_backward, need_bias);
        grad_x = grad_act;
      }
      grad_bias = if_asked(grad_bias, need_bias);
      if (rebuild_y_in_backward) {
        grad_weight = at::mm(grad_out_2d.t(), y.reshape_symint({rows, act_width}).to(compute)).to(weight.scalar_type());
      }
    }
    return {grad_x, grad_bias, grad_weight, grad_linear_bias, at::Tensor()};
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

at::Tensor act_linear_autograd(const at::Tensor& x, const OptionalTensor& bias, const at::Tensor& weight,
                               const OptionalTensor& linear_bias, const std::string& activation) {
  return ActLinearFunction::apply(x.contiguous(), contiguous(bias), weight, linear_bias, activation);
}

at::Tensor act_linear_values(const at::Tensor& x, const OptionalTensor& bias, const at::Tensor& weight,
                             const OptionalTensor& linear_bias, const std::string& activation) {
  check_act_linear(x, weight, linear_bias, activation);
  return linear_as_autocast(act_forward(x.contiguous(), contiguous(bias), activation), weight, linear_bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  m.impl("bias_act", &bias_act_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("act_linear", &act_linear_autograd);
}

TORCH_LIBRARY_IMPL(memopt, CompositeExplicitAutograd, m) {
  m.impl("bias_act", &bias_act_values);
  m.impl("swiglu", &swiglu_values);
  m.impl("act_linear", &act_linear_values);
}

}  // namespace memopt
