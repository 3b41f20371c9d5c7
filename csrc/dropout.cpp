// dropout_add: out = residual + dropout(x, p), CPU kernels. The mask is regenerated from
// (seed, offset) in the backward (philox.h), so nothing but the 16-byte key is kept.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"
#include "dropout.h"
#include "philox.h"

namespace memopt {

void check_dropout_add_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p) {
  constexpr const char* op = "dropout_add";
  check_float_dtype(x, op, "x");
  check_contiguous(x, op, "x");
  check_dropout_p(p, op);
  if (residual.has_value()) {
    check_same_shape(*residual, x, op, "residual", "x");
    check_same_dtype(*residual, x, op, "residual", "x");
    check_same_device(*residual, x, op, "residual", "x");
    check_contiguous(*residual, op, "residual");
  }
}

namespace {

// Each step handles the 4 elements that share one Philox call.
template <typename scalar_t>
void dropout_add_cpu_kernel(const scalar_t* x, const scalar_t* residual, scalar_t* out, int64_t numel,
                            double p, uint64_t seed, uint64_t offset) {
  using acc_t = at::opmath_type<scalar_t>;
  const uint32_t threshold = dropout_threshold(p);
  const acc_t scale = static_cast<acc_t>(1.0 / (1.0 - p));
  const int64_t groups = (numel + 3) / 4;
  at::parallel_for(0, groups, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const PhiloxBlock words = philox4x32_10(offset + static_cast<uint64_t>(g), seed);
      for (int j = 0; j < 4; ++j) {
        const int64_t i = 4 * g + j;
        if (i >= numel) break;
        acc_t value = words.v[j] >= threshold ? static_cast<acc_t>(x[i]) * scale : acc_t(0);
        if (residual != nullptr) value += static_cast<acc_t>(residual[i]);
        out[i] = static_cast<scalar_t>(value);
      }
    }
  });
}

at::Tensor dropout_add_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual, double p,
                               const at::Tensor& rng_key) {
  check_dropout_add_inputs(x, residual, p);
  const auto [seed, offset] = read_rng_key(rng_key, "dropout_add");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dropout_add_fwd_cpu", [&] {
    dropout_add_cpu_kernel<scalar_t>(x.const_data_ptr<scalar_t>(),
                                     residual.has_value() ? residual->const_data_ptr<scalar_t>() : nullptr,
                                     out.mutable_data_ptr<scalar_t>(), x.numel(), p, seed, offset);
  });
  return out;
}

// The gradient of x is dropout of grad_out under the same mask; residual's is grad_out itself.
at::Tensor dropout_add_bwd_cpu(const at::Tensor& grad_out, double p, const at::Tensor& rng_key) {
  check_dropout_add_inputs(grad_out, std::nullopt, p);
  const auto [seed, offset] = read_rng_key(rng_key, "dropout_add");
  auto grad_x = at::empty_like(grad_out, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "dropout_add_bwd_cpu", [&] {
    dropout_add_cpu_kernel<scalar_t>(grad_out.const_data_ptr<scalar_t>(), nullptr,
                                     grad_x.mutable_data_ptr<scalar_t>(), grad_out.numel(), p, seed, offset);
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("dropout_add_fwd", &dropout_add_fwd_cpu);
  m.impl("dropout_add_bwd", &dropout_add_bwd_cpu);
}

}  // namespace memopt
