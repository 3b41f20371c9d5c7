// bias_act (y = act(x + bias)) and swiglu, CUDA kernels. The math is activation.h's, the same
// functions the CPU kernels call.
//
// * Forward, and backward without a bias: one grid-stride elementwise pass.
// * Backward with a bias: a 2-D grid of CTAs, each over a tile of columns and a chunk of rows. A
//   CTA writes grad_x (and the rebuilt y) for its tile and the float32 sum of its rows' bias
//   gradient to partials[chunk, column]; column_sum.cuh adds the partials in a fixed order. No
//   atomics, so the bias gradient is the same on every run.
// * Each kernel moves packs of W elements: W = 16 bytes' worth (4 floats, 8 halves) when the row
//   (swiglu: the half row d) is a multiple of that and the tensors are 16-byte aligned, as ATen's
//   vectorized elementwise kernels do, one 16-byte load or store per thread and tensor; W = 1
//   otherwise. Each element's math does not depend on W, so y and grad_x are the same bits either
//   way; the bias gradient's row chunks follow the grid (W times wider column tiles when packed),
//   so its float32 sums may round apart.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "activation.h"
#include "column_sum.cuh"
#include "common.h"
#include "vector_pack.cuh"

namespace memopt {
namespace {

constexpr int kThreads = 256;  // elementwise kernels
constexpr int kTileCols = 32;  // bias-gradient kernels: blockDim.x, one warp across columns
constexpr int kTileRows = 8;   // bias-gradient kernels: blockDim.y, rows handled side by side
constexpr int kRowUnroll = 4;  // bias_act's bias-gradient kernel: rows a thread loads at once
constexpr int64_t kMinRowsPerChunk = 4 * kTileRows;
constexpr int64_t kMaxGridY = 65535;

int multiprocessors() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// The packed kernels' condition: `width` (a row, or swiglu's half row) a multiple of the pack
// (W = kPack16<scalar_t>, 16 bytes; the element-wise kernels take W = 1) and every given pointer
// 16-byte aligned (null ones, absent outputs, do not count).
template <typename scalar_t>
bool packable(int64_t width, std::initializer_list<const void*> pointers) {
  return width % kPack16<scalar_t> == 0 && all_aligned(16, pointers);
}

// The forward kernels load a pack's bias columns as one Pack<bias_t, W> (16 or 32 bytes): it
// needs that alignment of the bias too (a parameter's storage has it; a view may not).
template <typename scalar_t, typename bias_t>
bool bias_packable(const bias_t* bias) {
  return all_aligned(sizeof(Pack<bias_t, kPack16<scalar_t>>), {bias});
}

int elementwise_blocks(int64_t numel) {
  const int64_t max_blocks = static_cast<int64_t>(multiprocessors()) * 16;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((numel + kThreads - 1) / kThreads, max_blocks)));
}

// The bias-gradient grid: column tiles (kTileCols threads of cols_per_thread columns each) along
// x, row chunks along y, sized for as many CTAs as are resident at once (resident_ctas: 2-4 per
// SM, by registers) and at least kMinRowsPerChunk rows per chunk.
struct BiasGradGrid {
  dim3 grid;
  int64_t rows_per_chunk;
  int64_t chunks;
};

template <typename Kernel>
BiasGradGrid bias_grad_grid(Kernel kernel, int64_t rows, int64_t cols, int64_t cols_per_thread) {
  const int64_t resident = resident_ctas(kernel, kTileCols * kTileRows);
  const int64_t tile_width = kTileCols * cols_per_thread;
  const int64_t col_tiles = (cols + tile_width - 1) / tile_width;
  const int64_t wanted = std::max<int64_t>(1, (resident + col_tiles - 1) / col_tiles);
  const int64_t most = std::max<int64_t>(1, (rows + kMinRowsPerChunk - 1) / kMinRowsPerChunk);
  int64_t chunks = std::min({wanted, most, kMaxGridY});
  const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
  chunks = (rows + rows_per_chunk - 1) / rows_per_chunk;
  return {dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(chunks)), rows_per_chunk, chunks};
}

