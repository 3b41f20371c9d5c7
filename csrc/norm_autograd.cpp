// layer_norm / rms_norm as differentiable ops: the autograd node of memopt.layer_norm and
// memopt.rms_norm, in C++.
//
// The kernels (layer_norm_fwd / _bwd, rms_norm_fwd / _bwd; norm.cpp, norm_cuda.cu) are faster
// than ATen's on CPU (forward 0.07 against 0.11 ms, backward 0.11 against 0.13 ms at 512 x 512, one
// thread), but a Python autograd Function around them costs ~40 us per forward + backward, which
// lost that lead to F.layer_norm at small shapes. This node is C++, as ATen's is. It saves x (or
// residual_out when a residual was added: an output anyway), the per-row statistics and the
// parameters, nothing of y's size; a backward under create_graph=True (second derivatives)
// runs the backward formula as plain ATen ops in the statistics dtype, so second derivatives are
// exact. Checks: the kernels' (norm_common.cpp), after memopt/ops/norm.py's.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <numeric>
#include <vector>

namespace memopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

OptionalTensor optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// (y, residual_out, mean (undefined for RMSNorm), rstd) from the registered forward op.
Tensor4 norm_forward(bool rms, const at::Tensor& x, const OptionalTensor& residual, const OptionalTensor& weight,
                     const OptionalTensor& bias, double eps) {
  if (rms) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("memopt::rms_norm_fwd", "")
                         .typed<Tensor3(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double)>();
    auto [y, residual_out, rstd] = op.call(x, residual, weight, eps);
    return {y, residual_out, at::Tensor(), rstd};
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::layer_norm_fwd", "")
                       .typed<Tensor4(const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                      const OptionalTensor&, double)>();
  return op.call(x, residual, weight, bias, eps);
}

// (grad_x, grad_weight, grad_bias) from the registered backward op; grad_x_extra is added to grad_x.
Tensor3 norm_backward(bool rms, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd,
                      const at::Tensor& grad_x_extra) {
  const OptionalTensor extra = grad_x_extra.defined() ? OptionalTensor(grad_x_extra.contiguous()) : std::nullopt;
  if (rms) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("memopt::rms_norm_bwd", "")
                         .typed<Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                                        const OptionalTensor&, bool)>();
    auto [grad_x, grad_weight, y] = op.call(grad_y, x, optional(weight), rstd, extra, false);
    return {grad_x, grad_weight, at::Tensor()};
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::layer_norm_bwd", "")
                       .typed<Tensor4(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                      const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                                      const OptionalTensor&, bool)>();
  auto [grad_x, grad_weight, grad_bias, y] =
      op.call(grad_y, x, optional(weight), optional(bias), mean, rstd, extra, false);
  return {grad_x, grad_weight, grad_bias};
}

// The backward as differentiable ATen ops, in the kernels' statistics dtype: under
// create_graph=True the returned gradients are functions of x and the parameters, so a second
// backward differentiates them exactly. Written out rather than obtained from autograd::grad of
// the norm: x may be residual_out, this node's own output, and a reentrant grad with respect to
// it from inside the node's backward deadlocks.
//   x_hat = (x - mean) * rstd (mean 0 for RMSNorm), g = grad_y * weight,
//   grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) (no mean(g) for RMSNorm),
//   grad_weight = sum over rows of grad_y * x_hat, grad_bias = sum over rows of grad_y.
Tensor3 norm_backward_math(bool rms, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& bias, double eps) {
  const at::ScalarType compute = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor h = x.to(compute);
  const at::Tensor centred = rms ? h : h - h.mean(-1, /*keepdim=*/true);
  const at::Tensor rstd = at::rsqrt(centred.pow(2).mean(-1, /*keepdim=*/true) + eps);
  const at::Tensor x_hat = centred * rstd;
  const at::Tensor dy = grad_y.to(compute);
  const at::Tensor g = weight.defined() ? dy * weight.to(compute) : dy;
  at::Tensor inner = g - x_hat * (g * x_hat).mean(-1, /*keepdim=*/true);
  if (!rms) {
    inner = inner - g.mean(-1, /*keepdim=*/true);
  }
  const at::Tensor grad_x = (rstd * inner).to(x.scalar_type());
  std::vector<int64_t> rows(x.dim() - 1);
  std::iota(rows.begin(), rows.end(), 0);
  const at::Tensor grad_weight =
      weight.defined() ? (dy * x_hat).sum(rows).to(weight.scalar_type()) : at::Tensor();
  const at::Tensor grad_bias = bias.defined() ? dy.sum(rows).to(bias.scalar_type()) : at::Tensor();
  return {grad_x, grad_weight, grad_bias};
}

