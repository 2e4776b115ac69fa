// V:2:M (VENOM) weight × dense activations on the sparse tensor cores: the forward of a
// Linear whose weight is V:N:M, Y[tokens, out] = X[tokens, in] · Wᵀ (+ bias), the GPU
// counterpart of cpu::linear_vnm (sparse/compressed.h).
//
// W [rows = out features, cols = in features] is V:2:M along cols: per block of V rows ×
// M columns, 4 columns are selected (indices stored once per block) and every row keeps 2
// of those 4. The kernel walks K in steps of 8 blocks (8·M columns of X): the block's 4
// selected columns of X are gathered from shared memory straight into the B fragments of
// mma.sp.m16n8k32 (so X is multiplied at density 4/M), and the 2-of-4 choice inside them
// is the instruction's own 2:4 metadata. Operands are bf16, accumulation fp32, output bf16
// or fp32.
//
// The CPU compressed layout is converted once per weight, on the device, into the
// kernel's layout (VnmDeviceWeight): the kept values and metadata in the exact order of
// the mma.sp A fragments and metadata registers, and the selected columns as offsets
// inside a K step. Only the values change during training; vnm_update_values rewrites
// them without touching the indices.
//
// Backward: dX = dY · W is NOT done with this kernel. mma.sp needs the sparse operand to
// be 2:4 along the reduction dimension, which for dX is `out`; along `out` a V:2:M weight
// has no such bound (a selected column is non-zero in any subset of the block's V rows), so
// the sparse tensor cores cannot run it. Backward-data uses the dense weight
// (vnm_decompress, then gpu::Gemm::backward_input); dW is a dense GEMM whose result is
// gathered at the kept positions. See docs/sparsity-formats.md for the CPU layouts.
//
// Supported: V a multiple of 64 (64, 128, ...; the 16 and 32 that the CPU side allows are
// refused), 4 <= M <= 16 (M = 4 is plain 2:4), any in features that are a multiple of M.
//
// On sm_90 the forward runs by default on a second kernel built on Hopper's sparse warpgroup
// MMA, wgmma.sp (sparse/cuda/vnm_wgmma.cu; VnmKernel below), from the same converted weight.
//
// Performance of the mma.sp kernel (H100, bench/results/vnm-gemm-h100.csv): correct, but on the measured LLM
// shapes SLOWER than the dense cuBLASLt GEMM on the decompressed weight: dense time / ours
// is 0.55-0.57 for 64:2:8, 0.60-0.62 for 128:2:8 and 0.89-0.96 for 64:2:16. Until the
// kernel is faster (vnm_gemm.cu says why it is not, and what would fix it), a model should
// run V:N:M layers on the GPU through the dense weight (vnm_decompress) for speed, and
// use this kernel where memory for the dense weight is the constraint.
//
// Conventions as ops/gpu.h: asynchronous on the given stream, launch checked, device
// pointers, deterministic (each output is one fixed sequence of fp32 mma accumulations
// that depends on the sizes only). Only for the CUDA build (ESPLAG_CUDA=ON), sm_80 and up.
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/vnm_gemm.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sparse/compressed.h"

namespace esplag {
class DeviceArena;
}

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

// A V:2:M weight in the kernel's layout (device memory owned by whoever gave the
// storage). Rows are padded to kRowTile and the blocks of a row to a whole K step with
// zero values and valid indices, so the kernel never reads past its arrays.
struct VnmDeviceWeight {
  static constexpr int kRowTile = 256;      // rows (out features) per thread block
  static constexpr int kBlocksPerStep = 8;  // V:2:M blocks per K step (32 gathered columns)

  int v = 0, m = 0;
  int64_t rows = 0, cols = 0;  // the logical shape of W: [out, in]
  int64_t blocks = 0;          // cols / m
  int64_t ksteps = 0;          // ceil(blocks / kBlocksPerStep)
  int64_t row_tiles16 = 0;     // padded rows / 16
  int64_t row_blocks = 0;      // ceil(padded rows / v)
  // [ksteps][row_tiles16][32 lanes][4] u32: lane (g, t) of the 16-row tile holds the two
  // kept values (bf16 pairs) of rows g and g+8 in chunks t and t+4 of the step, in the
  // order of the m16n8k32 A fragment.
  uint32_t* frag = nullptr;
  // [ksteps][row_tiles16][32 lanes] u32: the metadata register of each lane (lanes 4g+0
  // and 4g+2: chunks 0-3, lanes 4g+1 and 4g+3: chunks 4-7; low half row g, high half
  // row g+8; one nibble per chunk, bits 0-1 the first kept position).
  uint32_t* meta = nullptr;
  // [ksteps][row_blocks][4 t][8] u8: for the lanes with t = lane % 4, the columns (within
  // the step's 8·m columns of X) of B fragment register i, elements j, at [2i + j].
  uint8_t* sel = nullptr;
};

// Bytes of storage vnm_prepare_weight needs for a [rows, cols] V:2:M weight.
size_t vnm_device_weight_bytes(int64_t rows, int64_t cols, int v, int m);

