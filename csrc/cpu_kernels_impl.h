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
#include <array>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define MEMOPT_PHILOX_X8 1
#else
#define MEMOPT_PHILOX_X8 0
#endif

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
// for the last, partial one. The full vectors get the constant W, so that the partial-load
// branches of Vectorized::loadu/store fold away there.
template <typename T, typename F>
inline void for_each_vector(int64_t n, const F& f) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) f(j, kWidth);
  if (j < n) f(j, n - j);
}

// Independent accumulators of a row reduction: a single one would make every vector wait for the
// previous add (its latency, several cycles), four keep the adders busy.
constexpr int kAccumulators = 4;

template <int I>
using AccumulatorIndex = std::integral_constant<int, I>;

// Like for_each_vector, with f(j, count, accumulator): accumulator (an AccumulatorIndex) runs
// 0, 1, 2, 3, 0, 1, ... over the full vectors in groups of four, and is 0 for the rest. The
// order, and so each row's sum, depends only on n.
template <typename T, typename F>
inline void for_each_vector_accumulating(int64_t n, const F& f) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  int64_t j = 0;
  for (; j + kAccumulators * kWidth <= n; j += kAccumulators * kWidth) {
    f(j, kWidth, AccumulatorIndex<0>{});
    f(j + kWidth, kWidth, AccumulatorIndex<1>{});
    f(j + 2 * kWidth, kWidth, AccumulatorIndex<2>{});
    f(j + 3 * kWidth, kWidth, AccumulatorIndex<3>{});
  }
  for (; j + kWidth <= n; j += kWidth) f(j, kWidth, AccumulatorIndex<0>{});
  if (j < n) f(j, n - j, AccumulatorIndex<0>{});
}

template <typename T>
using Accumulators = std::array<Vectorized<T>, kAccumulators>;

template <typename T>
inline Accumulators<T> zero_accumulators() {
  return {Vectorized<T>(T(0)), Vectorized<T>(T(0)), Vectorized<T>(T(0)), Vectorized<T>(T(0))};
}

template <typename T>
inline T sum_lanes(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](const Vectorized<T>& a, const Vectorized<T>& b) { return a + b; }, v);
}

// The accumulators added in a fixed order, then the lanes.
template <typename T>
inline T sum_accumulators(const Accumulators<T>& a) {
  return sum_lanes((a[0] + a[1]) + (a[2] + a[3]));
}

// ---------------------------------------------------------------------------------------------
// Activations: activation.h's formulas on vectors (gelu_tanh rewritten with a sigmoid), built from
// the same shared pieces in the forward and the backward so that the rebuilt value is bitwise the
// forward's.

// float32 through ATen's inline exp_u20 (within 20 ulp; Sleef's exp is a call), float64 through
// Sleef's exp (1 ulp), which gradcheck needs. exp_u20 saturates large arguments instead of
// returning inf, which leaves sigmoid 0 there.
template <typename T>
inline Vectorized<T> vec_exp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// erf in float32 without exp: the rational approximation Eigen and XLA use (an odd polynomial of
// degree 13 over an even one of degree 8 on [-4, 4], where erf is +-1 in float32 outside),
// absolute error about 1e-7, like ATen's vectorized erf (Abramowitz-Stegun 7.1.26 with a Sleef
// exp) that costs an exp and a call more. ATen's minimum/maximum keep NaN, so NaN gives NaN.
inline Vectorized<float> vec_erf_float(const Vectorized<float>& v) {
  using Vec = Vectorized<float>;
  const Vec x = at::vec::minimum(at::vec::maximum(v, Vec(-4.f)), Vec(4.f));
  const Vec x2 = x * x;
  Vec p = at::vec::fmadd(x2, Vec(-2.72614225801306e-10f), Vec(2.77068142495902e-08f));
  p = at::vec::fmadd(x2, p, Vec(-2.10102402082508e-06f));
  p = at::vec::fmadd(x2, p, Vec(-5.69250639462346e-05f));
  p = at::vec::fmadd(x2, p, Vec(-7.34990630326855e-04f));
  p = at::vec::fmadd(x2, p, Vec(-2.95459980854025e-03f));
  p = at::vec::fmadd(x2, p, Vec(-1.60960333262415e-02f));
  Vec q = at::vec::fmadd(x2, Vec(-1.45660718464996e-05f), Vec(-2.13374055278905e-04f));
  q = at::vec::fmadd(x2, q, Vec(-1.68282697438203e-03f));
  q = at::vec::fmadd(x2, q, Vec(-7.37332916720468e-03f));
  q = at::vec::fmadd(x2, q, Vec(-1.42647390514189e-02f));
  return x * p / q;
}

template <typename T>
inline Vectorized<T> vec_gelu_cdf(const Vectorized<T>& x) {  // Phi(x)
  const Vectorized<T> z = x * Vectorized<T>(T(0.70710678118654752440));
  if constexpr (std::is_same_v<T, float>) {
    return at::vec::fmadd(Vectorized<T>(T(0.5)), vec_erf_float(z), Vectorized<T>(T(0.5)));
  } else {  // float64: ATen's erf (Sleef's, to 1 ulp), which gradcheck needs
    return Vectorized<T>(T(0.5)) * (Vectorized<T>(T(1)) + z.erf());
  }
}

// exp(-x^2 / 2) / sqrt(2 pi), the derivative of Phi.
template <typename T>
inline Vectorized<T> vec_gelu_pdf(const Vectorized<T>& x) {
  return vec_exp(Vectorized<T>(T(-0.5)) * x * x) * Vectorized<T>(T(0.39894228040143267794));
}

