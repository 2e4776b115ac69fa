#include "model/cuda/device_linear_dense.h"

#include "core/cuda_check.h"
#include "core/device_arena.h"
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

// One for all fp8 layers, sized for the largest: two token-side operands (X or dY, either
// orientation) of tokens · max(in, out) bytes, the weight's cast of out · in bytes, the
// amax and inverse scale of each operand role, and the fp8 GEMM with its workspace.
struct DeviceDenseLinear::Fp8Scratch : SharedScratch::Part {
  DeviceArena arena;
  std::unique_ptr<gpu::Fp8Gemm> gemm;
  uint8_t *a = nullptr, *b = nullptr, *w = nullptr;
  bf16* bias = nullptr;  // a bias that is not 16-byte aligned, copied (the fp8 GEMM reads it so)
  float* scale = nullptr;  // per role the amax, then the inverse scale (kScaleStride apart)
  enum Role { input, weight, grad };
  float* amax(Role r) const { return scale + kScaleStride * (2 * r); }
  float* inv(Role r) const { return scale + kScaleStride * (2 * r + 1); }
  size_t bytes() const override { return arena.capacity(); }
};

DeviceDenseLinear::DeviceDenseLinear(const DeviceLinearSetup& s, const std::string& kind)
    : DeviceLinear(kind, s), fp8_(ctx_.precision.fp8) {
  ESPLAG_CHECK(!fp8_ || (in_ % 16 == 0 && out_ % 16 == 0), "linear [out ", out_, ", in ", in_,
               "]: fp8 products need in and out features that are multiples of 16 (cuBLASLt's fp8 GEMMs)");
}

namespace {

// The parts of the fp8 scratch, in the order they are taken from its arena.
struct Fp8Sizes {
  size_t side, weight, outs, scales, workspace;
  Fp8Sizes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens) {
    side = weight = outs = 0;
    for (const auto& [out, in] : shapes) {
      side = std::max(side, size_t(tokens) * size_t(std::max(out, in)));
      weight = std::max(weight, size_t(out * in));
      outs = std::max(outs, size_t(out));
    }
    scales = 6 * size_t(kScaleStride);
    workspace = gpu::Gemm::kDefaultWorkspaceBytes;
  }
  size_t bytes() const {
    return 2 * side + weight + sizeof(bf16) * outs + sizeof(float) * scales + workspace +
           6 * DeviceArena::kDefaultAlignment;
  }
};

}  // namespace

size_t DeviceDenseLinear::fp8_scratch_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t tokens) {
  return Fp8Sizes(shapes, tokens).bytes();
}

// Made at the first product, when the model knows every layer's shape (the layers are made
// one by one).
DeviceDenseLinear::Fp8Scratch& DeviceDenseLinear::fp8_scratch() {
  return ctx_.scratch.get<Fp8Scratch>(kFp8Scratch, [&] {
    const Fp8Sizes n(ctx_.shapes, ctx_.tokens);
    auto p = std::make_unique<Fp8Scratch>();
    p->arena = DeviceArena(n.bytes(), "fp8 operands");
    p->a = p->arena.allocate_array<uint8_t>("fp8.a", n.side);
    p->b = p->arena.allocate_array<uint8_t>("fp8.b", n.side);
    p->w = p->arena.allocate_array<uint8_t>("fp8.w", n.weight);
    p->bias = p->arena.allocate_array<bf16>("fp8.bias", n.outs);
    p->scale = p->arena.allocate_array<float>("fp8.scales", n.scales);
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
  gpu::fp8_amax(f.amax(R::input), in, int64_t(N) * K, s);
  gpu::fp8_cast(f.a, f.inv(R::input), in, int64_t(N) * K, f.amax(R::input), Fp8Format::e4m3, nullptr, s);
  gpu::fp8_amax(f.amax(R::weight), p_.weight.w, int64_t(OC) * K, s);
  gpu::fp8_cast(f.w, f.inv(R::weight), p_.weight.w, int64_t(OC) * K, f.amax(R::weight), Fp8Format::e4m3, nullptr,
                s);
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  const bool gelu = act == Act::gelu;
  bf16* y = gelu && pre_act ? pre_act : out;
  const bf16* bias = p_.bias.w;
  if (bias && reinterpret_cast<uintptr_t>(bias) % 16 != 0) {
    CUDA_CHECK(cudaMemcpyAsync(f.bias, bias, sizeof(bf16) * OC, cudaMemcpyDeviceToDevice, s));
    bias = f.bias;
  }
  f.gemm->set_fast_accum(true);  // the forward's product, as fp8 training recipes run it
  f.gemm->matmul(y, {f.a, f.inv(R::input), Fp8Format::e4m3}, {f.w, f.inv(R::weight), Fp8Format::e4m3}, bias, N, OC,
                 K, false, s);
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
  Fp8Scratch& f = fp8_scratch();
  const Fp8Format g = ctx_.precision.grad;
  ctx_.marks->mark(s, "fp8 cast");
  gpu::fp8_amax(f.amax(R::grad), dout, int64_t(N) * OC, s);
  gpu::fp8_cast(f.a, f.inv(R::grad), dout, int64_t(N) * OC, f.amax(R::grad), g, nullptr, s);
  gpu::fp8_amax(f.amax(R::weight), p_.weight.w, int64_t(OC) * K, s);
  gpu::fp8_cast_transpose(f.w, f.inv(R::weight), p_.weight.w, OC, K, f.amax(R::weight), Fp8Format::e4m3, nullptr,
                          s);
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  f.gemm->set_fast_accum(false);
  f.gemm->matmul(dinp, {f.a, f.inv(R::grad), g}, {f.w, f.inv(R::weight), Fp8Format::e4m3}, nullptr, N, K, OC, false,
                 s);
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
  Fp8Scratch& f = fp8_scratch();
  const Fp8Format g = ctx_.precision.grad;
  ctx_.marks->mark(s, "fp8 cast");
  gpu::fp8_amax(f.amax(R::grad), dout, int64_t(N) * OC, s);
  gpu::fp8_cast_transpose(f.a, f.inv(R::grad), dout, N, OC, f.amax(R::grad), g, nullptr, s);
  gpu::fp8_amax(f.amax(R::input), inp, int64_t(N) * K, s);
  gpu::fp8_cast_transpose(f.b, f.inv(R::input), inp, N, K, f.amax(R::input), Fp8Format::e4m3, nullptr, s);
  ctx_.marks->mark(s, op, 2.0 * N * K * OC);
  f.gemm->set_fast_accum(false);
  f.gemm->matmul(p_.weight.grad, {f.a, f.inv(R::grad), g}, {f.b, f.inv(R::input), Fp8Format::e4m3}, OC, K, N,
                 accumulate, s);
  if (bias_grad) {  // the exact sum of dY, as the CPU's (the bias gradient is not an fp8 product)
    ctx_.marks->mark(s, "bias grad");
    gpu::column_sum_add(p_.bias.grad, dout, N, OC, ctx_.colsum_scratch, ctx_.colsum_scratch_bytes, s);
  }
}

}  // namespace esplag
