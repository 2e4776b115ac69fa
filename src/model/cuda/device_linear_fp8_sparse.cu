#include "model/cuda/device_linear_fp8_sparse.h"

#include <algorithm>
#include <utility>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "model/cuda/fp8_grad_codes.h"
#include "model/cuda/step_marks.h"
#include "model/cuda/timing_operands.h"
#include "ops/gpu_fp8.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"

namespace esplag {

namespace {

constexpr const char* kScratchName = "fp8 2:4 operands";
// Each amax and inverse scale 256 bytes apart (16-byte aligned, as the fp8 GEMMs need).
constexpr int64_t kScaleStride = 64;

gpu::SparseGemm24Problem fp8_problem(int64_t out, int64_t in, int64_t tokens) {
  gpu::SparseGemm24Problem p = gpu::SparseGemm24Problem::linear_forward(out, in, tokens);
  p.dtype = gpu::SparseDtype::e4m3;
  p.device_scale = true;
  return p;
}

}  // namespace

// One for all fp8 2:4 layers, sized for the largest: X's codes (or Xᵀ's), dY's and dYᵀ's
// (and their second pair where SwiGLU's backward writes fc's: swiglu_grad_codes), a weight's
// e4m3 cast (compressed from here, or multiplied by the dense products),
// cusparseLtSpMMACompress's scratch, and the fp8 GEMM with its workspace.
struct Fp8SparseProducts::Scratch : SharedScratch::Part {
  DeviceArena arena;
  DeviceArena compress;  // grows to the largest layer's need
  std::unique_ptr<gpu::Fp8Gemm> gemm;
  uint8_t *x = nullptr, *w = nullptr;
  Fp8GradCodes dy_codes;
  bf16* bias = nullptr;  // a bias that is not 16-byte aligned, copied (the fp8 GEMM reads it so)
  size_t bytes() const override { return arena.capacity() + compress.capacity(); }
};

Fp8SparseProducts::Fp8SparseProducts(DeviceLinearContext& ctx, const std::string& weight_name, int64_t out,
                                     int64_t in, bool bias)
    : ctx_(ctx), name_(weight_name), out_(out), in_(in), bias_(bias), workspace_("fp8 2:4 " + weight_name) {
  ESPLAG_CHECK(ctx.precision.grad == Fp8Format::e4m3, name_,
               ": train.precision is fp8 and train.fp8_grad is e5m2, but the 2:4 kinds' fp8 input-gradient "
               "products on the GPU take e4m3 operands only (cuSPARSELt): set train.fp8_grad: e4m3");
  ESPLAG_CHECK(in % 16 == 0 && out % 16 == 0, name_, " [out ", out, ", in ", in,
               "]: fp8 products need in and out features that are multiples of 16");
  const bool fits = !bias && out % 32 == 0 && in % 32 == 0 && ctx.tokens % 32 == 0;
  if (fits && gpu::cusparselt_available()) {
    fwd_ = &gpu::SparseGemm24::get(fp8_problem(out, in, ctx.tokens));
    bwd_ = &gpu::SparseGemm24::get(fp8_problem(in, out, ctx.tokens));  // Wbᵀ [in, out] structured
  }
  const size_t a = DeviceArena::kDefaultAlignment;
  const size_t scales = sizeof(float) * kScaleStride * 2 * slots;
  const size_t comp = sparse() ? fwd_->compressed_allocation_bytes() + bwd_->compressed_allocation_bytes() : 0;
  own_ = DeviceArena(scales + comp + 4 * a, "fp8 2:4 " + name_);
  own_.allocate_array<float>("scales", kScaleStride * 2 * slots);
  x_amax_ = Fp8OperandAmax(amax(input), ctx.fp8_histories, name_, ProductOperand::input);
  dy_amax_ = Fp8OperandAmax(amax(grad), ctx.fp8_histories, name_, ProductOperand::grad);
  produced_ = Fp8ProducedCodes(ctx_, this, name_, out_, in_, x_amax_, dy_amax_, [this] {
    Scratch& sc = scratch();
    return Fp8ProducedCodes::Operands{sc.x, inv(input), &sc.dy_codes, inv(grad)};
  });
  if (!sparse()) return;
  comp_fwd_ = own_.allocate("compressed Wf (e4m3)", fwd_->compressed_allocation_bytes());
  comp_bwd_ = own_.allocate("compressed Wb^T (e4m3)", bwd_->compressed_allocation_bytes());
  workspace_.fit({fwd_, bwd_}, ctx_.stream);
  Scratch& s = scratch();
  const size_t need = std::max(fwd_->compress_scratch_bytes(), bwd_->compress_scratch_bytes());
  if (need && s.compress.capacity() < need + a) s.compress = DeviceArena(need + a, "fp8 2:4 compress scratch");
}

Fp8SparseProducts::~Fp8SparseProducts() = default;

float* Fp8SparseProducts::amax(Slot s) const {
  return static_cast<float*>(own_.base()) + kScaleStride * (2 * int64_t(s));
}
float* Fp8SparseProducts::inv(Slot s) const {
  return static_cast<float*>(own_.base()) + kScaleStride * (2 * int64_t(s) + 1);
}

Fp8SparseProducts::Scratch& Fp8SparseProducts::scratch() {
  return ctx_.scratch.get<Scratch>(kScratchName, [&] {
    size_t x = 0, dy = 0, weight = 0, outs = 0;
    for (const auto& [out, in] : ctx_.shapes) {
      x = std::max(x, size_t(ctx_.tokens) * size_t(in));
      dy = std::max(dy, size_t(ctx_.tokens) * size_t(out));
      weight = std::max(weight, size_t(out * in));
      outs = std::max(outs, size_t(out));
    }
    const size_t ws = gpu::Gemm::kDefaultWorkspaceBytes;
    auto p = std::make_unique<Scratch>();
    p->arena = DeviceArena(x + Fp8GradCodes::bytes(dy, ctx_.swiglu_grad_codes) + weight + sizeof(bf16) * outs + ws +
                               4 * DeviceArena::kDefaultAlignment,
                           "fp8 2:4 operands");
    p->x = p->arena.allocate_array<uint8_t>("fp8.x", x);
    p->dy_codes.allocate(p->arena, dy, ctx_.swiglu_grad_codes);
    p->w = p->arena.allocate_array<uint8_t>("fp8.w", weight);
    p->bias = p->arena.allocate_array<bf16>("fp8.bias", outs);
    p->gemm = std::make_unique<gpu::Fp8Gemm>(p->arena.allocate("fp8.workspace", ws), ws);
    return p;
  });
}

void Fp8SparseProducts::shared_parts(std::set<std::string>& used) { used.insert(kScratchName); }

void Fp8SparseProducts::prepare(const bf16* wf, const bf16* wbt) {
  cudaStream_t s = ctx_.stream;
  const int64_t n = out_ * in_;
  ctx_.marks->mark(s, "fp8 cast");
  gpu::fp8_amax(amax(weight_fwd), wf, n, s);
  gpu::fp8_amax(amax(weight_bwd), wbt, n, s);
  if (!sparse()) return;  // the dense products cast the weights themselves
  Scratch& sc = scratch();
  void* cs = sc.compress.capacity() ? sc.compress.base() : nullptr;
  gpu::fp8_cast(sc.w, inv(weight_fwd), wf, n, amax(weight_fwd), Fp8Format::e4m3, ctx_.fp8_saturated, s);
  ctx_.marks->mark(s, "fp8 compress");
  fwd_->compress(comp_fwd_, sc.w, cs, sc.compress.capacity(), s);
  ctx_.marks->mark(s, "fp8 cast");
  gpu::fp8_cast(sc.w, inv(weight_bwd), wbt, n, amax(weight_bwd), Fp8Format::e4m3, ctx_.fp8_saturated, s);
  ctx_.marks->mark(s, "fp8 compress");
  bwd_->compress(comp_bwd_, sc.w, cs, sc.compress.capacity(), s);
}

bool Fp8SparseProducts::own_layout() {
  if (own_layout_ < 0)
    own_layout_ = gpu::cusparselt24_layout_matches(*fwd_) && gpu::cusparselt24_layout_matches(*bwd_);
  return own_layout_ == 1;
}

void Fp8SparseProducts::prepare_transposable(const bf16* ws) {
  ESPLAG_CHECK(writes_own_layout(), name_, ": prepare_transposable without our e4m3 writer (writes_own_layout)");
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, "fp8 compress");
  gpu::fp8_amax(amax(weight_fwd), ws, out_ * in_, s);
  gpu::cusparselt24_compress_e4m3(ws, out_, in_, amax(weight_fwd), inv(weight_fwd), comp_fwd_, comp_bwd_, s);
  // The same scale for Wsᵀ (the dense dX product casts with weight_bwd's amax).
  CUDA_CHECK(cudaMemcpyAsync(amax(weight_bwd), amax(weight_fwd), sizeof(float), cudaMemcpyDeviceToDevice, s));
  CUDA_CHECK(cudaMemcpyAsync(inv(weight_bwd), inv(weight_fwd), sizeof(float), cudaMemcpyDeviceToDevice, s));
}

