// bias_act (y = act(x + bias)) and swiglu (y = silu(gate + b_gate) * (up + b_up)), CPU kernels and
// the argument checks shared with the CUDA launchers. The forward keeps nothing; the backward
// recomputes act and act' from x (activation.h) and can hand back the rebuilt y.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "activation.h"
#include "common.h"

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

// Rows per chunk of the backward: each chunk reduces its rows' bias gradient into its own row of
// partial sums, and the partials are added in chunk order, so the result does not depend on the
// number of threads.
constexpr int64_t kRowsPerChunk = 32;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// grad_bias[c] = sum over chunks of partials[chunk, c], in the partials' precision.
template <typename acc_t, typename bias_t>
void reduce_partials(const acc_t* partials, int64_t chunks, int64_t cols, bias_t* grad_bias) {
  at::parallel_for(0, cols, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      acc_t sum = 0;
      for (int64_t k = 0; k < chunks; ++k) sum += partials[k * cols + c];
      grad_bias[c] = static_cast<bias_t>(sum);
    }
  });
}

template <Activation A, typename scalar_t, typename bias_t>
void bias_act_fwd_kernel(const scalar_t* x, const bias_t* bias, scalar_t* y, int64_t rows, int64_t cols) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        acc_t h = static_cast<acc_t>(x[base + c]);
        if (bias != nullptr) h += static_cast<acc_t>(bias[c]);
        y[base + c] = static_cast<scalar_t>(activation_value<A>(h));
      }
    }
  });
}

template <Activation A, typename scalar_t, typename bias_t>
void bias_act_bwd_kernel(const scalar_t* grad_y, const scalar_t* x, const bias_t* bias,
                         scalar_t* grad_x,
                         scalar_t* y,                                // rebuilt act(x + bias), or null
                         at::opmath_type<scalar_t>* partials,        // [chunks, cols], or null
                         int64_t rows, int64_t cols) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t grain = std::max<int64_t>(1, grain_rows(cols) / kRowsPerChunk);
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      acc_t* partial = partials != nullptr ? partials + k * cols : nullptr;
      if (partial != nullptr) std::fill(partial, partial + cols, acc_t(0));
      const int64_t row_end = std::min(rows, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < row_end; ++r) {
        const int64_t base = r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          acc_t h = static_cast<acc_t>(x[base + c]);
          if (bias != nullptr) h += static_cast<acc_t>(bias[c]);
          const ValueAndGrad<acc_t> act = activation_value_and_grad<A>(h);
          const acc_t grad_h = static_cast<acc_t>(grad_y[base + c]) * act.grad;
          grad_x[base + c] = static_cast<scalar_t>(grad_h);
          if (y != nullptr) y[base + c] = static_cast<scalar_t>(act.value);
          if (partial != nullptr) partial[c] += grad_h;
        }
      }
    }
  });
}

// swiglu over x = [gate | up] rows of width 2 * d; y rows of width d.
template <typename scalar_t, typename bias_t>
void swiglu_fwd_kernel(const scalar_t* x, const bias_t* bias, scalar_t* y, int64_t rows, int64_t d) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* x_row = x + r * 2 * d;
      for (int64_t c = 0; c < d; ++c) {
        acc_t gate = static_cast<acc_t>(x_row[c]);
        acc_t up = static_cast<acc_t>(x_row[d + c]);
        if (bias != nullptr) {
          gate += static_cast<acc_t>(bias[c]);
          up += static_cast<acc_t>(bias[d + c]);
        }
        y[r * d + c] = static_cast<scalar_t>(activation_value<Activation::kSilu>(gate) * up);
      }
    }
  });
}

template <typename scalar_t, typename bias_t>
void swiglu_bwd_kernel(const scalar_t* grad_y, const scalar_t* x, const bias_t* bias, scalar_t* grad_x,
                       scalar_t* y,                          // rebuilt output, or null
                       at::opmath_type<scalar_t>* partials,  // [chunks, 2 * d], or null
                       int64_t rows, int64_t d) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  const int64_t grain = std::max<int64_t>(1, grain_rows(2 * d) / kRowsPerChunk);
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      acc_t* partial = partials != nullptr ? partials + k * 2 * d : nullptr;
      if (partial != nullptr) std::fill(partial, partial + 2 * d, acc_t(0));
      const int64_t row_end = std::min(rows, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < row_end; ++r) {
        const scalar_t* x_row = x + r * 2 * d;
        scalar_t* grad_x_row = grad_x + r * 2 * d;
        for (int64_t c = 0; c < d; ++c) {
          acc_t gate = static_cast<acc_t>(x_row[c]);
          acc_t up = static_cast<acc_t>(x_row[d + c]);
          if (bias != nullptr) {
            gate += static_cast<acc_t>(bias[c]);
            up += static_cast<acc_t>(bias[d + c]);
          }
          const ValueAndGrad<acc_t> act = activation_value_and_grad<Activation::kSilu>(gate);
          const acc_t g = static_cast<acc_t>(grad_y[r * d + c]);
          const acc_t grad_gate = g * up * act.grad;
          const acc_t grad_up = g * act.value;
          grad_x_row[c] = static_cast<scalar_t>(grad_gate);
          grad_x_row[d + c] = static_cast<scalar_t>(grad_up);
          if (y != nullptr) y[r * d + c] = static_cast<scalar_t>(act.value * up);
          if (partial != nullptr) {
            partial[c] += grad_gate;
            partial[d + c] += grad_up;
          }
        }
      }
    }
  });
}

