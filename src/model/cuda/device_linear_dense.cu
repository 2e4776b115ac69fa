#include "model/cuda/device_linear_dense.h"

#include "model/cuda/step_marks.h"

namespace esplag {

void DeviceDenseLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
  ctx_.gemm->forward(out, in, p_.weight.w, p_.bias.w, N, K, OC, ctx_.stream, act, pre_act);
}

void DeviceDenseLinear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
  ctx_.gemm->backward_input(dinp, dout, p_.weight.w, N, K, OC, false, ctx_.stream, pre_act);
}

void DeviceDenseLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                    const char* op) {
  const int K = int(in_), OC = int(out_);
  ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
  ctx_.gemm->backward_weight(p_.weight.grad, bias_grad ? p_.bias.grad : nullptr, dout, inp, N, K, OC, accumulate,
                             ctx_.stream);
}

}  // namespace esplag
