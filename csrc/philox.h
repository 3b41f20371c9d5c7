// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011) shared by the CPU and CUDA
// kernels, so a dropout mask is a pure function of (seed, offset, element index): the backward
// regenerates it instead of storing it, and every device, tiling and launch gives the same bits.
//
// The mask convention (memopt/ops/_philox.py implements the same in plain PyTorch for tests):
//   element i of a contiguous tensor draws
//     r = philox4x32_10(counter = (lo32(offset + i / 4), hi32(offset + i / 4), 0, 0),
//                       key     = (lo32(seed), hi32(seed)))[i % 4]
//   and is kept iff r >= dropout_threshold(p); kept elements are scaled by 1 / (1 - p).
// It matches Triton's tl.randint4x(seed, offset + i // 4)[i % 4].
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEMOPT_HOST_DEVICE __host__ __device__ __forceinline__
#define MEMOPT_UNROLL _Pragma("unroll")
#else
#define MEMOPT_HOST_DEVICE inline
#define MEMOPT_UNROLL
#endif

namespace memopt {

struct PhiloxBlock {
  uint32_t v[4];
};

MEMOPT_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t product = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// Four 32-bit random words for one 64-bit counter and 64-bit key.
MEMOPT_HOST_DEVICE PhiloxBlock philox4x32_10(uint64_t counter, uint64_t key) {
  constexpr uint32_t kRoundA = 0xD2511F53u;
  constexpr uint32_t kRoundB = 0xCD9E8D57u;
  constexpr uint32_t kKeyA = 0x9E3779B9u;
  constexpr uint32_t kKeyB = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  MEMOPT_UNROLL
  for (int round = 0; round < 10; ++round) {
    uint32_t hi_a, hi_b;
    const uint32_t lo_a = mulhilo32(kRoundA, c0, &hi_a);
    const uint32_t lo_b = mulhilo32(kRoundB, c2, &hi_b);
    const uint32_t n0 = hi_b ^ c1 ^ k0;
    const uint32_t n2 = hi_a ^ c3 ^ k1;
    c0 = n0;
    c1 = lo_b;
    c2 = n2;
    c3 = lo_a;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  return PhiloxBlock{{c0, c1, c2, c3}};
}

// Elements whose random word is below this are dropped: P(drop) = threshold / 2^32 = p
// (to within 2^-32).
inline uint32_t dropout_threshold(double p) {
  const double scaled = p * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled);
}

// The random word of element `index` under (seed, offset).
MEMOPT_HOST_DEVICE uint32_t philox_word(uint64_t seed, uint64_t offset, uint64_t index) {
  return philox4x32_10(offset + index / 4, seed).v[index % 4];
}

}  // namespace memopt