at::Tensor bias_act_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                            const std::string& activation) {
  const Activation act = parse_activation(activation, kBiasAct);
  const RowsCols shape = check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bias_act_fwd_cpu", [&] {
    dispatch_bias_type<scalar_t>(bias, [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      dispatch_activation(act, [&](auto a) {
        bias_act_fwd_kernel<decltype(a)::value, scalar_t, bias_t>(
            x.const_data_ptr<scalar_t>(), bias_data<bias_t>(bias), y.mutable_data_ptr<scalar_t>(), shape.rows,
            shape.cols);
      });
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                                const std::optional<at::Tensor>& bias,
                                                                const std::string& activation, bool return_y) {
  const Activation act = parse_activation(activation, kBiasAct);
  const RowsCols shape = check_act_inputs(x, bias, x.dim() >= 1 ? x.size(-1) : 0, kBiasAct);
  check_act_grad(grad_y, x, x.sizes(), kBiasAct);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty_like(x, at::MemoryFormat::Contiguous) : absent_like(x);
  auto grad_bias = bias.has_value() ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : absent_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bias_act_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t chunks = (shape.rows + kRowsPerChunk - 1) / kRowsPerChunk;
    at::Tensor partials;
    if (bias.has_value()) {
      partials = at::empty({chunks, shape.cols}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    dispatch_bias_type<scalar_t>(bias, [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      dispatch_activation(act, [&](auto a) {
        bias_act_bwd_kernel<decltype(a)::value, scalar_t, bias_t>(
            grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), bias_data<bias_t>(bias),
            grad_x.mutable_data_ptr<scalar_t>(), return_y ? y.mutable_data_ptr<scalar_t>() : nullptr,
            bias.has_value() ? partials.mutable_data_ptr<acc_t>() : nullptr, shape.rows, shape.cols);
      });
      if (bias.has_value()) {
        reduce_partials(partials.const_data_ptr<acc_t>(), chunks, shape.cols, grad_bias.mutable_data_ptr<bias_t>());
      }
    });
  });
  return {grad_x, grad_bias, y};
}

at::Tensor swiglu_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const int64_t d = swiglu_half_width(x);
  const RowsCols shape = check_act_inputs(x, bias, 2 * d, kSwiglu);
  auto y = at::empty(swiglu_out_sizes(x), x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_fwd_cpu", [&] {
    dispatch_bias_type<scalar_t>(bias, [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      swiglu_fwd_kernel<scalar_t, bias_t>(x.const_data_ptr<scalar_t>(), bias_data<bias_t>(bias),
                                          y.mutable_data_ptr<scalar_t>(), shape.rows, d);
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_bwd_cpu(const at::Tensor& grad_y, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& bias,
                                                              bool return_y) {
  const int64_t d = swiglu_half_width(x);
  const RowsCols shape = check_act_inputs(x, bias, 2 * d, kSwiglu);
  const auto out_sizes = swiglu_out_sizes(x);
  check_act_grad(grad_y, x, out_sizes, kSwiglu);
  auto grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto y = return_y ? at::empty(out_sizes, x.options()) : absent_like(x);
  auto grad_bias = bias.has_value() ? at::empty_like(*bias, at::MemoryFormat::Contiguous) : absent_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t chunks = (shape.rows + kRowsPerChunk - 1) / kRowsPerChunk;
    at::Tensor partials;
    if (bias.has_value()) {
      partials = at::empty({chunks, 2 * d}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    }
    dispatch_bias_type<scalar_t>(bias, [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      swiglu_bwd_kernel<scalar_t, bias_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                          bias_data<bias_t>(bias), grad_x.mutable_data_ptr<scalar_t>(),
                                          return_y ? y.mutable_data_ptr<scalar_t>() : nullptr,
                                          bias.has_value() ? partials.mutable_data_ptr<acc_t>() : nullptr,
                                          shape.rows, d);
      if (bias.has_value()) {
        reduce_partials(partials.const_data_ptr<acc_t>(), chunks, 2 * d, grad_bias.mutable_data_ptr<bias_t>());
      }
    });
  });
  return {grad_x, grad_bias, y};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("bias_act_fwd", &bias_act_fwd_cpu);
  m.impl("bias_act_bwd", &bias_act_bwd_cpu);
  m.impl("swiglu_fwd", &swiglu_fwd_cpu);
  m.impl("swiglu_bwd", &swiglu_bwd_cpu);
}

}  // namespace memopt
