// What the C++ autograd nodes of the differentiable ops share (norm_autograd.cpp,
// activation_autograd.cpp): optional-tensor plumbing, the copy of strided input, and the rule
// for when a backward runs as differentiable ATen ops instead of the kernels.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <optional>

namespace memopt {

using OptionalTensor = std::optional<at::Tensor>;

inline OptionalTensor optional(const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// The differentiable ops take input of any strides, as their ATen counterparts do; the kernels
// read rows and parameter vectors, so a non-contiguous one is copied first. At the Autograd key
// that copy is a recorded op (its gradient flows back to the strided input, and create_graph
// sees it); a contiguous tensor is passed through with no copy.
inline OptionalTensor contiguous(const OptionalTensor& t) {
  return t.has_value() ? OptionalTensor(t->contiguous()) : std::nullopt;
}

// Whether a backward takes its differentiable path (ATen ops of the saved tensors) rather than
// the kernels: under create_graph=True, and for a gradient that torch.autograd.grad batched
// (is_grads_batched=True, jacobian(vectorize=True): legacy vmap), for which the kernels have no
// batching rule and vmap's fallback cannot run their out= products.
inline bool differentiable_backward(const at::Tensor& grad_a, const at::Tensor& grad_b = at::Tensor()) {
  const auto batched = [](const at::Tensor& grad) {
    return grad.defined() && grad.key_set().has(c10::DispatchKey::Batched);
  };
  return at::GradMode::is_enabled() || batched(grad_a) || batched(grad_b);
}

// A gradient the backward op returned: undefined where it was not asked for (the op returns an
// empty tensor there, which autograd would take for a gradient of the wrong shape).
inline at::Tensor if_asked(const at::Tensor& grad, bool asked) { return asked ? grad : at::Tensor(); }

// The dtype the kernels compute in: float64 for float64 input, float32 otherwise.
inline at::ScalarType compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace memopt
