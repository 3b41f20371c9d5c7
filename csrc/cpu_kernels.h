// The CPU kernels of the activation, norm and dropout ops, compiled once for any CPU (namespace generic,
// cpu_kernels_generic.cpp) and, on x86-64 with GCC, for AVX2 + FMA (namespace avx2,
// cpu_kernels_avx2.cpp) and AVX-512 (namespace avx512, cpu_kernels_avx512.cpp). The launchers
// (activation.cpp, norm.cpp) check the arguments, allocate the outputs and call
// MEMOPT_CPU_KERNEL(name)(...), which runs the build that matches the instruction set ATen picks
// for its own kernels (so ATEN_CPU_CAPABILITY=default or =avx2 caps it, as it caps ATen).
//
// Every tensor is contiguous and has x's dtype, float32 or float64, which is also the compute
// type (at::opmath_type of both is itself). An undefined tensor stands for an absent input or an
// output that was not asked for. The launchers convert float32 parameters of float64 x to float64
// before the call (cpu_param) and the parameter gradients back after it (CpuParamGrad).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "activation.h"
// Before any target pragma of the including file: its inline functions stay baseline code.
#include "philox.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define MEMOPT_CPU_HAVE_X86_BUILDS 1
#else
#define MEMOPT_CPU_HAVE_X86_BUILDS 0
#endif

namespace memopt {

// Dropout on the attention probabilities (p == 0: none). Element (b, h, i, j) of the (B, H, Sq, Sk)
// probabilities is element b H Sq Sk + h Sq Sk + i Sk + j of philox.h's mask under (seed, offset),
// the index memopt.ops.attention's native and Triton paths draw, so every backend drops the same
// elements; kept probabilities are scaled by 1 / (1 - p) after the softmax's normalisation.
struct AttentionDropout {
  double p = 0.0;
  uint64_t seed = 0;
  uint64_t offset = 0;
};

#define MEMOPT_DECLARE_CPU_KERNELS(ISA)                                                                          \
  namespace ISA {                                                                                                \
  void bias_act_fwd_kernel(Activation activation, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& y);   \
  /* grad_bias is undefined when bias is */                                                                      \
  void bias_act_bwd_kernel(Activation activation, const at::Tensor& grad_y, const at::Tensor& x,                 \
                           const at::Tensor& bias, const at::Tensor& grad_x, const at::Tensor& y, const at::Tensor& grad_bias);    \
  void swiglu_fwd_kernel(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& y);                            \
  void swiglu_bwd_kernel(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& bias,                  \
                         const at::Tensor& grad_x, const at::Tensor& y, const at::Tensor& grad_bias);                              \
  /* mean is undefined for RMSNorm; residual_out is written when residual is given */                            \
  void norm_fwd_kernel(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,                \
                       const at::Tensor& bias, const at::Tensor& y, const at::Tensor& residual_out, const at::Tensor& mean,        \
                       const at::Tensor& rstd, double eps);                                                            \
  /* bias is only read to rebuild y; grad_weight/grad_bias are written when weight/bias are given */             \
  void norm_bwd_kernel(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,                  \
                       const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd,                   \
                       const at::Tensor& grad_x_extra, const at::Tensor& grad_x, const at::Tensor& y,                        \
                       const at::Tensor& grad_weight, const at::Tensor& grad_bias);                                          \
  /* out = x * mask / (1 - p) (+ residual), mask from (seed, offset) as philox.h defines it */                    \
  void dropout_add_kernel(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& out, double p,      \
                          uint64_t seed, uint64_t offset);                                                       \
  /* attention_cpu_kernels_impl.h: q (B, H, Sq, D), k and v (B, Hkv, Sk, D), out and the gradients of the */     \
  /* same shapes, any strides with a contiguous last dimension; lse (B, H, Sq) contiguous; grad_k and */         \
  /* grad_v zero on entry (the backward adds into them) */                                                      \
  void attention_fwd_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,           \
                            double scale, const AttentionDropout& dropout, const at::Tensor& out,                \
                            const at::Tensor& lse);                                                               \
  void attention_bwd_kernel(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,                 \
                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,        \
                            double scale, const AttentionDropout& dropout, const at::Tensor& grad_q,              \
                            const at::Tensor& grad_k, const at::Tensor& grad_v);                                  \
  }

MEMOPT_DECLARE_CPU_KERNELS(generic)
#if MEMOPT_CPU_HAVE_X86_BUILDS
MEMOPT_DECLARE_CPU_KERNELS(avx2)
MEMOPT_DECLARE_CPU_KERNELS(avx512)
#endif
#undef MEMOPT_DECLARE_CPU_KERNELS

enum class CpuKernelBuild { kGeneric, kAvx2, kAvx512 };

// The build of the kernels that runs on this machine (decided once).
CpuKernelBuild cpu_kernel_build();

#if MEMOPT_CPU_HAVE_X86_BUILDS
#define MEMOPT_CPU_KERNEL(name)                                                                   \
  (::memopt::cpu_kernel_build() == ::memopt::CpuKernelBuild::kAvx512 ? &::memopt::avx512::name \
   : ::memopt::cpu_kernel_build() == ::memopt::CpuKernelBuild::kAvx2 ? &::memopt::avx2::name   \
                                                                       : &::memopt::generic::name)
#else
#define MEMOPT_CPU_KERNEL(name) (&::memopt::generic::name)
#endif

// A parameter as the kernels take it: x's dtype (a float32 parameter of float64 x is widened,
// exactly), undefined when absent.
inline at::Tensor cpu_param(const std::optional<at::Tensor>& param, const at::Tensor& x) {
  return param.has_value() ? param->to(x.scalar_type()) : at::Tensor();
}

// A parameter gradient as the kernels write it: into the output itself when the parameter has x's
// dtype, else into an x-dtype buffer that finish() rounds into the output.
class CpuParamGrad {
 public:
  CpuParamGrad(const at::Tensor& output, const std::optional<at::Tensor>& param, const at::Tensor& x)
      : output_(param.has_value() ? output : at::Tensor()),
        buffer_(!param.has_value()                       ? at::Tensor()
                : param->scalar_type() == x.scalar_type() ? output
                                                          : at::empty(output.sizes(), x.options())) {}
  const at::Tensor& kernel_output() const { return buffer_; }
  void finish() const {
    if (output_.defined() && !buffer_.is_same(output_)) output_.copy_(buffer_);
  }

 private:
  at::Tensor output_;
  at::Tensor buffer_;
};

}  // namespace memopt
