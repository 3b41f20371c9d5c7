// The schemas of every C++ op in memopt, in one place. Kernels register per backend beside
// their source (TORCH_LIBRARY_IMPL(memopt, CPU, m) in <family>.cpp, CUDA in <family>_cuda.cu);
// fake impls for torch.compile and the autograd functions live in memopt/ops/<family>.py.
//
// Conventions:
// * Outputs that were not asked for come back as empty tensors (a schema cannot return None).
// * Per-row statistics (mean, rstd) are float32, or float64 for float64 input.
// * Parameter gradients are reduced over rows in float32 (float64 for float64 input).
// * rng_key is an int64 CPU tensor (seed, offset); see philox.h for the mask it defines.
#include <Python.h>
#include <torch/library.h>

#include "common.h"
#include "cpu_linear.h"
#include "new_output.h"

TORCH_LIBRARY(memopt, m) {
  // out = residual + dropout(x, p) (residual optional). The mask is a function of rng_key and the
  // element index, never stored: the backward regenerates it.
  m.def("dropout_add_fwd(Tensor x, Tensor? residual, float p, Tensor rng_key) -> Tensor out");
  m.def("dropout_add_bwd(Tensor grad_out, float p, Tensor rng_key) -> Tensor grad_x");
  // LayerNorm over the last dim of x (+ residual when given).
  //   residual_out = x + residual (empty when residual is None); y = (residual_out - mean) * rstd * weight + bias
  m.def("layer_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps)"
        " -> (Tensor y, Tensor residual_out, Tensor mean, Tensor rstd)");
  // x is what was normalised (residual_out when a residual was added). grad_x_extra, when given, is
  // added to grad_x (the gradient reaching residual_out from its other use). return_y rebuilds y from
  // the statistics so the next matmul's weight gradient need not keep it. return_grad_weight /
  // return_grad_bias false: that gradient is not computed and comes back empty (a frozen parameter,
  // as ATen's native_layer_norm_backward output_mask).
  m.def("layer_norm_bwd(Tensor grad_y, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd,"
        " Tensor? grad_x_extra, bool return_y, bool return_grad_weight=True, bool return_grad_bias=True)"
        " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias, Tensor y)");
  // The backward writing grad_x over grad_y (same shape, dtype, contiguous): for a caller that made
  // grad_y (the next matmul's input gradient) and needs it no more; returns the rest.
  m.def("layer_norm_bwd_inplace(Tensor(a!) grad_y, Tensor x, Tensor? weight, Tensor? bias, Tensor mean,"
        " Tensor rstd, Tensor? grad_x_extra, bool return_y, bool return_grad_weight=True,"
        " bool return_grad_bias=True) -> (Tensor grad_weight, Tensor grad_bias, Tensor y)");
  m.def("rms_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, float eps)"
        " -> (Tensor y, Tensor residual_out, Tensor rstd)");
  m.def("rms_norm_bwd(Tensor grad_y, Tensor x, Tensor? weight, Tensor rstd, Tensor? grad_x_extra,"
        " bool return_y, bool return_grad_weight=True) -> (Tensor grad_x, Tensor grad_weight, Tensor y)");
  m.def("rms_norm_bwd_inplace(Tensor(a!) grad_y, Tensor x, Tensor? weight, Tensor rstd, Tensor? grad_x_extra,"
        " bool return_y, bool return_grad_weight=True) -> (Tensor grad_weight, Tensor y)");
  // The differentiable norms (memopt.layer_norm / rms_norm): the forward op under a C++ autograd
  // node that saves x (residual_out with a residual), the statistics and the parameters
  // (norm_autograd.cpp). residual_out is empty without a residual.
  m.def("layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps)"
        " -> (Tensor y, Tensor residual_out)");
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps) -> (Tensor y, Tensor residual_out)");
  // out = F.linear(norm(x [+ residual]), linear_weight, linear_bias), norm RMSNorm when rms (norm_bias
  // then None), under a C++ autograd node that keeps no norm output: its backward rebuilds it from
  // x and the statistics for the weight gradient (norm_autograd.cpp). Under torch.autocast the
  // linear runs in the autocast dtype. residual_out = x + residual, empty without a residual.
  m.def("norm_linear(Tensor x, Tensor? residual, Tensor? norm_weight, Tensor? norm_bias, Tensor linear_weight,"
        " Tensor? linear_bias, bool rms, float eps) -> (Tensor out, Tensor residual_out)");
  // y = act(x + bias), activation in {"relu", "gelu", "gelu_tanh", "silu"}. Only x is saved for
  // backward; the backward recomputes act and act' (and y when return_y). return_grad_bias false:
  // the bias gradient is not computed and comes back empty (a frozen bias).
  m.def("bias_act_fwd(Tensor x, Tensor? bias, str activation) -> Tensor y");
  // bias_act_fwd writing y over x (bias must not share x's memory): for a caller that made x (the
  // matmul output) and needs it no more, as torch's encoder fast path does, so a forward without a
  // graph holds one d_ff-wide buffer instead of two. The same kernels: the same bits.
  m.def("bias_act_fwd_inplace(Tensor(a!) x, Tensor? bias, str activation) -> ()");
  m.def("bias_act_bwd(Tensor grad_y, Tensor x, Tensor? bias, str activation, bool return_y,"
        " bool return_grad_bias=True) -> (Tensor grad_x, Tensor grad_bias, Tensor y)");
  // bias_act_bwd writing grad_x over grad_y (same shape, dtype and layout): the caller owns grad_y
  // (the matmul output it just made) and needs it no more, so the backward allocates no d_ff-wide
  // buffer for grad_x. Returns what bias_act_bwd returns besides grad_x.
  m.def("bias_act_bwd_inplace(Tensor(a!) grad_y, Tensor x, Tensor? bias, str activation, bool return_y,"
        " bool return_grad_bias=True) -> (Tensor grad_bias, Tensor y)");
  // x = [gate | up] on the last dim (2 * d); y = silu(gate + bias[:d]) * (up + bias[d:]).
  m.def("swiglu_fwd(Tensor x, Tensor? bias) -> Tensor y");
  m.def("swiglu_bwd(Tensor grad_y, Tensor x, Tensor? bias, bool return_y, bool return_grad_bias=True)"
        " -> (Tensor grad_x, Tensor grad_bias, Tensor y)");
  // The differentiable activations (memopt.bias_act / swiglu): the forward op under a C++ autograd
  // node that saves x and the bias, nothing of y's size (activation_autograd.cpp).
  m.def("bias_act(Tensor x, Tensor? bias, str activation) -> Tensor y");
  m.def("swiglu(Tensor x, Tensor? bias) -> Tensor y");
  // out = F.linear(act(x + bias), linear_weight, linear_bias), activation one of bias_act's or
  // "swiglu", under a C++ autograd node that keeps no activation output: its backward rebuilds it
  // from x for the weight gradient (activation_autograd.cpp). Under torch.autocast the linear runs
  // in the autocast dtype.
  m.def("act_linear(Tensor x, Tensor? bias, Tensor linear_weight, Tensor? linear_bias, str activation) -> Tensor out");
  // keep[...] = the dropout keep bit (philox.h) of element index[...] under rng_key, for any int64
  // index tensor (>= 0): the mask of a slice of a larger tensor without building the whole mask.
  m.def("philox_keep_mask(Tensor index, float p, Tensor rng_key) -> Tensor keep");
  // scale[i_0, .., i_n] = 1 / (1 - p) if element index_offset + sum_d i_d * index_strides[d] is kept
  // under rng_key, else 0 (CPU, float32/float64): the dropout factor of a strided window of a larger
  // tensor, e.g. one key chunk of the attention probabilities, without an index tensor.
  m.def("philox_dropout_scale(int[] size, int[] index_strides, int index_offset, float p, Tensor rng_key,"
        " ScalarType dtype) -> Tensor scale");
  // softmax(q @ k^T * scale + causal mask) @ v on CPU, with dropout on the probabilities (philox.h's
  // mask of rng_key, required when dropout_p > 0), through memopt's or ATen's flash kernels under a
  // C++ autograd node that saves q, k, v, out, the log-sum-exp and the key (attention_cpu.cpp);
  // grouped-query heads when q's heads are a multiple of k's; scale None: 1 / sqrt(head_dim). It
  // checks its inputs as memopt.attention does (same messages): memopt.attention calls it for CPU
  // tensors whenever "auto" resolves to a CPU flash backend (memopt/ops/attention.py).
  m.def("attention_flash_cpu(Tensor q, Tensor k, Tensor v, bool causal, float? scale=None, float dropout_p=0.,"
        " Tensor? rng_key=None) -> Tensor out");
  // memopt's CPU flash-attention kernels (attention_cpu.cpp, the "cpu_flash" backend): out and a
  // contiguous lse (B, H, Sq) in q's dtype; the gradients as (B, S, H, D) buffers' views. Dropout
  // on the probabilities replays philox.h's mask of rng_key (required when dropout_p > 0), the mask
  // memopt.attention's other backends draw.
  m.def("cpu_flash_attention_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, float dropout_p=0.,"
        " Tensor? rng_key=None) -> (Tensor out, Tensor lse)");
  m.def("cpu_flash_attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal,"
        " float scale, float dropout_p=0., Tensor? rng_key=None) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");
  // The same gradients as one (B, S, H + 2 Hkv, D) tensor, the layout of a fused qkv projection.
  m.def("cpu_flash_attention_bwd_packed(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
        " bool causal, float scale, float dropout_p=0., Tensor? rng_key=None) -> Tensor grad_qkv");
}