template <bool kRms>
struct NormFunction : public torch::autograd::Function<NormFunction<kRms>> {
  // Returns (y, residual_out); residual_out is empty (and not differentiable) without a residual.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& residual,
                               const OptionalTensor& weight, const OptionalTensor& bias, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, residual_out, mean, rstd] = norm_forward(kRms, x, residual, weight, bias, eps);
    const bool has_residual = residual.has_value();
    ctx->save_for_backward({has_residual ? residual_out : x, weight.value_or(at::Tensor()),
                            bias.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_residual"] = has_residual;
    ctx->set_materialize_grads(false);
    if (!has_residual) {
      ctx->mark_non_differentiable({residual_out});
    }
    return {y, residual_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const at::Tensor& grad_y = grads[0];
    const at::Tensor grad_residual_out = has_residual ? grads[1] : at::Tensor();
    at::Tensor grad_x, grad_weight, grad_bias;
    if (at::GradMode::is_enabled()) {
      if (grad_y.defined()) {
        std::tie(grad_x, grad_weight, grad_bias) =
            norm_backward_math(kRms, grad_y, x, weight, bias, ctx->saved_data["eps"].toDouble());
      }
      if (grad_residual_out.defined()) {
        grad_x = grad_x.defined() ? grad_x + grad_residual_out : grad_residual_out;
      }
    } else {
      at::AutoDispatchBelowADInplaceOrView guard;
      const at::Tensor dy = grad_y.defined() ? grad_y.contiguous() : at::zeros_like(x);
      std::tie(grad_x, grad_weight, grad_bias) =
          norm_backward(kRms, dy, x, weight, bias, saved[3], saved[4], grad_residual_out);
      if (!weight.defined()) grad_weight = at::Tensor();
      if (!bias.defined()) grad_bias = at::Tensor();
    }
    return {grad_x, has_residual ? grad_x : at::Tensor(), grad_weight, grad_bias, at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> layer_norm_autograd(const at::Tensor& x, const OptionalTensor& residual,
                                                       const OptionalTensor& weight, const OptionalTensor& bias,
                                                       double eps) {
  const variable_list out = NormFunction<false>::apply(x, residual, weight, bias, eps);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const OptionalTensor& residual,
                                                     const OptionalTensor& weight, double eps) {
  const variable_list out = NormFunction<true>::apply(x, residual, weight, OptionalTensor(), eps);
  return {out[0], out[1]};
}

// Below autograd (no grad needed, or inside another node): the forward op's y and residual_out.
std::tuple<at::Tensor, at::Tensor> layer_norm_values(const at::Tensor& x, const OptionalTensor& residual,
                                                     const OptionalTensor& weight, const OptionalTensor& bias,
                                                     double eps) {
  auto [y, residual_out, mean, rstd] = norm_forward(false, x, residual, weight, bias, eps);
  return {y, residual_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_values(const at::Tensor& x, const OptionalTensor& residual,
                                                   const OptionalTensor& weight, double eps) {
  auto [y, residual_out, mean, rstd] = norm_forward(true, x, residual, weight, std::nullopt, eps);
  return {y, residual_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
}

TORCH_LIBRARY_IMPL(memopt, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm_values);
  m.impl("rms_norm", &rms_norm_values);
}

}  // namespace memopt
