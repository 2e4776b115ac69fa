// The kept values of a row-wise 2:4 mask on the GPU: the storage of a slope layer's trained
// parameter (model/linear_slope.h's "<weight>.values") and of its gradient and AdamW
// moments, which exist for the kept values only.
//
// A matrix [rows, cols] under a mask that keeps exactly 2 of every 4 consecutive columns
// of each row (SLoPe's static forward mask) is stored as its kept values [rows, cols/2]:
// the two kept values of group g (columns 4g..4g+3) of row r are values[r·cols/2 + 2g + 0/1]
// in ascending column order, the order of sparse/compressed.h's Compressed24T. The mask
// comes as 4×4 tile bits ([rows/4, cols/4] uint16, bit 4·(r%4) + c%4 = element (r, c) of
// the tile, 1 = kept; sparse/masks.h's tile_bits). A group whose row keeps fewer than two
// positions (not a 2:4 forward mask) stores zeros in its missing slots.
//
// rows and cols must be positive multiples of 4; the pointers device memory (dense and
// values 4-byte aligned for float, 2-byte for bf16), values not overlapping dense. One
// thread per group of 4; launches are asynchronous on `stream` and checked.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/kept_values.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace esplag::gpu {

// values [rows, cols/2] = dense's kept values (accumulate: values += them); T is float or
// __nv_bfloat16 (bf16 sums in fp32, rounded to nearest even).
template <typename T>
void gather_kept_24(T* values, const T* dense, const uint16_t* tiles, int64_t rows, int64_t cols, bool accumulate,
                    cudaStream_t stream);

// dense [rows, cols] = the kept values at their positions, 0 elsewhere (every element written).
template <typename T>
void scatter_kept_24(T* dense, const T* values, const uint16_t* tiles, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace esplag::gpu