// An elementwise launch over packs seen as a [rows, row_packs] grid of packs (a row, or swiglu's
// half row, of row_packs packs). The grid stride, blocks * kThreads packs, is split into whole rows
// and a column remainder on the host, so that a thread steps its row and column with additions of
// kernel arguments: dividing every pack index by row_packs in the loop costs a 64-bit division per
// pack (a call of about 70 instructions, or 20 with a MUFU.RCP where both operands fit in 32 bits,
// nvcc 13.0 for sm_90), and steps computed in the kernel would hold registers.
struct PackGrid {
  int64_t packs;      // all of them, rows * row_packs
  int64_t row_packs;
  int64_t row_step;   // stride / row_packs
  int64_t col_step;   // stride % row_packs
};

PackGrid pack_grid(int64_t packs, int64_t row_packs, int blocks) {
  const int64_t stride = static_cast<int64_t>(blocks) * kThreads;
  return {packs, row_packs, stride / row_packs, stride % row_packs};
}

// A thread's place in the grid of packs: row and column pack of its current pack index.
struct PackCursor {
  int64_t row, col;

  __device__ PackCursor(int64_t p, const PackGrid& grid) : row(p / grid.row_packs), col(p % grid.row_packs) {}

  __device__ __forceinline__ void advance(const PackGrid& grid) {
    row += grid.row_step;
    col += grid.col_step;
    if (col >= grid.row_packs) {  // both were below row_packs: one carry at most
      col -= grid.row_packs;
      ++row;
    }
  }
};

// Pack index p covers elements [p * W, p * W + W); a pack never straddles two rows (W divides
// the row), so its bias columns are consecutive, one Pack<bias_t, W> (the launcher checks its
// alignment). y may be x (bias_act_fwd_inplace): a thread loads its x pack before it stores its y
// pack there, and no thread reads another's pack.
template <Activation A, typename scalar_t, typename bias_t, int W>
__device__ __forceinline__ void bias_act_fwd_packs(const scalar_t* x,
                                                   const bias_t* __restrict__ bias,  // [cols], or null
                                                   scalar_t* y, const PackGrid& grid) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  PackCursor at(first, grid);
  for (int64_t p = first; p < grid.packs; p += stride, at.advance(grid)) {
    const Pack<scalar_t, W> in = load_pack<W>(x + p * W);
    Pack<bias_t, W> b;
    if (bias != nullptr) b = load_pack<W>(bias, at.col);
    Pack<scalar_t, W> out;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      acc_t h = static_cast<acc_t>(in.v[j]);
      if (bias != nullptr) h += static_cast<acc_t>(b.v[j]);
      out.v[j] = static_cast<scalar_t>(activation_value<A>(h));
    }
    store_pack<W>(y + p * W, out);
  }
}

template <Activation A, typename scalar_t, typename bias_t, int W>
__global__ void bias_act_fwd_cuda_kernel(const scalar_t* __restrict__ x,
                                         const bias_t* __restrict__ bias,  // [cols], or null
                                         scalar_t* __restrict__ y, const PackGrid grid) {
  bias_act_fwd_packs<A, scalar_t, bias_t, W>(x, bias, y, grid);
}

// bias_act_fwd_inplace: y written over x, which therefore carries no __restrict__.
template <Activation A, typename scalar_t, typename bias_t, int W>
__global__ void bias_act_fwd_inplace_cuda_kernel(scalar_t* x,
                                                 const bias_t* __restrict__ bias,  // [cols], or null
                                                 const PackGrid grid) {
  bias_act_fwd_packs<A, scalar_t, bias_t, W>(x, bias, x, grid);
}

