// memopt.attention on CPU: memopt's flash kernels (the "cpu_flash" backend,
// attention_cpu_kernels_impl.h: faster than ATen's CPU flash kernels at every shape measured,
// causal or not, and the only ones that replay a dropout mask) under an autograd node in C++ (the
// op attention_flash_cpu).
//
// They keep memopt's attention contract (save q, k, v, the output, one log-sum-exp per row and the
// RNG key; the backward recomputes the probabilities tile by tile and regenerates the dropout mask
// from the key), so the only thing memopt's Python path (AttentionFunction over attention_fwd /
// attention_bwd) would add is its cost: two dispatcher round trips into Python kernels and a Python
// autograd node, ~0.2 ms per forward + backward, 10% of a (1, 4, 256, 64) call and half of a
// (2, 2, 16, 16) one with dropout. Here the node is C++, as SDPA's is, and it keeps what SDPA
// lacks: a backward run with create_graph=True (second derivatives) differentiates the attention
// again as plain ATen ops, the same dropout mask included (philox_dropout_scale), so second
// derivatives are exact instead of an error.
//
// Layouts follow memopt.ops.attention's contract: the output is contiguous when q is, else a
// (B, H, S, D) view of a (B, S, H, D) buffer; the gradients are such views.
//
// The ops check their own inputs (check_inputs), with the messages and in the order of
// memopt.ops.attention._check_inputs, so that memopt.attention's common call (CPU, no dropout)
// goes straight here: on CPU the Python checks cost more than the C++ node they guard
// (~40 us warm, several times that after a kernel that has swept the caches).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "common.h"
#include "cpu_kernels.h"

namespace memopt {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Python's spelling of a shape, "(2, 4, 8, 64)", and of a dtype, "torch.float32", so the messages
// read as memopt.ops.attention's do.
std::string python_shape(const at::Tensor& t) {
  std::ostringstream out;
  out << "(";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out << (d ? ", " : "") << t.size(d);
  }
  out << (t.dim() == 1 ? ",)" : ")");
  return out.str();
}

std::string python_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    default: return std::string("torch.") + c10::toString(dtype);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, std::optional<double> scale) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"q", &q}, {"k", &k}, {"v", &v}}) {
    TORCH_CHECK_VALUE(t->dim() == 4, "memopt.attention: ", name, " must be 4-D (batch, heads, seq, head_dim), got shape ",
                      python_shape(*t));
  }
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "memopt.attention: k and v must have the same shape, got ", python_shape(k),
                    " and ", python_shape(v));
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2), head_dim = q.size(3);
  TORCH_CHECK_VALUE(k.size(0) == batch && k.size(3) == head_dim, "memopt.attention: k and v must be (batch=", batch,
                    ", kv_heads, seq_k, head_dim=", head_dim, ") to match q ", python_shape(q), ", got ", python_shape(k));
  const int64_t kv_heads = k.size(1), seq_k = k.size(2);
  TORCH_CHECK_VALUE(kv_heads != 0 && heads % kv_heads == 0, "memopt.attention: the heads of q (", heads,
                    ") must be a multiple of the heads of k and v (", kv_heads, ")");
  TORCH_CHECK_VALUE(seq_q != 0 && seq_k != 0, "memopt.attention: sequence lengths must be >= 1, got seq_q=", seq_q,
                    ", seq_k=", seq_k);
  // memopt.ops.attention.MAX_HEAD_DIM: the limit every backend shares (ATen's CUDA kernels'), so a
  // model runs on either device; these kernels themselves take any size.
  TORCH_CHECK_VALUE(head_dim >= 1 && head_dim <= 256, "memopt.attention: head_dim must be between 1 and 256, got head_dim=",
                    head_dim);
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(),
                    "memopt.attention: q, k and v must be on one device, got ", q.device(), ", ", k.device(), ", ",
                    v.device());
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                    "memopt.attention: q, k and v must have one dtype, got ", python_dtype(q.scalar_type()), ", ",
                    python_dtype(k.scalar_type()), ", ", python_dtype(v.scalar_type()));
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
                    "memopt.attention: q, k, v dtype must be one of (torch.float32, torch.float64) on CPU, got ",
                    python_dtype(q.scalar_type()));
  TORCH_CHECK_TYPE(!scale.has_value() || std::isfinite(*scale),
                   "memopt.attention: scale must be a finite real number or None, got ", scale.value_or(0.0));
}

// The softmax scale: 1 / sqrt(head_dim) unless given.
double resolved_scale(const at::Tensor& q, std::optional<double> scale) {
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
}

