// The differentiable norm ops, their autograd nodes in C++: memopt.layer_norm and memopt.rms_norm
// (torch.ops.memopt.{layer_norm,rms_norm}) and memopt.norm_linear (torch.ops.memopt.norm_linear).
//
// The kernels (layer_norm_fwd / _bwd, rms_norm_fwd / _bwd; norm.cpp, norm_cuda.cu) are faster
// than ATen's on CPU (forward 0.07 against 0.11 ms, backward 0.11 against 0.13 ms at 512 x 512, one
// thread), but a Python autograd Function around them costs ~40 us per forward + backward, which
// lost that lead to F.layer_norm at small shapes. These nodes are C++, as ATen's are. They save x
// (or residual_out when a residual was added: an output anyway), the per-row statistics and the
// parameters, nothing of y's size; a backward under create_graph=True (second derivatives)
// runs the backward formula as plain ATen ops in the statistics dtype, so second derivatives are
// exact. Checks: the kernels' (norm_common.cpp) and check_norm_linear's; memopt/ops/norm.py runs
// its own (the same conditions, in Python's words) only when a call fails.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <numeric>
#include <vector>

#include "autograd_common.h"
#include "common.h"
#include "cpu_linear.h"

namespace memopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;

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

// Which parameter gradients a norm's backward computes: those whose parameter is present and
// needs one (a frozen norm's take no time, as in ATen's output_mask).
struct ParamGradMask {
  bool weight;
  bool bias;
};

// (grad_x, grad_weight, grad_bias) from the registered backward op; grad_x_extra is added to grad_x.
// A parameter gradient outside `mask` comes back undefined.
Tensor3 norm_backward(bool rms, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                      const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd,
                      const at::Tensor& grad_x_extra, ParamGradMask mask) {
  const OptionalTensor extra = grad_x_extra.defined() ? OptionalTensor(grad_x_extra.contiguous()) : std::nullopt;
  if (rms) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("memopt::rms_norm_bwd", "")
                         .typed<Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                                        const OptionalTensor&, bool, bool)>();
    auto [grad_x, grad_weight, y] = op.call(grad_y, x, optional(weight), rstd, extra, false, mask.weight);
    return {grad_x, if_asked(grad_weight, mask.weight), at::Tensor()};
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::layer_norm_bwd", "")
                       .typed<Tensor4(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                      const OptionalTensor&, const at::Tensor&, const at::Tensor&,
                                      const OptionalTensor&, bool, bool, bool)>();
  auto [grad_x, grad_weight, grad_bias, y] =
      op.call(grad_y, x, optional(weight), optional(bias), mean, rstd, extra, false, mask.weight, mask.bias);
  return {grad_x, if_asked(grad_weight, mask.weight), if_asked(grad_bias, mask.bias)};
}

// (grad_weight, grad_bias, y) from the registered in-place backward op, which writes grad_x over
// grad_y (a buffer the caller made and needs no more); y (rebuilt) only when return_y. A parameter
// gradient outside `mask` comes back undefined.
Tensor3 norm_backward_inplace(bool rms, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd,
                              const at::Tensor& grad_x_extra, bool return_y, ParamGradMask mask) {
  const OptionalTensor extra = grad_x_extra.defined() ? OptionalTensor(grad_x_extra.contiguous()) : std::nullopt;
  if (rms) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("memopt::rms_norm_bwd_inplace", "")
                         .typed<Tensor2(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
                                        const OptionalTensor&, bool, bool)>();
    auto [grad_weight, y] = op.call(grad_y, x, optional(weight), rstd, extra, return_y, mask.weight);
    return {if_asked(grad_weight, mask.weight), at::Tensor(), y};
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("memopt::layer_norm_bwd_inplace", "")
                       .typed<Tensor3(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const OptionalTensor&,
                                      const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool, bool, bool)>();
  auto [grad_weight, grad_bias, y] =
      op.call(grad_y, x, optional(weight), optional(bias), mean, rstd, extra, return_y, mask.weight, mask.bias);
  return {if_asked(grad_weight, mask.weight), if_asked(grad_bias, mask.bias), y};
}