// grad_x may be grad_y (bias_act_bwd_inplace): a thread loads its grad_y pack before it stores its
// grad_x pack there, so the two pointers carry no __restrict__.
template <Activation A, typename scalar_t, int W>
__global__ void bias_act_bwd_cuda_kernel(const scalar_t* grad_y, const scalar_t* __restrict__ x, scalar_t* grad_x,
                                         scalar_t* __restrict__ y,  // rebuilt act(x), or null
                                         int64_t packs) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < packs; p += stride) {
    const Pack<scalar_t, W> g = load_pack<W>(grad_y + p * W);
    const Pack<scalar_t, W> in = load_pack<W>(x + p * W);
    Pack<scalar_t, W> grad, value;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const ValueAndGrad<acc_t> act = activation_value_and_grad<A>(static_cast<acc_t>(in.v[j]));
      grad.v[j] = static_cast<scalar_t>(static_cast<acc_t>(g.v[j]) * act.grad);
      value.v[j] = static_cast<scalar_t>(act.value);
    }
    store_pack<W>(grad_x + p * W, grad);
    if (y != nullptr) store_pack<W>(y + p * W, value);
  }
}

// A CTA of (kTileCols, kTileRows) threads over kTileCols * W columns and one chunk of rows: thread
// (tx, ty) takes rows ty, ty + kTileRows, ... for its W columns, and row 0 of the CTA adds the
// kTileRows sums in order into the chunk's partials.
template <Activation A, typename scalar_t, typename bias_t, int W>
__global__ void bias_act_bwd_bias_cuda_kernel(const scalar_t* grad_y, const scalar_t* __restrict__ x,
                                              const bias_t* __restrict__ bias,  // [cols]
                                              scalar_t* grad_x,  // may be grad_y (bias_act_bwd_inplace)
                                              scalar_t* __restrict__ y,  // rebuilt act(x + bias), or null
                                              at::opmath_type<scalar_t>* __restrict__ partials,  // [chunks, cols], or null
                                              int64_t rows, int64_t cols, int64_t rows_per_chunk) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t tile[kTileRows][kTileCols * W + 1];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x) * W;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  acc_t sum[W];
#pragma unroll
  for (int j = 0; j < W; ++j) sum[j] = 0;
  if (col < cols) {  // W divides cols: the whole pack is in the row
    acc_t b[W];
#pragma unroll
    for (int j = 0; j < W; ++j) b[j] = static_cast<acc_t>(bias[col + j]);
    // kRowUnroll of the thread's rows at a time, every load before any store: grad_x may alias
    // grad_y, so the compiler may not move a later row's loads above an earlier row's stores, and
    // one row at a time would cost one memory round trip per row. The rows are still summed in
    // order (r, r + kTileRows, ...), so the bias gradient's bits do not depend on the unroll.
    for (int64_t r0 = row_begin + threadIdx.y; r0 < row_end; r0 += kTileRows * kRowUnroll) {
      Pack<scalar_t, W> g[kRowUnroll], in[kRowUnroll];
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t r = r0 + u * kTileRows;
        if (r >= row_end) break;
        g[u] = load_pack<W>(grad_y + r * cols + col);
        in[u] = load_pack<W>(x + r * cols + col);
      }
#pragma unroll
      for (int u = 0; u < kRowUnroll; ++u) {
        const int64_t r = r0 + u * kTileRows;
        if (r >= row_end) break;
        Pack<scalar_t, W> grad, value;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const ValueAndGrad<acc_t> act = activation_value_and_grad<A>(static_cast<acc_t>(in[u].v[j]) + b[j]);
          const acc_t grad_h = static_cast<acc_t>(g[u].v[j]) * act.grad;
          grad.v[j] = static_cast<scalar_t>(grad_h);
          value.v[j] = static_cast<scalar_t>(act.value);
          sum[j] += grad_h;
        }
        // Indexed from the row's start: written as `grad_x + r * cols + col`, nvcc 13.0 split each
        // pack's store into 32-bit ones for sm_90 (no STG.E.128 in the SASS; loads were 128-bit).
        store_pack<W>(grad_x + r * cols, col / W, grad);
        if (y != nullptr) store_pack<W>(y + r * cols, col / W, value);
      }
    }
  }
  // No bias gradient asked for (a frozen bias). partials is the same for every thread of the
  // grid, so the whole CTA returns here, before the barrier.
  if (partials == nullptr) return;
