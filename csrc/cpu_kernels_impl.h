// The bodies of the CPU kernels declared in cpu_kernels.h, written once with at::vec::Vectorized
// and compiled once per instruction set: the including file defines MEMOPT_CPU_ISA (the namespace,
// generic or avx2) and, for AVX2, the target and ATen's CPU_CAPABILITY macros before any include.
//
// Each kernel makes one pass over memory: rows (or flat elements, where no per-column parameter
// is read) are split over threads with at::parallel_for, columns are walked one vector at a time,
// the tail of a row with a partial load/store, so every element goes through the same vector code
// and the backward's rebuilt output is bitwise the forward's. Sums over rows (parameter
// gradients) go through fixed row blocks and are added in block order: results do not depend on
// the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>

#include "cpu_kernels.h"

#ifndef MEMOPT_CPU_ISA
#error "define MEMOPT_CPU_ISA (the namespace of this build of the kernels) before including cpu_kernels_impl.h"
#endif

namespace memopt::MEMOPT_CPU_ISA {
namespace {

using at::vec::Vectorized;

// Elements per parallel task: below this, a thread costs more than it saves.
constexpr int64_t kGrainElements = 32768;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(cols, 1)); }

// Calls f(j, count) for the vectors of a row of n elements: j = 0, W, 2W, ..., count = W except
// for the last, partial one.
template <typename T, typename F>
inline void for_each_vector(int64_t n, const F& f) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  for (int64_t j = 0; j < n; j += kWidth) f(j, std::min<int64_t>(kWidth, n - j));
}

template <typename T>
inline T sum_lanes(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](const Vectorized<T>& a, const Vectorized<T>& b) { return a + b; }, v);
}

// ---------------------------------------------------------------------------------------------
// Activations: activation.h's formulas on vectors (gelu_tanh rewritten with a sigmoid), built from
// the same shared pieces in the forward and the backward so that the rebuilt value is bitwise the
// forward's.

template <typename T>
inline Vectorized<T> vec_gelu_cdf(const Vectorized<T>& x) {  // Phi(x)
  return Vectorized<T>(T(0.5)) * (Vectorized<T>(T(1)) + (x * Vectorized<T>(T(0.70710678118654752440))).erf());
}

template <typename T>
inline Vectorized<T> vec_sigmoid(const Vectorized<T>& x) {
  const Vectorized<T> one(T(1));
  return one / (one + x.neg().exp());
}

// gelu_tanh through 1 + tanh(u) = 2 sigmoid(2u): one exp instead of a (much slower) vector tanh,
// and no cancellation in 1 + tanh(u) for negative x. Returns sigmoid(2u),
// u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename T>
inline Vectorized<T> vec_gelu_tanh_sigmoid(const Vectorized<T>& x) {
  const Vectorized<T> two_beta(T(2) * T(0.79788456080286535588));
  return vec_sigmoid(two_beta * (x + Vectorized<T>(T(0.044715)) * (x * x) * x));
}

template <Activation A, typename T>
inline Vectorized<T> vec_activation_value(const Vectorized<T>& x) {
  const Vectorized<T> zero(T(0));
  if constexpr (A == Activation::kRelu) {
    return Vectorized<T>::blendv(x, zero, x < zero);  // NaN compares false and passes through
  } else if constexpr (A == Activation::kGelu) {
    return x * vec_gelu_cdf(x);
  } else if constexpr (A == Activation::kGeluTanh) {
    return x * vec_gelu_tanh_sigmoid(x);  // x/2 (1 + tanh u)
  } else {
    return x * vec_sigmoid(x);
  }
}

template <typename T>
struct VecValueAndGrad {
  Vectorized<T> value;  // act(x)
  Vectorized<T> grad;   // act'(x)
};

