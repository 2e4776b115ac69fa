#include "model/cuda/device_linear_dense.h"

#include <utility>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "model/cuda/fp8_grad_codes.h"
#include "model/cuda/step_marks.h"
#include "ops/gpu_fp8.h"
#include "ops/gpu_fused.h"

namespace esplag {

namespace {

constexpr const char* kFp8Scratch = "fp8 operands";
// Each amax and inverse scale 256 bytes apart: cuBLASLt's fp8 kernels refuse scale
// pointers that are not 16-byte aligned.
constexpr int kScaleStride = 64;

}  // namespace

// One for all fp8 layers, sized for the largest: X's codes (or Xᵀ's) of tokens · in bytes,
// dY's and dYᵀ's of tokens · out bytes each, a bias's aligned copy, and the fp8 GEMM with
// its workspace.
struct DeviceDenseLinear::Fp8Scratch : SharedScratch::Part {
  DeviceArena arena;
  std::unique_ptr<gpu::Fp8Gemm> gemm;
  uint8_t* x = nullptr;
  Fp8GradCodes dy_codes;  // with its second pair where SwiGLU's backward writes fc's (swiglu_grad_codes)
  bf16* bias = nullptr;  // a bias that is not 16-byte aligned, copied (the fp8 GEMM reads it so)
  enum Role { input, weight, grad };
  size_t bytes() const override { return arena.capacity(); }
};

namespace {

constexpr int kScaleSlots = 6;  // amax and inverse scale of X, W, dY

// The parts of the fp8 scratch, in the order they are taken from its arena.
struct Fp8Sizes {
  size_t x, dy, outs, workspace;
  bool produced;  // the second pair of dY codes (DeviceLinearContext::swiglu_grad_codes)
  Fp8Sizes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens, bool produced)
      : produced(produced) {
    x = dy = outs = 0;
    for (const auto& [out, in] : shapes) {
      x = std::max(x, size_t(tokens) * size_t(in));
      dy = std::max(dy, size_t(tokens) * size_t(out));
      outs = std::max(outs, size_t(out));
    }
    workspace = gpu::Gemm::kDefaultWorkspaceBytes;
  }
  size_t bytes() const {
    return x + Fp8GradCodes::bytes(dy, produced) + sizeof(bf16) * outs + workspace + 3 * DeviceArena::kDefaultAlignment;
  }
};

}  // namespace

DeviceDenseLinear::DeviceDenseLinear(const DeviceLinearSetup& s, const std::string& kind)
    : DeviceLinear(kind, s), fp8_(ctx_.precision.fp8) {
  if (!fp8_) return;
  ESPLAG_CHECK(in_ % 16 == 0 && out_ % 16 == 0, "linear [out ", out_, ", in ", in_,
               "]: fp8 products need in and out features that are multiples of 16 (cuBLASLt's fp8 GEMMs)");
  fp8_own_ = DeviceArena(fp8_layer_bytes(out_, in_), "fp8 " + weight_name_);
  fp8_own_.allocate_array<float>("fp8.scales", kScaleSlots * kScaleStride);
  w8_ = fp8_own_.allocate_array<uint8_t>("fp8.w", size_t(out_ * in_));
  wt8_ = fp8_own_.allocate_array<uint8_t>("fp8.wt", size_t(out_ * in_));
  using R = Fp8Scratch::Role;
  x_amax_ = Fp8OperandAmax(fp8_amax(R::input), ctx_.fp8_histories, weight_name_, ProductOperand::input);
  dy_amax_ = Fp8OperandAmax(fp8_amax(R::grad), ctx_.fp8_histories, weight_name_, ProductOperand::grad);
  produced_ = Fp8ProducedCodes(ctx_, this, weight_name_, out_, in_, x_amax_, dy_amax_, [this] {
    Fp8Scratch& f = fp8_scratch();
    return Fp8ProducedCodes::Operands{f.x, fp8_inv(R::input), &f.dy_codes, fp8_inv(R::grad)};
  });
}