#pragma unroll
  for (int j = 0; j < W; ++j) tile[threadIdx.y][threadIdx.x * W + j] = sum[j];
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
#pragma unroll
    for (int j = 0; j < W; ++j) {
      acc_t total = 0;
      for (int k = 0; k < kTileRows; ++k) total += tile[k][threadIdx.x * W + j];
      partials[static_cast<int64_t>(blockIdx.y) * cols + col + j] = total;
    }
  }
}

// Output pack p of swiglu: row r, columns c .. c + W of the gate half (x[r, c]) and of the up half
// (x[r, d + c]).
template <typename scalar_t, typename bias_t, int W>
__global__ void swiglu_fwd_cuda_kernel(const scalar_t* __restrict__ x,
                                       const bias_t* __restrict__ bias,  // [2 * d], or null
                                       scalar_t* __restrict__ y,         // [rows, d]
                                       const PackGrid grid, int64_t d) {  // grid: of y's packs
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  PackCursor at(first, grid);
  for (int64_t p = first; p < grid.packs; p += stride, at.advance(grid)) {
    const scalar_t* gate_row = x + at.row * 2 * d;
    const Pack<scalar_t, W> gate = load_pack<W>(gate_row, at.col);
    const Pack<scalar_t, W> up = load_pack<W>(gate_row + d, at.col);
    Pack<bias_t, W> bias_gate, bias_up;
    if (bias != nullptr) {
      bias_gate = load_pack<W>(bias, at.col);
      bias_up = load_pack<W>(bias + d, at.col);
    }
    Pack<scalar_t, W> out;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      acc_t g = static_cast<acc_t>(gate.v[j]);
      acc_t u = static_cast<acc_t>(up.v[j]);
      if (bias != nullptr) {
        g += static_cast<acc_t>(bias_gate.v[j]);
        u += static_cast<acc_t>(bias_up.v[j]);
      }
      out.v[j] = static_cast<scalar_t>(activation_value<Activation::kSilu>(g) * u);
    }
    store_pack<W>(y + p * W, out);
  }
}

// One pack of swiglu's backward at row r, columns c .. c + W: writes grad_x's gate and up packs and
// y's; adds the gate and up gradients to grad_gate_sum / grad_up_sum (the bias reduction).
template <int W, typename scalar_t, typename acc_t>
__device__ __forceinline__ void swiglu_bwd_pack(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ x,
                                                scalar_t* __restrict__ grad_x, scalar_t* __restrict__ y, int64_t r,
                                                int64_t c, int64_t d, const acc_t* bias_gate, const acc_t* bias_up,
                                                acc_t* grad_gate_sum, acc_t* grad_up_sum) {
  const int64_t gate_index = r * 2 * d + c;
  const Pack<scalar_t, W> gate = load_pack<W>(x + gate_index);
  const Pack<scalar_t, W> up = load_pack<W>(x + gate_index + d);
  const Pack<scalar_t, W> g = load_pack<W>(grad_y + r * d + c);
  Pack<scalar_t, W> grad_gate, grad_up, value;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const acc_t gate_j = static_cast<acc_t>(gate.v[j]) + bias_gate[j];
    const acc_t up_j = static_cast<acc_t>(up.v[j]) + bias_up[j];
    const ValueAndGrad<acc_t> act = activation_value_and_grad<Activation::kSilu>(gate_j);
    const acc_t g_j = static_cast<acc_t>(g.v[j]);
    const acc_t dgate = g_j * up_j * act.grad;
    const acc_t dup = g_j * act.value;
    grad_gate.v[j] = static_cast<scalar_t>(dgate);
    grad_up.v[j] = static_cast<scalar_t>(dup);
    value.v[j] = static_cast<scalar_t>(act.value * up_j);
    grad_gate_sum[j] += dgate;
    grad_up_sum[j] += dup;
  }
  // Indexed from the row's start, as in bias_act_bwd_bias_cuda_kernel (one STG.E.128 per pack).
  store_pack<W>(grad_x + r * 2 * d, c / W, grad_gate);
  store_pack<W>(grad_x + r * 2 * d + d, c / W, grad_up);
  if (y != nullptr) store_pack<W>(y + r * d, c / W, value);
}

