// layer_norm / rms_norm: what the CPU and CUDA launchers share (norm_common.cpp), so both reject
// the same inputs with the same words and return outputs of the same dtypes and shapes: the
// argument checks, the output allocation and the four schema entry points over a backend's
// norm_fwd / norm_bwd.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace memopt {

// A forward call, checked: x viewed as [rows, n], the dtype of weight/bias (x's, or float32 for
// mixed precision with float32 master parameters), and the allocated outputs.
struct NormForward {
  int64_t rows;
  int64_t n;
  at::ScalarType param_dtype;
  at::Tensor y;             // like x, contiguous
  at::Tensor residual_out;  // x + residual, like x; empty without a residual
  at::Tensor mean;          // x.shape[:-1], float32 (float64 for float64 x); undefined for RMSNorm
  at::Tensor rstd;          // as mean
};

// What a backward call returns besides grad_x: the schema's return_y, return_grad_weight and
// return_grad_bias (false for a frozen parameter; ignored for an absent one, which has none).
struct NormBwdOutputs {
  bool y = false;
  bool grad_weight = true;
  bool grad_bias = true;
};

// A backward call, checked, with its outputs: grad_weight/grad_bias in param_dtype ([n], or empty
// when the parameter is absent or its gradient was not asked for; has_grad_weight / has_grad_bias
// say which), y (the rebuilt output) empty unless asked for.
struct NormBackward {
  int64_t rows;
  int64_t n;
  at::ScalarType param_dtype;
  bool has_grad_weight;
  bool has_grad_bias;
  at::Tensor grad_x;
  at::Tensor grad_weight;
  at::Tensor grad_bias;
  at::Tensor y;
};

// op is "layer_norm" or "rms_norm"; rms_norm has no bias and no mean.
NormForward prepare_norm_fwd(const char* op, bool rms, const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double eps);

NormBackward prepare_norm_bwd(const char* op, const at::Tensor& grad_y, const at::Tensor& x,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor* mean, const at::Tensor& rstd,
                              const std::optional<at::Tensor>& grad_x_extra, NormBwdOutputs outputs,
                              bool grad_x_in_grad_y = false);

using NormFwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // y, residual_out, mean, rstd
using NormBwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // grad_x, grad_w, grad_b, y

// The schema's four ops over one backend's launchers
//   NormFwdResult norm_fwd(op, rms, x, residual, weight, bias, eps)
//   NormBwdResult norm_bwd(op, grad_y, x, weight, bias, mean (null for RMSNorm), rstd, grad_x_extra,
//                          NormBwdOutputs, grad_x_in_grad_y)
// grad_x_in_grad_y (the *_bwd_inplace ops): grad_x is written over grad_y. Safe in every kernel:
// a row's grad_y is read (pass 1, or cached in registers) before its grad_x is written, and each
// element of grad_x is written by the thread that reads that element of grad_y.
template <auto norm_fwd, auto norm_bwd>
struct NormOps {
  static NormFwdResult layer_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                      double eps) {
    return norm_fwd("layer_norm", /*rms=*/false, x, residual, weight, bias, eps);
  }

  static NormBwdResult layer_norm_bwd(const at::Tensor& grad_y, const at::Tensor& x,
                                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                      const at::Tensor& mean, const at::Tensor& rstd,
                                      const std::optional<at::Tensor>& grad_x_extra, bool return_y,
                                      bool return_grad_weight, bool return_grad_bias) {
    return norm_bwd("layer_norm", grad_y, x, weight, bias, &mean, rstd, grad_x_extra,
                    NormBwdOutputs{return_y, return_grad_weight, return_grad_bias}, false);
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_inplace(
      const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
      const std::optional<at::Tensor>& grad_x_extra, bool return_y, bool return_grad_weight,
      bool return_grad_bias) {
    auto [grad_x, grad_weight, grad_bias, y] =
        norm_bwd("layer_norm", grad_y, x, weight, bias, &mean, rstd, grad_x_extra,
                 NormBwdOutputs{return_y, return_grad_weight, return_grad_bias}, true);
    return {grad_weight, grad_bias, y};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x,
                                                                     const std::optional<at::Tensor>& residual,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     double eps) {
    auto [y, residual_out, mean, rstd] = norm_fwd("rms_norm", /*rms=*/true, x, residual, weight, std::nullopt, eps);
    return {y, residual_out, rstd};
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& grad_y, const at::Tensor& x,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     const at::Tensor& rstd,
                                                                     const std::optional<at::Tensor>& grad_x_extra,
                                                                     bool return_y, bool return_grad_weight) {
    auto [grad_x, grad_weight, grad_bias, y] = norm_bwd("rms_norm", grad_y, x, weight, std::nullopt, nullptr, rstd,
                                                        grad_x_extra, NormBwdOutputs{return_y, return_grad_weight, false},
                                                        false);
    return {grad_x, grad_weight, y};
  }

  static std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_inplace(const at::Tensor& grad_y, const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& weight,
                                                                 const at::Tensor& rstd,
                                                                 const std::optional<at::Tensor>& grad_x_extra,
                                                                 bool return_y, bool return_grad_weight) {
    auto [grad_x, grad_weight, grad_bias, y] = norm_bwd("rms_norm", grad_y, x, weight, std::nullopt, nullptr, rstd,
                                                        grad_x_extra, NormBwdOutputs{return_y, return_grad_weight, false},
                                                        true);
    return {grad_weight, y};
  }
};

}  // namespace memopt