// The mask of a node whose inputs are x, then residual, weight and bias where present (an absent
// optional has no edge, so needs_input_grad counts only those given).
ParamGradMask param_grad_mask(AutogradContext* ctx, bool has_residual, const at::Tensor& weight,
                              const at::Tensor& bias) {
  const size_t weight_edge = 1 + size_t(has_residual);
  const size_t bias_edge = weight_edge + size_t(weight.defined());
  return {weight.defined() && ctx->needs_input_grad(weight_edge), bias.defined() && ctx->needs_input_grad(bias_edge)};
}

// The norm in differentiable ATen ops, in the kernels' statistics dtype: x_hat = (x - mean) * rstd
// (mean 0 for RMSNorm) and rstd, what norm_backward_math and norm_value_math build on.
struct NormMath {
  at::ScalarType compute;
  at::Tensor x_hat;
  at::Tensor rstd;
};

NormMath norm_math(bool rms, const at::Tensor& x, double eps) {
  const at::ScalarType compute = compute_dtype(x);
  const at::Tensor h = x.to(compute);
  const at::Tensor centred = rms ? h : h - h.mean(-1, /*keepdim=*/true);
  const at::Tensor rstd = at::rsqrt(centred.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return {compute, centred * rstd, rstd};
}

// y = x_hat * weight + bias in x's dtype, as differentiable ops (the kernels' forward, for a
// backward under create_graph=True that needs y).
at::Tensor norm_value_math(bool rms, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           double eps) {
  const NormMath m = norm_math(rms, x, eps);
  at::Tensor y = m.x_hat;
  if (weight.defined()) y = y * weight.to(m.compute);
  if (bias.defined()) y = y + bias.to(m.compute);
  return y.to(x.scalar_type());
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
  const NormMath m = norm_math(rms, x, eps);
  const at::Tensor dy = grad_y.to(m.compute);
  const at::Tensor g = weight.defined() ? dy * weight.to(m.compute) : dy;
  at::Tensor inner = g - m.x_hat * (g * m.x_hat).mean(-1, /*keepdim=*/true);
  if (!rms) {
    inner = inner - g.mean(-1, /*keepdim=*/true);
  }
  const at::Tensor grad_x = (m.rstd * inner).to(x.scalar_type());
  std::vector<int64_t> rows(x.dim() - 1);
  std::iota(rows.begin(), rows.end(), 0);
  const at::Tensor grad_weight =
      weight.defined() ? (dy * m.x_hat).sum(rows).to(weight.scalar_type()) : at::Tensor();
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
    if (differentiable_backward(grad_y, grad_residual_out)) {
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
      std::tie(grad_x, grad_weight, grad_bias) = norm_backward(kRms, dy, x, weight, bias, saved[3], saved[4],
                                                               grad_residual_out,
                                                               param_grad_mask(ctx, has_residual, weight, bias));
    }
    return {grad_x, has_residual ? grad_x : at::Tensor(), grad_weight, grad_bias, at::Tensor()};
  }
};

// ---------------------------------------------------------------------------------------------
// norm_linear: F.linear(norm(x [+ residual]), linear_weight, linear_bias) keeping no norm output.
// Saves what the norm's node saves plus linear_weight. The backward allocates one buffer of x's
// size: the norm's forward kernel rebuilds y in it, grad_W = grad_out^T @ y, then
// grad_y = grad_out @ W is written over y and the in-place norm-backward kernel writes grad_x over
// grad_y. (Eager norm + linear peaks at two: y and grad_y, then grad_y and grad_x; so did
// rebuilding y inside the backward kernel, beside grad_y. On CPU each fresh buffer of that size
// can cost more in page faults than the norm's whole kernel.) Under autocast, where the matmuls
// run in another dtype, y is rebuilt by the backward kernel and cast. A C++ node, as the norms':
// a Python autograd.Function around the same work cost 0.25-0.5 ms more per step once a GEMM had
// swept the caches.

