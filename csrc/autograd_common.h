// What the C++ autograd nodes of the differentiable ops share (norm_autograd.cpp,
// activation_autograd.cpp): optional-tensor plumbing, the copy of strided input, the rule for
// when a backward runs as differentiable ATen ops instead of the kernels, and the linear that
// norm_linear and act_linear end in (its checks, and how it runs under torch.autocast).
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <optional>

#include "common.h"
#include "cpu_linear.h"

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

// What F.linear after the norm or activation accepts, in memopt/ops/_common.py's check_linear's
// words: weight (m, in_features) and bias (m,) on x's device; outside torch.autocast in x's dtype,
// under it in a dtype autocast casts (float32, float16, bfloat16), x too. Sizes as SymInts: under
// torch.compile the nodes run on tensors of symbolic shape.
inline void check_linear_params(const char* op, const at::Tensor& x, const c10::SymInt& in_features,
                                const at::Tensor& weight, const OptionalTensor& bias) {
  MEMOPT_CHECK(weight.dim() == 2 && weight.sym_size(1) == in_features, op,
               "linear_weight must have shape [out_features, ", in_features, "], got ", weight.sym_sizes());
  if (bias.has_value()) {
    MEMOPT_CHECK(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), op, "linear_bias must have shape [",
                 weight.sym_size(0), "], got ", bias->sym_sizes());
  }
  const bool autocast = at::autocast::is_autocast_available(x.device().type()) &&
                        at::autocast::is_autocast_enabled(x.device().type());
  const auto castable = [](at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; };
  const auto check_param = [&](const at::Tensor& p, const char* name) {
    check_same_device(p, x, op, name, "x");
    if (autocast) {
      MEMOPT_CHECK(castable(p.scalar_type()) && castable(x.scalar_type()), op, "under torch.autocast x and ", name,
                   " must be float32, float16 or bfloat16 (autocast casts those), got x ", x.scalar_type(), " and ",
                   name, " ", p.scalar_type());
    } else {
      MEMOPT_CHECK(p.scalar_type() == x.scalar_type(), op, name, " must have x's dtype (", x.scalar_type(),
                   ") outside torch.autocast, got ", p.scalar_type());
    }
  };
  check_param(weight, "linear_weight");
  if (bias.has_value()) check_param(*bias, "linear_bias");
}

// F.linear as under torch.autocast when it is on (inputs cast to the autocast dtype, as autocast
// casts them for linear), but without autocast's cast cache: a weight cast made below autograd and
// cached would hand every later F.linear in the same autocast region a copy with no autograd
// history, so the weight would get no gradient there.
inline at::Tensor linear_as_autocast(const at::Tensor& y, const at::Tensor& weight, const OptionalTensor& bias) {
  const c10::DeviceType device = y.device().type();
  if (!at::autocast::is_autocast_available(device) || !at::autocast::is_autocast_enabled(device)) {
    return cpu_linear(y, weight, bias);
  }
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return at::linear(y.to(dtype), weight.to(dtype), bias.has_value() ? OptionalTensor(bias->to(dtype)) : std::nullopt);
}

}  // namespace memopt