namespace {

// setup.py passes these as bare tokens (quotes do not survive ninja's shell).
#define MEMOPT_STRINGIFY_(...) #__VA_ARGS__
#define MEMOPT_STRINGIFY(...) MEMOPT_STRINGIFY_(__VA_ARGS__)

PyObject* build_info(PyObject*, PyObject*) {
#ifdef MEMOPT_WITH_CUDA
  PyObject* with_cuda = Py_True;
#else
  PyObject* with_cuda = Py_False;
#endif
  return Py_BuildValue("{s:O,s:s,s:s}", "with_cuda", with_cuda, "cuda_archs",
                       MEMOPT_STRINGIFY(MEMOPT_CUDA_ARCHS), "torch_version",
                       MEMOPT_STRINGIFY(MEMOPT_TORCH_VERSION));
}

// A bad MEMOPT_CPU_LINEAR (read on first use) or name raises ValueError, not a C++ exception
// through the Python C API.
PyObject* cpu_linear_backend(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(memopt::cpu_linear_backend());
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_ValueError, err.what_without_backtrace());
    return nullptr;
  }
}

PyObject* cpu_linear_min_multiply_adds(PyObject*, PyObject*) {
  try {
    return PyLong_FromLongLong(memopt::cpu_linear_min_multiply_adds());
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_ValueError, err.what_without_backtrace());
    return nullptr;
  }
}