// The norm's parameters and the linear's (check_linear_params), with memopt.norm_linear's words.
void check_norm_linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias, bool rms,
                       const OptionalTensor& norm_weight, const OptionalTensor& norm_bias) {
  constexpr const char* op = "norm_linear";
  MEMOPT_CHECK(!(rms && norm_bias.has_value()), op, "norm_bias must be None for norm='rmsnorm' (RMSNorm has no bias)");
  // Sizes as SymInts: under torch.compile this node runs on tensors of symbolic shape.
  const c10::SymInt n = x.dim() > 0 ? x.sym_size(-1) : c10::SymInt(0);
  // The norm's parameters, under this op's names (the norm's forward op would name itself,
  // memopt.layer_norm or memopt.rms_norm, and weight / bias): the conditions of its check_params.
  const auto check_norm_param = [&](const at::Tensor& p, const char* name) {
    MEMOPT_CHECK(p.dim() == 1 && p.sym_size(0) == n, op, name, " must have shape [", n, "], got ", p.sym_sizes());
    check_same_device(p, x, op, name, "x");
    MEMOPT_CHECK(p.scalar_type() == x.scalar_type() || p.scalar_type() == at::kFloat, op, name,
                 " must have x's dtype (", x.scalar_type(), ") or float32, got ", p.scalar_type());
  };
  if (norm_weight.has_value()) check_norm_param(*norm_weight, "norm_weight");
  if (norm_bias.has_value()) {
    check_norm_param(*norm_bias, "norm_bias");
    if (norm_weight.has_value()) {
      MEMOPT_CHECK(norm_bias->scalar_type() == norm_weight->scalar_type(), op, "norm_bias must have the dtype of ",
                   "norm_weight (", norm_weight->scalar_type(), "), got ", norm_bias->scalar_type());
    }
  }
  check_linear_params(op, x, n, weight, bias);
}