// ---------------------------------------------------------------------------------------------
// memopt's own kernels (attention_cpu_kernels_impl.h: causal tiles skip the keys they cannot see),
// the "cpu_flash" backend: registered as cpu_flash_attention_fwd / _bwd, and what the C++ node
// below runs.

at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// An uninitialised (B, H, S, D) view of a (B, S, H, D) buffer.
at::Tensor bshd_empty(const at::Tensor& like) {
  return at::empty({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2);
}

// The ops' dropout arguments: p in [0, 1); a key when p > 0. Checked without reading the key,
// which a fake tensor (torch.compile, opcheck) cannot give.
void check_attention_dropout(double p, const std::optional<at::Tensor>& rng_key, const char* op) {
  TORCH_CHECK_VALUE(p >= 0.0 && p < 1.0, "memopt.", op, ": dropout_p must be in [0, 1), got ", p);
  TORCH_CHECK_VALUE(p == 0.0 || rng_key.has_value(), "memopt.", op,
                    ": dropout_p > 0 needs rng_key, an int64 CPU tensor (seed, offset), got None");
}

// The kernels' dropout: the checked arguments and the key's (seed, offset).
AttentionDropout attention_dropout(double p, const std::optional<at::Tensor>& rng_key, const char* op) {
  check_attention_dropout(p, rng_key, op);
  if (p == 0.0) {
    return {};
  }
  const auto [seed, offset] = read_rng_key(*rng_key, op);
  return {p, seed, offset};
}

std::tuple<at::Tensor, at::Tensor> cpu_flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale, const AttentionDropout& dropout) {
  const at::Tensor q_ = unit_last_stride(q), k_ = unit_last_stride(k), v_ = unit_last_stride(v);
  at::Tensor out = q.is_contiguous() ? at::empty(q.sizes(), q.options()) : bshd_empty(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  MEMOPT_CPU_KERNEL(attention_fwd_kernel)(q_, k_, v_, causal, scale, dropout, out, lse);
  return {out, lse};
}

// Runs the backward kernel into grad_q / grad_k / grad_v, views of buffers the caller laid out (the
// kernel adds into grad_k and grad_v, so they are zeroed here first).
void cpu_flash_backward_into(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
                             double scale, const AttentionDropout& dropout, const at::Tensor& grad_q,
                             const at::Tensor& grad_k, const at::Tensor& grad_v) {
  const at::Tensor q_ = unit_last_stride(q), k_ = unit_last_stride(k), v_ = unit_last_stride(v);
  const at::Tensor grad_out_ = unit_last_stride(grad_out.to(q.scalar_type()));
  const at::Tensor out_ = unit_last_stride(out.to(q.scalar_type()));
  const at::Tensor lse_ = lse.to(q.scalar_type()).contiguous();
  grad_k.zero_();
  grad_v.zero_();
  MEMOPT_CPU_KERNEL(attention_bwd_kernel)(grad_out_, q_, k_, v_, out_, lse_, causal, scale, dropout, grad_q, grad_k,
                                          grad_v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_flash_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  bool causal, double scale,
                                                                  const AttentionDropout& dropout) {
  at::Tensor grad_q = bshd_empty(q), grad_k = bshd_empty(k), grad_v = bshd_empty(v);
  cpu_flash_backward_into(grad_out, q, k, v, out, lse, causal, scale, dropout, grad_q, grad_k, grad_v);
  return {grad_q, grad_k, grad_v};
}

// The gradients of q, k and v written straight into one (B, S, H + 2 Hkv, D) buffer, the layout of
// a fused qkv projection's output: the block's gradient of that projection is then this buffer,
// with no torch.cat of three gradients.
at::Tensor cpu_flash_backward_packed(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, bool causal,
                                     double scale, const AttentionDropout& dropout) {
  const int64_t heads = q.size(1), kv_heads = k.size(1);
  at::Tensor grad_qkv = at::empty({q.size(0), q.size(2), heads + 2 * kv_heads, q.size(3)}, q.options());
  cpu_flash_backward_into(grad_out, q, k, v, out, lse, causal, scale, dropout,
                          grad_qkv.narrow(2, 0, heads).transpose(1, 2),
                          grad_qkv.narrow(2, heads, kv_heads).transpose(1, 2),
                          grad_qkv.narrow(2, heads + kv_heads, kv_heads).transpose(1, 2));
  return grad_qkv;
}

void check_like(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, "memopt.", op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.device().is_cpu(), "memopt.", op, ": ", name, " must be on the CPU, got ", t.device());
}

void check_backward_inputs(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, double scale) {
  check_inputs(q, k, v, scale);
  check_like(op, "grad_out", grad_out, q.sizes());
  check_like(op, "out", out, q.sizes());
  check_like(op, "lse", lse, q.sizes().slice(0, 3));
}

std::tuple<at::Tensor, at::Tensor> cpu_flash_attention_fwd(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, bool causal, double scale,
                                                           double dropout_p, const std::optional<at::Tensor>& rng_key) {
  check_inputs(q, k, v, scale);
  return cpu_flash_forward(q, k, v, causal, scale, attention_dropout(dropout_p, rng_key, "cpu_flash_attention_fwd"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_flash_attention_bwd(const at::Tensor& grad_out, const at::Tensor& q,
                                                                       const at::Tensor& k, const at::Tensor& v,
                                                                       const at::Tensor& out, const at::Tensor& lse,
                                                                       bool causal, double scale, double dropout_p,
                                                                       const std::optional<at::Tensor>& rng_key) {
  check_backward_inputs("cpu_flash_attention_bwd", grad_out, q, k, v, out, lse, scale);
  return cpu_flash_backward(grad_out, q, k, v, out, lse, causal, scale,
                            attention_dropout(dropout_p, rng_key, "cpu_flash_attention_bwd"));
}

// The node calls memopt's kernels through their registered ops, so that under
// torch.compile's fake tensors the ops' fake impls answer instead of a kernel reading no data.
std::tuple<at::Tensor, at::Tensor> cpu_flash_fwd_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    bool causal, double scale, double dropout_p = 0.0,
                                                    const std::optional<at::Tensor>& rng_key = std::nullopt) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memopt::cpu_flash_attention_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, double,
                                                    double, const std::optional<at::Tensor>&)>();
  return op.call(q, k, v, causal, scale, dropout_p, rng_key);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_flash_bwd_op(const at::Tensor& grad_out, const at::Tensor& q,
                                                                const at::Tensor& k, const at::Tensor& v,
                                                                const at::Tensor& out, const at::Tensor& lse,
                                                                bool causal, double scale, double dropout_p = 0.0,
                                                                const std::optional<at::Tensor>& rng_key = std::nullopt) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memopt::cpu_flash_attention_bwd", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, bool, double, double,
                                 const std::optional<at::Tensor>&)>();
  return op.call(grad_out, q, k, v, out, lse, causal, scale, dropout_p, rng_key);
}

