#include "model/cuda/fp8_produced_codes.h"

#include "core/error.h"

namespace esplag {

Fp8ProducedCodes::Operands Fp8ProducedCodes::operands_for(const char* target) const {
  ESPLAG_CHECK(on(), name_, ": ", target,
               " while the layer takes no produced codes (delayed fp8 scaling, warm, producers on)");
  return operands_();
}

gpu::Fp8Target Fp8ProducedCodes::input(const gpu::bf16* in, int N) {
  const Operands o = operands_for("fp8_input_target");
  x_made_ = {in, N};
  return {o.x, nullptr, o.x_inv, x_->before_cast(in, int64_t(N) * in_, ctx_->stream), Fp8Format::e4m3,
          ctx_->fp8_saturated};
}

gpu::Fp8Target Fp8ProducedCodes::input_t(int N) {
  const Operands o = operands_for("fp8_input_t_target");
  xt_made_rows_ = N;
  // The forward's scale of X, recorded there already (as backward_dw's transposed cast takes it).
  return {nullptr, o.x, o.x_inv, x_->last(), Fp8Format::e4m3, ctx_->fp8_saturated};
}

gpu::Fp8Target Fp8ProducedCodes::grad(const gpu::bf16* dout, int N, bool bias) {
  const Operands o = operands_for("fp8_grad_target");
  ESPLAG_CHECK(ctx_->swiglu_grad_codes && o.dy->made, name_, ": fp8_grad_target in a model whose MLP is not SwiGLU");
  ESPLAG_CHECK(!bias, name_, ": fp8_grad_target for a layer with a bias (its gradient reads dY)");
  const auto [dy, dyt] = o.dy->produced(owner_, dout, N);
  return {dy, dyt, o.dy_inv, dy_->before_cast(dout, int64_t(N) * out_, ctx_->stream), ctx_->precision.grad,
          ctx_->fp8_saturated};
}

}  // namespace esplag
