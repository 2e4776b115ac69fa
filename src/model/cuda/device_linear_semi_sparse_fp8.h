// semi_sparse in fp8 on the GPU (train.precision fp8, docs/fp8.md): after every weight
// change the runtime 2:4 of W (Ws: the transposable 4×4-tile prune, as the bf16 kind takes
// it) is cast to e4m3 and its two compressed copies written (Ws for the forward, Wsᵀ for dX,
// one scale: they hold the same values, as the CPU's emulation quantises them); the products
// are Fp8SparseProducts', as slope's: the forward and dX on cuSPARSELt's e4m3 2:4 products,
// dW dense fp8. Where those do not apply (another micro-batch size, a bias, the per-layer
// dispatch found the dense way faster) the dense fp8 products of Ws and Wsᵀ run, pruned
// again into a scratch the layers share. sparse_dw is refused in fp8.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <memory>

#include "model/cuda/device_linear_fp8_sparse.h"
#include "model/device_linear.h"

namespace esplag {

class DeviceSemiSparseFp8Linear : public DeviceLinear {
 public:
  explicit DeviceSemiSparseFp8Linear(const DeviceLinearSetup& s);
  ~DeviceSemiSparseFp8Linear() override;
  size_t device_bytes() const override { return fp8_->device_bytes(); }
  void shared_parts(std::set<std::string>& used) const override;
  bool prepares() const override { return true; }
  void prepare(bool refresh) override;
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override;
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override;
  gpu::PendingScale forward_leaving_scale(bf16* out, const bf16* in, int N, const char* op) override;
  gpu::PendingScale backward_dx_leaving_scale(bf16* dinp, const bf16* dout, int N, const char* op) override;
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad, const char* op) override;
  void begin_backward() override { fp8_->begin_backward(); }

 protected:
  Fp8ProducedCodes* fp8_produced_codes() override { return &fp8_->produced(); }

 private:
  struct Scratch;
  Scratch& scratch();
  // Ws [out, in] (transposed: Wsᵀ [in, out]) pruned now from the bound weight into the scratch.
  const bf16* pruned(bool transposed);

  std::unique_ptr<Fp8SparseProducts> fp8_;
};

}  // namespace esplag