at::Tensor cpu_flash_attention_bwd_packed(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                          bool causal, double scale, double dropout_p,
                                          const std::optional<at::Tensor>& rng_key) {
  check_backward_inputs("cpu_flash_attention_bwd_packed", grad_out, q, k, v, out, lse, scale);
  // The packed buffer has q's seq_q rows for the gradients of k and v too: a different seq_k would
  // have the kernel write seq_k rows into seq_q-row views (out of bounds when seq_k > seq_q).
  TORCH_CHECK_VALUE(q.size(2) == k.size(2),
                    "memopt.cpu_flash_attention_bwd_packed: packs the gradients of q, k and v along the heads, "
                    "so seq_q must equal seq_k, got ",
                    q.size(2), " and ", k.size(2), "; use memopt.cpu_flash_attention_bwd");
  return cpu_flash_backward_packed(grad_out, q, k, v, out, lse, causal, scale,
                                   attention_dropout(dropout_p, rng_key, "cpu_flash_attention_bwd_packed"));
}

at::Tensor flash_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                         double dropout_p, const std::optional<at::Tensor>& rng_key, at::Tensor* lse) {
  auto [out, row_lse] = cpu_flash_fwd_op(q, k, v, causal, scale, dropout_p, rng_key);
  if (lse != nullptr) {
    *lse = row_lse;
  }
  return out;
}

// The dropout factors keep / (1 - p) of the whole (B, H, Sq, Sk) probabilities (element
// ((b H + h) Sq + i) Sk + j of the key's mask), through the registered op the Python paths use.
at::Tensor dropout_scale_op(const at::Tensor& q, int64_t seq_k, double p, const at::Tensor& rng_key) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memopt::philox_dropout_scale", "")
                             .typed<at::Tensor(c10::IntArrayRef, c10::IntArrayRef, int64_t, double,
                                               const at::Tensor&, at::ScalarType)>();
  const int64_t heads = q.size(1), seq_q = q.size(2);
  return op.call({q.size(0), heads, seq_q, seq_k}, {heads * seq_q * seq_k, seq_q * seq_k, seq_k, 1}, 0, p, rng_key,
                 q.scalar_type());
}

