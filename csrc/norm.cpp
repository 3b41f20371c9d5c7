// layer_norm / rms_norm with an optional fused residual add, CPU launchers (the kernels are in
// cpu_kernels_impl.h) and the argument checks shared with the CUDA launchers. The forward returns
// per-row statistics; the backward rebuilds the normalised input from x and the statistics
// (and, with return_y, the normalised output too) instead of keeping it.
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "common.h"
#include "cpu_kernels.h"
#include "norm.h"

namespace memopt {

at::ScalarType norm_stat_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

std::vector<int64_t> norm_stat_shape(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

namespace {

void check_x(const char* op, const at::Tensor& x) {
  check_float_dtype(x, op, "x");
  MEMOPT_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, "x must have at least one dimension and a non-empty last "
               "dimension, got shape ", x.sizes());
  check_contiguous(x, op, "x");
}

void check_like_x(const char* op, const at::Tensor& t, const at::Tensor& x, const char* name) {
  check_same_device(t, x, op, name, "x");
  check_same_shape(t, x, op, name, "x");
  check_same_dtype(t, x, op, name, "x");
  check_contiguous(t, op, name);
}

// weight and bias: shape [n], on x's device, dtype x's or float32, both the same dtype.
at::ScalarType check_params(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias) {
  const int64_t n = x.size(-1);
  at::ScalarType param_dtype = x.scalar_type();
  const auto check_param = [&](const at::Tensor& p, const char* name) {
    check_vector(p, n, x, op, name);
    MEMOPT_CHECK(p.scalar_type() == x.scalar_type() || p.scalar_type() == at::kFloat, op, name,
                 " must have x's dtype (", x.scalar_type(), ") or float32, got ", p.scalar_type());
    param_dtype = p.scalar_type();
  };
  if (weight.has_value()) check_param(*weight, "weight");
  if (bias.has_value()) {
    check_param(*bias, "bias");
    if (weight.has_value()) check_same_dtype(*bias, *weight, op, "bias", "weight");
  }
  return param_dtype;
}

void check_stat(const char* op, const at::Tensor& stat, const at::Tensor& x, const char* name) {
  check_same_device(stat, x, op, name, "x");
  MEMOPT_CHECK(stat.sizes() == at::IntArrayRef(norm_stat_shape(x)), op, name, " must have shape x.shape[:-1] = ",
               at::IntArrayRef(norm_stat_shape(x)), ", got ", stat.sizes());
  MEMOPT_CHECK(stat.scalar_type() == norm_stat_dtype(x), op, name, " must be ", norm_stat_dtype(x), " for ",
               x.scalar_type(), " x, got ", stat.scalar_type());
  check_contiguous(stat, op, name);
}

}  // namespace

NormProblem check_norm_fwd_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  double eps) {
  check_x(op, x);
  if (residual.has_value()) check_like_x(op, *residual, x, "residual");
  MEMOPT_CHECK(std::isfinite(eps) && eps >= 0.0, op, "eps must be a finite number >= 0, got ", eps);
  const at::ScalarType param_dtype = check_params(op, x, weight, bias);
  const int64_t n = x.size(-1);
  return {x.numel() / n, n, param_dtype};
}

NormProblem check_norm_bwd_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  const at::Tensor* mean, const at::Tensor& rstd,
                                  const std::optional<at::Tensor>& grad_x_extra) {
  check_x(op, x);
  check_like_x(op, grad_y, x, "grad_y");
  if (grad_x_extra.has_value()) check_like_x(op, *grad_x_extra, x, "grad_x_extra");
  if (mean != nullptr) check_stat(op, *mean, x, "mean");
  check_stat(op, rstd, x, "rstd");
  const at::ScalarType param_dtype = check_params(op, x, weight, bias);
  const int64_t n = x.size(-1);
  return {x.numel() / n, n, param_dtype};
}

namespace {

// The CPU kernels take parameters of x's dtype: float32 parameters of float64 x are widened here
// (exactly) and their gradients narrowed back afterwards.
at::Tensor in_x_dtype(const std::optional<at::Tensor>& param, const at::Tensor& x) {
  return param.has_value() ? param->to(x.scalar_type()) : at::Tensor();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cpu(
    const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps) {
  check_norm_fwd_inputs(op, x, residual, weight, bias, eps);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto residual_out = residual.has_value() ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  const auto stat_options = x.options().dtype(norm_stat_dtype(x));
  auto mean = rms ? at::Tensor() : at::empty(norm_stat_shape(x), stat_options);
  auto rstd = at::empty(norm_stat_shape(x), stat_options);
  MEMOPT_CPU_KERNEL(norm_fwd_kernel)(x, residual.value_or(at::Tensor()), in_x_dtype(weight, x), in_x_dtype(bias, x), y,
                                     residual.has_value() ? residual_out : at::Tensor(), mean, rstd, eps);
  return {y, residual_out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd_cpu(
    const char* op, const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor* mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& grad_x_extra, bool return_y) {
  const NormProblem problem = check_norm_bwd_inputs(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  auto grad_weight = weight.has_value() ? at::empty({problem.n}, x.options()) : at::Tensor();
  auto grad_bias = bias.has_value() ? at::empty({problem.n}, x.options()) : at::Tensor();
  MEMOPT_CPU_KERNEL(norm_bwd_kernel)(grad_y, x, in_x_dtype(weight, x), in_x_dtype(bias, x),
                                     mean != nullptr ? *mean : at::Tensor(), rstd,
                                     grad_x_extra.value_or(at::Tensor()), grad_x, return_y ? y : at::Tensor(),
                                     grad_weight, grad_bias);
  const auto in_param_dtype = [&](const at::Tensor& grad) {
    return grad.defined() ? grad.to(problem.param_dtype) : absent_like(x);
  };
  return {grad_x, in_param_dtype(grad_weight), in_param_dtype(grad_bias), y};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps) {
  return norm_fwd_cpu("layer_norm", /*rms=*/false, x, residual, weight, bias, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& grad_x_extra, bool return_y) {
  return norm_bwd_cpu("layer_norm", grad_y, x, weight, bias, &mean, rstd, grad_x_extra, return_y);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& residual,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 double eps) {
  auto [y, residual_out, mean, rstd] = norm_fwd_cpu("rms_norm", /*rms=*/true, x, residual, weight, std::nullopt, eps);
  return {y, residual_out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 const at::Tensor& rstd,
                                                                 const std::optional<at::Tensor>& grad_x_extra,
                                                                 bool return_y) {
  auto [grad_x, grad_weight, grad_bias, y] =
      norm_bwd_cpu("rms_norm", grad_y, x, weight, std::nullopt, nullptr, rstd, grad_x_extra, return_y);
  return {grad_x, grad_weight, y};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
}

}  // namespace memopt