struct NormLinearFunction : public torch::autograd::Function<NormLinearFunction> {
  // Returns (out, residual_out); residual_out is empty (and not differentiable) without a residual.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptionalTensor& residual,
                               const OptionalTensor& norm_weight, const OptionalTensor& norm_bias,
                               const at::Tensor& linear_weight, const OptionalTensor& linear_bias, bool rms,
                               double eps) {
    check_norm_linear(x, linear_weight, linear_bias, rms, norm_weight, norm_bias);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, residual_out, mean, rstd] = norm_forward(rms, x, residual, norm_weight, norm_bias, eps);
    // Under torch.autocast the linear runs in the autocast dtype, as F.linear would.
    at::Tensor out = linear_as_autocast(y, linear_weight, linear_bias);
    const bool has_residual = residual.has_value();
    ctx->save_for_backward({has_residual ? residual_out : x, norm_weight.value_or(at::Tensor()),
                            norm_bias.value_or(at::Tensor()), linear_weight, mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["has_residual"] = has_residual;
    ctx->saved_data["linear_bias_dtype"] =
        linear_bias.has_value() ? static_cast<int64_t>(linear_bias->scalar_type()) : int64_t(-1);
    ctx->set_materialize_grads(false);
    if (!has_residual) {
      ctx->mark_non_differentiable({residual_out});
    }
    return {out, residual_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &norm_weight = saved[1], &norm_bias = saved[2], &linear_weight = saved[3];
    const bool rms = ctx->saved_data["rms"].toBool();
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const int64_t bias_dtype_code = ctx->saved_data["linear_bias_dtype"].toInt();
    const at::Tensor& grad_out = grads[0];
    const at::Tensor grad_residual_out = has_residual ? grads[1] : at::Tensor();
    at::Tensor grad_x, grad_norm_weight, grad_norm_bias, grad_linear_weight, grad_linear_bias;
    if (grad_out.defined()) {
      // The casts are the ones autocast made in the forward (to grad_out's dtype, the output's),
      // and nothing may recast: autocast is off here even when backward() runs inside it.
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      const at::ScalarType compute = grad_out.scalar_type();
      const c10::SymInt n = x.sym_size(-1);
      const c10::SymInt rows = x.sym_numel() / n;
      const at::Tensor grad_out_2d = grad_out.reshape_symint({rows, linear_weight.sym_size(0)});
      const at::Tensor weight_c = linear_weight.to(compute);
      // needs_input_grad counts the tensor arguments that were given (an absent optional has no
      // edge): x, then residual, norm_weight and norm_bias where present, then linear_weight and
      // linear_bias.
      const size_t linear_weight_edge = 1 + size_t(has_residual) + size_t(norm_weight.defined()) +
                                        size_t(norm_bias.defined());
      if (bias_dtype_code >= 0 && ctx->needs_input_grad(linear_weight_edge + 1)) {
        grad_linear_bias = grad_out_2d.sum(0).to(static_cast<at::ScalarType>(bias_dtype_code));
      }
      if (differentiable_backward(grad_out, grad_residual_out)) {
        // create_graph=True or batched gradients: every gradient as differentiable ops of x, the
        // parameters and grad_out.
        const double eps = ctx->saved_data["eps"].toDouble();
        const at::Tensor grad_y = at::mm(grad_out_2d, weight_c).to(x.scalar_type()).reshape_symint(x.sym_sizes());
        std::tie(grad_x, grad_norm_weight, grad_norm_bias) =
            norm_backward_math(rms, grad_y, x, norm_weight, norm_bias, eps);
        const at::Tensor y = norm_value_math(rms, x, norm_weight, norm_bias, eps).reshape_symint({rows, n});
        grad_linear_weight = at::mm(grad_out_2d.t(), y.to(compute)).to(linear_weight.scalar_type());
        if (grad_residual_out.defined()) grad_x = grad_x + grad_residual_out;
      } else {
        at::AutoDispatchBelowADInplaceOrView guard;
        const bool need_linear_weight_grad = ctx->needs_input_grad(linear_weight_edge);
        // Under autocast the matmuls run in another dtype: y is cast for grad_W anyway, so the
        // backward kernel rebuilds it beside grad_y.
        const bool rebuild_y_first = need_linear_weight_grad && compute == x.scalar_type();
        const bool rebuild_y_in_backward = need_linear_weight_grad && !rebuild_y_first;
        at::Tensor grad_y;
        if (rebuild_y_first) {
          // One buffer of x's size for the whole backward: y is rebuilt by the forward kernel (the
          // forward's bits), grad_W taken from it, then grad_y is written over it (or into the
          // memory it frees: cpu_mm_over) and grad_x over grad_y. Rebuilding y in the backward
          // kernel instead would need grad_y and y at once.
          const double eps = ctx->saved_data["eps"].toDouble();
          at::Tensor y =
              std::get<0>(norm_forward(rms, x, std::nullopt, optional(norm_weight), optional(norm_bias), eps));
          grad_linear_weight = at::mm(grad_out_2d.t(), y.view_symint({rows, n})).to(linear_weight.scalar_type());
          grad_y = cpu_mm_over(std::move(y), grad_out_2d, weight_c).view_symint(x.sym_sizes());
        } else {
          // A new buffer (the matmul's, or its cast's): grad_x is written over it.
          grad_y = cpu_mm(grad_out_2d, weight_c).to(x.scalar_type()).view_symint(x.sym_sizes());
        }
        at::Tensor y;
        std::tie(grad_norm_weight, grad_norm_bias, y) =
            norm_backward_inplace(rms, grad_y, x, norm_weight, norm_bias, saved[4], saved[5], grad_residual_out,
                                  rebuild_y_in_backward, param_grad_mask(ctx, has_residual, norm_weight, norm_bias));
        grad_x = grad_y;
        if (rebuild_y_in_backward) {
          grad_linear_weight =
              at::mm(grad_out_2d.t(), y.view_symint({rows, n}).to(compute)).to(linear_weight.scalar_type());
        }
      }
    } else {
      grad_x = grad_residual_out;  // only residual_out was used: the norm and the linear get no gradient
    }
    return {grad_x,           has_residual ? grad_x : at::Tensor(), grad_norm_weight, grad_norm_bias,
            grad_linear_weight, grad_linear_bias, at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> norm_linear_autograd(const at::Tensor& x, const OptionalTensor& residual,
                                                        const OptionalTensor& norm_weight,
                                                        const OptionalTensor& norm_bias, const at::Tensor& linear_weight,
                                                        const OptionalTensor& linear_bias, bool rms, double eps) {
  const variable_list out = NormLinearFunction::apply(x.contiguous(), contiguous(residual), contiguous(norm_weight),
                                                      contiguous(norm_bias), linear_weight, linear_bias, rms, eps);
  return {out[0], out[1]};
}

// Below autograd: the norm's forward op, then the linear.
std::tuple<at::Tensor, at::Tensor> norm_linear_values(const at::Tensor& x, const OptionalTensor& residual,
                                                      const OptionalTensor& norm_weight, const OptionalTensor& norm_bias,
                                                      const at::Tensor& linear_weight,
                                                      const OptionalTensor& linear_bias, bool rms, double eps) {
  check_norm_linear(x, linear_weight, linear_bias, rms, norm_weight, norm_bias);
  auto [y, residual_out, mean, rstd] =
      norm_forward(rms, x.contiguous(), contiguous(residual), contiguous(norm_weight), contiguous(norm_bias), eps);
  return {linear_as_autocast(y, linear_weight, linear_bias), residual_out};
}

std::tuple<at::Tensor, at::Tensor> layer_norm_autograd(const at::Tensor& x, const OptionalTensor& residual,
                                                       const OptionalTensor& weight, const OptionalTensor& bias,
                                                       double eps) {
  const variable_list out = NormFunction<false>::apply(x.contiguous(), contiguous(residual), contiguous(weight),
                                                       contiguous(bias), eps);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_autograd(const at::Tensor& x, const OptionalTensor& residual,
                                                     const OptionalTensor& weight, double eps) {
  const variable_list out =
      NormFunction<true>::apply(x.contiguous(), contiguous(residual), contiguous(weight), OptionalTensor(), eps);
  return {out[0], out[1]};
}

// Below autograd (no grad needed, or inside another node): the forward op's y and residual_out.
std::tuple<at::Tensor, at::Tensor> layer_norm_values(const at::Tensor& x, const OptionalTensor& residual,
                                                     const OptionalTensor& weight, const OptionalTensor& bias,
                                                     double eps) {
  auto [y, residual_out, mean, rstd] =
      norm_forward(false, x.contiguous(), contiguous(residual), contiguous(weight), contiguous(bias), eps);
  return {y, residual_out};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_values(const at::Tensor& x, const OptionalTensor& residual,
                                                   const OptionalTensor& weight, double eps) {
  auto [y, residual_out, mean, rstd] =
      norm_forward(true, x.contiguous(), contiguous(residual), contiguous(weight), std::nullopt, eps);
  return {y, residual_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, Autograd, m) {
  m.impl("layer_norm", &layer_norm_autograd);
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("norm_linear", &norm_linear_autograd);
}

TORCH_LIBRARY_IMPL(memopt, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm_values);
  m.impl("rms_norm", &rms_norm_values);
  m.impl("norm_linear", &norm_linear_values);
}

}  // namespace memopt
