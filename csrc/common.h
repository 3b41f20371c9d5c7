// Argument checks shared by every op. Each message names the op, the argument and what was
// expected, so a user sees "memopt.layer_norm: weight must have shape [768], got [512]".
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>

namespace memopt {

#define MEMOPT_CHECK(cond, op, ...) TORCH_CHECK((cond), "memopt.", op, ": ", __VA_ARGS__)

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  const bool ok = dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16;
  MEMOPT_CHECK(ok, op, name, " must be float32, float64, float16 or bfloat16, got ", dt);
  MEMOPT_CHECK(!(t.is_cuda() && dt == at::kDouble), op, name,
               " is float64 on CUDA; the CUDA kernels take float32, float16 or bfloat16");
  MEMOPT_CHECK(!(t.is_cpu() && (dt == at::kHalf || dt == at::kBFloat16)), op, name, " is ", dt,
               " on CPU; the CPU kernels take float32 or float64");
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  MEMOPT_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " must have the dtype of ", ref_name, " (",
               ref.scalar_type(), "), got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  MEMOPT_CHECK(t.device() == ref.device(), op, name, " must be on ", ref_name, "'s device (", ref.device(),
               "), got ", t.device());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  MEMOPT_CHECK(t.is_contiguous(), op, name, " must be contiguous (call .contiguous() first), got strides ",
               t.strides());
}

inline void check_same_shape(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  MEMOPT_CHECK(t.sizes() == ref.sizes(), op, name, " must have the shape of ", ref_name, " ", ref.sizes(),
               ", got ", t.sizes());
}

// A 1-D parameter over the last dimension (norm weight, bias): shape [n], same device, contiguous.
inline void check_vector(const at::Tensor& t, int64_t n, const at::Tensor& ref, const char* op,
                         const char* name) {
  MEMOPT_CHECK(t.dim() == 1 && t.size(0) == n, op, name, " must have shape [", n, "], got ", t.sizes());
  check_same_device(t, ref, op, name, "x");
  check_contiguous(t, op, name);
}

// The dropout RNG key: an int64 CPU tensor holding (seed, offset). It lives on the host so the
// CUDA launchers read it without a device sync.
inline std::pair<uint64_t, uint64_t> read_rng_key(const at::Tensor& key, const char* op) {
  MEMOPT_CHECK(key.device().is_cpu() && key.scalar_type() == at::kLong && key.numel() == 2, op,
               "rng_key must be an int64 CPU tensor of 2 elements (seed, offset), got ", key.scalar_type(),
               " on ", key.device(), " with shape ", key.sizes());
  const auto contiguous = key.contiguous();
  const int64_t* data = contiguous.data_ptr<int64_t>();
  return {static_cast<uint64_t>(data[0]), static_cast<uint64_t>(data[1])};
}

inline void check_dropout_p(double p, const char* op) {
  MEMOPT_CHECK(p >= 0.0 && p < 1.0, op, "p must be in [0, 1), got ", p);
}

// The element type of a parameter (bias, weight): scalar_t when it has x's dtype or is absent,
// float otherwise (a float32 parameter of lower-precision x, the only other dtype the checks let
// through). Calls fn(static_cast<param_t*>(nullptr)).
template <typename scalar_t, typename Fn>
void dispatch_param_type(at::ScalarType param_dtype, const Fn& fn) {
  if (param_dtype == c10::CppTypeToScalarType<scalar_t>::value) {
    fn(static_cast<scalar_t*>(nullptr));
  } else {
    fn(static_cast<float*>(nullptr));
  }
}

inline at::ScalarType param_dtype(const std::optional<at::Tensor>& param, const at::Tensor& x) {
  return param.has_value() ? param->scalar_type() : x.scalar_type();
}

template <typename T>
const T* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// The CUDA kernels take float32, float16 and bfloat16 (check_float_dtype rejects float64 there).
#define MEMOPT_DISPATCH_CUDA_FLOATS(TYPE, NAME, ...)                         \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)   \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// An empty tensor stands for an output that was not asked for (a schema cannot return None).
inline at::Tensor absent_like(const at::Tensor& ref) { return at::empty({0}, ref.options()); }

}  // namespace memopt