// sigmoid(z) = 1 / (1 + e), e = exp(-z), with e kept: 1 - sigmoid(z) = e sigmoid(z) exactly, and
// written so, the derivatives' s (1 - s) has no cancellation where s is near 1 (1 - s from a
// rounded s lost all but a few bits there: gelu_tanh's float32 gradient was 5.8x eager's error
// at x ~ 4.4).
template <typename T>
struct VecSigmoid {
  Vectorized<T> s;    // sigmoid(z)
  Vectorized<T> exp;  // exp(-z), so 1 - s = exp * s
};

template <typename T>
inline VecSigmoid<T> vec_sigmoid_parts(const Vectorized<T>& z) {
  const Vectorized<T> one(T(1));
  const Vectorized<T> e = vec_exp(z.neg());
  return {one / (one + e), e};
}

template <typename T>
inline Vectorized<T> vec_sigmoid(const Vectorized<T>& x) {
  return vec_sigmoid_parts(x).s;
}

// 1 - sigmoid(z): e s where s > 1/2 (e < 1), 1 - s elsewhere (no cancellation there, and e s
// would be inf * 0 = NaN where exp(-z) overflows).
template <typename T>
inline Vectorized<T> vec_one_minus_sigmoid(const VecSigmoid<T>& sig) {
  const Vectorized<T> one(T(1));
  return Vectorized<T>::blendv(sig.exp * sig.s, one - sig.s, sig.exp > one);
}

// gelu_tanh through 1 + tanh(u) = 2 sigmoid(2u): one exp instead of a (much slower) vector tanh,
// and no cancellation in 1 + tanh(u) for negative x. Returns sigmoid(2u) and exp(-2u),
// u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename T>
inline VecSigmoid<T> vec_gelu_tanh_sigmoid_parts(const Vectorized<T>& x) {
  const Vectorized<T> two_beta(T(2) * T(0.79788456080286535588));
  return vec_sigmoid_parts(two_beta * (x + Vectorized<T>(T(0.044715)) * (x * x) * x));
}

template <typename T>
inline Vectorized<T> vec_gelu_tanh_sigmoid(const Vectorized<T>& x) {
  return vec_gelu_tanh_sigmoid_parts(x).s;
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
    return {x * cdf, cdf + x * vec_gelu_pdf(x)};
  } else if constexpr (A == Activation::kGeluTanh) {
    // With s = sigmoid(2u), e = exp(-2u): (1 + tanh u)/2 = s and
    // x/2 (1 - tanh^2 u) = 2 x s (1 - s), 1 - s = e s where s > 1/2 (vec_one_minus_sigmoid).
    const Vectorized<T> two_beta(T(2) * T(0.79788456080286535588));  // 2 sqrt(2 / pi)
    const Vectorized<T> three_kappa(T(3) * T(0.044715));
    const VecSigmoid<T> sig = vec_gelu_tanh_sigmoid_parts(x);
    const Vectorized<T> s = sig.s;
    const Vectorized<T> grad = s + x * (s * vec_one_minus_sigmoid(sig)) * two_beta * (one + three_kappa * x * x);
    return {x * s, grad};
  } else {
    const VecSigmoid<T> sig = vec_sigmoid_parts(x);
    const Vectorized<T> s = sig.s;
    return {x * s, s * (one + x * vec_one_minus_sigmoid(sig))};
  }
}

// out[c] = sum over chunks k of partials[k, c] (a parameter gradient from its row blocks' partial
// sums), in an order fixed by chunks and cols: threads split the columns, never a column's sum,
// so results do not depend on the thread count. For float32 the sum is kept in float64 and
// rounded once: the bias_act / swiglu backward has one partial per 32 rows, and a float32 running
// sum over them lost ~5e-6 relative at 1M rows, 1.2e-5 at 4M (eager's pairwise sum: ~3e-7),
// while a float64 one is exact to the final rounding, up to the partials' own (32-term) error.
template <typename T>
void reduce_partials(const T* partials, int64_t chunks, int64_t cols, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    // Column tiles of kTile float64 accumulators (a local array the compiler keeps in vector
    // registers and vectorises over: float -> double conversions and adds), read row by row.
    constexpr int64_t kTile = 32;
    const int64_t tiles = (cols + kTile - 1) / kTile;
    const int64_t grain = std::max<int64_t>(1, kGrainElements / (std::max<int64_t>(chunks, 1) * kTile));
    at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t c0 = t * kTile;
        const int64_t width = std::min(kTile, cols - c0);
        double acc[kTile] = {};
        if (width == kTile) {  // constant trip count: the accumulators stay in registers
          for (int64_t k = 0; k < chunks; ++k) {
            const float* row = partials + k * cols + c0;
            for (int64_t c = 0; c < kTile; ++c) acc[c] += static_cast<double>(row[c]);
          }
        } else {
          // The last, narrower tile (all of a row narrower than kTile): its accumulators live in
          // memory, so four sets (chunk k into set k % 4, added at the end) keep four chunks'
          // adds in flight instead of one store-to-load chain (2.7x slower at 8 columns).
          double sets[4][kTile] = {};
          int64_t k = 0;
          for (; k + 4 <= chunks; k += 4) {
            for (int s = 0; s < 4; ++s) {
              const float* row = partials + (k + s) * cols + c0;
              for (int64_t c = 0; c < width; ++c) sets[s][c] += static_cast<double>(row[c]);
            }
          }
          for (; k < chunks; ++k) {
            const float* row = partials + k * cols + c0;
            for (int64_t c = 0; c < width; ++c) sets[0][c] += static_cast<double>(row[c]);
          }
          for (int64_t c = 0; c < width; ++c) acc[c] = (sets[0][c] + sets[1][c]) + (sets[2][c] + sets[3][c]);
        }
        for (int64_t c = 0; c < width; ++c) out[c0 + c] = static_cast<float>(acc[c]);
      }
    });
  } else {
    using Vec = Vectorized<T>;
    at::parallel_for(0, cols, kGrainElements / std::max<int64_t>(chunks, 1) + 1, [&](int64_t begin, int64_t end) {
      for_each_vector<T>(end - begin, [&](int64_t j, int64_t count) {
        Vec total(T(0));
        for (int64_t k = 0; k < chunks; ++k) total = total + Vec::loadu(partials + k * cols + begin + j, count);
        total.store(out + begin + j, count);
      });
    });
  }
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
                  T* partials,  // [chunks, cols] zeros, when bias (also when its gradient was not asked
                                // for: the same code, so grad_x keeps its bits; the sum is dropped)
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
                T* partials,  // [chunks, 2 * d] zeros, or null (no bias, or its gradient not asked for)
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
//
// Note: the optional inputs (weight, bias, residual gradient, rebuilt output, parameter gradients,
// LayerNorm's mean) are compile-time flags of the row loops below, dispatched once per call
// (with_constant); only the bias of the backward's rebuilt y (a recompute path) stays a runtime
// test, which would otherwise double the backward's instantiations. GCC unswitches two or three
// such tests out of a vector loop, not the six of the backward: with them as runtime tests the
// backward ran 10-15% slower at 512 x 2048 and 2048 x 1024 float32 (one thread, this project's CPU
// machine), which put layer_norm's forward + backward at parity with ATen's instead of below it.

