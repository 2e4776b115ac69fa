// Column reductions for weight and bias gradients (see reduce.cuh). Pass 1: block
// (kColTile columns × kColLanes row lanes) per (column tile, row chunk); each lane walks
// its rows in order, the lanes are then added in lane order. Pass 2: one thread per
// column adds the chunk partials in chunk order.
#include <algorithm>

#include "ops/cuda/reduce.cuh"

namespace esplag::gpu::detail {

namespace {

constexpr int kColTile = 64;
constexpr int kColLanes = 4;

// out_w / out_b: when `direct` the gradients themselves (+=), otherwise partial rows
// [G, C] (=). kBias uses out_w only.
template <ColumnMode kMode>
__global__ void __launch_bounds__(kColTile* kColLanes)
    column_partials_kernel(float* out_w, float* out_b, bool direct, const bf16* dout, const bf16* inp,
                           const float* mean, const float* rstd, int64_t N, int C, int64_t rows_per_chunk) {
  __shared__ float sw[kColLanes][kColTile];
  __shared__ float sb[kColLanes][kColTile];
  const int col = blockIdx.x * kColTile + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = min(N, r0 + rows_per_chunk);
  float aw = 0.f, ab = 0.f;
  if (col < C) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColLanes) {
      const float d = to_f(dout[r * C + col]);
      if constexpr (kMode == ColumnMode::bias) {
        aw += d;
      } else if constexpr (kMode == ColumnMode::layernorm) {
        const float xhat = (to_f(inp[r * C + col]) - mean[r]) * rstd[r];
        aw += d * xhat;
        ab += d;
      } else {
        aw += d * (to_f(inp[r * C + col]) * rstd[r]);
      }
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y != 0 || col >= C) return;
  float tw = 0.f, tb = 0.f;
#pragma unroll
  for (int l = 0; l < kColLanes; ++l) {
    tw += sw[l][threadIdx.x];
    tb += sb[l][threadIdx.x];
  }
  if (direct) {
    if (out_w) out_w[col] += tw;
    if (kMode == ColumnMode::layernorm && out_b) out_b[col] += tb;
  } else {
    const int64_t o = static_cast<int64_t>(blockIdx.y) * C + col;
    if (out_w) out_w[o] = tw;
    if (kMode == ColumnMode::layernorm && out_b) out_b[o] = tb;
  }
}

__global__ void column_finalize_kernel(float* dst, const float* partial, int G, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = 0.f;
  for (int g = 0; g < G; ++g) acc += partial[static_cast<int64_t>(g) * C + c];
  dst[c] += acc;
}

template <ColumnMode kMode>
void launch_partials(dim3 grid, dim3 block, cudaStream_t stream, float* pw, float* pb, bool direct,
                     const bf16* dout, const bf16* inp, const float* mean, const float* rstd, int64_t N, int C,
                     int64_t rows_per_chunk) {
  column_partials_kernel<kMode><<<grid, block, 0, stream>>>(pw, pb, direct, dout, inp, mean, rstd, N, C,
                                                            rows_per_chunk);
  CUDA_CHECK_LAUNCH("column_partials_kernel");
}

}  // namespace

size_t column_reduce_scratch_floats(int64_t N, int C, int outputs) {
  return static_cast<size_t>(row_chunks(N)) * static_cast<size_t>(C) * static_cast<size_t>(outputs);
}

void column_reduce(ColumnMode mode, float* dw, float* db, const bf16* dout, const bf16* inp, const float* mean,
                   const float* rstd, int64_t N, int C, float* scratch, size_t scratch_floats, cudaStream_t stream) {
  if (mode != ColumnMode::layernorm) db = nullptr;
  if ((!dw && !db) || N <= 0 || C <= 0) return;
  // A LayerNorm bias gradient alone is a plain column sum.
  if (mode == ColumnMode::layernorm && !dw) {
    mode = ColumnMode::bias;
    dw = db;
    db = nullptr;
  }
  const int outputs = db ? 2 : 1;
  const size_t per_chunk = static_cast<size_t>(C) * static_cast<size_t>(outputs);
  size_t G = static_cast<size_t>(row_chunks(N));
  if (!scratch) G = 1;
  G = std::max<size_t>(1, std::min(G, scratch_floats / per_chunk));
  const int64_t rows_per_chunk = (N + static_cast<int64_t>(G) - 1) / static_cast<int64_t>(G);
  const int chunks = static_cast<int>((N + rows_per_chunk - 1) / rows_per_chunk);  // no empty chunk
  const bool direct = (chunks == 1);
  float* pw = direct ? dw : scratch;
  float* pb = db ? (direct ? db : scratch + static_cast<size_t>(chunks) * C) : nullptr;
  const dim3 block(kColTile, kColLanes), grid(blocks_for(C, kColTile), static_cast<unsigned>(chunks));
  switch (mode) {
    case ColumnMode::bias:
      launch_partials<ColumnMode::bias>(grid, block, stream, pw, pb, direct, dout, inp, mean, rstd, N, C,
                                        rows_per_chunk);
      break;
    case ColumnMode::layernorm:
      launch_partials<ColumnMode::layernorm>(grid, block, stream, pw, pb, direct, dout, inp, mean, rstd, N, C,
                                             rows_per_chunk);
      break;
    case ColumnMode::rmsnorm:
      launch_partials<ColumnMode::rmsnorm>(grid, block, stream, pw, pb, direct, dout, inp, mean, rstd, N, C,
                                           rows_per_chunk);
      break;
  }
  if (direct) return;
  const unsigned fb = blocks_for(C, 256);
  column_finalize_kernel<<<fb, 256, 0, stream>>>(dw, pw, chunks, C);
  CUDA_CHECK_LAUNCH("column_finalize_kernel");
  if (db) {
    column_finalize_kernel<<<fb, 256, 0, stream>>>(db, pb, chunks, C);
    CUDA_CHECK_LAUNCH("column_finalize_kernel");
  }
}

}  // namespace esplag::gpu::detail
