// bias_act / swiglu: the argument checks and output allocation that the CPU launchers
// (activation.cpp) and the CUDA launchers (activation_cuda.cu) share.
#include <ATen/MemoryOverlap.h>

#include <vector>

#include "activation.h"
#include "common.h"
#include "new_output.h"

namespace memopt {
namespace {

constexpr const char* kBiasAct = "bias_act";
constexpr const char* kSwiglu = "swiglu";

// "relu" -> kRelu, ...; anything else raises an error listing the valid names.
Activation parse_activation(const std::string& name, const char* op) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "silu") return Activation::kSilu;
  MEMOPT_CHECK(false, op, "activation must be one of \"relu\", \"gelu\", \"gelu_tanh\", \"silu\", got \"", name,
               "\"");
  return Activation::kRelu;  // unreachable
}

// x: float dtype for its device, contiguous, at least 1-D; bias: shape [bias_size], dtype x's or
// float32, x's device, contiguous. Returns the number of rows of x viewed as [rows, x.size(-1)].
int64_t check_act_inputs(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t bias_size,
                         const char* op) {
  check_float_dtype(x, op, "x");
  MEMOPT_CHECK(x.dim() >= 1, op, "x must have at least 1 dimension, got a 0-d tensor");
  check_contiguous(x, op, "x");
  if (bias.has_value()) {
    check_vector(*bias, bias_size, x, op, "bias");
    MEMOPT_CHECK(bias->scalar_type() == x.scalar_type() || bias->scalar_type() == at::kFloat, op,
                 "bias must have x's dtype (", x.scalar_type(), ") or float32, got ", bias->scalar_type());
  }
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// grad_y: the forward output's shape (out_sizes), x's dtype and device, contiguous.
void check_act_grad(const at::Tensor& grad_y, const at::Tensor& x, at::IntArrayRef out_sizes, const char* op) {
  MEMOPT_CHECK(grad_y.sizes() == out_sizes, op, "grad_y must have the forward output's shape ", out_sizes,
               ", got ", grad_y.sizes());
  check_same_dtype(grad_y, x, op, "grad_y", "x");
  check_same_device(grad_y, x, op, "grad_y", "x");
  check_contiguous(grad_y, op, "grad_y");
}

// d for swiglu's x of last dimension 2 * d; raises when x.size(-1) is odd.
int64_t swiglu_half_width(const at::Tensor& x) {
  MEMOPT_CHECK(x.dim() >= 1, kSwiglu, "x must have at least 1 dimension, got a 0-d tensor");
  MEMOPT_CHECK(x.size(-1) % 2 == 0, kSwiglu, "x's last dimension must be even ([gate | up], 2 * d wide), got ",
               x.size(-1));
  return x.size(-1) / 2;
}

// x's shape with the last dimension halved.
std::vector<int64_t> swiglu_out_sizes(const at::Tensor& x) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() /= 2;
  return sizes;
}

// grad_x is grad_y itself when grad_x_in_grad_y (bias_act_bwd_inplace), else a new tensor like x.
ActBackward allocate_backward(Activation activation, int64_t rows, const at::Tensor& x,
                              const std::optional<at::Tensor>& bias, at::IntArrayRef out_sizes, bool return_y,
                              bool return_grad_bias, const at::Tensor& grad_y, bool grad_x_in_grad_y) {
  const bool has_grad_bias = bias.has_value() && return_grad_bias;
  return {activation,
          rows,
          x.size(-1),
          has_grad_bias,
          grad_x_in_grad_y ? grad_y : new_output_like(x),
          has_grad_bias ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : absent_like(x),
          return_y ? new_output(out_sizes, x.options()) : absent_like(x)};
}

}  // namespace

ActForward prepare_bias_act_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                const std::string& activation, bool y_in_x) {
  const Activation act = parse_activation(activation, kBiasAct);
  const int64_t rows = check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  if (y_in_x && bias.has_value()) {
    MEMOPT_CHECK(at::get_overlap_status(x, *bias) == at::MemOverlapStatus::No, kBiasAct,
                 "x is overwritten with y, so it must not share memory with bias");
  }
  return {act, rows, x.size(-1), y_in_x ? x : new_output_like(x)};
}

ActBackward prepare_bias_act_bwd(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                 const std::string& activation, bool return_y, bool return_grad_bias,
                                 bool grad_x_in_grad_y) {
  const Activation act = parse_activation(activation, kBiasAct);
  const int64_t rows = check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  check_act_grad(grad_y, x, x.sizes(), kBiasAct);
  if (grad_x_in_grad_y) {
    MEMOPT_CHECK(at::get_overlap_status(grad_y, x) == at::MemOverlapStatus::No, kBiasAct,
                 "grad_y is overwritten with grad_x, so it must not share memory with x");
    // A bias inside grad_y would be read after grad_x was written over it.
    MEMOPT_CHECK(!bias.has_value() || at::get_overlap_status(grad_y, *bias) == at::MemOverlapStatus::No, kBiasAct,
                 "grad_y is overwritten with grad_x, so it must not share memory with bias");
  }
  return allocate_backward(act, rows, x, bias, x.sizes(), return_y, return_grad_bias, grad_y, grad_x_in_grad_y);
}

ActForward prepare_swiglu_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const int64_t d = swiglu_half_width(x);
  const int64_t rows = check_act_inputs(x, bias, 2 * d, kSwiglu);
  return {Activation::kSilu, rows, 2 * d, new_output(swiglu_out_sizes(x), x.options())};
}

ActBackward prepare_swiglu_bwd(const at::Tensor& grad_y, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                               bool return_y, bool return_grad_bias) {
  const int64_t d = swiglu_half_width(x);
  const int64_t rows = check_act_inputs(x, bias, 2 * d, kSwiglu);
  const auto out_sizes = swiglu_out_sizes(x);
  check_act_grad(grad_y, x, out_sizes, kSwiglu);
  return allocate_backward(Activation::kSilu, rows, x, bias, out_sizes, return_y, return_grad_bias, grad_y, false);
}

}  // namespace memopt