// f(std::true_type{}) or f(std::false_type{}): a runtime flag handed to f as a compile-time one.
template <typename F>
inline void with_constant(bool flag, const F& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Asks for the cache line holding p[j] to be brought into L2 (not L1, where it would evict the row
// being worked on), once per line: a row's second pass calls it for the next row, whose first pass
// then finds its data in L2 instead of waiting for memory. Only for rows of a 4 KiB page or more:
// the hardware prefetchers stop at a page boundary, so each such row starts cold, while shorter
// rows share pages and the prefetchers run on. Measured on float32, one thread: the forward at
// 512 x 2048 from cold caches 0.78-0.82 -> 0.57-0.63 ms; at 512 x 512 (2 KiB rows) the prefetches
// made the forward 0.75 -> 0.86x ATen's.
constexpr int64_t kPageBytes = 4096;

template <typename T>
inline bool prefetch_rows(int64_t n) {
  return n * static_cast<int64_t>(sizeof(T)) >= kPageBytes;
}

template <typename T>
inline void prefetch_row_l2(const T* p, int64_t j) {
#if defined(__GNUC__)
  constexpr int64_t kLineElements = 64 / static_cast<int64_t>(sizeof(T));
  if (j % kLineElements == 0) __builtin_prefetch(p + j, 0, 2);
#else
  (void)p;
  (void)j;
#endif
}

// y = x_hat * weight + bias, written out once for the forward and the backward's rebuilt y: with
// both parameters it is one explicit fused multiply-add (at::vec::fmadd), so the compiler has no
// multiply and add of its own to contract in one and not the other (GCC contracts them when both
// are in one basic block), and the rebuilt y is bitwise the forward's.
template <bool kWeight, bool kBias, typename T>
inline Vectorized<T> norm_affine(const Vectorized<T>& x_hat, const T* weight, const T* bias, int64_t j, int64_t count) {
  using Vec = Vectorized<T>;
  if constexpr (kWeight && kBias) {
    return at::vec::fmadd(x_hat, Vec::loadu(weight + j, count), Vec::loadu(bias + j, count));
  } else if constexpr (kWeight) {
    return x_hat * Vec::loadu(weight + j, count);
  } else if constexpr (kBias) {
    return x_hat + Vec::loadu(bias + j, count);
  } else {
    return x_hat;
  }
}

// residual_out = x + residual, and that stored sum is what gets normalised, so the backward (which
// reads residual_out as its x) sees the same input. kLayerNorm false is RMSNorm, whose statistic
// is the root mean square about zero: its one reduction (of squares) shares the pass with the
// residual add. LayerNorm sums in that pass and takes the centred squares in a second one, over
// a row that is still in cache.
template <typename T, bool kLayerNorm, bool kWeight, bool kBias>
void norm_fwd_rows(const T* x, const T* residual, const T* weight, const T* bias, T* y, T* residual_out, T* mean,
                   T* rstd, int64_t rows, int64_t n, T eps) {
  using Vec = Vectorized<T>;
  const T inv_n = T(1) / static_cast<T>(n);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t offset = row * n;
      const T* src = x + offset;
      Accumulators<T> first_sum = zero_accumulators<T>();  // of src (LayerNorm) or of src^2 (RMSNorm)
      const auto accumulate = [&](const Vec& v, auto a) {
        if constexpr (kLayerNorm) {
          first_sum[a] = first_sum[a] + v;
        } else {
          first_sum[a] = first_sum[a] + v * v;
        }
      };
      if (residual != nullptr) {
        T* sum = residual_out + offset;
        for_each_vector_accumulating<T>(n, [&](int64_t j, int64_t count, auto a) {
          const Vec v = Vec::loadu(src + j, count) + Vec::loadu(residual + offset + j, count);
          v.store(sum + j, count);
          accumulate(v, a);
        });
        src = sum;
      } else {
        for_each_vector_accumulating<T>(n, [&](int64_t j, int64_t count, auto a) {
          accumulate(Vec::loadu(src + j, count), a);
        });
      }
      T row_mean = 0;
      T square_sum;
      if constexpr (kLayerNorm) {
        row_mean = sum_accumulators(first_sum) * inv_n;
        mean[row] = row_mean;
        const Vec mean_vec(row_mean);
        Accumulators<T> squares = zero_accumulators<T>();
        for_each_vector_accumulating<T>(n, [&](int64_t j, int64_t count, auto a) {
          const Vec centred = Vec::loadu(src + j, count) - mean_vec;
          if (count == Vec::size()) {
            squares[a] = squares[a] + centred * centred;
          } else {  // the tail's zero padding would add mean^2 per padded lane: mask it
            squares[a] = squares[a] + Vec::set(Vec(T(0)), centred * centred, count);
          }
        });
        square_sum = sum_accumulators(squares);
      } else {
        square_sum = sum_accumulators(first_sum);
      }
      const T row_rstd = T(1) / std::sqrt(square_sum * inv_n + eps);
      rstd[row] = row_rstd;
      const Vec mean_vec(row_mean);
      const Vec rstd_vec(row_rstd);
      const bool prefetch_next = row + 1 < end && prefetch_rows<T>(n);
      for_each_vector<T>(n, [&](int64_t j, int64_t count) {
        if (prefetch_next) {
          prefetch_row_l2(x + offset + n, j);
          if (residual != nullptr) prefetch_row_l2(residual + offset + n, j);
        }
        const Vec x_hat = (Vec::loadu(src + j, count) - mean_vec) * rstd_vec;
        norm_affine<kWeight, kBias>(x_hat, weight, bias, j, count).store(y + offset + j, count);
      });
    }
  });
}

