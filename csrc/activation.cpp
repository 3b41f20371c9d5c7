// bias_act (y = act(x + bias)) and swiglu (y = silu(gate + b_gate) * (up + b_up)), CPU launchers
// (the kernels are in cpu_kernels_impl.h) and the argument checks shared with the CUDA launchers.
// The forward keeps nothing; the backward recomputes act and act' from x and can hand back the
// rebuilt y.
#include <torch/library.h>

#include "activation.h"
#include "common.h"
#include "cpu_kernels.h"

namespace memopt {

Activation parse_activation(const std::string& name, const char* op) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "silu") return Activation::kSilu;
  MEMOPT_CHECK(false, op, "activation must be one of \"relu\", \"gelu\", \"gelu_tanh\", \"silu\", got \"", name,
               "\"");
  return Activation::kRelu;  // unreachable
}

RowsCols check_act_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t bias_size,
                          const char* op) {
  check_float_dtype(x, op, "x");
  MEMOPT_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension, got a 0-d tensor");
  check_contiguous(x, op, "x");
  if (bias.has_value()) {
    check_vector(*bias, bias_size, x, op, "bias");
    MEMOPT_CHECK(bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat, op,
                 "bias must have x's dtype (", x.scalar_type(), ") or float32, got ", bias->scalar_type());
  }
  const int64_t cols = x.size(-1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return {rows, cols};
}

void check_act_grad(const at::Tensor& grad_y, const at::Tensor& x, at::IntArrayRef out_sizes, const char* op) {
  MEMOPT_CHECK(grad_y.sizes() == out_sizes, op, "grad_y must have the forward output's shape ", out_sizes,
               ", got ", grad_y.sizes());
  check_same_dtype(grad_y, x, op, "grad_y", "x");
  check_same_device(grad_y, x, op, "grad_y", "x");
  check_contiguous(grad_y, op, "grad_y");
}

int64_t swiglu_half_width(const at::Tensor& x) {
  MEMOPT_CHECK(x.dim() >= 1, "swiglu", "x must have at least 1 dimension, got a 0-d tensor");
  MEMOPT_CHECK(x.size(-1) % 2 == 0, "swiglu",
               "x's last dimension must be even ([gate | up], 2 * d wide), got ", x.size(-1));
  return x.size(-1) / 2;
}

std::vector<int64_t> swiglu_out_sizes(const at::Tensor& x) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() /= 2;
  return sizes;
}

namespace {

constexpr const char* kBiasAct = "bias_act";
constexpr const char* kSwiglu = "swiglu";

// The CPU kernels take parameters of x's dtype: a float32 bias of float64 x is widened here
// (exactly) and its gradient narrowed back afterwards.
at::Tensor in_x_dtype(const std::optional<at::Tensor>& param, const at::Tensor& x) {
  return param.has_value() ? param->to(x.scalar_type()) : at::Tensor();
}

at::Tensor bias_act_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                            const std::string& activation) {
  const Activation act = parse_activation(activation, kBiasAct);
  check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  MEMOPT_CPU_KERNEL(bias_act_fwd_kernel)(act, x, in_x_dtype(bias, x), y);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                const std::optional<at::Tensor>& bias,
                                                                const std::string& activation, bool return_y) {
  const Activation act = parse_activation(activation, kBiasAct);
  check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  check_act_grad(grad_y, x, x.sizes(), kBiasAct);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  auto grad_bias = bias.has_value() ? at::empty({x.size(-1)}, x.options()) : at::Tensor();
  MEMOPT_CPU_KERNEL(bias_act_bwd_kernel)(act, grad_y, x, in_x_dtype(bias, x), grad_x, return_y ? y : at::Tensor(),
                                         grad_bias);
  return {grad_x, bias.has_value() ? grad_bias.to(bias->scalar_type()) : absent_like(x), y};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const int64_t d = swiglu_half_width(x);
  check_act_inputs(x, bias, 2 * d, kSwiglu);
  auto y = at::empty(swiglu_out_sizes(x), x.options());
  MEMOPT_CPU_KERNEL(swiglu_fwd_kernel)(x, in_x_dtype(bias, x), y);
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& bias,
                                                              bool return_y) {
  const int64_t d = swiglu_half_width(x);
  check_act_inputs(x, bias, 2 * d, kSwiglu);
  const auto out_sizes = swiglu_out_sizes(x);
  check_act_grad(grad_y, x, out_sizes, kSwiglu);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty(out_sizes, x.options()) : absent_like(x);
  auto grad_bias = bias.has_value() ? at::empty({2 * d}, x.options()) : at::Tensor();
  MEMOPT_CPU_KERNEL(swiglu_bwd_kernel)(grad_y, x, in_x_dtype(bias, x), grad_x, return_y ? y : at::Tensor(), grad_bias);
  return {grad_x, bias.has_value() ? grad_bias.to(bias->scalar_type()) : absent_like(x), y};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("bias_act_fwd", &bias_act_fwd_cpu);
  m.impl("bias_act_bwd", &bias_act_bwd_cpu);
  m.impl("swiglu_fwd", &swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &swiglu_bwd_cpu);
}

}  // namespace memopt
