#include "model/cuda/rows_24_forward.h"

#include "core/cuda_check.h"
#include "core/error.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"

namespace esplag {

bool Rows24Forward::applies(int64_t out, int64_t in, int64_t tokens) {
  return out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0 && gpu::cusparselt_available();
}

Rows24Forward::Rows24Forward(const std::string& name, int64_t out, int64_t in, int64_t tokens, bool bias)
    : name_(name), out_(out), in_(in), workspace_("2:4 forward " + name) {
  ESPLAG_CHECK(applies(out, in, tokens), name_, " [out ", out, ", in ", in, "] over ", tokens,
               " tokens: the 2:4 forward needs cuSPARSELt and multiples of 16");
  g_ = &gpu::SparseGemm24::get(gpu::SparseGemm24Problem::linear_forward(out, in, tokens, bias));
  own_layout_ = gpu::cusparselt24_layout_matches(*g_);
  const size_t a = DeviceArena::kDefaultAlignment;
  compress_scratch_bytes_ = own_layout_ ? 0 : g_->compress_scratch_bytes();
  own_ = DeviceArena(g_->compressed_allocation_bytes() + compress_scratch_bytes_ + 2 * a, "2:4 forward " + name_);
  compressed_ = own_.allocate("compressed W", g_->compressed_allocation_bytes());
  if (compress_scratch_bytes_) compress_scratch_ = own_.allocate("compress scratch", compress_scratch_bytes_);
  workspace_.fit({g_}, nullptr);
}

Rows24Forward::~Rows24Forward() = default;

void Rows24Forward::prepare(const bf16* w, cudaStream_t s) {
  if (own_layout_)
    gpu::cusparselt24_compress(w, out_, in_, compressed_, nullptr, s);
  else
    g_->compress(compressed_, w, compress_scratch_, compress_scratch_bytes_, s);
}

void Rows24Forward::forward(bf16* y, const bf16* x, const bf16* bias, cudaStream_t s) {
  workspace_.tune_once(*g_, tuned_, {g_}, y, compressed_, x, bias, s);
  g_->matmul(y, compressed_, x, bias, workspace_.get(), workspace_.bytes(), s);
}

}  // namespace esplag