// mean is null for RMSNorm.
template <typename T>
void norm_fwd(const T* x, const T* residual, const T* weight, const T* bias, T* y, T* residual_out, T* mean, T* rstd,
              int64_t rows, int64_t n, T eps) {
  with_constant(mean != nullptr, [&](auto layer_norm) {
    with_constant(weight != nullptr, [&](auto has_weight) {
      with_constant(bias != nullptr, [&](auto has_bias) {
        norm_fwd_rows<T, decltype(layer_norm)::value, decltype(has_weight)::value, decltype(has_bias)::value>(
            x, residual, weight, bias, y, residual_out, mean, rstd, rows, n, eps);
      });
    });
  });
}

// Row blocks of the norm backward, each summing its rows' parameter gradients into its own
// partial row; the partials are then added in block order. At most 64 of them, with at least
// 64K elements each (the partials are zeroed, written and read again: at 512 x 512, 64 blocks
// of 8 rows would add a quarter to the kernel's traffic). The count depends on the shape only.
constexpr int64_t kMaxRowBlocks = 64;
constexpr int64_t kMinBlockElements = 65536;

int64_t norm_row_blocks(int64_t rows, int64_t n) {
  return std::max<int64_t>(1, std::min({rows, kMaxRowBlocks, rows * n / kMinBlockElements}));
}

// Which optional inputs and outputs a norm backward has (see norm_bwd).
template <bool LayerNorm, bool Weight, bool WeightGrad, bool BiasGrad, bool RebuildY, bool GradXExtra>
struct NormBwdFlags {
  static constexpr bool kLayerNorm = LayerNorm;
  static constexpr bool kWeight = Weight;
  static constexpr bool kWeightGrad = WeightGrad;
  static constexpr bool kBiasGrad = BiasGrad;
  static constexpr bool kRebuildY = RebuildY;
  static constexpr bool kGradXExtra = GradXExtra;
};

