// Which GEMM memopt's own linears run on for float32 CPU tensors (cpu_linear.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace memopt {

// "onednn" or "aten": what cpu_linear and cpu_mm run on for float32 CPU tensors in this process
// (oneDNN: for products of at least cpu_linear_min_multiply_adds() multiply-adds).
const char* cpu_linear_backend();

// Under the "auto" rule oneDNN takes only products of m * k * n >= this many multiply-adds (2^24,
// 33.6 MFLOP): below, its fixed cost per call (~15-20 us here) outweighs its faster inner loop, and
// MKL's sgemm runs. 0 where MEMOPT_CPU_LINEAR=onednn forces it for every product.
int64_t cpu_linear_min_multiply_adds();

// Overrides the rule for this process ("auto", "onednn" or "aten"); the bench's A/B runs and the
// tests use it. Raises on any other name.
void set_cpu_linear_backend(const std::string& name);

// x @ weight^T + bias, x of any leading dims: at::linear, or oneDNN's inner product
// (mkldnn::_linear_pointwise) for float32 CPU tensors where cpu_linear_backend() is "onednn".
// Below autograd: callers are autograd nodes.
at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// a @ b for 2-D a (m, k) and b (k, n), a new tensor: cpu_linear(a, b^T) (oneDNN reads b^T's
// strides, no copy) or at::mm.
at::Tensor cpu_mm(const at::Tensor& a, const at::Tensor& b);

// a @ b in the memory of scratch, a contiguous buffer of a @ b's numel and dtype that the caller
// owns alone and needs no more: at::mm_out over it, or, where oneDNN runs and scratch is smaller
// than what glibc maps afresh (32 MiB), scratch freed first and cpu_mm's new tensor returned (the
// heap hands that memory straight back). Either way one such buffer at a time.
at::Tensor cpu_mm_over(at::Tensor&& scratch, const at::Tensor& a, const at::Tensor& b);

}  // namespace memopt
