// semi_sparse on the GPU (model/linear_semi_sparse.h's runtime 2:4): after every AdamW step
// (under ZeRO stage 3: in the next forward), and after set_params / init_weights, the
// transposable 4×4-tile 2:4 of the current W is taken (Ws) and compressed for cuSPARSELt
// (prepare); the forward and dX products are 2:4 GEMMs of Ws (the bias in cuSPARSELt's
// epilogue, a GELU and its gradient as separate passes), dW stays the dense dYᵀ·X (or, with
// sparse_dw, the 2:4 product of the MVUE of dYᵀ for full-size micro-batches), the master
// weight stays dense. Micro-batches of another size than the full one run the dense products
// of Ws (the 2:4 plans are per token count; Ws is then pruned again into a shared scratch as
// large as the largest such layer), and so do all micro-batches where per-layer dispatch
// found cuBLASLt faster.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <memory>

#include "model/device_linear.h"
#include "sparse/cuda/sparse_linear.h"

namespace esplag {

// The buffers every sparse_dw layer's backward uses (gpu::SparseLinearOptions::dw_scratch),
// sized for the largest block Linear; shared by semi_sparse and slope.
void* sparse_dw_scratch(DeviceLinearContext& ctx);
inline constexpr const char* kSparseDwScratch = "sparse_dw";

class DeviceSemiSparseLinear : public DeviceLinear {
 public:
  explicit DeviceSemiSparseLinear(const DeviceLinearSetup& s);
  ~DeviceSemiSparseLinear() override;
  void bind(const DeviceLinearParams& p) override;
  size_t device_bytes() const override;
  void shared_parts(std::set<std::string>& used) const override;
  bool prepares() const override { return true; }
  void prepare(bool refresh) override;
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  bool sparse_dw() const override;
  uint64_t sparse_dw_draws() const override;
  // The CPU twin is a SemiSparseLinear (model/linear_semi_sparse.h): its sparse dW's seed
  // and draws.
  // DeviceLinearKind::setting_from_twin for this kind.
  static void setting_from_twin(const Linear<float>& twin, int64_t step, bool masks, Setting& s, TwinMasks& held);
  void to_twin(Linear<float>& twin, const TwinCopy& c) const override;

 private:
  bool sparse_for(int N) const;
  // The weight a dense product reads: the pruned Ws the layer keeps (dense dispatch), or Ws
  // pruned now into the shared scratch (stream order keeps it until the product has read it).
  const bf16* dense_weight();

  std::unique_ptr<gpu::SparseLinear> sp_;
};

}  // namespace esplag