PyObject* set_cpu_linear_backend(PyObject*, PyObject* name) {
  const char* text = PyUnicode_AsUTF8(name);
  if (text == nullptr) return nullptr;
  try {
    memopt::set_cpu_linear_backend(text);
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_ValueError, err.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "What this build of memopt._C contains."},
    {"cpu_linear_backend", cpu_linear_backend, METH_NOARGS,
     "'onednn' or 'aten': the GEMM memopt's own float32 CPU linears run on (cpu_linear.cpp)."},
    {"cpu_linear_min_multiply_adds", cpu_linear_min_multiply_adds, METH_NOARGS,
     "The fewest multiply-adds (m * k * n) of a product that runs on oneDNN (0: every product)."},
    {"_set_cpu_linear_backend", set_cpu_linear_backend, METH_O,
     "Override the CPU linear rule for this process: 'auto', 'onednn' or 'aten'."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "memopt native kernels", -1, methods};

}  // namespace

// Importing memopt._C runs the static registrations above and in every kernel file.
// FRESH_MAPPING_BYTES: kFreshMappingBytes, for the Python side of the same rules (cpu_linear.py).
PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&module);
  if (m != nullptr &&
      PyModule_AddIntConstant(m, "FRESH_MAPPING_BYTES", static_cast<long>(memopt::kFreshMappingBytes)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
