// Vectorised loads and stores for memopt's CUDA kernels (norm, activation, dropout): N consecutive
// elements moved as one access, 16 bytes where the tensors allow it, as PyTorch's and Apex's
// vectorised kernels do. A kernel specialised on N = 1 is the element-wise fallback for rows that
// are not a multiple of the pack or tensors that are not aligned to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

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

// Whether every non-null pointer is a multiple of `bytes` (null ones, absent optional tensors, do
// not count).
inline bool all_aligned(std::size_t bytes, std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % bytes != 0) return false;
  }
  return true;
}

}  // namespace memopt
