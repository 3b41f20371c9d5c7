// bias + activation (relu, gelu, gelu_tanh, silu) and SwiGLU: the math of the CUDA kernels (the
// CPU kernels, cpu_kernels_impl.h, write the same formulas on vectors), and the argument checks and
// output allocation shared by the CPU and CUDA launchers (activation_common.cpp), so both devices
// reject the same inputs with the same words.
//
// The formulas follow PyTorch's own kernels (aten/src/ATen/native/cpu/Activation.cpp):
//   relu      y = max(x, 0)                          y' = x <= 0 ? 0 : 1 (0 at x == 0, as PyTorch)
//   gelu      y = x Phi(x)                           y' = Phi(x) + x phi(x)
//   gelu_tanh y = x/2 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
//             y' = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
//   silu      y = x s(x), s = sigmoid                y' = s (1 + x (1 - s))
// T is the compute type: at::opmath_type<scalar_t> (float, or double for float64 input).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "philox.h"  // MEMOPT_HOST_DEVICE

namespace memopt {

enum class Activation : int { kRelu = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3 };

// Float and double overloads of the libm functions, callable from host and device code alike.
MEMOPT_HOST_DEVICE float act_exp(float v) { return ::expf(v); }
MEMOPT_HOST_DEVICE double act_exp(double v) { return ::exp(v); }
MEMOPT_HOST_DEVICE float act_erf(float v) { return ::erff(v); }
MEMOPT_HOST_DEVICE double act_erf(double v) { return ::erf(v); }
MEMOPT_HOST_DEVICE float act_tanh(float v) { return ::tanhf(v); }
MEMOPT_HOST_DEVICE double act_tanh(double v) { return ::tanh(v); }

// a * b + c. On the device one fused multiply-add, always: written out as a * b + c, nvcc may or
// may not contract it depending on the code around it, and gelu's gradient came out of the packed
// and the element-wise CUDA kernels one bit apart on an H200 (bench/results/h200-20261204). On the
// host the compiler's contraction rule stands (the CPU kernels have one code shape per op).
template <typename T>
MEMOPT_HOST_DEVICE T mul_add(T a, T b, T c) {
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == sizeof(float)) {
    return __fmaf_rn(a, b, c);
  } else {
    return __fma_rn(a, b, c);
  }
#else
  return a * b + c;
#endif
}

template <typename T>
struct ValueAndGrad {
  T value;  // act(x)
  T grad;   // act'(x)
};

// The pieces that the value and the derivative share. The forward and the backward build act(x)
// from the same pieces with the same expression, so the backward's rebuilt activation (return_y)
// is bitwise the forward's output.
template <typename T>
MEMOPT_HOST_DEVICE T gelu_cdf(T x) {  // Phi(x)
  return T(0.5) * (T(1) + act_erf(x * T(0.70710678118654752440)));
}

template <typename T>
MEMOPT_HOST_DEVICE T gelu_tanh_inner(T x) {  // tanh(sqrt(2/pi) (x + 0.044715 x^3))
  return act_tanh(T(0.79788456080286535588) * (x + T(0.044715) * (x * x) * x));
}

template <typename T>
MEMOPT_HOST_DEVICE T sigmoid(T x) {
  return T(1) / (T(1) + act_exp(-x));
}

// act(x) alone, for the forward.
template <Activation A, typename T>
MEMOPT_HOST_DEVICE T activation_value(T x) {
  if constexpr (A == Activation::kRelu) {
    return x < T(0) ? T(0) : x;  // NaN passes through, as in torch.relu
  } else if constexpr (A == Activation::kGelu) {
    return x * gelu_cdf(x);
  } else if constexpr (A == Activation::kGeluTanh) {
    return (T(0.5) * x) * (T(1) + gelu_tanh_inner(x));
  } else {
    return x * sigmoid(x);
  }
}

// act(x) and act'(x) together: the backward needs the derivative, and the value when it hands the
// rebuilt activation back (return_y), for the price of one evaluation.
template <Activation A, typename T>
MEMOPT_HOST_DEVICE ValueAndGrad<T> activation_value_and_grad(T x) {
  if constexpr (A == Activation::kRelu) {
    // threshold_backward's rule: zero where x <= 0 (so at 0), the gradient elsewhere (NaN too).
    return {x < T(0) ? T(0) : x, x <= T(0) ? T(0) : T(1)};
  } else if constexpr (A == Activation::kGelu) {
    const T cdf = gelu_cdf(x);
    const T pdf = act_exp(T(-0.5) * x * x) * T(0.39894228040143267794);  // 1 / sqrt(2 pi)
    return {x * cdf, mul_add(x, pdf, cdf)};
  } else if constexpr (A == Activation::kGeluTanh) {
    constexpr T kBeta = T(0.79788456080286535588);  // sqrt(2 / pi)
    constexpr T kKappa = T(0.044715);
    const T tanh_inner = gelu_tanh_inner(x);
    const T half_x = T(0.5) * x;
    const T one_plus_tanh = T(1) + tanh_inner;
    const T grad = T(0.5) * one_plus_tanh +
                   half_x * (T(1) - tanh_inner * tanh_inner) * kBeta * (T(1) + T(3) * kKappa * x * x);
    return {half_x * one_plus_tanh, grad};
  } else {
    const T s = sigmoid(x);
    return {x * s, s * (T(1) + x * (T(1) - s))};
  }
}

// Calls fn(std::integral_constant<Activation, A>{}) for the runtime activation, so the kernels are
// compiled once per activation with the branch resolved at compile time.
template <typename Fn>
void dispatch_activation(Activation activation, Fn&& fn) {
  switch (activation) {
    case Activation::kRelu:
      fn(std::integral_constant<Activation, Activation::kRelu>{});
      break;
    case Activation::kGelu:
      fn(std::integral_constant<Activation, Activation::kGelu>{});
      break;
    case Activation::kGeluTanh:
      fn(std::integral_constant<Activation, Activation::kGeluTanh>{});
      break;
    case Activation::kSilu:
      fn(std::integral_constant<Activation, Activation::kSilu>{});
      break;
  }
}

// The launchers' shared front half: parse the activation name, check the arguments (raising the
// same errors on every device) and allocate the outputs. x: [..., cols]; bias: [cols] of x's
// dtype or float32, or absent; for swiglu cols = 2 * d, y: [..., d].
struct ActForward {
  Activation activation;
  int64_t rows;
  int64_t cols;  // x.size(-1)
  at::Tensor y;  // contiguous, x's dtype
};

struct ActBackward {
  Activation activation;
  int64_t rows;
  int64_t cols;
  bool has_grad_bias;    // a bias was given and its gradient asked for (return_grad_bias)
  at::Tensor grad_x;     // like x
  at::Tensor grad_bias;  // like bias (its dtype), or empty when there is no bias or it was not asked for
  at::Tensor y;          // the rebuilt output with return_y, else empty
};

// y_in_x (bias_act_fwd_inplace): y is x itself, written over it; bias must not share x's memory.
ActForward prepare_bias_act_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::string& activation, bool y_in_x = false);
// grad_x_in_grad_y (bias_act_bwd_inplace): grad_x is grad_y itself, nothing of x's size is
// allocated but y with return_y.
ActBackward prepare_bias_act_bwd(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                 const std::string& activation, bool return_y, bool return_grad_bias,
                                 bool grad_x_in_grad_y = false);
ActForward prepare_swiglu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias);
ActBackward prepare_swiglu_bwd(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                               bool return_y, bool return_grad_bias);

}  // namespace memopt
