// cuSPARSELt's compressed 2:4 buffer written directly (namespace esplag::gpu), so that the
// per-step weight preparation of the 2:4 Linear kinds (sparse/cuda/sparse_linear.h) does
// not pay cusparseLtSpMMACompress (1.7 ms of semi_sparse's 1.8 ms preparation of an
// 11008×4096 bf16 W on an H100, for two compressions) but one memory-bound pass over W.
//
// cuSPARSELt does not document the layout. The one written here is the expected format of
// 16-bit operands on SM90; it is NOT trusted blindly: cusparselt24_layout_matches()
// compresses a random 2:4 matrix of the real problem through the library and through this
// code once per problem (and per process, hence per loaded library version) and compares
// the buffers byte for byte. Callers use this writer only when that check passes and keep
// cusparseLtSpMMACompress otherwise, so a library whose layout differs (another version,
// another GPU, op T) can never be fed a wrong buffer.
//
// Status (tests/gpu_cusparselt_layout.cu on an H100, cuSPARSELt 0.8.0): byte-identical to
// cusparseLtSpMMACompress for every forward-form (op N) problem tested, 16×16 to
// 11008×4096; the library's op T layout differs, so backward_data keeps the library's
// compression and the 2:4 Linear kinds take their input gradient as a forward-form product
// of Wᵀ instead. With it, semi_sparse's per-step preparation of an 11008×4096 W fell from
// 1.80 to 0.16 ms (fused with the pruning; 0.094 ms for 4096×11008 since each thread works
// on whole 4×4 tiles, docs/sparse-gpu.md) and slope's from 3.06 to 0.36 ms
// (bench/results/layer-h100.csv).
//
// The layout, for the structured operand op(W) seen as a logical row-major M×K matrix,
// 2:4 along K (forward: op(W) = W [out, in], M = out, K = in; input gradient with W as A
// and op T: op(W) = Wᵀ, M = in, K = out; weight gradient: op(S) = S [out, N], the 2:4
// estimate of dYᵀ, M = out, K = N), bf16, M and K multiples of 64:
//   bytes [0, M·K)        the kept values, row-major [M, K/2]: per group of 4 along K the
//                         two kept values in ascending position.
//   bytes [M·K, M·K·9/8)  the metadata, 4 bits per group: idx0 | idx1 << 2 (the positions
//                         0..3 in the group, idx0 < idx1), arranged by blocks:
//     offset(r, g) = M·K + (r / 64)·8·K + (g / 8)·256 + ((r % 64) / 16)·64 + byte(r % 16, g % 8)
//     where r is the row of op(W), g the group along K (g / 8: the 32-column chunk), and
//     within a 16-row × 32-column block (64 bytes), row a' = r % 16, group j = g % 8:
//       a = a' % 8, half = a' / 8 (rows a and a + 8 share a byte: low / high nibble),
//       h = j % 2, c = j / 2 (the 8-column chunk), q = c % 2, t = c / 2,
//       byte = a·8 + q·4 + h·2 + t.
//   Total M·K·9/8 bytes; cusparseLtSpMMACompressedSize must agree (checked).
// Groups of the input holding fewer than two non-zeros (the transposable greedy can leave
// such groups) are stored with the non-zero positions padded by the lowest zero positions
// (their stored value is the zero that is there); the product is the same whatever
// positions the library would have chosen. A group with more than two non-zeros is not 2:4:
// the input must be pruned (only the first two non-zeros would be stored).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/cusparselt_layout.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;
class SparseGemm24;

// Bytes of the layout for a structured operand op(W) of M×K; 0 when this writer does not
// handle the shape (M or K not a positive multiple of 64).
size_t cusparselt24_layout_bytes(int64_t m, int64_t k);

// The CPU reference: dst (cusparselt24_layout_bytes) = the layout of op(W), W [rows, cols]
// bf16 bits, row-major; transposed = false: op(W) = W (M = rows, K = cols); true:
// op(W) = Wᵀ (M = cols, K = rows). Throws Error for shapes the layout does not handle.
void cusparselt24_compress_host(const uint16_t* w, int64_t rows, int64_t cols, bool transposed, uint8_t* dst);

