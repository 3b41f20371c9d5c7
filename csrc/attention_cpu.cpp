// attention_flash_cpu: memopt.attention without dropout on CPU, through ATen's flash kernels with
// the autograd node in C++.
//
// Without dropout, ATen's CPU flash kernels keep memopt's attention contract as they are (save q,
// k, v, the output and one log-sum-exp per row; the backward recomputes the probabilities block by
// block), so the only thing memopt's Python path (AttentionFunction over attention_fwd /
// attention_bwd) adds on top of F.scaled_dot_product_attention is its cost: two dispatcher round
// trips into Python kernels and a Python autograd node, ~0.2 ms per forward + backward, 10% of a
// (1, 4, 256, 64) call. Here the node is C++, as SDPA's is, and it keeps what SDPA lacks: a
// backward run with create_graph=True (second derivatives) differentiates the attention again
// as plain ATen ops, so second derivatives are exact instead of an error.
//
// Layouts follow memopt.ops.attention's contract: the output is contiguous when q is, else a
// (B, H, S, D) view of a (B, S, H, D) buffer; the gradients are such views. Checks are Python's
// (memopt.ops.attention._check_inputs), run before this op is called.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <limits>

namespace memopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// t (B, H, S, D) as a view of a (B, S, H, D) buffer: itself when it is one, else a copy.
at::Tensor as_bshd(const at::Tensor& t) {
  if (t.transpose(1, 2).is_contiguous()) {
    return t;
  }
  return t.transpose(1, 2).contiguous().transpose(1, 2);
}

at::Tensor in_output_layout(const at::Tensor& out, const at::Tensor& q) {
  if (!q.is_contiguous()) {
    return as_bshd(out);
  }
  return out.is_contiguous() ? out : out.contiguous();
}

at::Tensor flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                         at::Tensor* lse) {
  auto [out, row_lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, std::nullopt, scale);
  if (lse != nullptr) {
    *lse = row_lse;
  }
  return in_output_layout(out, q);
}

// The attention as differentiable ATen ops (the (B, H, Sq, Sk) probabilities materialised, as a
// double backward through attention must keep them); the causal mask is top-left aligned, like
// F.scaled_dot_product_attention's is_causal, so every row sees key 0.
at::Tensor attention_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor keys = group == 1 ? k : k.repeat_interleave(group, 1);
  const at::Tensor values = group == 1 ? v : v.repeat_interleave(group, 1);
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)).mul(scale);
  if (causal) {
    const at::Tensor hidden = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  return at::matmul(at::softmax(scores, -1), values);
}

struct FlashAttentionCpuFunction : public torch::autograd::Function<FlashAttentionCpuFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, double scale) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor lse;
    at::Tensor out = flash_forward(q, k, v, causal, scale, &lse);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const at::Tensor& grad_out = grads[0];
    if (at::GradMode::is_enabled()) {
      // create_graph=True: gradients as functions of q, k, v, differentiable again.
      variable_list inputs;
      for (const at::Tensor* t : {&q, &k, &v}) {
        if (t->requires_grad()) {
          inputs.push_back(*t);
        }
      }
      variable_list found;
      if (!inputs.empty() && grad_out.defined()) {
        found = torch::autograd::grad({attention_math(q, k, v, causal, scale)}, inputs, {grad_out},
                                      /*retain_graph=*/true, /*create_graph=*/true, /*allow_unused=*/true);
      }
      variable_list result(5);
      size_t next = 0;
      for (size_t i = 0; i < 3; ++i) {
        if (saved[i].requires_grad()) {
          result[i] = next < found.size() ? found[next] : at::Tensor();
          ++next;
        }
      }
      return result;
    }
    auto [grad_q, grad_k, grad_v] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, saved[3], saved[4], 0.0, causal, std::nullopt, scale);
    return {as_bshd(grad_q), as_bshd(grad_k), as_bshd(grad_v), at::Tensor(), at::Tensor()};
  }
};

at::Tensor attention_flash_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                               double scale) {
  return flash_forward(q, k, v, causal, scale, nullptr);
}

at::Tensor attention_flash_cpu_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                        double scale) {
  return FlashAttentionCpuFunction::apply(q, k, v, causal, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) { m.impl("attention_flash_cpu", &attention_flash_cpu); }

TORCH_LIBRARY_IMPL(memopt, AutogradCPU, m) { m.impl("attention_flash_cpu", &attention_flash_cpu_autograd); }

}  // namespace memopt
