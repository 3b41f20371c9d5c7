// philox_keep_mask: the dropout keep-mask (philox.h) of an arbitrary set of element indices, CPU
// kernel. Callers that apply dropout to a slice of a larger tensor (the native attention path's
// key chunks) pass the slice's flat indices in the full tensor and get the bits the fused kernels
// use for those elements.
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

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CPU, m) { m.impl("philox_keep_mask", &philox_keep_mask_cpu); }

}  // namespace memopt