// The device writer, one pass over W [rows, cols] (bf16, row-major, 16-byte aligned):
// dst_n (may be null) = the layout of W (2:4 along rows), dst_t (may be null) = the layout
// of Wᵀ (2:4 along columns); each 16-byte aligned. A transposable W (2:4 both ways) gives
// the forward's and the input gradient's buffers of one Linear in the same pass.
// rows, cols multiples of 64 (else Error). Asynchronous on `stream`.
void cusparselt24_compress(const bf16* w, int64_t rows, int64_t cols, void* dst_n, void* dst_t, cudaStream_t stream);

// The same for slope's stored form: W1 [rows, cols] given by its kept values [rows, cols/2]
// (bf16, 4-byte aligned; sparse/cuda/kept_values.h's order) and its row-wise 2:4 forward
// mask as 4×4 tile bits [rows/4, cols/4]: dst_n (may be null) = the layout of W1, dst_t
// (may be null) = the layout of W2ᵀ, W2 = W1 ⊙ backward_tiles (same form, W's
// orientation). Byte for byte what cusparselt24_compress writes from the dense W1 and W2,
// in one read of the kept values and masks.
void cusparselt24_compress_kept(const bf16* values, const uint16_t* forward_tiles, const uint16_t* backward_tiles,
                                int64_t rows, int64_t cols, void* dst_n, void* dst_t, cudaStream_t stream);

// The same from a dense W, pruned on the way with the transposable greedy 4×4-tile 2:4 mask
// (gpu::transposable_24's, bit for bit): pruned (may be null) = that pruned W [rows, cols],
// dst_n / dst_t (may be null) = its layouts. One read of W instead of a pruning pass and a
// compression pass over the pruned copy (semi_sparse's per-step preparation).
void cusparselt24_prune_compress(const bf16* w, int64_t rows, int64_t cols, bf16* pruned, void* dst_n, void* dst_t,
                                 cudaStream_t stream);

// The same with the row-wise 2:4 of X [rows, cols] instead (the two largest |x| of every 4
// along a row, NaN as +inf, ties to the lower index: gpu::activation_24_rows's rule, bit
// for bit): pruned (may be null) = X pruned, dst_n = its layout (op N only: the result is
// 2:4 along its rows alone). semi_sparse_activation's row_24 input and its forward's
// compressed operand (SparseProduct::activation_forward) in one read of X.
void cusparselt24_prune_rows_compress(const bf16* x, int64_t rows, int64_t cols, bf16* pruned, void* dst_n,
                                      cudaStream_t stream);