template <Activation A, typename T>
inline VecValueAndGrad<T> vec_activation_value_and_grad(const Vectorized<T>& x) {
  const Vectorized<T> zero(T(0));
  const Vectorized<T> one(T(1));
  if constexpr (A == Activation::kRelu) {
    // threshold_backward's rule: zero where x <= 0 (so at 0), one elsewhere (NaN too).
    return {Vectorized<T>::blendv(x, zero, x < zero), Vectorized<T>::blendv(one, zero, x <= zero)};
  } else if constexpr (A == Activation::kGelu) {
    const Vectorized<T> cdf = vec_gelu_cdf(x);
    const Vectorized<T> pdf = (Vectorized<T>(T(-0.5)) * x * x).exp() * Vectorized<T>(T(0.39894228040143267794));
    return {x * cdf, cdf + x * pdf};
  } else if constexpr (A == Activation::kGeluTanh) {
    // With s = sigmoid(2u): (1 + tanh u)/2 = s and x/2 (1 - tanh^2 u) = 2 x s (1 - s).
    const Vectorized<T> two_beta(T(2) * T(0.79788456080286535588));  // 2 sqrt(2 / pi)
    const Vectorized<T> three_kappa(T(3) * T(0.044715));
    const Vectorized<T> s = vec_gelu_tanh_sigmoid(x);
    const Vectorized<T> grad = s + x * (s * (one - s)) * two_beta * (one + three_kappa * x * x);
    return {x * s, grad};
  } else {
    const Vectorized<T> s = vec_sigmoid(x);
    return {x * s, s * (one + x * (one - s))};
  }
}

// grad_bias[c] = sum over chunks k of partials[k, c], k in increasing order.
template <typename T>
void reduce_partials(const T* partials, int64_t chunks, int64_t cols, T* out) {
  using Vec = Vectorized<T>;
  at::parallel_for(0, cols, kGrainElements / std::max<int64_t>(chunks, 1) + 1, [&](int64_t begin, int64_t end) {
    for_each_vector<T>(end - begin, [&](int64_t j, int64_t count) {
      Vec total(T(0));
      for (int64_t k = 0; k < chunks; ++k) total = total + Vec::loadu(partials + k * cols + begin + j, count);
      total.store(out + begin + j, count);
    });
  });
}

// Rows per chunk of the activation backward: each chunk sums its rows' bias gradient into its own
// row of partials.
constexpr int64_t kRowsPerChunk = 32;

template <Activation A, typename T>
void bias_act_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t cols) {
  using Vec = Vectorized<T>;
  if (bias == nullptr) {  // no per-column term: one flat pass
    at::parallel_for(0, rows * cols, kGrainElements, [&](int64_t begin, int64_t end) {
      for_each_vector<T>(end - begin, [&](int64_t j, int64_t count) {
        vec_activation_value<A>(Vec::loadu(x + begin + j, count)).store(y + begin + j, count);
      });
    });
    return;
  }
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* x_row = x + r * cols;
      T* y_row = y + r * cols;
      for_each_vector<T>(cols, [&](int64_t c, int64_t count) {
        const Vec h = Vec::loadu(x_row + c, count) + Vec::loadu(bias + c, count);
        vec_activation_value<A>(h).store(y_row + c, count);
      });
    }
  });
}

template <Activation A, typename T>
void bias_act_bwd(const T* grad_y, const T* x, const T* bias, T* grad_x,
                  T* y,         // rebuilt act(x + bias), or null
                  T* partials,  // [chunks, cols] zeros, when bias
                  int64_t rows, int64_t cols) {
  using Vec = Vectorized<T>;
  if (bias == nullptr) {
    at::parallel_for(0, rows * cols, kGrainElements, [&](int64_t begin, int64_t end) {
      for_each_vector<T>(end - begin, [&](int64_t j, int64_t count) {
        const int64_t i = begin + j;
        const VecValueAndGrad<T> act = vec_activation_value_and_grad<A>(Vec::loadu(x + i, count));
        (Vec::loadu(grad_y + i, count) * act.grad).store(grad_x + i, count);
        if (y != nullptr) act.value.store(y + i, count);
      });
    });
    return;
  }
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, chunks, std::max<int64_t>(1, grain_rows(cols) / kRowsPerChunk), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      T* partial = partials + k * cols;
      const int64_t row_end = std::min(rows, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < row_end; ++r) {
        const int64_t base = r * cols;
        for_each_vector<T>(cols, [&](int64_t c, int64_t count) {
          const Vec h = Vec::loadu(x + base + c, count) + Vec::loadu(bias + c, count);
          const VecValueAndGrad<T> act = vec_activation_value_and_grad<A>(h);
          const Vec grad_h = Vec::loadu(grad_y + base + c, count) * act.grad;
          grad_h.store(grad_x + base + c, count);
          if (y != nullptr) act.value.store(y + base + c, count);
          (Vec::loadu(partial + c, count) + grad_h).store(partial + c, count);
        });
      }
    }
  });
}

