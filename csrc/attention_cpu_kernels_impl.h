// The bodies of memopt's CPU flash-attention kernels (the "cpu_flash" backend of memopt.attention),
// included at the end of cpu_kernels_impl.h so that they are compiled once per instruction set
// with its vector helpers (vec_exp, sum_lanes).
//
// The contract is memopt.ops.attention's: the forward writes the output and one natural-log
// log-sum-exp of the scaled scores per row; the backward recomputes the probabilities from q, k
// and the log-sum-exp, tile by tile, so nothing of size seq^2 is ever stored. The causal mask is
// top-left aligned (query i sees keys j <= i).
//
// Why memopt has its own: ATen's CPU flash kernel splits the keys in blocks of 512, so below that
// length a causal call computes and then masks the whole score matrix (measured at seq 256: causal
// as slow as non-causal). Here a tile of kBlockQ query rows multiplies only the keys it can see,
// [0, min(seq_k, last row + 1)): at seq 256 that is 10/16 of the score matrix instead of all of it.
// Every tile product is one BLAS GEMM on the strided rows of q, k, v (views of a fused projection
// need no copy); the row softmax runs on vectors.
//
// Work split: the forward over (batch, head, query tile); the backward over (batch, kv head), so
// that one thread owns the gradient rows of its k and v and no two threads add into the same
// memory: results do not depend on the number of threads.
//
// Dropout (AttentionDropout, cpu_kernels.h) multiplies each row of probabilities by its factors
// (1 / (1 - p) or 0, regenerated from the Philox counter of each element, nothing stored) after
// the row's sum is taken: the forward before the P V product, the backward on dP (dO V^T) before
// the softmax backward and on P before dV += P^T dO; the softmax backward itself takes the
// undropped P, so dS = P * (dP * factors - rowsum(dO * O)).
#include "cpu_blas.h"

#include <limits>
#include <vector>

namespace memopt::MEMOPT_CPU_ISA {
namespace {

// Query rows per tile, forward and backward. Measured at (2, 8, 256, 64) causal, one thread: 32
// and 128 rows were slower than 64 (forward 1.1-1.2x, backward 1.0-1.2x); 128 or 256 rows did
// not make the non-causal backward faster either.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 512;  // keys per score block (an online softmax runs across blocks)

// Keys [c0, c0 + width) that query row i sees.
inline int64_t visible_keys(bool causal, int64_t i, int64_t c0, int64_t width) {
  return causal ? std::clamp<int64_t>(i + 1 - c0, 0, width) : width;
}

template <typename T>
T row_max(const T* s, int64_t n) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  T result = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= kWidth) {
    Vectorized<T> acc = Vectorized<T>::loadu(s);
    for (j = kWidth; j + kWidth <= n; j += kWidth) {
      acc = at::vec::maximum(acc, Vectorized<T>::loadu(s + j));
    }
    result = at::vec::vec_reduce_all<T>([](const Vectorized<T>& a, const Vectorized<T>& b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; j < n; ++j) {
    result = std::max(result, s[j]);
  }
  return result;
}

// p[j] = exp(s[j] - shift) for j < n (p may be s); returns their sum when Sum.
template <bool Sum, typename T>
T exp_shifted(const T* s, T* p, int64_t n, T shift) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  const Vectorized<T> shift_v(shift);
  Vectorized<T> acc(T(0));
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    const Vectorized<T> e = vec_exp(Vectorized<T>::loadu(s + j) - shift_v);
    e.store(p + j);
    if constexpr (Sum) acc = acc + e;
  }
  T sum = Sum ? sum_lanes(acc) : T(0);
  if (j < n) {
    const Vectorized<T> e = vec_exp(Vectorized<T>::loadu(s + j, n - j) - shift_v);
    e.store(p + j, n - j);
    if constexpr (Sum) {
      for (int64_t i = j; i < n; ++i) sum += p[i];
    }
  }
  return sum;
}