size_t DeviceDenseLinear::fp8_layer_bytes(int64_t out, int64_t in) {
  return sizeof(float) * kScaleSlots * kScaleStride + 2 * size_t(out * in) + 3 * DeviceArena::kDefaultAlignment;
}

float* DeviceDenseLinear::fp8_amax(int role) const {
  return static_cast<float*>(fp8_own_.base()) + kScaleStride * (2 * role);
}
float* DeviceDenseLinear::fp8_inv(int role) const {
  return static_cast<float*>(fp8_own_.base()) + kScaleStride * (2 * role + 1);
}

void DeviceDenseLinear::bind(const DeviceLinearParams& p) {
  DeviceLinear::bind(p);
  w8_current_ = false;  // another weight: its codes are made at the next prepare or product
  weight_amax_ = nullptr;
}

void DeviceDenseLinear::prepare(bool) {
  if (!fp8_) return;
  ctx_.marks->mark(ctx_.stream, "fp8 cast");
  cast_weight();
}

void DeviceDenseLinear::cast_weight() {
  using R = Fp8Scratch::Role;
  cudaStream_t s = ctx_.stream;
  const float* amax = std::exchange(weight_amax_, nullptr);  // AdamW's, once
  if (!amax) {
    float* own = fp8_amax(R::weight);
    gpu::fp8_amax(own, p_.weight.w, out_ * in_, s);
    amax = own;
  }
  gpu::fp8_cast_both(w8_, wt8_, fp8_inv(R::weight), p_.weight.w, out_, in_, amax, Fp8Format::e4m3, ctx_.fp8_saturated,
                     s);
  w8_current_ = true;
}

void DeviceDenseLinear::begin_backward() {
  produced_.begin_backward();
  if (!fp8_) return;
  if (Fp8Scratch* f = ctx_.scratch.find<Fp8Scratch>(kFp8Scratch)) f->dy_codes.forget();
}

Fp8GradCodes::Codes DeviceDenseLinear::grad_codes(const bf16* dout, int N) {
  using R = Fp8Scratch::Role;
  return fp8_scratch().dy_codes.take(this, dout, N, out_, dy_amax_, fp8_inv(R::grad), ctx_.precision.grad,
                                     ctx_.fp8_saturated, ctx_.stream);
}

size_t DeviceDenseLinear::fp8_scratch_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens,
                                            bool swiglu_grad_codes) {
  return Fp8Sizes(shapes, tokens, swiglu_grad_codes).bytes();
}

// Made at the first product, when the model knows every layer's shape (the layers are made
// one by one).
DeviceDenseLinear::Fp8Scratch& DeviceDenseLinear::fp8_scratch() {
  return ctx_.scratch.get<Fp8Scratch>(kFp8Scratch, [&] {
    const Fp8Sizes n(ctx_.shapes, ctx_.tokens, ctx_.swiglu_grad_codes);
    auto p = std::make_unique<Fp8Scratch>();
    p->arena = DeviceArena(n.bytes(), "fp8 operands");
    p->x = p->arena.allocate_array<uint8_t>("fp8.x", n.x);
    p->dy_codes.allocate(p->arena, n.dy, n.produced);
    p->bias = p->arena.allocate_array<bf16>("fp8.bias", n.outs);
    p->gemm = std::make_unique<gpu::Fp8Gemm>(p->arena.allocate("fp8.workspace", n.workspace), n.workspace);
    return p;
  });
}

void DeviceDenseLinear::shared_parts(std::set<std::string>& used) const {
  if (fp8_) used.insert(kFp8Scratch);
}

