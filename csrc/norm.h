// layer_norm / rms_norm: argument checks and dtype helpers shared by the CPU and CUDA launchers,
// so both reject the same inputs with the same words.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <vector>

namespace memopt {

// What a norm call works on: x viewed as [rows, n], and the dtype of weight/bias (x's dtype, or
// float32 for mixed precision with float32 master parameters).
struct NormProblem {
  int64_t rows;
  int64_t n;
  at::ScalarType param_dtype;
};

// Per-row statistics (mean, rstd) are float32, or float64 for float64 x.
at::ScalarType norm_stat_dtype(const at::Tensor& x);
// x.shape[:-1]: one statistic per row.
std::vector<int64_t> norm_stat_shape(const at::Tensor& x);

// op is "layer_norm" or "rms_norm" (rms_norm passes no bias).
NormProblem check_norm_fwd_inputs(const char* op, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  double eps);

// mean is null for rms_norm.
NormProblem check_norm_bwd_inputs(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  const at::Tensor* mean, const at::Tensor& rstd,
                                  const std::optional<at::Tensor>& grad_x_extra);

// Calls f(static_cast<param_t*>(nullptr)) with param_t = scalar_t when the parameters have x's
// dtype and param_t = float otherwise (the only other dtype the checks let through).
template <typename scalar_t, typename F>
void dispatch_param_type(at::ScalarType param_dtype, const F& f) {
  if (param_dtype == c10::CppTypeToScalarType<scalar_t>::value) {
    f(static_cast<scalar_t*>(nullptr));
  } else {
    f(static_cast<float*>(nullptr));
  }
}

template <typename T>
const T* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

}  // namespace memopt