// The attention as differentiable ATen ops (the (B, H, Sq, Sk) probabilities materialised, as a
// double backward through attention must keep them); the causal mask is top-left aligned, like
// F.scaled_dot_product_attention's is_causal, so every row sees key 0. With dropout the
// probabilities are multiplied by the factors of the same mask the kernels regenerate.
at::Tensor attention_math(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          double dropout_p, const at::Tensor& rng_key) {
  const int64_t group = q.size(1) / k.size(1);
  const at::Tensor keys = group == 1 ? k : k.repeat_interleave(group, 1);
  const at::Tensor values = group == 1 ? v : v.repeat_interleave(group, 1);
  at::Tensor scores = at::matmul(q, keys.transpose(-2, -1)).mul(scale);
  if (causal) {
    const at::Tensor hidden = at::ones({q.size(2), k.size(2)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  at::Tensor probs = at::softmax(scores, -1);
  if (dropout_p > 0.0) {
    probs = probs * dropout_scale_op(q, k.size(2), dropout_p, rng_key);
  }
  return at::matmul(probs, values);
}

std::optional<at::Tensor> optional_key(const at::Tensor& key) {
  return key.defined() ? std::optional<at::Tensor>(key) : std::nullopt;
}

struct FlashAttentionCpuFunction : public torch::autograd::Function<FlashAttentionCpuFunction> {
  // rng_key: none without dropout (nothing to replay, nothing saved for it). An optional, not an
  // undefined tensor: the node's inputs and its saved tensors are handed to saved-tensor hooks
  // (offload, SavedTensorCounter), and an undefined tensor has no device to be read.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, double scale, double dropout_p, const std::optional<at::Tensor>& rng_key) {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor lse;
    at::Tensor out = flash_forward(q, k, v, causal, scale, dropout_p, rng_key, &lse);
    ctx->save_for_backward(rng_key.has_value() ? variable_list{q, k, v, out, lse, *rng_key}
                                               : variable_list{q, k, v, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const at::Tensor rng_key = saved.size() > 5 ? saved[5] : at::Tensor();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
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
        found = torch::autograd::grad({attention_math(q, k, v, causal, scale, dropout_p, rng_key)}, inputs,
                                      {grad_out}, /*retain_graph=*/true, /*create_graph=*/true,
                                      /*allow_unused=*/true);
      }
      variable_list result(7);
      size_t next = 0;
      for (size_t i = 0; i < 3; ++i) {
        if (saved[i].requires_grad()) {
          result[i] = next < found.size() ? found[next] : at::Tensor();
          ++next;
        }
      }
      return result;
    }
    auto [grad_q, grad_k, grad_v] =
        cpu_flash_bwd_op(grad_out, q, k, v, saved[3], saved[4], causal, scale, dropout_p, optional_key(rng_key));
    return {grad_q, grad_k, grad_v, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The key the node keeps: the caller's when there is dropout, else none. Its contents are checked
// where they are read, by the cpu_flash_attention_fwd op the node calls.
std::optional<at::Tensor> checked_key(double dropout_p, const std::optional<at::Tensor>& rng_key) {
  check_attention_dropout(dropout_p, rng_key, "attention_flash_cpu");
  return dropout_p > 0.0 ? rng_key : std::nullopt;
}

at::Tensor attention_flash_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                               std::optional<double> scale, double dropout_p, const std::optional<at::Tensor>& rng_key) {
  check_inputs(q, k, v, scale);
  return flash_forward(q, k, v, causal, resolved_scale(q, scale), dropout_p, checked_key(dropout_p, rng_key), nullptr);
}

at::Tensor attention_flash_cpu_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                        std::optional<double> scale, double dropout_p,
                                        const std::optional<at::Tensor>& rng_key) {
  check_inputs(q, k, v, scale);
  return FlashAttentionCpuFunction::apply(q, k, v, causal, resolved_scale(q, scale), dropout_p,
                                          checked_key(dropout_p, rng_key));
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("attention_flash_cpu", &attention_flash_cpu);
  m.impl("cpu_flash_attention_fwd", &cpu_flash_attention_fwd);
  m.impl("cpu_flash_attention_bwd", &cpu_flash_attention_bwd);
  m.impl("cpu_flash_attention_bwd_packed", &cpu_flash_attention_bwd_packed);
}

TORCH_LIBRARY_IMPL(memopt, AutogradCPU, m) { m.impl("attention_flash_cpu", &attention_flash_cpu_autograd); }

}  // namespace memopt