// x = [gate | up] rows of width 2 * d, y rows of width d: y = silu(gate + b_gate) * (up + b_up).
template <typename T>
void swiglu_fwd(const T* x, const T* bias, T* y, int64_t rows, int64_t d) {
  using Vec = Vectorized<T>;
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate_row = x + r * 2 * d;
      const T* up_row = gate_row + d;
      T* y_row = y + r * d;
      for_each_vector<T>(d, [&](int64_t c, int64_t count) {
        Vec gate = Vec::loadu(gate_row + c, count);
        Vec up = Vec::loadu(up_row + c, count);
        if (bias != nullptr) {
          gate = gate + Vec::loadu(bias + c, count);
          up = up + Vec::loadu(bias + d + c, count);
        }
        (vec_activation_value<Activation::kSilu>(gate) * up).store(y_row + c, count);
      });
    }
  });
}

template <typename T>
void swiglu_bwd(const T* grad_y, const T* x, const T* bias, T* grad_x,
                T* y,         // rebuilt output, or null
                T* partials,  // [chunks, 2 * d] zeros, or null (no bias)
                int64_t rows, int64_t d) {
  using Vec = Vectorized<T>;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::parallel_for(0, chunks, std::max<int64_t>(1, grain_rows(2 * d) / kRowsPerChunk), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      T* partial = partials != nullptr ? partials + k * 2 * d : nullptr;
      const int64_t row_end = std::min(rows, (k + 1) * kRowsPerChunk);
      for (int64_t r = k * kRowsPerChunk; r < row_end; ++r) {
        const T* gate_row = x + r * 2 * d;
        T* grad_gate_row = grad_x + r * 2 * d;
        for_each_vector<T>(d, [&](int64_t c, int64_t count) {
          Vec gate = Vec::loadu(gate_row + c, count);
          Vec up = Vec::loadu(gate_row + d + c, count);
          if (bias != nullptr) {
            gate = gate + Vec::loadu(bias + c, count);
            up = up + Vec::loadu(bias + d + c, count);
          }
          const VecValueAndGrad<T> act = vec_activation_value_and_grad<Activation::kSilu>(gate);
          const Vec g = Vec::loadu(grad_y + r * d + c, count);
          const Vec grad_gate = g * up * act.grad;
          const Vec grad_up = g * act.value;
          grad_gate.store(grad_gate_row + c, count);
          grad_up.store(grad_gate_row + d + c, count);
          if (y != nullptr) (act.value * up).store(y + r * d + c, count);
          if (partial != nullptr) {
            (Vec::loadu(partial + c, count) + grad_gate).store(partial + c, count);
            (Vec::loadu(partial + d + c, count) + grad_up).store(partial + d + c, count);
          }
        });
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// layer_norm / rms_norm.

// residual_out = x + residual, and that stored sum is what gets normalised, so the backward (which
// reads residual_out as its x) sees the same input. mean is null for RMSNorm, whose statistic is
// the root mean square about zero: its one reduction (of squares) shares the pass with the
// residual add. LayerNorm sums in that pass and takes the centred squares in a second one, over
// a row that is still in cache.
template <typename T>
void norm_fwd(const T* x, const T* residual, const T* weight, const T* bias, T* y, T* residual_out, T* mean, T* rstd,
              int64_t rows, int64_t n, T eps) {
  using Vec = Vectorized<T>;
  const T inv_n = T(1) / static_cast<T>(n);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * n;
      const T* src = x + offset;
      Vec first_sum(T(0));  // of src (LayerNorm) or of src^2 (RMSNorm)
      const auto accumulate = [&](const Vec& v) { first_sum = mean != nullptr ? first_sum + v : first_sum + v * v; };
      if (residual != nullptr) {
        T* sum = residual_out + offset;
        for_each_vector<T>(n, [&](int64_t j, int64_t count) {
          const Vec v = Vec::loadu(src + j, count) + Vec::loadu(residual + offset + j, count);
          v.store(sum + j, count);
          accumulate(v);
        });
        src = sum;
      } else {
        for_each_vector<T>(n, [&](int64_t j, int64_t count) { accumulate(Vec::loadu(src + j, count)); });
      }
      T row_mean = 0;
      T square_sum;
      if (mean != nullptr) {
        row_mean = sum_lanes(first_sum) * inv_n;
        mean[row] = row_mean;
        const Vec mean_vec(row_mean);
        Vec squares(T(0));
        for_each_vector<T>(n, [&](int64_t j, int64_t count) {
          // The tail's zero padding would add mean^2 per padded lane: mask it with the count.
          const Vec centred = Vec::loadu(src + j, count) - mean_vec;
          squares = squares + Vec::set(Vec(T(0)), centred * centred, count);
        });
        square_sum = sum_lanes(squares);
      } else {
        square_sum = sum_lanes(first_sum);
      }
      const T row_rstd = T(1) / std::sqrt(square_sum * inv_n + eps);
      rstd[row] = row_rstd;
      const Vec mean_vec(row_mean);
      const Vec rstd_vec(row_rstd);
      for_each_vector<T>(n, [&](int64_t j, int64_t count) {
        Vec value = (Vec::loadu(src + j, count) - mean_vec) * rstd_vec;
        if (weight != nullptr) value = value * Vec::loadu(weight + j, count);
        if (bias != nullptr) value = value + Vec::loadu(bias + j, count);
        value.store(y + offset + j, count);
      });
    }
  });
}

