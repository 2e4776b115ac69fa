// The fp8 codes of a layer's X, Xᵀ and dY that the ops making those operands write
// themselves (delayed scaling, DeviceLinear::takes_produced_fp8): the targets handed to the
// producers, and the marks that tell the layer's next products to take those codes instead
// of casting. One per fp8 layer, held by its products: the dense ones
// (model/cuda/device_linear_dense.h, also masked and vnm) and the 2:4 ones
// (model/cuda/device_linear_fp8_sparse.h, slope and semi_sparse).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "model/cuda/fp8_grad_codes.h"
#include "model/cuda/fp8_histories.h"
#include "model/device_linear.h"

namespace esplag {

class Fp8ProducedCodes {
 public:
  // Where the layer's products read X's codes (or Xᵀ's), dY's, and their inverse scales.
  struct Operands {
    uint8_t* x;
    float* x_inv;
    Fp8GradCodes* dy;
    float* dy_inv;
  };
  Fp8ProducedCodes() = default;  // for a layer in full precision: never on
  // Its owner's: it points at the owner's scaling and asks the owner for its operands.
  Fp8ProducedCodes(const Fp8ProducedCodes&) = delete;
  Fp8ProducedCodes& operator=(const Fp8ProducedCodes&) = delete;
  Fp8ProducedCodes& operator=(Fp8ProducedCodes&&) = default;
  // For the layer `owner` [out, in] named weight_name: `x` and `dy` its scaling of X and dY
  // (which outlive this), `operands` where its codes are (asked only for a target).
  Fp8ProducedCodes(const DeviceLinearContext& ctx, const void* owner, std::string weight_name, int64_t out,
                   int64_t in, const Fp8OperandAmax& x, const Fp8OperandAmax& dy, std::function<Operands()> operands)
      : ctx_(&ctx),
        owner_(owner),
        name_(std::move(weight_name)),
        out_(out),
        in_(in),
        x_(&x),
        dy_(&dy),
        operands_(std::move(operands)) {}

  // Whether producers may write the codes now: producers on (DeviceLinearContext::
  // fp8_producers), both histories warm and not paused.
  bool on() const { return ctx_ && ctx_->fp8_producers && x_->from_history() && dy_->from_history(); }

  // The targets of DeviceLinear::fp8_input_target, fp8_input_t_target and fp8_grad_target
  // (see there), each an Error naming the layer unless on().
  gpu::Fp8Target input(const gpu::bf16* in, int N);
  gpu::Fp8Target input_t(int N);  // at the forward's scale of X
  // Into the second pair of dY's codes (Fp8GradCodes::produced). Refused for a layer with a
  // bias (its gradient reads dY) or outside a SwiGLU model (no second pair).
  gpu::Fp8Target grad(const gpu::bf16* dout, int N, bool bias);

  // Whether a producer wrote X's codes of `in` over N rows for this forward: the last
  // input() was for that pointer and those rows, and producers are still on (a mark left
  // before a pause is not honoured). The mark goes either way.
  bool take_input(const gpu::bf16* in, int N) {
    const bool made = x_made_.in == in && x_made_.rows == N && on();
    x_made_ = {};
    return made;
  }
  // The same for Xᵀ's codes of N rows in backward_dw (input_t() since begin_backward()).
  bool take_input_t(int N) {
    const bool made = xt_made_rows_ == N && on();
    xt_made_rows_ = 0;
    return made;
  }
  void begin_backward() { xt_made_rows_ = 0; }

 private:
  // The layer's operands, after an Error naming `target` unless on().
  Operands operands_for(const char* target) const;

  const DeviceLinearContext* ctx_ = nullptr;
  const void* owner_ = nullptr;
  std::string name_;
  int64_t out_ = 0, in_ = 0;
  const Fp8OperandAmax *x_ = nullptr, *dy_ = nullptr;
  std::function<Operands()> operands_;
  struct {
    const gpu::bf16* in = nullptr;  // whose X codes a producer wrote for the next forward (null: none)
    int rows = 0;
  } x_made_;
  int xt_made_rows_ = 0;  // rows of Xᵀ's codes a producer wrote for the next backward_dw (0: none)
};

}  // namespace esplag