// grad_x = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + grad_x_extra, g = grad_y * weight;
// RMSNorm drops the mean(g) term. Two passes over a row: the first sums and feeds the
// parameter-gradient partials (and rebuilds y), the second, over the cached row, writes grad_x
// and asks for the next row's inputs (rows of a page or more, prefetch_rows).
template <typename T, typename Flags>
void norm_bwd_rows(const T* grad_y, const T* x, const T* weight, const T* bias, const T* mean, const T* rstd,
                   const T* grad_x_extra, T* grad_x, T* y, T* weight_partials, T* bias_partials, int64_t rows,
                   int64_t n, int64_t blocks) {
  using Vec = Vectorized<T>;
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  const T inv_n = T(1) / static_cast<T>(n);
  // float32: a block's partial row holds at most kRowsPerChunk rows' sum at a time, then is added
  // into float64 accumulators and zeroed (and at the block's end holds the rounded float64 sum):
  // one float32 running sum over a block's rows (16K rows of a 1M x 8 input) lost up to 12x
  // F.rms_norm's error in the weight gradient.
  constexpr bool kFlush = std::is_same_v<T, float> && (Flags::kWeightGrad || Flags::kBiasGrad);
  at::parallel_for(0, blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    std::vector<double> weight_acc, bias_acc;
    if constexpr (kFlush) {
      if (Flags::kWeightGrad) weight_acc.resize(n);
      if (Flags::kBiasGrad) bias_acc.resize(n);
    }
    // partial[c] into acc[c] (round: partial[c] = acc[c], acc zeroed; else partial[c] zeroed).
    const auto flush = [n](T* partial, double* acc, bool round) {
      if (partial == nullptr) return;
      if (round) {
        for (int64_t c = 0; c < n; ++c) {
          partial[c] = static_cast<T>(acc[c] + static_cast<double>(partial[c]));
          acc[c] = 0.0;
        }
      } else {
        for (int64_t c = 0; c < n; ++c) {
          acc[c] += static_cast<double>(partial[c]);
          partial[c] = T(0);
        }
      }
    };
    for (int64_t block = block_begin; block < block_end; ++block) {
      T* weight_partial = Flags::kWeightGrad ? weight_partials + block * n : nullptr;
      T* bias_partial = Flags::kBiasGrad ? bias_partials + block * n : nullptr;
      const int64_t row_begin = block * rows_per_block;
      const int64_t row_end = std::min(rows, (block + 1) * rows_per_block);
      for (int64_t row = row_begin; row < row_end; ++row) {
        if constexpr (kFlush) {
          if (row != row_begin && (row - row_begin) % kRowsPerChunk == 0) {
            flush(weight_partial, weight_acc.data(), false);
            flush(bias_partial, bias_acc.data(), false);
          }
        }
        const int64_t offset = row * n;
        const Vec mean_vec(Flags::kLayerNorm ? mean[row] : T(0));
        const T row_rstd = rstd[row];
        const Vec rstd_vec(row_rstd);
        // Padded tail lanes load zeros for grad_y, so g is zero there and adds nothing.
        Accumulators<T> g_sum = zero_accumulators<T>();
        Accumulators<T> g_xhat_sum = zero_accumulators<T>();
        for_each_vector_accumulating<T>(n, [&](int64_t j, int64_t count, auto a) {
          const Vec x_hat = (Vec::loadu(x + offset + j, count) - mean_vec) * rstd_vec;
          const Vec dy = Vec::loadu(grad_y + offset + j, count);
          const Vec w = Flags::kWeight ? Vec::loadu(weight + j, count) : Vec(T(1));
          const Vec g = dy * w;
          if constexpr (Flags::kLayerNorm) g_sum[a] = g_sum[a] + g;
          g_xhat_sum[a] = g_xhat_sum[a] + g * x_hat;
          if constexpr (Flags::kWeightGrad) {
            (Vec::loadu(weight_partial + j, count) + dy * x_hat).store(weight_partial + j, count);
          }
          if constexpr (Flags::kBiasGrad) {
            (Vec::loadu(bias_partial + j, count) + dy).store(bias_partial + j, count);
          }
          if constexpr (Flags::kRebuildY) {
            const Vec value = bias != nullptr ? norm_affine<Flags::kWeight, true>(x_hat, weight, bias, j, count)
                                              : norm_affine<Flags::kWeight, false>(x_hat, weight, bias, j, count);
            value.store(y + offset + j, count);
          }
        });
        const Vec g_mean(Flags::kLayerNorm ? sum_accumulators(g_sum) * inv_n : T(0));
        const Vec g_xhat_mean(sum_accumulators(g_xhat_sum) * inv_n);
        const bool prefetch_next = row + 1 < rows && prefetch_rows<T>(n);
        for_each_vector<T>(n, [&](int64_t j, int64_t count) {
          if (prefetch_next) {
            prefetch_row_l2(x + offset + n, j);
            prefetch_row_l2(grad_y + offset + n, j);
            if constexpr (Flags::kGradXExtra) prefetch_row_l2(grad_x_extra + offset + n, j);
          }
          const Vec x_hat = (Vec::loadu(x + offset + j, count) - mean_vec) * rstd_vec;
          const Vec dy = Vec::loadu(grad_y + offset + j, count);
          const Vec g = Flags::kWeight ? dy * Vec::loadu(weight + j, count) : dy;
          Vec dx = rstd_vec * (g - g_mean - x_hat * g_xhat_mean);
          if constexpr (Flags::kGradXExtra) dx = dx + Vec::loadu(grad_x_extra + offset + j, count);
          dx.store(grad_x + offset + j, count);
        });
      }
      if constexpr (kFlush) {
        if (row_end - row_begin > kRowsPerChunk) {  // else the partial is the whole sum already
          flush(weight_partial, weight_acc.data(), true);
          flush(bias_partial, bias_acc.data(), true);
        }
      }
    }
  });
}

// mean is null for RMSNorm; weight, bias, grad_x_extra, y (the rebuilt output) and the partials
// ([blocks, n] zeros) are null where absent. A weight gradient needs the weight, a bias gradient
// LayerNorm.
template <typename T>
void norm_bwd(const T* grad_y, const T* x, const T* weight, const T* bias, const T* mean, const T* rstd,
              const T* grad_x_extra, T* grad_x, T* y, T* weight_partials, T* bias_partials, int64_t rows, int64_t n,
              int64_t blocks) {
  if (rows == 0) return;  // (an empty mean reads as null)
  TORCH_INTERNAL_ASSERT(weight_partials == nullptr || weight != nullptr, "norm_bwd: a weight gradient without weight");
  TORCH_INTERNAL_ASSERT(bias_partials == nullptr || mean != nullptr, "norm_bwd: a bias gradient without LayerNorm");
  with_constant(mean != nullptr, [&](auto layer_norm) {
    with_constant(weight != nullptr, [&](auto has_weight) {
      with_constant(weight_partials != nullptr, [&](auto weight_grad) {
        with_constant(bias_partials != nullptr, [&](auto bias_grad) {
          with_constant(y != nullptr, [&](auto rebuild_y) {
            with_constant(grad_x_extra != nullptr, [&](auto grad_x_extra_flag) {
              // Combinations the asserts above rule out are not instantiated.
              constexpr bool kLayerNorm = decltype(layer_norm)::value, kWeight = decltype(has_weight)::value;
              constexpr bool kWeightGrad = decltype(weight_grad)::value, kBiasGrad = decltype(bias_grad)::value;
              if constexpr ((!kWeightGrad || kWeight) && (!kBiasGrad || kLayerNorm)) {
                using Flags = NormBwdFlags<kLayerNorm, kWeight, kWeightGrad, kBiasGrad, decltype(rebuild_y)::value,
                                           decltype(grad_x_extra_flag)::value>;
                norm_bwd_rows<T, Flags>(grad_y, x, weight, bias, mean, rstd, grad_x_extra, grad_x, y, weight_partials,
                                        bias_partials, rows, n, blocks);
              }
            });
          });
        });
      });
    });
  });
}