void DeviceDenseLinear::forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_);
  cudaStream_t s = ctx_.stream;
  if (!fp8_) {
    ctx_.marks->mark(s, op, 2.0 * N * K * OC);
    ctx_.gemm->forward(out, in, p_.weight.w, p_.bias.w, N, K, OC, s, act, pre_act);
    return;
  }
  using R = Fp8Scratch::Role;
  Fp8Scratch& f = fp8_scratch();
  ctx_.marks->mark(s, "fp8 cast");
  if (!w8_current_) cast_weight();
  if (!produced_.take_input(in, N))
    gpu::fp8_cast(f.x, fp8_inv(R::input), in, int64_t(N) * K, x_amax_.before_cast(in, int64_t(N) * K, s),
                  Fp8Format::e4m3, ctx_.fp8_saturated, s);
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  const bool gelu = act == Act::gelu;
  bf16* y = gelu && pre_act ? pre_act : out;
  const bf16* bias = p_.bias.w;
  if (bias && reinterpret_cast<uintptr_t>(bias) % 16 != 0) {
    CUDA_CHECK(cudaMemcpyAsync(f.bias, bias, sizeof(bf16) * OC, cudaMemcpyDeviceToDevice, s));
    bias = f.bias;
  }
  f.gemm->set_fast_accum(true);  // the forward's product, as fp8 training recipes run it
  f.gemm->matmul(y, {f.x, fp8_inv(R::input), Fp8Format::e4m3}, {w8_, fp8_inv(R::weight), Fp8Format::e4m3}, bias, N,
                 OC, K, false, s);
  if (gelu) {
    ctx_.marks->mark(s, "gelu fwd");
    gpu::gelu_forward(out, y, int64_t(N) * OC, s);
  }
}

void DeviceDenseLinear::backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) {
  const int K = int(in_), OC = int(out_);
  cudaStream_t s = ctx_.stream;
  if (!fp8_) {
    ctx_.marks->mark(s, op, 2.0 * N * K * OC);
    ctx_.gemm->backward_input(dinp, dout, p_.weight.w, N, K, OC, false, s, pre_act);
    return;
  }
  // dX [N, in] = dY [N, out] · (Wᵀ [in, out])ᵀ
  using R = Fp8Scratch::Role;
  ctx_.marks->mark(s, "fp8 cast");
  if (!w8_current_) cast_weight();
  const Fp8GradCodes::Codes dy = grad_codes(dout, N);
  Fp8Scratch& f = fp8_scratch();
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  f.gemm->set_fast_accum(false);
  f.gemm->matmul(dinp, {dy.dy, fp8_inv(R::grad), ctx_.precision.grad},
                 {wt8_, fp8_inv(R::weight), Fp8Format::e4m3}, nullptr, N, K, OC, false, s);
  gelu_backward_pass(dinp, pre_act, N);
}

void DeviceDenseLinear::backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                                    const char* op) {
  const int K = int(in_), OC = int(out_);
  cudaStream_t s = ctx_.stream;
  if (!fp8_) {
    ctx_.marks->mark(s, op, 2.0 * N * K * OC);
    ctx_.gemm->backward_weight(p_.weight.grad, bias_grad ? p_.bias.grad : nullptr, dout, inp, N, K, OC, accumulate,
                               s);
    return;
  }
  // dW [out, in] = dYᵀ [out, N] · (Xᵀ [in, N])ᵀ, accumulated in fp32
  using R = Fp8Scratch::Role;
  ctx_.marks->mark(s, "fp8 cast");
  const Fp8GradCodes::Codes dy = grad_codes(dout, N);
  Fp8Scratch& f = fp8_scratch();
  if (!produced_.take_input_t(N))
    gpu::fp8_cast_transpose(f.x, fp8_inv(R::input), inp, N, K, x_amax_.last(), Fp8Format::e4m3, ctx_.fp8_saturated,
                            s);  // the forward's scale of X
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  f.gemm->set_fast_accum(false);
  f.gemm->matmul(p_.weight.grad, {dy.dyt, fp8_inv(R::grad), ctx_.precision.grad},
                 {f.x, fp8_inv(R::input), Fp8Format::e4m3}, OC, K, N, accumulate, s);
  if (bias_grad && p_.bias.grad) {  // the exact sum of dY, as the CPU's (the bias gradient is not an fp8 product)
    ctx_.marks->mark(s, "bias grad");
    gpu::column_sum_add(p_.bias.grad, dout, N, OC, ctx_.colsum_scratch, ctx_.colsum_scratch_bytes, s);
  }
}

}  // namespace esplag
