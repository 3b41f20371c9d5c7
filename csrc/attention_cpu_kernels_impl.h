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
// Every tile product runs on vectors here (tile_gemm: a block of 4 rows of the product held in
// registers, the other operand's rows loaded and each element of the first broadcast), on the
// strided rows of q, k, v (views of a fused projection need no copy) and on k^T and v^T, transposed
// once per head; each block of 4 query rows multiplies only the keys its last row sees, so a causal
// tile computes about 1/64 of its masked part instead of half. One thread, (2, 8, 256, 64) causal:
// MKL's sgemm took these tiles at 87-92 GFLOP/s, tile_gemm at 114, measured on this project's
// development host (AMD EPYC, AVX-512), and it needs no BLAS. The row softmax runs on vectors.
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

// ---------------------------------------------------------------------------------------------
// Tile products. C (ldc) = alpha * A B, or C + alpha * A B when accumulate, over row blocks of C:
// A(r, k) = a[r * a_row + k * a_col] (any strides: q, p or p^T, ds or ds^T), B's rows contiguous
// (ldb apart). Every element sums its k in increasing order with fused multiply-adds, so a product
// does not depend on the thread count or on where a row block starts.

// Rows of C held in registers per block: 4 x 2 vectors (8 accumulators, the FMA latency covered)
// measured 114 GFLOP/s against 107 for 6 x 2 and 113 for 8 x 2 (one thread, AVX-512 floats).
constexpr int kGemmRows = 4;
constexpr int kGemmVectors = 2;

// Rows [0, Rows) of C, columns [0, n), k in [k0, k1).
template <typename T, int Rows>
inline void gemm_row_block(int64_t n, int64_t k0, int64_t k1, const T* a, int64_t a_row, int64_t a_col, const T* b,
                           int64_t ldb, T* c, int64_t ldc, T alpha, bool accumulate) {
  using Vec = Vectorized<T>;
  constexpr int64_t kWidth = Vec::size();
  const Vec alpha_v(alpha);
  int64_t j = 0;
  for (; j + kGemmVectors * kWidth <= n; j += kGemmVectors * kWidth) {
    Vec acc[Rows][kGemmVectors];
    for (int r = 0; r < Rows; ++r) {
      for (int v = 0; v < kGemmVectors; ++v) acc[r][v] = Vec(T(0));
    }
    for (int64_t k = k0; k < k1; ++k) {
      const T* b_row = b + k * ldb + j;
      Vec b_v[kGemmVectors];
      for (int v = 0; v < kGemmVectors; ++v) b_v[v] = Vec::loadu(b_row + v * kWidth);
      for (int r = 0; r < Rows; ++r) {
        const Vec a_v(a[r * a_row + k * a_col]);
        for (int v = 0; v < kGemmVectors; ++v) acc[r][v] = at::vec::fmadd(a_v, b_v[v], acc[r][v]);
      }
    }
    for (int r = 0; r < Rows; ++r) {
      for (int v = 0; v < kGemmVectors; ++v) {
        T* out = c + r * ldc + j + v * kWidth;
        const Vec product = acc[r][v] * alpha_v;
        (accumulate ? Vec::loadu(out) + product : product).store(out);
      }
    }
  }
  for (; j < n; j += kWidth) {  // the last columns, one (partial) vector at a time
    const int64_t count = std::min<int64_t>(kWidth, n - j);
    Vec acc[Rows];
    for (int r = 0; r < Rows; ++r) acc[r] = Vec(T(0));
    for (int64_t k = k0; k < k1; ++k) {
      const Vec b_v = Vec::loadu(b + k * ldb + j, count);
      for (int r = 0; r < Rows; ++r) acc[r] = at::vec::fmadd(Vec(a[r * a_row + k * a_col]), b_v, acc[r]);
    }
    for (int r = 0; r < Rows; ++r) {
      T* out = c + r * ldc + j;
      const Vec product = acc[r] * alpha_v;
      (accumulate ? Vec::loadu(out, count) + product : product).store(out, count);
    }
  }
}

// The n columns and the k range a block of C's rows needs.
struct GemmExtent {
  int64_t n, k0, k1;
};