// ---------------------------------------------------------------------------------------------
// dropout_add: the Philox4x32-10 mask of philox.h regenerated in the kernel, eight Philox calls at
// a time with 256-bit integer instructions in the AVX2 and AVX-512 builds, one at a time in the
// baseline build. Both give philox.h's words, so the mask does not depend on the build, the
// thread count or where a thread's range starts.
//
// out = x * factor (+ residual), factor = 1 / (1 - p) where kept and 0 where dropped: the product
// torch's dropout forms (x * mask * scale), so a NaN or inf of x gives NaN at a dropped position,
// as in torch. The backward is the same kernel on grad_out.

// Elements per vector block: 8 Philox calls of 4 words.
constexpr int64_t kDropoutBlock = 32;

template <typename T>
inline T dropout_factor(uint32_t word, uint32_t threshold, T scale) {
  return word >= threshold ? scale : T(0);
}

// Elements [4 * group, min(4 * group + 4, end)) one Philox call at a time.
template <typename T>
inline void dropout_add_groups(const T* x, const T* residual, T* out, int64_t begin, int64_t end, uint32_t threshold,
                               T scale, uint64_t seed, uint64_t offset) {
  for (int64_t group = begin / 4; 4 * group < end; ++group) {
    const PhiloxBlock words = philox4x32_10(offset + static_cast<uint64_t>(group), seed);
    for (int j = 0; j < 4; ++j) {
      const int64_t i = 4 * group + j;
      if (i >= end) break;
      T value = x[i] * dropout_factor(words.v[j], threshold, scale);
      if (residual != nullptr) value += residual[i];
      out[i] = value;
    }
  }
}

#if MEMOPT_PHILOX_X8

// The per-round keys of philox4x32_10, broadcast to 8 lanes.
struct PhiloxKeysX8 {
  __m256i k0[10];
  __m256i k1[10];
  explicit PhiloxKeysX8(uint64_t seed) {
    uint32_t k0_value = static_cast<uint32_t>(seed), k1_value = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      k0[round] = _mm256_set1_epi32(static_cast<int>(k0_value));
      k1[round] = _mm256_set1_epi32(static_cast<int>(k1_value));
      k0_value += 0x9E3779B9u;
      k1_value += 0xBB67AE85u;
    }
  }
};

// lo/hi 32 bits of multiplier * c per 32-bit lane (multiplier broadcast).
inline void mulhilo_x8(__m256i multiplier, __m256i c, __m256i& lo, __m256i& hi) {
  const __m256i even = _mm256_mul_epu32(multiplier, c);                         // lanes 0, 2, 4, 6
  const __m256i odd = _mm256_mul_epu32(multiplier, _mm256_srli_epi64(c, 32));  // lanes 1, 3, 5, 7
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// Keep masks (all ones where kept) of the 32 elements from 4 * group on, in element order:
// masks[v] holds elements 8v .. 8v + 7.
inline void dropout_keep_masks_x8(uint64_t counter, const PhiloxKeysX8& keys, uint32_t threshold, __m256i masks[4]) {
  alignas(32) uint32_t counter_lo[8];
  alignas(32) uint32_t counter_hi[8];
  for (int lane = 0; lane < 8; ++lane) {
    const uint64_t value = counter + static_cast<uint64_t>(lane);
    counter_lo[lane] = static_cast<uint32_t>(value);
    counter_hi[lane] = static_cast<uint32_t>(value >> 32);
  }
  const __m256i round_a = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i round_b = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(counter_lo));
  __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(counter_hi));
  __m256i c2 = _mm256_setzero_si256();
  __m256i c3 = _mm256_setzero_si256();
  for (int round = 0; round < 10; ++round) {
    __m256i lo_a, hi_a, lo_b, hi_b;
    mulhilo_x8(round_a, c0, lo_a, hi_a);
    mulhilo_x8(round_b, c2, lo_b, hi_b);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), keys.k0[round]);
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), keys.k1[round]);
    c1 = lo_b;
    c3 = lo_a;
  }
  // word >= threshold (unsigned) <=> max(word, threshold) == word
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(threshold));
  const auto keep = [&](__m256i w) { return _mm256_cmpeq_epi32(_mm256_max_epu32(w, limit), w); };
  const __m256i r0 = keep(c0), r1 = keep(c1), r2 = keep(c2), r3 = keep(c3);  // word j of calls 0..7
  // Transpose 4 words x 8 calls into element order (element 4 * call + word).
  const __m256i t0 = _mm256_unpacklo_epi32(r0, r1);  // calls 0, 1 | 4, 5 of words 0, 1
  const __m256i t1 = _mm256_unpackhi_epi32(r0, r1);  // calls 2, 3 | 6, 7 of words 0, 1
  const __m256i t2 = _mm256_unpacklo_epi32(r2, r3);
  const __m256i t3 = _mm256_unpackhi_epi32(r2, r3);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2);  // call 0 | call 4
  const __m256i u1 = _mm256_unpackhi_epi64(t0, t2);  // call 1 | call 5
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3);  // call 2 | call 6
  const __m256i u3 = _mm256_unpackhi_epi64(t1, t3);  // call 3 | call 7
  masks[0] = _mm256_permute2x128_si256(u0, u1, 0x20);
  masks[1] = _mm256_permute2x128_si256(u2, u3, 0x20);
  masks[2] = _mm256_permute2x128_si256(u0, u1, 0x31);
  masks[3] = _mm256_permute2x128_si256(u2, u3, 0x31);
}