// At most this many row blocks, each summing its rows' parameter gradients into its own partial
// row; the partials are then added in block order.
constexpr int64_t kMaxRowBlocks = 64;

// grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + grad_x_extra, g = grad_y * weight;
// RMSNorm (mean == null) drops the mean(g) term. Two passes over a row: the first sums and feeds
// the parameter-gradient partials (and rebuilds y), the second, over the cached row, writes grad_x.
template <typename T>
void norm_bwd(const T* grad_y, const T* x, const T* weight, const T* bias, const T* mean, const T* rstd,
              const T* grad_x_extra, T* grad_x, T* y,
              T* weight_partials,  // [blocks, n] zeros, or null
              T* bias_partials,    // [blocks, n] zeros, or null
              int64_t rows, int64_t n, int64_t blocks) {
  using Vec = Vectorized<T>;
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  const T inv_n = T(1) / static_cast<T>(n);
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t block = block_begin; block < block_end; ++block) {
      T* weight_partial = weight_partials != nullptr ? weight_partials + block * n : nullptr;
      T* bias_partial = bias_partials != nullptr ? bias_partials + block * n : nullptr;
      const int64_t row_end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t row = block * rows_per_block; row < row_end; ++row) {
        const int64_t offset = row * n;
        const Vec mean_vec(mean != nullptr ? mean[row] : T(0));
        const T row_rstd = rstd[row];
        const Vec rstd_vec(row_rstd);
        // Padded tail lanes load zeros for grad_y, so g is zero there and adds nothing.
        Vec g_sum(T(0));
        Vec g_xhat_sum(T(0));
        for_each_vector<T>(n, [&](int64_t j, int64_t count) {
          const Vec x_hat = (Vec::loadu(x + offset + j, count) - mean_vec) * rstd_vec;
          const Vec dy = Vec::loadu(grad_y + offset + j, count);
          const Vec w = weight != nullptr ? Vec::loadu(weight + j, count) : Vec(T(1));
          const Vec g = dy * w;
          g_sum = g_sum + g;
          g_xhat_sum = g_xhat_sum + g * x_hat;
          if (weight_partial != nullptr) {
            (Vec::loadu(weight_partial + j, count) + dy * x_hat).store(weight_partial + j, count);
          }
          if (bias_partial != nullptr) (Vec::loadu(bias_partial + j, count) + dy).store(bias_partial + j, count);
          if (y != nullptr) {
            Vec value = weight != nullptr ? x_hat * w : x_hat;
            if (bias != nullptr) value = value + Vec::loadu(bias + j, count);
            value.store(y + offset + j, count);
          }
        });
        const Vec g_mean(mean != nullptr ? sum_lanes(g_sum) * inv_n : T(0));
        const Vec g_xhat_mean(sum_lanes(g_xhat_sum) * inv_n);
        for_each_vector<T>(n, [&](int64_t j, int64_t count) {
          const Vec x_hat = (Vec::loadu(x + offset + j, count) - mean_vec) * rstd_vec;
          const Vec dy = Vec::loadu(grad_y + offset + j, count);
          const Vec g = weight != nullptr ? dy * Vec::loadu(weight + j, count) : dy;
          Vec dx = rstd_vec * (g - g_mean - x_hat * g_xhat_mean);
          if (grad_x_extra != nullptr) dx = dx + Vec::loadu(grad_x_extra + offset + j, count);
          dx.store(grad_x + offset + j, count);
        });
      }
    }
  });
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

template <typename T>
T* mutable_data_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

at::Tensor partials_for(const at::Tensor& x, int64_t chunks, int64_t width) {
  return at::zeros({chunks, width}, x.options());
}

}  // namespace

void bias_act_fwd_kernel(Activation activation, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& y) {
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bias_act_fwd_cpu", [&] {
    dispatch_activation(activation, [&](auto a) {
      bias_act_fwd<decltype(a)::value, scalar_t>(x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(bias),
                                                 y.mutable_data_ptr<scalar_t>(), rows, cols);
    });
  });
}