DeviceLinearContext::ProductTimes Fp8SparseProducts::time_ways(const std::function<void()>& prepare,
                                                               const std::function<const bf16*()>& wf,
                                                               const std::function<const bf16*()>& wbt,
                                                               const bf16* bias) {
  cudaStream_t s = ctx_.stream;
  const int N = static_cast<int>(ctx_.tokens);
  const TimingOperands o(N, in_, out_, s);
  const auto step = [&](int) {
    prepare();
    begin_backward();  // dY's codes made in each round
    forward(o.y, o.x, bias, N, wf, "dispatch timing");
    backward_dx(o.dx, o.dy, N, wbt, "dispatch timing");
  };
  const StepMarks::Pause unmarked(*ctx_.marks);
  // The timing's casts count nothing and record no amax: the run's are of the steps' casts.
  const DeviceFp8Histories::Pause unrecorded(ctx_.fp8_histories);
  struct Uncounted {
    uint64_t*& counter;
    uint64_t* const held;
    ~Uncounted() { counter = held; }
  } uncounted{ctx_.fp8_saturated, std::exchange(ctx_.fp8_saturated, nullptr)};
  DeviceLinearContext::ProductTimes t;
  set_dense(true);
  t.dense_ms = median_event_ms(step, 2, 10, s);
  set_dense(false);
  t.sparse_ms = median_event_ms(step, 2, 10, s);
  return t;
}