// The weight-gradient product's structured operand from the output gradient, in one read
// of it: dst_t = the layout of S = MVUE(Gᵀ), the MVUE 2:4 (sparse/mvue.h) of Gᵀ [cols, rows]
// for `seed`, where G [rows, cols] is bf16, row-major, 16-byte aligned (SparseLinear's
// sparse_dw: G = dY [N, out], so S estimates dYᵀ [out, N], 2:4 along the tokens: M = out,
// K = N). Groups are 4 consecutive rows of one column of G, numbered as
// cpu::mvue_24_bf16 numbers them on Gᵀ: column c, rows 4j..4j+3 is group c·(rows/4) + j;
// each group runs sparse_detail::mvue_24_group, so the bytes are exactly
// cusparselt24_compress_host(mvue_24_bf16(Gᵀ, seed), transposed = false). The 64×64 tile of
// cusparselt24_compress, with the MVUE choosing the kept values instead of "the
// non-zeros"; no dense estimate and no transposed copy of G are written. rows, cols
// multiples of 64 (else Error). The seed is read from device memory (`seed`, one uint64)
// when the kernel runs, so a captured CUDA graph uses whatever seed the stream's earlier
// work left there. Asynchronous on `stream`.
void cusparselt24_compress_mvue_t(const bf16* g, int64_t rows, int64_t cols, const uint64_t* seed, void* dst_t,
                                  cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// 8-bit (e4m3) operands: another layout (sparse/cuda/cusparselt_layout_e4m3.cu), learned from
// cuSPARSELt 0.8.0's compression of probe matrices on an H100 and, like the 16-bit one,
// used only where cusparselt24_layout_matches() finds it byte for byte. For op(W) =
// M×K, op N (the forward form, the only one fp8 training runs), M and K multiples of 64:
//   bytes [0, M·K/2)          the kept codes, row-major [M, K/2]: per group of 4 along K the
//                             two kept codes in ascending position.
//   bytes [M·K/2, M·K·5/8)    the metadata, 4 bits per group, idx0 | idx1 << 2:
//     offset(r, g) = M·K/2 + (r / 64)·8·K + (g / 16)·512 + ((r % 64) / 16)·128 + (r % 8)·16
//                    + ((g % 8) / 2)·4 + ((g % 16) / 8)·2 + (r % 16) / 8,
//     the low nibble for an even group g, the high nibble for an odd one.
// A group of fewer than two non-zero codes (±0 counts as zero) is padded by the HIGHEST
// positions not taken (the 16-bit layout pads by the lowest).

// M·K·5/8, or 0 when M or K is not a positive multiple of 64.
size_t cusparselt24_e4m3_layout_bytes(int64_t m, int64_t k);

// The CPU reference: dst (cusparselt24_e4m3_layout_bytes) = the layout of the row-major
// M×K e4m3 codes w. Throws Error for shapes the layout does not handle.
void cusparselt24_compress_e4m3_host(const uint8_t* w, int64_t m, int64_t k, uint8_t* dst);

// slope's two fp8 copies from its stored form, in two reads of it: W1 [rows, cols] given by
// its kept values [rows, cols/2] (bf16) and forward mask tile bits [rows/4, cols/4], W2 =
// W1 ⊙ backward_tiles, as cusparselt24_compress_kept takes them. The first pass writes
// *amax_n = amax(W1) and *amax_t = amax(W2) (core's fp8_amax: the largest finite |w|); the
// second casts each with its scale (gpu::fp8_cast's codes, bit for bit, e4m3) and writes
// dst_n = the layout of W1's codes and dst_t = that of W2ᵀ's [cols, rows], 2:4 along rows,
// and *inv_n, *inv_t the inverse scales (as fp8_cast writes them). The same bytes as
// casting the expanded W1 and W2ᵀ with fp8_cast and compressing them through cuSPARSELt.
// rows, cols multiples of 64 (else Error); values 4-byte aligned, dst_n, dst_t 16-byte
// aligned (else Error). Asynchronous on `stream`.
void cusparselt24_compress_kept_e4m3(const bf16* values, const uint16_t* forward_tiles,
                                     const uint16_t* backward_tiles, int64_t rows, int64_t cols, float* amax_n,
                                     float* amax_t, float* inv_n, float* inv_t, void* dst_n, void* dst_t,
                                     cudaStream_t stream);

// The same from a W [rows, cols] (bf16, 8-byte aligned) that is 2:4 along both dimensions
// (semi_sparse's transposable prune), with one scale from *amax (fp8_amax of W): dst_n =
// the layout of W's codes, dst_t = that of Wᵀ's [cols, rows] (either may be null; 16-byte
// aligned), *inv the inverse scale. One read of W. rows, cols multiples of 64 (else Error).
void cusparselt24_compress_e4m3(const bf16* w, int64_t rows, int64_t cols, const float* amax, float* inv,
                                void* dst_n, void* dst_t, cudaStream_t stream);

// Whether our layout of g's dtype is the one the loaded cuSPARSELt produces for g's
// structured operand. Decided once per (dtype, product, operand, structured shape) and
// process (thread-safe); synchronises the device the first time; false when cuSPARSELt is
// not available, and for every problem with ESPLAG_CUSPARSELT_OWN_LAYOUT=0.
//   bf16: operand A (the forward's op N, backward_data's op T of W; weight_grad's op N of S
//     [out, tokens], the forward form with M = out, K = tokens; activation_forward's op N of
//     Xs [tokens, in], M = tokens, K = in), the compressed size equal to
//     cusparselt24_layout_bytes, and a random 2:4 (along both dimensions) matrix of the
//     operand's shape compressed both ways giving identical bytes.
//   e4m3: a forward problem with W as A, the compressed size equal to
//     cusparselt24_e4m3_layout_bytes, and random codes of the structured operand's shape
//     (groups of two, one and no non-zeros, zeros of both signs) compressed by the library
//     and by cusparselt24_compress_e4m3_host giving identical bytes
//     (cusparselt24_e4m3_layout_agrees, the uncached check).
bool cusparselt24_layout_matches(const SparseGemm24& g);
bool cusparselt24_e4m3_layout_agrees(const SparseGemm24& g);

}  // namespace esplag::gpu
