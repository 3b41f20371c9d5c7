// Dropout masks (philox.h) of parts of a larger tensor, CPU kernels. Callers that apply dropout
// to a slice of a tensor they never build whole (the native attention path's key chunks of the
// (B, H, Sq, Sk) probabilities) get the bits the fused kernels use for those elements.
//   philox_keep_mask:     the keep bits of an arbitrary int64 index tensor.
//   philox_dropout_scale: 1 / (1 - p) where kept and 0 where dropped, for a strided window of
//                         element indices (index = index_offset + sum_d i_d * index_strides[d]),
//                         the factor to multiply the window by; no index tensor is built.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "common.h"
#include "philox.h"
#include "philox_mask.h"

namespace memopt {

void check_philox_keep_mask_inputs(const at::Tensor& index, double p) {
  constexpr const char* op = "philox_keep_mask";
  MEMOPT_CHECK(index.scalar_type() == at::kLong, op, "index must be int64, got ", index.scalar_type());
  check_dropout_p(p, op);
}

namespace {

// Indices usually come in runs (a row of a chunk): four consecutive indices share one Philox
// counter, so each call remembers its last block and computes a new one only when the counter
// changes. A chunk of a parallel_for starts with an empty cache; nothing is shared between threads.
at::Tensor philox_keep_mask_cpu(const at::Tensor& index, double p, const at::Tensor& rng_key) {
  check_philox_keep_mask_inputs(index, p);
  const auto [seed, offset] = read_rng_key(rng_key, "philox_keep_mask");
  const auto index_contiguous = index.contiguous();
  auto keep = at::empty(index.sizes(), index.options().dtype(at::kBool));
  const int64_t* idx = index_contiguous.const_data_ptr<int64_t>();
  bool* out = keep.mutable_data_ptr<bool>();
  const uint32_t threshold = dropout_threshold(p);
  std::atomic<bool> saw_negative{false};
  at::parallel_for(0, index.numel(), 8192, [&](int64_t begin, int64_t end) {
    bool negative = false;
    uint64_t cached_counter = 0;
    PhiloxBlock cached{};
    bool have_cached = false;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t element = idx[i];
      negative |= element < 0;
      const uint64_t u = static_cast<uint64_t>(element);
      const uint64_t counter = offset + u / 4;
      if (!have_cached || counter != cached_counter) {
        cached = philox4x32_10(counter, seed);
        cached_counter = counter;
        have_cached = true;
      }
      out[i] = cached.v[u % 4] >= threshold;
    }
    if (negative) saw_negative.store(true, std::memory_order_relaxed);
  });
  MEMOPT_CHECK(!saw_negative.load(), "philox_keep_mask", "index must hold element indices >= 0, got a negative one");
  return keep;
}

// ---------------------------------------------------------------------------------------------
// philox_dropout_scale: one row (consecutive indices) at a time; full Philox blocks go kLanes
// counters at once, with AVX2 (8 lanes of 32x32->64 multiplies per vpmuludq pair) where the CPU has
// it, else one counter at a time.

constexpr int kLanes = 8;

using PhiloxLanes = void (*)(uint64_t counter0, uint64_t key, uint32_t (&words)[4][kLanes]);

// The four words of counters counter0 .. counter0 + kLanes - 1, word-major: words[w][lane].
void philox_lanes_scalar(uint64_t counter0, uint64_t key, uint32_t (&words)[4][kLanes]) {
  for (int i = 0; i < kLanes; ++i) {
    const PhiloxBlock block = philox4x32_10(counter0 + static_cast<uint64_t>(i), key);
    for (int w = 0; w < 4; ++w) words[w][i] = block.v[w];
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define MEMOPT_PHILOX_AVX2 1
#include <immintrin.h>

// (hi, lo) 32-bit halves of x * m per 32-bit lane.
__attribute__((target("avx2"))) inline void mulhilo_lanes(__m256i x, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(x, m);                         // lanes 0, 2, 4, 6 as 64 bits
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), m);   // lanes 1, 3, 5, 7
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

__attribute__((target("avx2"))) void philox_lanes_avx2(uint64_t counter0, uint64_t key,
                                                       uint32_t (&words)[4][kLanes]) {
  alignas(32) uint32_t lo_words[kLanes], hi_words[kLanes];
  for (int i = 0; i < kLanes; ++i) {
    const uint64_t counter = counter0 + static_cast<uint64_t>(i);
    lo_words[i] = static_cast<uint32_t>(counter);
    hi_words[i] = static_cast<uint32_t>(counter >> 32);
  }
  __m256i c0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo_words));
  __m256i c1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi_words));
  __m256i c2 = _mm256_setzero_si256();
  __m256i c3 = _mm256_setzero_si256();
  const __m256i round_a = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i round_b = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    __m256i hi_a, lo_a, hi_b, lo_b;
    mulhilo_lanes(c0, round_a, &hi_a, &lo_a);
    mulhilo_lanes(c2, round_b, &hi_b, &lo_b);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi_b, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi_a, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo_b;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[0]), c0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[1]), c1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[2]), c2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(words[3]), c3);
}
#else
#define MEMOPT_PHILOX_AVX2 0
#endif