template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  const Vectorized<T> f(factor);
  for_each_vector<T>(n, [&](int64_t j, int64_t count) { (Vectorized<T>::loadu(x + j, count) * f).store(x + j, count); });
}

template <typename T>
void multiply_row(T* x, const T* factors, int64_t n) {
  for_each_vector<T>(n, [&](int64_t j, int64_t count) {
    (Vectorized<T>::loadu(x + j, count) * Vectorized<T>::loadu(factors + j, count)).store(x + j, count);
  });
}

// The dropout factors of the rows of probabilities: element (b, h, i, j) is element
// ((b H + h) Sq + i) Sk + j of the mask (AttentionDropout).
template <typename T>
class RowDropout {
 public:
  RowDropout(const AttentionDropout& d, int64_t heads, int64_t seq_q, int64_t seq_k)
      : factors_(d.p, d.seed, d.offset), heads_(heads), seq_q_(seq_q), seq_k_(seq_k) {}

  // out[c] for keys key0 .. key0 + n - 1 of query row i of head (b, h).
  void factors(T* out, int64_t n, int64_t b, int64_t h, int64_t i, int64_t key0) const {
    factors_.row(out, n, static_cast<uint64_t>(((b * heads_ + h) * seq_q_ + i) * seq_k_ + key0));
  }

 private:
  DropoutFactors<T> factors_;
  int64_t heads_, seq_q_, seq_k_;
};

template <typename T>
void zero_row(T* x, int64_t n) {
  std::fill(x, x + n, T(0));
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  Vectorized<T> acc(T(0));
  for_each_vector<T>(n, [&](int64_t j, int64_t count) {
    acc = at::vec::fmadd(Vectorized<T>::loadu(a + j, count), Vectorized<T>::loadu(b + j, count), acc);
  });
  return sum_lanes(acc);
}

// dS = P * (dP - d) over the first n entries of a row (in dP's memory).
template <typename T>
void softmax_grad_row(const T* p, T* dp, int64_t n, T d) {
  const Vectorized<T> d_v(d);
  for_each_vector<T>(n, [&](int64_t j, int64_t count) {
    (Vectorized<T>::loadu(p + j, count) * (Vectorized<T>::loadu(dp + j, count) - d_v)).store(dp + j, count);
  });
}

// One (batch, head) of a (B, H, S, D) tensor whose last dimension is contiguous.
template <typename T>
struct Rows {
  T* data;
  int64_t stride;  // between rows (sequence positions)
  T* row(int64_t i) const { return data + i * stride; }
};

template <typename T>
Rows<T> head_rows(const at::Tensor& t, int64_t b, int64_t h) {
  T* base = const_cast<T*>(t.const_data_ptr<T>());
  return {base + b * t.stride(0) + h * t.stride(1), t.stride(2)};
}