// The factors (scale where the mask is all ones, else 0) of the block's floats 8v .. 8v + 7, or of
// its doubles 4v .. 4v + 3 (each 8-lane mask widens to two 4-lane ones).
inline __m256 dropout_factor_vector(const __m256i masks[4], int v, float scale) {
  return _mm256_castsi256_ps(_mm256_and_si256(masks[v], _mm256_castps_si256(_mm256_set1_ps(scale))));
}

inline __m256d dropout_factor_vector(const __m256i masks[4], int v, double scale) {
  const __m128i half = (v % 2 == 0) ? _mm256_castsi256_si128(masks[v / 2]) : _mm256_extracti128_si256(masks[v / 2], 1);
  return _mm256_castsi256_pd(_mm256_and_si256(_mm256_cvtepi32_epi64(half), _mm256_castpd_si256(_mm256_set1_pd(scale))));
}

// out[0 .. 32) = x * factor (+ residual).
inline void dropout_apply_x8(const float* x, const float* residual, float* out, const __m256i masks[4], float scale) {
  for (int v = 0; v < 4; ++v) {
    __m256 value = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * v), dropout_factor_vector(masks, v, scale));
    if (residual != nullptr) value = _mm256_add_ps(value, _mm256_loadu_ps(residual + 8 * v));
    _mm256_storeu_ps(out + 8 * v, value);
  }
}

inline void dropout_apply_x8(const double* x, const double* residual, double* out, const __m256i masks[4],
                             double scale) {
  for (int v = 0; v < 8; ++v) {
    __m256d value = _mm256_mul_pd(_mm256_loadu_pd(x + 4 * v), dropout_factor_vector(masks, v, scale));
    if (residual != nullptr) value = _mm256_add_pd(value, _mm256_loadu_pd(residual + 4 * v));
    _mm256_storeu_pd(out + 4 * v, value);
  }
}

#endif  // MEMOPT_PHILOX_X8

// Blocks of 32 elements are split over threads; a block's 8 Philox calls run together, the last,
// partial block's one at a time.
template <typename T>
void dropout_add(const T* x, const T* residual, T* out, int64_t numel, double p, uint64_t seed, uint64_t offset) {
  const uint32_t threshold = dropout_threshold(p);
  const T scale = static_cast<T>(1.0 / (1.0 - p));
  const int64_t blocks = (numel + kDropoutBlock - 1) / kDropoutBlock;
  at::parallel_for(0, blocks, kGrainElements / kDropoutBlock, [&](int64_t begin, int64_t end) {
#if MEMOPT_PHILOX_X8
    const PhiloxKeysX8 keys(seed);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t start = block * kDropoutBlock;
      if (start + kDropoutBlock > numel) {
        dropout_add_groups(x, residual, out, start, numel, threshold, scale, seed, offset);
        continue;
      }
      __m256i masks[4];
      dropout_keep_masks_x8(offset + static_cast<uint64_t>(start / 4), keys, threshold, masks);
      dropout_apply_x8(x + start, residual != nullptr ? residual + start : nullptr, out + start, masks, scale);
    }
#else
    dropout_add_groups(x, residual, out, begin * kDropoutBlock, std::min(numel, end * kDropoutBlock), threshold, scale,
                       seed, offset);
#endif
  });
}

// The dropout factors (scale or 0) of a row of consecutive elements of a larger tensor, whose first
// element need not start a Philox call: the attention kernels' rows of probabilities
// (attention_cpu_kernels_impl.h). The same words as dropout_add, so the same mask.
template <typename T>
class DropoutFactors {
 public:
  DropoutFactors(double p, uint64_t seed, uint64_t offset)
      : threshold_(dropout_threshold(p)), scale_(static_cast<T>(1.0 / (1.0 - p))), seed_(seed), offset_(offset)
#if MEMOPT_PHILOX_X8
        , keys_(seed)
#endif
  {
  }

  // factors[c] for elements first .. first + n - 1.
  void row(T* factors, int64_t n, uint64_t first) const {
    int64_t c = 0;
    // One Philox call per group of 4 elements, from element c up to `stop`.
    const auto groups_until = [&](int64_t stop) {
      while (c < stop) {
        const uint64_t element = first + static_cast<uint64_t>(c);
        const PhiloxBlock words = philox4x32_10(offset_ + element / 4, seed_);
        for (uint64_t w = element % 4; w < 4 && c < stop; ++w, ++c) {
          factors[c] = dropout_factor(words.v[w], threshold_, scale_);
        }
      }
    };
    groups_until(std::min<int64_t>(n, static_cast<int64_t>((4 - first % 4) % 4)));
#if MEMOPT_PHILOX_X8
    for (; c + kDropoutBlock <= n; c += kDropoutBlock) {
      __m256i masks[4];
      dropout_keep_masks_x8(offset_ + (first + static_cast<uint64_t>(c)) / 4, keys_, threshold_, masks);
      store_factors_x8(factors + c, masks);
    }
#endif
    groups_until(n);
  }