void bias_act_bwd_kernel(Activation activation, const at::Tensor& grad_y, const at::Tensor& x,
                         const at::Tensor& bias, const at::Tensor& grad_x, const at::Tensor& y, const at::Tensor& grad_bias) {
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::Tensor partials = bias.defined() ? partials_for(x, chunks, cols) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bias_act_bwd_cpu", [&] {
    dispatch_activation(activation, [&](auto a) {
      bias_act_bwd<decltype(a)::value, scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                                 data_or_null<scalar_t>(bias), grad_x.mutable_data_ptr<scalar_t>(),
                                                 mutable_data_or_null<scalar_t>(y),
                                                 mutable_data_or_null<scalar_t>(partials), rows, cols);
    });
    if (bias.defined()) {
      reduce_partials(partials.const_data_ptr<scalar_t>(), chunks, cols, grad_bias.mutable_data_ptr<scalar_t>());
    }
  });
}

void swiglu_fwd_kernel(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& y) {
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = d == 0 ? 0 : x.numel() / (2 * d);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_fwd_cpu", [&] {
    swiglu_fwd<scalar_t>(x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(bias), y.mutable_data_ptr<scalar_t>(),
                         rows, d);
  });
}

void swiglu_bwd_kernel(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& bias, const at::Tensor& grad_x,
                       const at::Tensor& y, const at::Tensor& grad_bias) {
  const int64_t d = x.size(-1) / 2;
  const int64_t rows = d == 0 ? 0 : x.numel() / (2 * d);
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  at::Tensor partials = bias.defined() ? partials_for(x, chunks, 2 * d) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_bwd_cpu", [&] {
    swiglu_bwd<scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         data_or_null<scalar_t>(bias), grad_x.mutable_data_ptr<scalar_t>(),
                         mutable_data_or_null<scalar_t>(y), mutable_data_or_null<scalar_t>(partials), rows, d);
    if (bias.defined()) {
      reduce_partials(partials.const_data_ptr<scalar_t>(), chunks, 2 * d, grad_bias.mutable_data_ptr<scalar_t>());
    }
  });
}

void norm_fwd_kernel(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                     const at::Tensor& bias, const at::Tensor& y, const at::Tensor& residual_out, const at::Tensor& mean,
                     const at::Tensor& rstd, double eps) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_fwd_cpu", [&] {
    norm_fwd<scalar_t>(x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(residual), data_or_null<scalar_t>(weight),
                       data_or_null<scalar_t>(bias), y.mutable_data_ptr<scalar_t>(),
                       mutable_data_or_null<scalar_t>(residual_out), mutable_data_or_null<scalar_t>(mean),
                       rstd.mutable_data_ptr<scalar_t>(), rows, n, static_cast<scalar_t>(eps));
  });
}

void norm_bwd_kernel(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& grad_x_extra,
                     const at::Tensor& grad_x, const at::Tensor& y, const at::Tensor& grad_weight, const at::Tensor& grad_bias) {
  const int64_t n = x.size(-1);
  const int64_t rows = x.numel() / n;
  const int64_t blocks = std::max<int64_t>(1, std::min(rows, kMaxRowBlocks));
  at::Tensor weight_partials = grad_weight.defined() ? partials_for(x, blocks, n) : at::Tensor();
  at::Tensor bias_partials = grad_bias.defined() ? partials_for(x, blocks, n) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_bwd_cpu", [&] {
    norm_bwd<scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(weight),
                       data_or_null<scalar_t>(bias), data_or_null<scalar_t>(mean), rstd.const_data_ptr<scalar_t>(),
                       data_or_null<scalar_t>(grad_x_extra), grad_x.mutable_data_ptr<scalar_t>(),
                       mutable_data_or_null<scalar_t>(y), mutable_data_or_null<scalar_t>(weight_partials),
                       mutable_data_or_null<scalar_t>(bias_partials), rows, n, blocks);
    if (grad_weight.defined()) {
      reduce_partials(weight_partials.const_data_ptr<scalar_t>(), blocks, n, grad_weight.mutable_data_ptr<scalar_t>());
    }
    if (grad_bias.defined()) {
      reduce_partials(bias_partials.const_data_ptr<scalar_t>(), blocks, n, grad_bias.mutable_data_ptr<scalar_t>());
    }
  });
}

}  // namespace memopt::MEMOPT_CPU_ISA
