// The workspace of one layer's cuSPARSELt products (SparseGemm24). Plans are the process's,
// one per problem and shared by every layer of that shape, and the search that tunes a plan
// (its first use, by whichever layer) may pick a configuration that needs more: fit() before
// a product keeps the workspace as large as the plans it serves need now.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>
#include <utility>

#include "core/device_buffer.h"

namespace esplag::gpu {

class SparseGemm24;

class Workspace24 {
 public:
  // `owner` names the layer in allocation errors.
  explicit Workspace24(std::string owner) : owner_(std::move(owner)) {}

  // Grows to the largest workspace_bytes() of `plans` (null ones skipped). A workspace that
  // grows is replaced after `s` is done with it (the first allocation does not wait).
  void fit(std::initializer_list<const SparseGemm24*> plans, cudaStream_t s);
  // What a product of plan g (one of `plans`) needs first: fit(plans) and, while `tuned` is
  // false (the caller's first product of g), g.tune on these operands (a search once per
  // problem and process, which synchronises), fit again, and `tuned` set.
  void tune_once(SparseGemm24& g, bool& tuned, std::initializer_list<const SparseGemm24*> plans, __nv_bfloat16* out,
                 const void* compressed, const void* dense, const __nv_bfloat16* bias, cudaStream_t s);

  void* get() const { return buf_.get(); }
  size_t bytes() const { return buf_.bytes(); }

 private:
  std::string owner_;
  DeviceBuffer buf_;
};

}  // namespace esplag::gpu
