#include "sparse/cuda/workspace_24.h"

#include <algorithm>

#include "core/cuda_check.h"
#include "sparse/cuda/cusparselt.h"

namespace esplag::gpu {

void Workspace24::fit(std::initializer_list<const SparseGemm24*> plans, cudaStream_t s) {
  size_t need = 0;
  for (const SparseGemm24* g : plans)
    if (g) need = std::max(need, g->workspace_bytes());
  if (need <= buf_.bytes()) return;
  if (buf_.bytes()) CUDA_CHECK(cudaStreamSynchronize(s));  // the old workspace may still be in use
  buf_.allocate(need, owner_, "the cuSPARSELt workspace");
}

void Workspace24::tune_once(SparseGemm24& g, bool& tuned, std::initializer_list<const SparseGemm24*> plans,
                            __nv_bfloat16* out, const void* compressed, const void* dense,
                            const __nv_bfloat16* bias, cudaStream_t s) {
  fit(plans, s);
  if (tuned) return;
  g.tune(out, compressed, dense, bias, get(), bytes(), s);
  tuned = true;
  fit(plans, s);
}

}  // namespace esplag::gpu