template <typename T>
void attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, T scale,
                   const AttentionDropout& dropout, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2), group = heads / kv_heads;
  const int64_t tiles = (seq_q + kBlockQ - 1) / kBlockQ;
  const bool drop = dropout.p > 0.0;
  const RowDropout<T> row_dropout(dropout, heads, seq_q, seq_k);
  T* lse_data = lse.mutable_data_ptr<T>();
  at::parallel_for(0, batch * heads * tiles, 1, [&](int64_t begin, int64_t end) {
    T* const scores = scratch<T, 0>(kBlockQ * kBlockK);
    T* const acc = scratch<T, 1>(kBlockQ * head_dim);
    T* const row_max_ = scratch<T, 2>(kBlockQ);
    T* const row_sum = scratch<T, 3>(kBlockQ);
    T* const factors = drop ? scratch<T, 6>(kBlockK) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (heads * tiles), h = item / tiles % heads, r0 = item % tiles * kBlockQ;
      const int64_t rows = std::min(kBlockQ, seq_q - r0);
      const int64_t key_end = causal ? std::min(seq_k, r0 + rows) : seq_k;
      const Rows<T> q_rows = head_rows<T>(q, b, h), k_rows = head_rows<T>(k, b, h / group);
      const Rows<T> v_rows = head_rows<T>(v, b, h / group), out_rows = head_rows<T>(out, b, h);
      std::fill(row_max_, row_max_ + kBlockQ, -std::numeric_limits<T>::infinity());
      std::fill(row_sum, row_sum + kBlockQ, T(0));
      for (int64_t c0 = 0; c0 < key_end; c0 += kBlockK) {
        const int64_t width = std::min(kBlockK, key_end - c0);
        cpu_gemm(false, true, rows, width, head_dim, scale, q_rows.row(r0), q_rows.stride, k_rows.row(c0),
                 k_rows.stride, T(0), scores, kBlockK);
        for (int64_t i = 0; i < rows; ++i) {
          T* s = scores + i * kBlockK;
          const int64_t visible = visible_keys(causal, r0 + i, c0, width);
          if (visible == 0) {  // a later block of a causal row: nothing to add (never the first block)
            zero_row(s, width);
            continue;
          }
          const T new_max = std::max(row_max_[i], row_max(s, visible));
          const T rescale = c0 == 0 ? T(0) : std::exp(row_max_[i] - new_max);
          const T sum = exp_shifted<true>(s, s, visible, new_max);
          zero_row(s + visible, width - visible);
          if (drop) {
            row_dropout.factors(factors, visible, b, h, r0 + i, c0);
            multiply_row(s, factors, visible);
          }
          row_sum[i] = row_sum[i] * rescale + sum;
          row_max_[i] = new_max;
          if (c0 != 0 && rescale != T(1)) {
            scale_row(acc + i * head_dim, head_dim, rescale);
          }
        }
        cpu_gemm(false, false, rows, head_dim, width, T(1), scores, kBlockK, v_rows.row(c0), v_rows.stride,
                 c0 == 0 ? T(0) : T(1), acc, head_dim);
      }
      T* lse_row = lse_data + (b * heads + h) * seq_q + r0;
      for (int64_t i = 0; i < rows; ++i) {
        T* o = out_rows.row(r0 + i);
        const T inverse = T(1) / row_sum[i];
        const Vectorized<T> f(inverse);
        const T* a = acc + i * head_dim;
        for_each_vector<T>(head_dim, [&](int64_t j, int64_t count) { (Vectorized<T>::loadu(a + j, count) * f).store(o + j, count); });
        lse_row[i] = row_max_[i] + std::log(row_sum[i]);
      }
    }
  });
}

