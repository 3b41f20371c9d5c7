// Vectorised loads and stores for memopt's CUDA kernels (norm, activation, dropout): N consecutive
// elements moved as one access, 16 bytes where the tensors allow it, as PyTorch's and Apex's
// vectorised kernels do. A kernel specialised on N = 1 is the element-wise fallback for rows that
// are not a multiple of the pack or tensors that are not aligned to it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace memopt {

// N consecutive elements of T, aligned to their size so that one load or store moves them all.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements of T in one 16-byte access (4 floats, 8 halves, 2 doubles).
template <typename T>
constexpr int kPack16 = 16 / sizeof(T);

// The index-th pack from base (base aligned to Pack<T, N>): elements [index * N, index * N + N).
template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* base, int64_t index = 0) {
  return reinterpret_cast<const Pack<T, N>*>(base)[index];
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* base, int64_t index, const Pack<T, N>& value) {
  reinterpret_cast<Pack<T, N>*>(base)[index] = value;
}

// The pack that starts at p.
template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& value) {
  *reinterpret_cast<Pack<T, N>*>(p) = value;
}

// A 16-byte pack as four 32-bit words, for a kernel that keeps the pack in registers while it
// waits on something else (norm's row across its reduction). Loaded as a Pack<T, 8> of 16-bit
// elements, the pack is split into one register per element as it arrives (nvcc 13.0 for sm_90):
// twice the registers, and a split that waits for the load, so where a branch separates it from
// the next pack's load, that load is issued one memory round trip later. Loaded as words, two
// elements share a register until word_element converts one where it is used.
using Words16 = Pack<uint32_t, 4>;

// The index-th 16-byte pack from base (base aligned to 16 bytes), as words.
template <typename T>
__device__ __forceinline__ Words16 load_words(const T* base, int64_t index) {
  return load_pack<4>(reinterpret_cast<const uint32_t*>(base), index);
}

// Element k of the kPack16<T> elements of T in w, as float: bit for bit static_cast<float> of the
// element (bfloat16 and half widen exactly).
template <typename T>
__device__ __forceinline__ float word_element(const Words16& w, int k) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w.v[k]);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return __uint_as_float(k % 2 == 0 ? w.v[k / 2] << 16 : w.v[k / 2] & 0xffff0000u);
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "word_element: float, bfloat16 or half");
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w.v[k / 2] >> (k % 2 == 0 ? 0 : 16))));
  }
}

// Whether every non-null pointer is a multiple of `bytes` (null ones, absent optional tensors, do
// not count).
inline bool all_aligned(std::size_t bytes, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % bytes != 0) return false;
  }
  return true;
}

}  // namespace memopt