// Converts a weight given in the CPU compressed layout (CompressedVNMT, already copied to
// the device byte for byte) into the kernel layout inside `storage`:
//   columns [rows/v, cols/m, 4] u8, values [rows, cols/m·2] bf16,
//   meta [rows, ceil(cols/m·4/16)] u16.
// Throws esplag::Error for shapes the kernel cannot run (rows % v, cols % m, v not a
// multiple of 64, m outside 4..16, storage too small) and, after synchronising the stream,
// if any column index is >= m or any metadata nibble is not an ascending pair (mma.sp
// would compute garbage). Once per weight; not for the timed path.
VnmDeviceWeight vnm_prepare_weight(void* storage, size_t storage_bytes, const uint8_t* columns, const bf16* values,
                                   const uint16_t* meta, int64_t rows, int64_t cols, int v, int m,
                                   cudaStream_t stream);

// Copies a host CompressedVNMBf16 to the device (temporaries and storage from `arena`;
// the temporaries are released again) and converts it. Synchronous.
VnmDeviceWeight vnm_upload_weight(const CompressedVNMBf16& w, DeviceArena& arena, cudaStream_t stream);

// Rewrites the kept values of `w` from values [rows, cols/m·2] bf16 (the CPU order); the
// indices stay. Asynchronous: for use after every optimizer step.
void vnm_update_values(const VnmDeviceWeight& w, const bf16* values, cudaStream_t stream);

// out [rows, cols] bf16 = the dense W (zeros where pruned), e.g. for backward-data.
void vnm_decompress(bf16* out, const VnmDeviceWeight& w, cudaStream_t stream);

// The warp tile of the kernel: 64 out rows × 64 tokens, or 128 × 32 (each gathered B
// fragment then feeds 8 mma.sp instead of 4; needs V % 128 == 0). `automatic` takes the
// 128-row tile whenever V allows it.
enum class VnmTile { automatic, rows64, rows128 };

// Which kernel runs the forward. `wgmma_sp`: Hopper's sparse warpgroup MMA (vnm_wgmma.cu,
// sm_90a; a warp-specialised producer/consumer pipeline, the tile parameter does not apply);
// `mma_sp`: the mma.sp.m16n8k32 kernel above (sm_80 and up). `automatic` takes mma_sp: the
// wgmma.sp kernel is correct but slower so far (H100, bench/results/vnm-wgmma-h100.txt: 0.29-0.67x
// of cuBLASLt on Xᵀ, 0.03-0.07x on X, against mma.sp's 0.52-1.08x; docs/sparse-gpu.md says what it
// lacks). The environment variable ESPLAG_VNM_KERNEL (automatic, wgmma_sp or mma_sp) overrides
// `automatic`. Asking for wgmma_sp where it is not available is an error.
enum class VnmKernel { automatic, wgmma_sp, mma_sp };

// True on a compute-capability 9.0 device when the binary carries the sm_90a kernel.
bool vnm_wgmma_available();

// The kernel a forward called with `requested` runs on the current device (reads
// ESPLAG_VNM_KERNEL for `automatic`; throws for an unknown value or an unavailable kernel).
VnmKernel vnm_resolve_kernel(VnmKernel requested);

// out[tokens, w.rows] = x[tokens, w.cols] · Wᵀ (+ bias[w.rows], added in fp32 before the
// rounding), overwritten. Any tokens >= 0; x and out may have any 2-byte (4-byte for fp32)
// alignment (16-byte aligned x with cols % 8 == 0 takes the cp.async path, otherwise a
// slower element-wise load path).
void vnm_linear_forward(bf16* out, const bf16* x, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
                        cudaStream_t stream, VnmTile tile = VnmTile::automatic,
                        VnmKernel kernel = VnmKernel::automatic);
void vnm_linear_forward(float* out, const bf16* x, const VnmDeviceWeight& w, const bf16* bias, int64_t tokens,
                        cudaStream_t stream, VnmTile tile = VnmTile::automatic,
                        VnmKernel kernel = VnmKernel::automatic);

// The same product from Xᵀ [cols, ldxt] (ldxt >= tokens, a multiple of 8; 16-byte aligned).
// With the tokens contiguous, one 16-byte shared-memory load gathers a selected column for
// 8 tokens at once, instead of one 2-byte load per token: far fewer shared-memory
// instructions than vnm_linear_forward (see vnm_gemm.cu). Worth it where the producer of X
// can write it transposed, or with vnm_transpose_input (one extra pass over X).
void vnm_linear_forward_xt(bf16* out, const bf16* xt, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias,
                           int64_t tokens, cudaStream_t stream, VnmTile tile = VnmTile::automatic,
                           VnmKernel kernel = VnmKernel::automatic);
void vnm_linear_forward_xt(float* out, const bf16* xt, int64_t ldxt, const VnmDeviceWeight& w, const bf16* bias,
                           int64_t tokens, cudaStream_t stream, VnmTile tile = VnmTile::automatic,
                           VnmKernel kernel = VnmKernel::automatic);

// Xᵀ for vnm_linear_forward_xt: xt [cols, vnm_transposed_ld(tokens)] = x [tokens, cols]ᵀ
// (the padding columns are not written and never read).
int64_t vnm_transposed_ld(int64_t tokens);
size_t vnm_transposed_input_bytes(int64_t tokens, int64_t cols);
void vnm_transpose_input(bf16* xt, const bf16* x, int64_t tokens, int64_t cols, cudaStream_t stream);

}  // namespace esplag::gpu
