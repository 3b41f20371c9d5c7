// layer_norm / rms_norm: the argument checks and output allocation that the CPU launchers
// (norm.cpp) and the CUDA launchers (norm_cuda.cu) share.
#include <ATen/MemoryOverlap.h>
#include <cmath>
#include <utility>
#include <vector>

#include "common.h"
#include "new_output.h"
#include "norm.h"

namespace memopt {
namespace {

struct NormShape {
  int64_t rows;
  int64_t n;
  at::ScalarType param_dtype;
};

// Per-row statistics (mean, rstd) are float32, or float64 for float64 x.
at::ScalarType norm_stat_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

std::vector<int64_t> norm_stat_shape(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

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

NormShape check_norm_fwd_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  double eps) {
  check_x(op, x);
  if (residual.has_value()) check_like_x(op, *residual, x, "residual");
  MEMOPT_CHECK(std::isfinite(eps) && eps >= 0.0, op, "eps must be a finite number >= 0, got ", eps);
  const at::ScalarType param_dtype = check_params(op, x, weight, bias);
  const int64_t n = x.size(-1);
  return {x.numel() / n, n, param_dtype};
}

NormShape check_norm_bwd_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
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

}  // namespace

NormForward prepare_norm_fwd(const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps) {
  const NormShape shape = check_norm_fwd_inputs(op, x, residual, weight, bias, eps);
  const auto stat_options = x.options().dtype(norm_stat_dtype(x));
  return {shape.rows,
          shape.n,
          shape.param_dtype,
          new_output_like(x),
          residual.has_value() ? new_output_like(x) : absent_like(x),
          rms ? at::Tensor() : at::empty(norm_stat_shape(x), stat_options),
          at::empty(norm_stat_shape(x), stat_options)};
}

NormBackward prepare_norm_bwd(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor* mean, const at::Tensor& rstd,
                              const std::optional<at::Tensor>& grad_x_extra, NormBwdOutputs outputs,
                              bool grad_x_in_grad_y) {
  const NormShape shape = check_norm_bwd_inputs(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra);
  if (grad_x_in_grad_y) {
    MEMOPT_CHECK(at::get_overlap_status(grad_y, x) == at::MemOverlapStatus::No, op,
                 "grad_y is overwritten with grad_x, so it must not share memory with x");
    // A grad_x_extra inside grad_y would be read after other elements of grad_x were written
    // over it (and the CUDA kernels take it as __restrict__).
    MEMOPT_CHECK(!grad_x_extra.has_value() ||
                     at::get_overlap_status(grad_y, *grad_x_extra) == at::MemOverlapStatus::No,
                 op, "grad_y is overwritten with grad_x, so it must not share memory with grad_x_extra");
    // Nor with a parameter or a statistic: read by every row, after earlier rows' grad_x was written.
    const std::pair<const char*, const at::Tensor*> others[] = {
        {"weight", weight.has_value() ? &*weight : nullptr},
        {"bias", bias.has_value() ? &*bias : nullptr},
        {"mean", mean},
        {"rstd", &rstd}};
    for (const auto& [name, t] : others) {
      MEMOPT_CHECK(t == nullptr || !t->defined() || at::get_overlap_status(grad_y, *t) == at::MemOverlapStatus::No,
                   op, "grad_y is overwritten with grad_x, so it must not share memory with ", name);
    }
  }
  const auto param_options = x.options().dtype(shape.param_dtype);
  const bool has_grad_weight = weight.has_value() && outputs.grad_weight;
  const bool has_grad_bias = bias.has_value() && outputs.grad_bias;
  return {shape.rows,
          shape.n,
          shape.param_dtype,
          has_grad_weight,
          has_grad_bias,
          grad_x_in_grad_y ? grad_y : new_output_like(x),
          has_grad_weight ? at::empty({shape.n}, param_options) : absent_like(x),
          has_grad_bias ? at::empty({shape.n}, param_options) : absent_like(x),
          outputs.y ? new_output_like(x) : absent_like(x)};
}

}  // namespace memopt