template <typename scalar_t, int W>
__global__ void swiglu_bwd_cuda_kernel(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ x,
                                       scalar_t* __restrict__ grad_x,
                                       scalar_t* __restrict__ y,  // rebuilt output, or null
                                       const PackGrid grid, int64_t d) {  // grid: of y's packs
  using acc_t = at::opmath_type<scalar_t>;
  acc_t zeros[W], unused_gate[W], unused_up[W];
#pragma unroll
  for (int j = 0; j < W; ++j) zeros[j] = unused_gate[j] = unused_up[j] = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  PackCursor at(first, grid);
  for (int64_t p = first; p < grid.packs; p += stride, at.advance(grid)) {
    swiglu_bwd_pack<W>(grad_y, x, grad_x, y, at.row, at.col * W, d, zeros, zeros, unused_gate, unused_up);
  }
}

// As bias_act_bwd_bias_cuda_kernel, over the gate and up halves at once.
template <typename scalar_t, typename bias_t, int W>
__global__ void swiglu_bwd_bias_cuda_kernel(const scalar_t* __restrict__ grad_y, const scalar_t* __restrict__ x,
                                            const bias_t* __restrict__ bias,  // [2 * d]
                                            scalar_t* __restrict__ grad_x,
                                            scalar_t* __restrict__ y,  // rebuilt output, or null
                                            at::opmath_type<scalar_t>* __restrict__ partials,  // [chunks, 2 * d], or null
                                            int64_t rows, int64_t d, int64_t rows_per_chunk) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t gate_tile[kTileRows][kTileCols * W + 1];
  __shared__ acc_t up_tile[kTileRows][kTileCols * W + 1];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kTileCols + threadIdx.x) * W;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t row_end = row_begin + rows_per_chunk < rows ? row_begin + rows_per_chunk : rows;
  acc_t gate_sum[W], up_sum[W];
#pragma unroll
  for (int j = 0; j < W; ++j) gate_sum[j] = up_sum[j] = 0;
  if (col < d) {  // W divides d
    acc_t bias_gate[W], bias_up[W];
#pragma unroll
    for (int j = 0; j < W; ++j) {
      bias_gate[j] = static_cast<acc_t>(bias[col + j]);
      bias_up[j] = static_cast<acc_t>(bias[d + col + j]);
    }
    for (int64_t r = row_begin + threadIdx.y; r < row_end; r += kTileRows) {
      swiglu_bwd_pack<W>(grad_y, x, grad_x, y, r, col, d, bias_gate, bias_up, gate_sum, up_sum);
    }
  }
  if (partials == nullptr) return;  // as in bias_act_bwd_bias_cuda_kernel: a frozen bias