PhiloxLanes philox_lanes_for_this_cpu() {
#if MEMOPT_PHILOX_AVX2
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  if (has_avx2) return &philox_lanes_avx2;
#endif
  return &philox_lanes_scalar;
}

// out[c] = scale if the word of element first_index + c is >= threshold else 0, c < cols.
template <typename scalar_t>
void scale_row(PhiloxLanes lanes, scalar_t* out, int64_t cols, uint64_t first_index, uint64_t seed,
               uint64_t offset, uint32_t threshold, scalar_t scale) {
  int64_t c = 0;
  // Up to the first multiple of 4: a partial Philox block.
  while (c < cols && (first_index + c) % 4 != 0) {
    out[c] = philox_word(seed, offset, first_index + c) >= threshold ? scale : scalar_t(0);
    ++c;
  }
  uint32_t words[4][kLanes];
  for (; c + 4 * kLanes <= cols; c += 4 * kLanes) {
    lanes(offset + (first_index + c) / 4, seed, words);
    scalar_t* block = out + c;
    for (int i = 0; i < kLanes; ++i) {
      for (int w = 0; w < 4; ++w) block[4 * i + w] = words[w][i] >= threshold ? scale : scalar_t(0);
    }
  }
  for (; c < cols; ++c) {
    out[c] = philox_word(seed, offset, first_index + c) >= threshold ? scale : scalar_t(0);
  }
}

at::Tensor philox_dropout_scale_cpu(at::IntArrayRef size, at::IntArrayRef index_strides, int64_t index_offset,
                                    double p, const at::Tensor& rng_key, at::ScalarType dtype) {
  constexpr const char* op = "philox_dropout_scale";
  check_dropout_p(p, op);
  MEMOPT_CHECK(!size.empty() && size.size() == index_strides.size(), op,
               "size and index_strides must have one entry per dim (at least one), got ", size, " and ",
               index_strides);
  MEMOPT_CHECK(index_strides.back() == 1, op, "the last index stride must be 1, got ", index_strides);
  MEMOPT_CHECK(index_offset >= 0, op, "index_offset must be >= 0, got ", index_offset);
  for (size_t d = 0; d < size.size(); ++d) {
    MEMOPT_CHECK(size[d] >= 0 && index_strides[d] >= 0, op, "size and index_strides must be >= 0, got ", size,
                 " and ", index_strides);
  }
  MEMOPT_CHECK(dtype == at::kFloat || dtype == at::kDouble, op, "dtype must be float32 or float64, got ", dtype);
  const auto [seed, offset] = read_rng_key(rng_key, op);
  auto scale = at::empty(size, rng_key.options().dtype(dtype));
  const int64_t cols = size.back();
  if (scale.numel() == 0) return scale;
  const int64_t rows = scale.numel() / cols;
  const uint32_t threshold = dropout_threshold(p);
  const int64_t dims = static_cast<int64_t>(size.size()) - 1;
  const PhiloxLanes lanes = philox_lanes_for_this_cpu();
  AT_DISPATCH_FLOATING_TYPES(dtype, "philox_dropout_scale", [&] {
    scalar_t* out = scale.mutable_data_ptr<scalar_t>();
    const scalar_t keep_scale = static_cast<scalar_t>(1.0 / (1.0 - p));
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        // Unravel the row over the leading dims into its first element's index.
        int64_t rest = row;
        uint64_t first = static_cast<uint64_t>(index_offset);
        for (int64_t d = dims - 1; d >= 0; --d) {
          first += static_cast<uint64_t>(rest % size[d]) * static_cast<uint64_t>(index_strides[d]);
          rest /= size[d];
        }
        scale_row(lanes, out + row * cols, cols, first, seed, offset, threshold, keep_scale);
      }
    });
  });
  return scale;
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) {
  m.impl("philox_keep_mask", &philox_keep_mask_cpu);
  m.impl("philox_dropout_scale", &philox_dropout_scale_cpu);
}

}  // namespace memopt
