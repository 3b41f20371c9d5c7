// The GEMM under memopt's own linears on CPU (norm_linear's here; act_linear's and the block's
// through memopt/ops/cpu_linear.py, which asks cpu_linear_backend() for the same rule).
//
// Note: memopt never runs a kernel slower than the fastest one PyTorch offers for the same job.
// For a float32 linear on CPU, ATen's at::linear / at::mm call MKL's sgemm; PyTorch also ships
// oneDNN's inner product (mkldnn::_linear_pointwise, what torch.compile's CPU backend fuses
// linears into). Measured on this project's development host (AMD EPYC, Zen 4, AVX-512), one
// thread, the (rows, in) x (in, out) products of the kernels bench: oneDNN 106-111 GFLOP/s against
// MKL's 95-103 for x @ W^T and 92-112 against 82-103 for grad @ W (MKL is known to pick its code
// by CPU vendor, oneDNN by instruction set). So the rule ("auto") is: oneDNN on AMD CPUs with
// AVX-512, ATen (MKL) elsewhere (unmeasured there, so no change), and on those hosts only for
// products of 2^24 multiply-adds and up: oneDNN's op costs ~15-20 us a call more than sgemm
// (measured, 2 threads: 24.7 us against 9.1 at 32 x 64 x 64, parity at 128 x 128 x 384 (0.98x),
// 0.97x at 256^3, 0.92-0.94x from 512 x 256 x 1024 up), which made a block of d_model 64 1.9x
// eager's step where MKL gives 1.27x. The rule depends on the host and the product's shape only,
// never on timing, so one process gives the same bits every step, under every policy (the
// forward and its recompute take the same kernel). MEMOPT_CPU_LINEAR=aten|onednn|auto overrides
// it (onednn: every product, whatever its size). oneDNN writes a new output; where a product
// would go into a buffer the caller owns and frees (cpu_mm_over), oneDNN runs only below glibc's
// mmap threshold, where the freed memory comes straight back from the heap: above it, a fresh
// mapping's page faults (~0.35 ms per MiB here) cost more than oneDNN gains.
#include "cpu_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdlib>
#include <string>

#include "common.h"
#include "new_output.h"

namespace memopt {
namespace {

// onednn_large: oneDNN for products of kOneDnnMinMultiplyAdds and up ("auto" on a host it suits).
enum class Backend { aten, onednn, onednn_large };

constexpr int64_t kOneDnnMinMultiplyAdds = int64_t{1} << 24;

bool onednn_measured_faster() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

Backend parse(const std::string& name, const char* what) {
  if (name == "auto") return onednn_measured_faster() ? Backend::onednn_large : Backend::aten;
  if (name == "onednn") return Backend::onednn;
  if (name == "aten") return Backend::aten;
  TORCH_CHECK(false, "memopt: ", what, " must be 'auto', 'onednn' or 'aten', got '", name, "'");
}

// The oneDNN op, where this torch build has it (x86 and aarch64 builds with MKLDNN do).
const std::optional<c10::OperatorHandle>& onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op;
}

Backend& chosen() {
  static Backend backend = [] {
    const char* env = std::getenv("MEMOPT_CPU_LINEAR");
    return parse(env != nullptr && env[0] != '\0' ? env : "auto", "MEMOPT_CPU_LINEAR");
  }();
  return backend;
}

// A plain tensor: not a fake or other Python subclass (torch.compile traces these nodes with fake
// tensors, whose sizes may be symbolic), so that traced graphs keep ATen's op.
bool plain(const at::Tensor& t) {
  return !t.key_set().has(c10::DispatchKey::Python) && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

bool use_onednn(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (chosen() == Backend::aten || !x.is_cpu() || !plain(x) || !plain(weight) || x.scalar_type() != at::kFloat ||
      weight.scalar_type() != at::kFloat || weight.dim() != 2 || x.dim() < 1 || x.numel() == 0 ||
      weight.numel() == 0) {
    return false;
  }
  // (x.numel() / in) rows times weight's out x in: the product's multiply-adds
  if (x.numel() / x.size(-1) * weight.numel() < cpu_linear_min_multiply_adds()) return false;
  if (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->is_contiguous())) return false;
  // The oneDNN op has no derivative: a graph being built (create_graph) takes ATen's.
  if (at::GradMode::is_enabled() &&
      (x.requires_grad() || weight.requires_grad() || (bias.has_value() && bias->requires_grad()))) {
    return false;
  }
  return at::globalContext().userEnabledMkldnn() && onednn_linear_op().has_value();
}

// x @ weight^T + bias on oneDNN, for arguments use_onednn accepted.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  std::vector<c10::IValue> stack{x, weight, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue(std::string("none")),
                                 c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  onednn_linear_op()->callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

const char* cpu_linear_backend() {
  return chosen() != Backend::aten && onednn_linear_op().has_value() ? "onednn" : "aten";
}

int64_t cpu_linear_min_multiply_adds() { return chosen() == Backend::onednn_large ? kOneDnnMinMultiplyAdds : 0; }

void set_cpu_linear_backend(const std::string& name) { chosen() = parse(name, "the CPU linear backend"); }

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return use_onednn(x, weight, bias) ? onednn_linear(x, weight, bias) : at::linear(x, weight, bias);
}

at::Tensor cpu_mm(const at::Tensor& a, const at::Tensor& b) {
  return a.dim() == 2 && use_onednn(a, b, std::nullopt) ? onednn_linear(a, b.t(), std::nullopt) : at::mm(a, b);
}

at::Tensor cpu_mm_over(at::Tensor&& scratch, const at::Tensor& a, const at::Tensor& b) {
  // use_onednn first: it refuses fake tensors, whose sizes (and nbytes) may be symbolic.
  if (a.dim() == 2 && use_onednn(a, b, std::nullopt) && static_cast<int64_t>(scratch.nbytes()) < kFreshMappingBytes) {
    scratch.reset();
    return onednn_linear(a, b.t(), std::nullopt);
  }
  at::Tensor out = scratch.view_symint({a.sym_size(0), b.sym_size(1)});
  at::mm_out(out, a, b);
  return out;
}

}  // namespace memopt