#pragma unroll
  for (int j = 0; j < W; ++j) {
    gate_tile[threadIdx.y][threadIdx.x * W + j] = gate_sum[j];
    up_tile[threadIdx.y][threadIdx.x * W + j] = up_sum[j];
  }
  __syncthreads();
  if (threadIdx.y == 0 && col < d) {
    acc_t* partial = partials + static_cast<int64_t>(blockIdx.y) * 2 * d;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      acc_t gate_total = 0;
      acc_t up_total = 0;
      for (int k = 0; k < kTileRows; ++k) {
        gate_total += gate_tile[k][threadIdx.x * W + j];
        up_total += up_tile[k][threadIdx.x * W + j];
      }
      partial[col + j] = gate_total;
      partial[d + col + j] = up_total;
    }
  }
}

template <typename acc_t, typename bias_t>
void launch_reduce_partials(const at::Tensor& partials, int64_t chunks, int64_t width, const at::Tensor& grad_bias) {
  launch_column_sum(partials.const_data_ptr<acc_t>(), chunks, width, grad_bias.mutable_data_ptr<bias_t>());
}

// call.y may be x itself (bias_act_fwd_inplace): the in-place kernel then runs.
void run_bias_act_fwd_cuda(const ActForward& call, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const at::Tensor& y = call.y;
  const int64_t numel = x.numel();
  if (numel == 0) return;
  const bool in_place = y.is_same(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "bias_act_fwd_cuda", [&] {
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
    dispatch_param_type<scalar_t>(param_dtype(bias, x), [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      const bias_t* bias_data = optional_data<bias_t>(bias);
      const bool packed =
          packable<scalar_t>(call.cols, {x_data, y_data}) && bias_packable<scalar_t, bias_t>(bias_data);
      const int64_t w = packed ? kPack16<scalar_t> : 1;
      const int blocks = elementwise_blocks(numel / w);
      dispatch_activation(call.activation, [&](auto a) {
        constexpr Activation A = decltype(a)::value;
        if (in_place) {
          const auto kernel = packed ? bias_act_fwd_inplace_cuda_kernel<A, scalar_t, bias_t, kPack16<scalar_t>>
                                     : bias_act_fwd_inplace_cuda_kernel<A, scalar_t, bias_t, 1>;
          kernel<<<blocks, kThreads, 0, stream>>>(y_data, bias_data, pack_grid(numel / w, call.cols / w, blocks));
        } else {
          const auto kernel = packed ? bias_act_fwd_cuda_kernel<A, scalar_t, bias_t, kPack16<scalar_t>>
                                     : bias_act_fwd_cuda_kernel<A, scalar_t, bias_t, 1>;
          kernel<<<blocks, kThreads, 0, stream>>>(x_data, bias_data, y_data,
                                                  pack_grid(numel / w, call.cols / w, blocks));
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
}

at::Tensor bias_act_fwd_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& activation) {
  const ActForward call = prepare_bias_act_fwd(x, bias, activation);
  run_bias_act_fwd_cuda(call, x, bias);
  return call.y;
}

void bias_act_fwd_inplace_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                               const std::string& activation) {
  const ActForward call = prepare_bias_act_fwd(x, bias, activation, /*y_in_x=*/true);
  run_bias_act_fwd_cuda(call, x, bias);
}

// Each thread reads grad_y[i] and x[i] before it writes grad_x[i] and y[i], so call.grad_x may be
// grad_y itself (bias_act_bwd_inplace): the kernels take grad_y and grad_x without __restrict__.
void run_bias_act_bwd_cuda(const ActBackward& call, const at::Tensor& grad_y, const at::Tensor& x,
                           const std::optional<at::Tensor>& bias, bool return_y) {
  const at::Tensor &grad_x = call.grad_x, &grad_bias = call.grad_bias, &y = call.y;
  const int64_t numel = x.numel();
  if (numel == 0) {
    if (call.has_grad_bias) grad_bias.zero_();
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "bias_act_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* grad_y_data = grad_y.const_data_ptr<scalar_t>();
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    scalar_t* grad_x_data = grad_x.mutable_data_ptr<scalar_t>();
    scalar_t* y_ptr = return_y ? y.mutable_data_ptr<scalar_t>() : nullptr;
    const bool packed = packable<scalar_t>(call.cols, {grad_y_data, x_data, grad_x_data, y_ptr});
    const int64_t w = packed ? kPack16<scalar_t> : 1;
    if (!bias.has_value()) {
      dispatch_activation(call.activation, [&](auto a) {
        constexpr Activation A = decltype(a)::value;
        const auto kernel = packed ? bias_act_bwd_cuda_kernel<A, scalar_t, kPack16<scalar_t>>
                                   : bias_act_bwd_cuda_kernel<A, scalar_t, 1>;
        kernel<<<elementwise_blocks(numel / w), kThreads, 0, stream>>>(grad_y_data, x_data, grad_x_data, y_ptr,
                                                                        numel / w);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    dispatch_param_type<scalar_t>(param_dtype(bias, x), [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      dispatch_activation(call.activation, [&](auto a) {
        constexpr Activation A = decltype(a)::value;
        const auto kernel = packed ? bias_act_bwd_bias_cuda_kernel<A, scalar_t, bias_t, kPack16<scalar_t>>
                                   : bias_act_bwd_bias_cuda_kernel<A, scalar_t, bias_t, 1>;
        const BiasGradGrid launch = bias_grad_grid(kernel, call.rows, call.cols, w);
        // No partials and no column sum for a bias gradient not asked for (a frozen bias).
        const at::Tensor partials =
            call.has_grad_bias
                ? at::empty({launch.chunks, call.cols}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value))
                : at::Tensor();
        kernel<<<launch.grid, dim3(kTileCols, kTileRows), 0, stream>>>(
            grad_y_data, x_data, optional_data<bias_t>(bias), grad_x_data, y_ptr,
            call.has_grad_bias ? partials.mutable_data_ptr<acc_t>() : nullptr, call.rows, call.cols,
            launch.rows_per_chunk);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (call.has_grad_bias) launch_reduce_partials<acc_t, bias_t>(partials, launch.chunks, call.cols, grad_bias);
      });
    });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bias_act_bwd_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                                 const std::optional<at::Tensor>& bias,
                                                                 const std::string& activation, bool return_y,
                                                                 bool return_grad_bias) {
  const ActBackward call = prepare_bias_act_bwd(grad_y, x, bias, activation, return_y, return_grad_bias);
  run_bias_act_bwd_cuda(call, grad_y, x, bias, return_y);
  return {call.grad_x, call.grad_bias, call.y};
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_inplace_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                             const std::optional<at::Tensor>& bias,
                                                             const std::string& activation, bool return_y,
                                                             bool return_grad_bias) {
  const ActBackward call =
      prepare_bias_act_bwd(grad_y, x, bias, activation, return_y, return_grad_bias, /*grad_x_in_grad_y=*/true);
  run_bias_act_bwd_cuda(call, grad_y, x, bias, return_y);
  return {call.grad_bias, call.y};
}

at::Tensor swiglu_fwd_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias) {
  const ActForward call = prepare_swiglu_fwd(x, bias);
  const at::Tensor& y = call.y;
  const int64_t d = call.cols / 2;
  const int64_t numel_out = y.numel();
  if (numel_out == 0) return y;
  const c10::cuda::CUDAGuard guard(x.device());
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "swiglu_fwd_cuda", [&] {
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    scalar_t* y_data = y.mutable_data_ptr<scalar_t>();
    dispatch_param_type<scalar_t>(param_dtype(bias, x), [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      const bias_t* bias_data = optional_data<bias_t>(bias);
      const bool packed = packable<scalar_t>(d, {x_data, y_data}) && bias_packable<scalar_t, bias_t>(bias_data);
      const int64_t w = packed ? kPack16<scalar_t> : 1;
      const auto kernel = packed ? swiglu_fwd_cuda_kernel<scalar_t, bias_t, kPack16<scalar_t>>
                                 : swiglu_fwd_cuda_kernel<scalar_t, bias_t, 1>;
      const int blocks = elementwise_blocks(numel_out / w);
      kernel<<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          x_data, bias_data, y_data, pack_grid(numel_out / w, d / w, blocks), d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_bwd_cuda(const at::Tensor& grad_y, const at::Tensor& x,
                                                               const std::optional<at::Tensor>& bias,
                                                               bool return_y, bool return_grad_bias) {
  const ActBackward call = prepare_swiglu_bwd(grad_y, x, bias, return_y, return_grad_bias);
  const at::Tensor &grad_x = call.grad_x, &grad_bias = call.grad_bias, &y = call.y;
  const int64_t d = call.cols / 2;
  const int64_t numel_out = call.rows * d;
  if (numel_out == 0) {
    if (call.has_grad_bias) grad_bias.zero_();
    return {grad_x, grad_bias, y};
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  MEMOPT_DISPATCH_CUDA_FLOATS(x.scalar_type(), "swiglu_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* grad_y_data = grad_y.const_data_ptr<scalar_t>();
    const scalar_t* x_data = x.const_data_ptr<scalar_t>();
    scalar_t* grad_x_data = grad_x.mutable_data_ptr<scalar_t>();
    scalar_t* y_ptr = return_y ? y.mutable_data_ptr<scalar_t>() : nullptr;
    const bool packed = packable<scalar_t>(d, {grad_y_data, x_data, grad_x_data, y_ptr});
    const int64_t w = packed ? kPack16<scalar_t> : 1;
    if (!bias.has_value()) {
      const auto kernel = packed ? swiglu_bwd_cuda_kernel<scalar_t, kPack16<scalar_t>> : swiglu_bwd_cuda_kernel<scalar_t, 1>;
      const int blocks = elementwise_blocks(numel_out / w);
      kernel<<<blocks, kThreads, 0, stream>>>(grad_y_data, x_data, grad_x_data, y_ptr,
                                              pack_grid(numel_out / w, d / w, blocks), d);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    dispatch_param_type<scalar_t>(param_dtype(bias, x), [&](auto* bias_tag) {
      using bias_t = std::remove_pointer_t<decltype(bias_tag)>;
      const auto kernel = packed ? swiglu_bwd_bias_cuda_kernel<scalar_t, bias_t, kPack16<scalar_t>>
                                 : swiglu_bwd_bias_cuda_kernel<scalar_t, bias_t, 1>;
      const BiasGradGrid launch = bias_grad_grid(kernel, call.rows, d, w);
      const at::Tensor partials =
          call.has_grad_bias
              ? at::empty({launch.chunks, 2 * d}, x.options().dtype(c10::CppTypeToScalarType<acc_t>::value))
              : at::Tensor();
      kernel<<<launch.grid, dim3(kTileCols, kTileRows), 0, stream>>>(
          grad_y_data, x_data, optional_data<bias_t>(bias), grad_x_data, y_ptr,
          call.has_grad_bias ? partials.mutable_data_ptr<acc_t>() : nullptr, call.rows, d, launch.rows_per_chunk);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (call.has_grad_bias) launch_reduce_partials<acc_t, bias_t>(partials, launch.chunks, 2 * d, grad_bias);
    });
  });
  return {grad_x, grad_bias, y};
}

}  // namespace

TORCH_LIBRARY_IMPL(memopt, CUDA, m) {
  m.impl("bias_act_fwd", &bias_act_fwd_cuda);
  m.impl("bias_act_fwd_inplace", &bias_act_fwd_inplace_cuda);
  m.impl("bias_act_bwd", &bias_act_bwd_cuda);
  m.impl("bias_act_bwd_inplace", &bias_act_bwd_inplace_cuda);
  m.impl("swiglu_fwd", &swiglu_fwd_cuda);
  m.impl("swiglu_bwd", &swiglu_bwd_cuda);
}

}  // namespace memopt
