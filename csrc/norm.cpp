// layer_norm / rms_norm with an optional fused residual add, CPU kernels. The forward returns
// per-row statistics; the backward rebuilds the normalised input from x and the statistics
// (and, with return_y, the normalised output too) instead of keeping it.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "common.h"
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

// Rows per parallel task: enough elements to be worth a task.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 32768 / n); }

// residual_out = x + residual (rounded to scalar_t, and that rounded value is what gets
// normalised, so the backward sees the same input). mean is null for RMSNorm, whose statistic
// is the root mean square about zero.
template <typename scalar_t, typename param_t>
void norm_fwd_cpu_kernel(const scalar_t* x, const scalar_t* residual, const param_t* weight, const param_t* bias,
                         scalar_t* y, scalar_t* residual_out, at::opmath_type<scalar_t>* mean,
                         at::opmath_type<scalar_t>* rstd, int64_t rows, int64_t n, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * n;
      const scalar_t* src = x + offset;
      if (residual != nullptr) {
        scalar_t* sum = residual_out + offset;
        for (int64_t j = 0; j < n; ++j) {
          sum[j] = static_cast<scalar_t>(static_cast<acc_t>(src[j]) + static_cast<acc_t>(residual[offset + j]));
        }
        src = sum;
      }
      acc_t row_mean = 0;
      if (mean != nullptr) {
        for (int64_t j = 0; j < n; ++j) row_mean += static_cast<acc_t>(src[j]);
        row_mean /= static_cast<acc_t>(n);
        mean[row] = row_mean;
      }
      acc_t square_sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const acc_t centred = static_cast<acc_t>(src[j]) - row_mean;
        square_sum += centred * centred;
      }
      const acc_t row_rstd = acc_t(1) / std::sqrt(square_sum / static_cast<acc_t>(n) + static_cast<acc_t>(eps));
      rstd[row] = row_rstd;
      for (int64_t j = 0; j < n; ++j) {
        acc_t value = (static_cast<acc_t>(src[j]) - row_mean) * row_rstd;
        if (weight != nullptr) value *= static_cast<acc_t>(weight[j]);
        if (bias != nullptr) value += static_cast<acc_t>(bias[j]);
        y[offset + j] = static_cast<scalar_t>(value);
      }
    }
  });
}

// Parameter gradients are summed per fixed block of rows into acc_t partials, then over blocks
// in a fixed order: the result does not depend on the number of threads.
constexpr int64_t kMaxRowBlocks = 64;

template <typename scalar_t, typename param_t>
void norm_bwd_cpu_kernel(const scalar_t* grad_y, const scalar_t* x, const param_t* weight,
                         const at::opmath_type<scalar_t>* mean,  // null for RMSNorm
                         const at::opmath_type<scalar_t>* rstd, const scalar_t* grad_x_extra, scalar_t* grad_x,
                         scalar_t* y,                               // null unless return_y
                         const param_t* bias,                       // only read to rebuild y
                         at::opmath_type<scalar_t>* weight_partials,  // [blocks, n] or null
                         at::opmath_type<scalar_t>* bias_partials,    // [blocks, n] or null
                         int64_t rows, int64_t n, int64_t blocks) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  const acc_t inv_n = acc_t(1) / static_cast<acc_t>(n);
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t block = block_begin; block < block_end; ++block) {
      acc_t* weight_partial = weight_partials ? weight_partials + block * n : nullptr;
      acc_t* bias_partial = bias_partials ? bias_partials + block * n : nullptr;
      const int64_t row_end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        const int64_t offset = row * n;
        const acc_t row_mean = mean ? mean[row] : acc_t(0);
        const acc_t row_rstd = rstd[row];
        // grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) with g = grad_y * weight;
        // RMSNorm drops the mean(g) term.
        acc_t g_sum = 0;
        acc_t g_xhat_sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const acc_t x_hat = (static_cast<acc_t>(x[offset + j]) - row_mean) * row_rstd;
          const acc_t dy = static_cast<acc_t>(grad_y[offset + j]);
          const acc_t g = weight ? dy * static_cast<acc_t>(weight[j]) : dy;
          g_sum += g;
          g_xhat_sum += g * x_hat;
          if (weight_partial) weight_partial[j] += dy * x_hat;
          if (bias_partial) bias_partial[j] += dy;
          if (y) {
            acc_t value = weight ? x_hat * static_cast<acc_t>(weight[j]) : x_hat;
            if (bias) value += static_cast<acc_t>(bias[j]);
            y[offset + j] = static_cast<scalar_t>(value);
          }
        }
        const acc_t g_mean = mean ? g_sum * inv_n : acc_t(0);
        const acc_t g_xhat_mean = g_xhat_sum * inv_n;
        for (int64_t j = 0; j < n; ++j) {
          const acc_t x_hat = (static_cast<acc_t>(x[offset + j]) - row_mean) * row_rstd;
          const acc_t dy = static_cast<acc_t>(grad_y[offset + j]);
          const acc_t g = weight ? dy * static_cast<acc_t>(weight[j]) : dy;
          acc_t dx = row_rstd * (g - g_mean - x_hat * g_xhat_mean);
          if (grad_x_extra) dx += static_cast<acc_t>(grad_x_extra[offset + j]);
          grad_x[offset + j] = static_cast<scalar_t>(dx);
        }
      }
    }
  });
}