bool Fp8SparseProducts::prepare_kept(const bf16* values, const uint16_t* forward_tiles,
                                     const uint16_t* backward_tiles) {
  if (!writes_own_layout()) return false;
  ctx_.marks->mark(ctx_.stream, "fp8 compress");
  gpu::cusparselt24_compress_kept_e4m3(values, forward_tiles, backward_tiles, out_, in_, amax(weight_fwd),
                                       amax(weight_bwd), inv(weight_fwd), inv(weight_bwd), comp_fwd_, comp_bwd_,
                                       ctx_.stream);
  return true;
}

gpu::PendingScale Fp8SparseProducts::sparse_product(gpu::SparseGemm24& g, bool forward, bf16* out,
                                                    const void* compressed, const uint8_t* codes, Slot codes_slot,
                                                    Slot weight_slot, int N, const char* op) {
  cudaStream_t s = ctx_.stream;
  workspace_.tune_once(g, forward ? tuned_fwd_ : tuned_bwd_, {fwd_, bwd_}, out, compressed, codes, nullptr, s);
  ctx_.marks->mark_product(s, op, 2.0 * N * in_ * out_, true);
  g.matmul(out, compressed, codes, nullptr, workspace_.get(), workspace_.bytes(), s);
  return {inv(codes_slot), inv(weight_slot)};
}

void Fp8SparseProducts::forward(bf16* y, const bf16* x, const bf16* bias, int N,
                                const std::function<const bf16*()>& wf, const char* op) {
  gpu::apply_pending_scale(y, int64_t(N) * out_, forward_leaving_scale(y, x, bias, N, wf, op), ctx_.stream);
}

gpu::PendingScale Fp8SparseProducts::forward_leaving_scale(bf16* y, const bf16* x, const bf16* bias, int N,
                                                           const std::function<const bf16*()>& wf, const char* op) {
  cudaStream_t s = ctx_.stream;
  Scratch& sc = scratch();
  const int64_t nx = int64_t(N) * in_;
  ctx_.marks->mark(s, "fp8 cast");
  if (!produced_.take_input(x, N))
    gpu::fp8_cast(sc.x, inv(input), x, nx, x_amax_.before_cast(x, nx, s), Fp8Format::e4m3, ctx_.fp8_saturated, s);
  if (sparse() && N == ctx_.tokens) return sparse_product(*fwd_, true, y, comp_fwd_, sc.x, input, weight_fwd, N, op);
  gpu::fp8_cast(sc.w, inv(weight_fwd), wf(), out_ * in_, amax(weight_fwd), Fp8Format::e4m3, ctx_.fp8_saturated, s);
  if (bias && reinterpret_cast<uintptr_t>(bias) % 16 != 0) {
    CUDA_CHECK(cudaMemcpyAsync(sc.bias, bias, sizeof(bf16) * out_, cudaMemcpyDeviceToDevice, s));
    bias = sc.bias;
  }
  ctx_.marks->mark(s, op, 2.0 * N * in_ * out_);
  sc.gemm->set_fast_accum(true);  // as the dense kind's forward
  sc.gemm->matmul(y, {sc.x, inv(input), Fp8Format::e4m3}, {sc.w, inv(weight_fwd), Fp8Format::e4m3}, bias, N,
                  int(out_), int(in_), false, s);
  return {};
}

