// The forward product of a layer whose weight is 2:4 along its rows as it lies: a masked or
// vnm layer whose mask keeps at most 2 of every aligned 4 inputs in each row (2:4 masks, and
// V:2:M with M a multiple of 4, VENOM's 64:2:8 among them: 2 of every M are at most 2 of any
// aligned 4), on cuSPARSELt's bf16 2:4 product. Such a weight needs no pruning, so the
// product is the dense one of the masked weight up to the order of its sums.
//
// prepare() compresses the weight after every weight change: our one-pass writer of
// cuSPARSELt's layout (sparse/cuda/cusparselt_layout.h) where the library's layout was
// found to be that one for this problem, else cusparseLtSpMMACompress. The bias goes in
// cuSPARSELt's epilogue. Only the forward: dX = dY · W multiplies W down its columns, which
// such masks leave unstructured, and dW is needed at the kept positions only, scattered.
// Why not a V:N:M kernel with the gathered columns instead: docs/sparse-gpu.md ("V:N:M as
// 2:4").
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/device_arena.h"
#include "sparse/cuda/workspace_24.h"

namespace esplag {

namespace gpu {
class SparseGemm24;
}

class Rows24Forward {
 public:
  using bf16 = __nv_bfloat16;

  // Whether the product can run: cuSPARSELt loaded, out, in and tokens multiples of 16.
  static bool applies(int64_t out, int64_t in, int64_t tokens);

  // The plan of [out, in] over `tokens` rows (with a bias or not) and the compressed copy's
  // memory. `name` names the layer in errors and allocations.
  Rows24Forward(const std::string& name, int64_t out, int64_t in, int64_t tokens, bool bias);
  ~Rows24Forward();
  Rows24Forward(const Rows24Forward&) = delete;
  Rows24Forward& operator=(const Rows24Forward&) = delete;

  // The compressed copy of w [out, in] (bf16, 2:4 along its rows; anything else gives wrong
  // products). Asynchronous on `s`.
  void prepare(const bf16* w, cudaStream_t s);
  // y [tokens, out] = x [tokens, in] · Wᵀ (+ bias, given exactly when the plan has one), W
  // as the last prepare() had it. The first call tunes the plan (a search, once per problem
  // and process, which synchronises); a call may enlarge the workspace (Workspace24).
  void forward(bf16* y, const bf16* x, const bf16* bias, cudaStream_t s);

  size_t device_bytes() const { return own_.capacity() + workspace_.bytes(); }

 private:
  const std::string name_;
  const int64_t out_, in_;
  gpu::SparseGemm24* g_ = nullptr;  // the process-wide cached plan
  bool own_layout_ = false;         // our writer serves this problem
  bool tuned_ = false;
  DeviceArena own_;        // the compressed copy, and cusparseLtSpMMACompress's scratch without our writer
  gpu::Workspace24 workspace_;
  void* compressed_ = nullptr;
  void* compress_scratch_ = nullptr;
  size_t compress_scratch_bytes_ = 0;
};

}  // namespace esplag