 private:
#if MEMOPT_PHILOX_X8
  // factors[0 .. 32) = scale where the mask is all ones, else 0.
  void store_factors_x8(float* factors, const __m256i masks[4]) const {
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(factors + 8 * v, dropout_factor_vector(masks, v, scale_));
  }
  void store_factors_x8(double* factors, const __m256i masks[4]) const {
    for (int v = 0; v < 8; ++v) _mm256_storeu_pd(factors + 4 * v, dropout_factor_vector(masks, v, scale_));
  }
#endif

  uint32_t threshold_;
  T scale_;
  uint64_t seed_, offset_;
#if MEMOPT_PHILOX_X8
  PhiloxKeysX8 keys_;
#endif
};

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

template <typename T>
T* mutable_data_or_null(const at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<T>() : nullptr;
}

// Per-thread scratch that outlives the call (it only grows). A buffer of 128 KiB or more made per
// call would be mapped fresh by glibc's malloc each time and page-fault its way in: the norm
// backward's partials at 512 x 2048 (16 x 2048 floats each) took 20 page faults a call and made it
// 9% slower than ATen's with cold caches. Slots 0-3 are the attention kernels' tiles, 4 and 5
// the backward partials below, 6 the attention kernels' row of dropout factors, 7 and 8 their
// k^T and v^T.
template <typename T, int Slot>
T* scratch(int64_t elements) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements) {
    buffer.resize(elements);
  }
  return buffer.data();
}

// Partials above this size get a tensor of their own, so no thread keeps more than this per slot.
constexpr int64_t kMaxScratchPartialBytes = 4 << 20;

// Zeroed [chunks, width] partial sums of a parameter gradient, in the launching thread's scratch
// (slot Slot) or, when larger than kMaxScratchPartialBytes, in `holder`. The workers of the
// launcher's at::parallel_for write into it; it is read back (reduce_partials) before the
// launcher returns.
template <typename T, int Slot>
T* zeroed_partials(int64_t chunks, int64_t width, const at::Tensor& like, at::Tensor& holder) {
  const int64_t elements = chunks * width;
  if (elements * static_cast<int64_t>(sizeof(T)) > kMaxScratchPartialBytes) {
    holder = at::zeros({chunks, width}, like.options());
    return holder.mutable_data_ptr<T>();
  }
  T* partials = scratch<T, Slot>(elements);
  std::fill_n(partials, elements, T(0));
  return partials;
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
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "bias_act_bwd_cpu", [&] {
    at::Tensor holder;
    // With a bias the partials are summed even when its gradient was not asked for (a frozen
    // bias): a second row loop without them compiled to other bits of grad_x (float64 GELU with
    // torch 2.11's headers), and the sum is a small part of the pass.
    scalar_t* partials = bias.defined() ? zeroed_partials<scalar_t, 4>(chunks, cols, x, holder) : nullptr;
    dispatch_activation(activation, [&](auto a) {
      bias_act_bwd<decltype(a)::value, scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                                 data_or_null<scalar_t>(bias), grad_x.mutable_data_ptr<scalar_t>(),
                                                 mutable_data_or_null<scalar_t>(y),
                                                 partials, rows, cols);
    });
    if (grad_bias.defined()) {
      reduce_partials<scalar_t>(partials, chunks, cols, grad_bias.mutable_data_ptr<scalar_t>());
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
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "swiglu_bwd_cpu", [&] {
    at::Tensor holder;
    scalar_t* partials = grad_bias.defined() ? zeroed_partials<scalar_t, 4>(chunks, 2 * d, x, holder) : nullptr;
    swiglu_bwd<scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                         data_or_null<scalar_t>(bias), grad_x.mutable_data_ptr<scalar_t>(),
                         mutable_data_or_null<scalar_t>(y), partials, rows, d);
    if (grad_bias.defined()) {
      reduce_partials<scalar_t>(partials, chunks, 2 * d, grad_bias.mutable_data_ptr<scalar_t>());
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
  const int64_t blocks = norm_row_blocks(rows, n);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "norm_bwd_cpu", [&] {
    at::Tensor weight_holder, bias_holder;
    scalar_t* weight_partials =
        grad_weight.defined() ? zeroed_partials<scalar_t, 4>(blocks, n, x, weight_holder) : nullptr;
    scalar_t* bias_partials = grad_bias.defined() ? zeroed_partials<scalar_t, 5>(blocks, n, x, bias_holder) : nullptr;
    norm_bwd<scalar_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(weight),
                       data_or_null<scalar_t>(bias), data_or_null<scalar_t>(mean), rstd.const_data_ptr<scalar_t>(),
                       data_or_null<scalar_t>(grad_x_extra), grad_x.mutable_data_ptr<scalar_t>(),
                       mutable_data_or_null<scalar_t>(y), weight_partials, bias_partials, rows, n, blocks);
    if (grad_weight.defined()) {
      reduce_partials<scalar_t>(weight_partials, blocks, n, grad_weight.mutable_data_ptr<scalar_t>());
    }
    if (grad_bias.defined()) {
      reduce_partials<scalar_t>(bias_partials, blocks, n, grad_bias.mutable_data_ptr<scalar_t>());
    }
  });
}

void dropout_add_kernel(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& out, double p, uint64_t seed,
                        uint64_t offset) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "dropout_add_cpu", [&] {
    dropout_add<scalar_t>(x.const_data_ptr<scalar_t>(), data_or_null<scalar_t>(residual),
                          out.mutable_data_ptr<scalar_t>(), x.numel(), p, seed, offset);
  });
}

}  // namespace memopt::MEMOPT_CPU_ISA

// memopt's CPU flash-attention kernels, with the vector helpers above.
#include "attention_cpu_kernels_impl.h"