void Fp8SparseProducts::forward(bf16* out, const bf16* x, const bf16* bias, int N, gpu::Gemm::Act act,
                                bf16* pre_act, const std::function<const bf16*()>& wf, const char* op) {
  const bool gelu = act == gpu::Gemm::Act::gelu;
  bf16* y = gelu && pre_act ? pre_act : out;
  forward(y, x, bias, N, wf, op);
  if (gelu) {
    ctx_.marks->mark(ctx_.stream, "gelu fwd");
    gpu::gelu_forward(out, y, int64_t(N) * out_, ctx_.stream);
  }
}

void Fp8SparseProducts::begin_backward() {
  produced_.begin_backward();
  if (Scratch* sc = ctx_.scratch.find<Scratch>(kScratchName)) sc->dy_codes.forget();
}

Fp8GradCodes::Codes Fp8SparseProducts::grad_codes(const bf16* dy, int N) {
  return scratch().dy_codes.take(this, dy, N, out_, dy_amax_, inv(grad), ctx_.precision.grad, ctx_.fp8_saturated,
                                 ctx_.stream);
}

void Fp8SparseProducts::backward_dx(bf16* dx, const bf16* dy, int N, const std::function<const bf16*()>& wbt,
                                    const char* op) {
  gpu::apply_pending_scale(dx, int64_t(N) * in_, backward_dx_leaving_scale(dx, dy, N, wbt, op), ctx_.stream);
}

gpu::PendingScale Fp8SparseProducts::backward_dx_leaving_scale(bf16* dx, const bf16* dy, int N,
                                                               const std::function<const bf16*()>& wbt,
                                                               const char* op) {
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, "fp8 cast");
  const Fp8GradCodes::Codes codes = grad_codes(dy, N);
  if (sparse() && N == ctx_.tokens)
    return sparse_product(*bwd_, false, dx, comp_bwd_, codes.dy, grad, weight_bwd, N, op);
  // Fp8Gemm's B is Wbᵀ [in, out], K-major.
  Scratch& sc = scratch();
  gpu::fp8_cast(sc.w, inv(weight_bwd), wbt(), out_ * in_, amax(weight_bwd), Fp8Format::e4m3, ctx_.fp8_saturated, s);
  ctx_.marks->mark(s, op, 2.0 * N * in_ * out_);
  sc.gemm->set_fast_accum(false);
  sc.gemm->matmul(dx, {codes.dy, inv(grad), ctx_.precision.grad}, {sc.w, inv(weight_bwd), Fp8Format::e4m3},
                  nullptr, N, int(in_), int(out_), false, s);
  return {};
}

void Fp8SparseProducts::backward_dw(float* dw, const bf16* dy, const bf16* x, int N, bool accumulate,
                                    const char* op) {
  cudaStream_t s = ctx_.stream;
  ctx_.marks->mark(s, "fp8 cast");
  const Fp8GradCodes::Codes codes = grad_codes(dy, N);
  Scratch& sc = scratch();
  if (!produced_.take_input_t(N))
    gpu::fp8_cast_transpose(sc.x, inv(input), x, N, in_, x_amax_.last(), Fp8Format::e4m3, ctx_.fp8_saturated,
                            s);  // the forward's scale of X
  ctx_.marks->mark(s, op, 2.0 * N * in_ * out_);
  sc.gemm->set_fast_accum(false);
  sc.gemm->matmul(dw, {codes.dyt, inv(grad), ctx_.precision.grad}, {sc.x, inv(input), Fp8Format::e4m3},
                  int(out_), int(in_), N, accumulate, s);
}

}  // namespace esplag