template <typename T>
void attention_bwd(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, bool causal, T scale,
                   const AttentionDropout& dropout, const at::Tensor& grad_q, const at::Tensor& grad_k,
                   const at::Tensor& grad_v) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2), group = heads / kv_heads;
  const bool drop = dropout.p > 0.0;
  const RowDropout<T> row_dropout(dropout, heads, seq_q, seq_k);
  const T* lse_data = lse.const_data_ptr<T>();
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    T* const probs = scratch<T, 0>(kBlockQ * kBlockK);
    T* const grad_scores = scratch<T, 1>(kBlockQ * kBlockK);
    T* const delta = scratch<T, 2>(kBlockQ);
    T* const factors = drop ? scratch<T, 6>(kBlockK) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv_head = item % kv_heads;
      const Rows<T> k_rows = head_rows<T>(k, b, kv_head), v_rows = head_rows<T>(v, b, kv_head);
      const Rows<T> dk_rows = head_rows<T>(grad_k, b, kv_head), dv_rows = head_rows<T>(grad_v, b, kv_head);
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        const Rows<T> q_rows = head_rows<T>(q, b, h), o_rows = head_rows<T>(out, b, h);
        const Rows<T> do_rows = head_rows<T>(grad_out, b, h), dq_rows = head_rows<T>(grad_q, b, h);
        const T* lse_head = lse_data + (b * heads + h) * seq_q;
        for (int64_t r0 = 0; r0 < seq_q; r0 += kBlockQ) {
          const int64_t rows = std::min(kBlockQ, seq_q - r0);
          const int64_t key_end = causal ? std::min(seq_k, r0 + rows) : seq_k;
          for (int64_t i = 0; i < rows; ++i) {
            delta[i] = dot(do_rows.row(r0 + i), o_rows.row(r0 + i), head_dim);  // rowsum(dO * O)
          }
          for (int64_t c0 = 0; c0 < key_end; c0 += kBlockK) {
            const int64_t width = std::min(kBlockK, key_end - c0);
            // P = exp(scale * q k^T - lse), zero where masked
            cpu_gemm(false, true, rows, width, head_dim, scale, q_rows.row(r0), q_rows.stride, k_rows.row(c0),
                     k_rows.stride, T(0), probs, kBlockK);
            for (int64_t i = 0; i < rows; ++i) {
              T* p = probs + i * kBlockK;
              const int64_t visible = visible_keys(causal, r0 + i, c0, width);
              exp_shifted<false>(p, p, visible, lse_head[r0 + i]);
              zero_row(p + visible, width - visible);
            }
            // dP = dO V^T (of the dropped probabilities), then dS = P * (dP * factors - rowsum(dO * O))
            // in its place; under dropout P becomes the dropped P * factors after that, for dV
            cpu_gemm(false, true, rows, width, head_dim, T(1), do_rows.row(r0), do_rows.stride, v_rows.row(c0),
                     v_rows.stride, T(0), grad_scores, kBlockK);
            for (int64_t i = 0; i < rows; ++i) {
              T* p = probs + i * kBlockK;
              T* dp = grad_scores + i * kBlockK;
              const int64_t visible = drop ? visible_keys(causal, r0 + i, c0, width) : 0;
              if (visible > 0) {
                row_dropout.factors(factors, visible, b, h, r0 + i, c0);
                multiply_row(dp, factors, visible);
              }
              softmax_grad_row(p, dp, width, delta[i]);
              if (visible > 0) {
                multiply_row(p, factors, visible);
              }
            }
            // dV += P^T dO
            cpu_gemm(true, false, width, head_dim, rows, T(1), probs, kBlockK, do_rows.row(r0), do_rows.stride,
                     T(1), dv_rows.row(c0), dv_rows.stride);
            // dQ (+)= scale * dS K, dK += scale * dS^T Q
            cpu_gemm(false, false, rows, head_dim, width, scale, grad_scores, kBlockK, k_rows.row(c0),
                     k_rows.stride, c0 == 0 ? T(0) : T(1), dq_rows.row(r0), dq_rows.stride);
            cpu_gemm(true, false, width, head_dim, rows, scale, grad_scores, kBlockK, q_rows.row(r0),
                     q_rows.stride, T(1), dk_rows.row(c0), dk_rows.stride);
          }
        }
      }
    }
  });
}

}  // namespace

void attention_fwd_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                          const AttentionDropout& dropout, const at::Tensor& out, const at::Tensor& lse) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_flash_attention_fwd", [&] {
    attention_fwd<scalar_t>(q, k, v, causal, static_cast<scalar_t>(scale), dropout, out, lse);
  });
}

void attention_bwd_kernel(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, bool causal, double scale,
                          const AttentionDropout& dropout, const at::Tensor& grad_q, const at::Tensor& grad_k,
                          const at::Tensor& grad_v) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_flash_attention_bwd", [&] {
    attention_bwd<scalar_t>(grad_out, q, k, v, out, lse, causal, static_cast<scalar_t>(scale), dropout, grad_q,
                            grad_k, grad_v);
  });
}

}  // namespace memopt::MEMOPT_CPU_ISA