// Sums partials [blocks, n] over blocks into out [n] of the parameter's dtype.
template <typename acc_t, typename param_t>
void reduce_partials(const acc_t* partials, param_t* out, int64_t blocks, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    acc_t total = 0;
    for (int64_t b = 0; b < blocks; ++b) total += partials[b * n + j];
    out[j] = static_cast<param_t>(total);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cpu(
    const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps) {
  const NormProblem problem = check_norm_fwd_inputs(op, x, residual, weight, bias, eps);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto residual_out = residual.has_value() ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  const auto stat_options = x.options().dtype(norm_stat_dtype(x));
  auto mean = rms ? at::Tensor() : at::empty(norm_stat_shape(x), stat_options);
  auto rstd = at::empty(norm_stat_shape(x), stat_options);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      norm_fwd_cpu_kernel<scalar_t, param_t>(
          x.const_data_ptr<scalar_t>(), optional_data<scalar_t>(residual), optional_data<param_t>(weight),
          optional_data<param_t>(bias), y.mutable_data_ptr<scalar_t>(),
          residual.has_value() ? residual_out.mutable_data_ptr<scalar_t>() : nullptr,
          rms ? nullptr : mean.mutable_data_ptr<acc_t>(), rstd.mutable_data_ptr<acc_t>(), problem.rows, problem.n,
          eps);
    });
  });
  return {y, residual_out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd_cpu(
    const char* op, const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor* mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& grad_x_extra, bool return_y) {
  const NormProblem problem = check_norm_bwd_inputs(op, grad_y, x, weight, bias, mean, rstd, grad_x_extra);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  const auto param_options = x.options().dtype(problem.param_dtype);
  auto grad_weight = weight.has_value() ? at::empty({problem.n}, param_options) : absent_like(x);
  auto grad_bias = bias.has_value() ? at::empty({problem.n}, param_options) : absent_like(x);
  const int64_t blocks = std::max<int64_t>(1, std::min(problem.rows, kMaxRowBlocks));
  const auto partial_options = x.options().dtype(norm_stat_dtype(x));
  auto weight_partials = weight.has_value() ? at::zeros({blocks, problem.n}, partial_options) : at::Tensor();
  auto bias_partials = bias.has_value() ? at::zeros({blocks, problem.n}, partial_options) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dispatch_param_type<scalar_t>(problem.param_dtype, [&](auto* tag) {
      using param_t = std::remove_pointer_t<decltype(tag)>;
      acc_t* weight_partial_data = weight.has_value() ? weight_partials.mutable_data_ptr<acc_t>() : nullptr;
      acc_t* bias_partial_data = bias.has_value() ? bias_partials.mutable_data_ptr<acc_t>() : nullptr;
      norm_bwd_cpu_kernel<scalar_t, param_t>(
          grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), optional_data<param_t>(weight),
          mean ? mean->const_data_ptr<acc_t>() : nullptr, rstd.const_data_ptr<acc_t>(),
          optional_data<scalar_t>(grad_x_extra), grad_x.mutable_data_ptr<scalar_t>(),
          return_y ? y.mutable_data_ptr<scalar_t>() : nullptr, optional_data<param_t>(bias), weight_partial_data,
          bias_partial_data, problem.rows, problem.n, blocks);
      if (weight_partial_data) {
        reduce_partials(weight_partial_data, grad_weight.mutable_data_ptr<param_t>(), blocks, problem.n);
      }
      if (bias_partial_data) {
        reduce_partials(bias_partial_data, grad_bias.mutable_data_ptr<param_t>(), blocks, problem.n);
      }
    });
  });
  return {grad_x, grad_weight, grad_bias, y};
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