// C rows [0, m) as above; extent(first, last) gives the block of rows first..last its columns and
// k range (a causal product's trimmed shape). Columns past a block's n are left as they were.
template <typename T, typename Extent>
void tile_gemm(int64_t m, const T* a, int64_t a_row, int64_t a_col, const T* b, int64_t ldb, T* c, int64_t ldc,
               T alpha, bool accumulate, const Extent& extent) {
  int64_t r = 0;
  for (; r + kGemmRows <= m; r += kGemmRows) {
    const GemmExtent e = extent(r, r + kGemmRows - 1);
    gemm_row_block<T, kGemmRows>(e.n, e.k0, e.k1, a + r * a_row, a_row, a_col, b, ldb, c + r * ldc, ldc, alpha,
                                 accumulate);
  }
  const auto rest = [&](auto rows) {
    const GemmExtent e = extent(r, r + rows.value - 1);
    gemm_row_block<T, decltype(rows)::value>(e.n, e.k0, e.k1, a + r * a_row, a_row, a_col, b, ldb, c + r * ldc, ldc,
                                              alpha, accumulate);
  };
  switch (m - r) {
    case 3: rest(std::integral_constant<int, 3>{}); break;
    case 2: rest(std::integral_constant<int, 2>{}); break;
    case 1: rest(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// A thread's buffer for k^T or v^T: its scratch slot up to kMaxScratchPartialBytes, beyond that
// `holder`, freed when the kernel returns (a long sequence's would otherwise stay with the thread).
template <typename T, int Slot>
T* transposed_buffer(int64_t elements, std::vector<T>& holder) {
  if (elements * static_cast<int64_t>(sizeof(T)) <= kMaxScratchPartialBytes) return scratch<T, Slot>(elements);
  holder.resize(elements);
  return holder.data();
}

// dst[c * ld + j] = rows.row(j)[c] for j < count, c < cols: k or v as the row-contiguous second
// operand of q k^T or do v^T.
template <typename T>
void transpose_rows(const Rows<T>& rows, int64_t count, int64_t cols, T* dst, int64_t ld) {
  constexpr int64_t kBlock = 16;  // rows read per pass, so each written line gets 16 elements
  for (int64_t j0 = 0; j0 < count; j0 += kBlock) {
    const int64_t j1 = std::min(count, j0 + kBlock);
    for (int64_t c = 0; c < cols; ++c) {
      T* out = dst + c * ld;
      for (int64_t j = j0; j < j1; ++j) out[j] = rows.row(j)[c];
    }
  }
}

// Tiles of query rows [first_tile, end_tile) of one head share its k^T; the work is split over
// (batch, head, group of tiles), with more than one group per head only where there are fewer
// heads than threads. At least 1, also for no heads or no tiles (an empty batch or sequence).
int64_t tile_groups(int64_t heads_total, int64_t tiles) {
  const int64_t threads = at::get_num_threads();
  if (heads_total <= 0 || tiles <= 1 || heads_total >= threads) return 1;
  return std::min(tiles, (threads + heads_total - 1) / heads_total);
}

template <typename T>
void attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, T scale,
                   const AttentionDropout& dropout, const at::Tensor& out, const at::Tensor& lse) {
  const int64_t batch = q.size(0), heads = q.size(1), seq_q = q.size(2), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), seq_k = k.size(2), group = heads / kv_heads;
  const int64_t tiles = (seq_q + kBlockQ - 1) / kBlockQ;
  const int64_t groups = tile_groups(batch * heads, tiles);
  const int64_t tiles_per_group = (tiles + groups - 1) / groups;
  const bool drop = dropout.p > 0.0;
  const RowDropout<T> row_dropout(dropout, heads, seq_q, seq_k);
  T* lse_data = lse.mutable_data_ptr<T>();
  at::parallel_for(0, batch * heads * groups, 1, [&](int64_t begin, int64_t end) {
    T* const scores = scratch<T, 0>(kBlockQ * kBlockK);
    T* const acc = scratch<T, 1>(kBlockQ * head_dim);
    T* const row_max_ = scratch<T, 2>(kBlockQ);
    T* const row_sum = scratch<T, 3>(kBlockQ);
    T* const factors = drop ? scratch<T, 6>(kBlockK) : nullptr;
    std::vector<T> k_t_holder;
    T* const k_t = transposed_buffer<T, 7>(head_dim * seq_k, k_t_holder);  // k^T: head_dim rows of seq_k
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (heads * groups), h = item / groups % heads, g = item % groups;
      const int64_t first_tile = g * tiles_per_group, end_tile = std::min(tiles, first_tile + tiles_per_group);
      if (first_tile >= end_tile) continue;
      const Rows<T> q_rows = head_rows<T>(q, b, h), k_rows = head_rows<T>(k, b, h / group);
      const Rows<T> v_rows = head_rows<T>(v, b, h / group), out_rows = head_rows<T>(out, b, h);
      const int64_t last_row = std::min(seq_q, end_tile * kBlockQ) - 1;
      transpose_rows(k_rows, causal ? std::min(seq_k, last_row + 1) : seq_k, head_dim, k_t, seq_k);
      for (int64_t tile = first_tile; tile < end_tile; ++tile) {
        const int64_t r0 = tile * kBlockQ;
        const int64_t rows = std::min(kBlockQ, seq_q - r0);
        const int64_t key_end = causal ? std::min(seq_k, r0 + rows) : seq_k;
        std::fill(row_max_, row_max_ + kBlockQ, -std::numeric_limits<T>::infinity());
        std::fill(row_sum, row_sum + kBlockQ, T(0));
        for (int64_t c0 = 0; c0 < key_end; c0 += kBlockK) {
          const int64_t width = std::min(kBlockK, key_end - c0);
          // Keys a block of rows sees: those of its last row.
          const auto seen = [&](int64_t last) { return visible_keys(causal, r0 + last, c0, width); };
          tile_gemm<T>(rows, q_rows.row(r0), q_rows.stride, 1, k_t + c0, seq_k, scores, kBlockK, scale, false,
                       [&](int64_t, int64_t last) { return GemmExtent{seen(last), 0, head_dim}; });
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
          tile_gemm<T>(rows, scores, kBlockK, 1, v_rows.row(c0), v_rows.stride, acc, head_dim, T(1), c0 != 0,
                       [&](int64_t, int64_t last) { return GemmExtent{head_dim, 0, seen(last)}; });
        }
        T* lse_row = lse_data + (b * heads + h) * seq_q + r0;
        for (int64_t i = 0; i < rows; ++i) {
          T* o = out_rows.row(r0 + i);
          const T inverse = T(1) / row_sum[i];
          const Vectorized<T> f(inverse);
          const T* a = acc + i * head_dim;
          for_each_vector<T>(head_dim, [&](int64_t j, int64_t count) {
            (Vectorized<T>::loadu(a + j, count) * f).store(o + j, count);
          });
          lse_row[i] = row_max_[i] + std::log(row_sum[i]);
        }
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
    std::vector<T> k_t_holder, v_t_holder;
    T* const k_t = transposed_buffer<T, 7>(head_dim * seq_k, k_t_holder);  // k^T and v^T: head_dim rows of seq_k
    T* const v_t = transposed_buffer<T, 8>(head_dim * seq_k, v_t_holder);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, kv_head = item % kv_heads;
      const Rows<T> k_rows = head_rows<T>(k, b, kv_head), v_rows = head_rows<T>(v, b, kv_head);
      const Rows<T> dk_rows = head_rows<T>(grad_k, b, kv_head), dv_rows = head_rows<T>(grad_v, b, kv_head);
      const int64_t keys_seen = causal ? std::min(seq_k, seq_q) : seq_k;
      transpose_rows(k_rows, keys_seen, head_dim, k_t, seq_k);
      transpose_rows(v_rows, keys_seen, head_dim, v_t, seq_k);
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
            // A block of query rows multiplies the keys its last row sees; a block of keys (rows of
            // dK, dV) the query rows that see its first key, to the tile's end.
            const auto seen = [&](int64_t last) { return visible_keys(causal, r0 + last, c0, width); };
            const auto seen_by = [&](int64_t first_key) {
              return causal ? std::clamp<int64_t>(c0 + first_key - r0, 0, rows) : int64_t{0};
            };
            // P = exp(scale * q k^T - lse), zero where masked
            tile_gemm<T>(rows, q_rows.row(r0), q_rows.stride, 1, k_t + c0, seq_k, probs, kBlockK, scale, false,
                         [&](int64_t, int64_t last) { return GemmExtent{seen(last), 0, head_dim}; });
            // dP = dO V^T (of the dropped probabilities)
            tile_gemm<T>(rows, do_rows.row(r0), do_rows.stride, 1, v_t + c0, seq_k, grad_scores, kBlockK, T(1), false,
                         [&](int64_t, int64_t last) { return GemmExtent{seen(last), 0, head_dim}; });
            // then dS = P * (dP * factors - rowsum(dO * O)) in its place, zero where masked; under
            // dropout P becomes the dropped P * factors after that, for dV
            for (int64_t i = 0; i < rows; ++i) {
              T* p = probs + i * kBlockK;
              T* dp = grad_scores + i * kBlockK;
              const int64_t visible = visible_keys(causal, r0 + i, c0, width);
              exp_shifted<false>(p, p, visible, lse_head[r0 + i]);
              zero_row(p + visible, width - visible);
              if (drop && visible > 0) {
                row_dropout.factors(factors, visible, b, h, r0 + i, c0);
                multiply_row(dp, factors, visible);
              }
              softmax_grad_row(p, dp, visible, delta[i]);
              zero_row(dp + visible, width - visible);
              if (drop && visible > 0) {
                multiply_row(p, factors, visible);
              }
            }
            const auto keys_extent = [&](int64_t first_key, int64_t) {
              return GemmExtent{head_dim, seen_by(first_key), rows};
            };
            // dV += P^T dO
            tile_gemm<T>(width, probs, 1, kBlockK, do_rows.row(r0), do_rows.stride, dv_rows.row(c0), dv_rows.stride,
                         T(1), true, keys_extent);
            // dQ (+)= scale * dS K, dK += scale * dS^T Q
            tile_gemm<T>(rows, grad_scores, kBlockK, 1, k_rows.row(c0), k_rows.stride, dq_rows.row(r0), dq_rows.stride,
                         scale, c0 != 0, [&](int64_t, int64_t last) { return GemmExtent{head_dim, 0, seen(last)}; });
            tile_gemm<T>(width, grad_scores, 1, kBlockK, q_rows.row(r0), q_rows.stride, dk_rows.row(c0), dk_rows.stride,
                         scale, true, keys_extent);
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
