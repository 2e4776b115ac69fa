#include "sparse/cuda/sparse_activation_linear.h"

#include <algorithm>
#include <climits>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "ops/gpu.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparsify.h"
#include "sparse/cuda/workspace_24.h"

namespace esplag::gpu {

namespace {

// y[r, o] += b[o], bf16 (the 2:4 forward's bias: cuSPARSELt's epilogue would add it along
// the tokens). One thread per pair of outputs.
__global__ void add_bias_kernel(bf16* y, const bf16* __restrict__ b, int64_t rows, int64_t out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t pairs = out / 2;
  if (i >= rows * pairs) return;
  const int64_t o = 2 * (i % pairs);
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(y + (i / pairs) * out + o);
  const float2 v = __bfloat1622float2(*p);
  *p = __floats2bfloat162_rn(v.x + __bfloat162float(b[o]), v.y + __bfloat162float(b[o + 1]));
}

constexpr size_t kAlign = 256;
size_t aligned(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Whether the 2:4 forward can run for this shape (cuSPARSELt loaded, multiples of 16).
bool sparse_shape(int64_t out, int64_t in, int64_t tokens) {
  return out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0 && cusparselt_available();
}

// Whether tile_24's weight gradient can be the 2:4 product of Xsᵀ: the fused kernel's
// 64×64 tiles (in and tokens), on top of the forward's rule; the layout check comes later.
bool sparse_dw_shape(ActivationSparsity pattern, int64_t out, int64_t in, int64_t tokens) {
  return pattern == ActivationSparsity::tile_24 && sparse_shape(out, in, tokens) && in % 64 == 0 && tokens % 64 == 0;
}

}  // namespace

void prune_activation(ActivationSparsity pattern, bf16* xs, const bf16* x, int64_t rows, int64_t in,
                      cudaStream_t stream) {
  if (pattern == ActivationSparsity::row_24)
    activation_24_rows(x, rows, in, Sparse24Out{xs}, stream);
  else
    activation_24_tiles(x, rows, in, Sparse24Out{xs}, Sparse24Out{}, stream);
}

size_t sparse_activation_scratch_bytes(int64_t out, int64_t in, int64_t tokens, ActivationSparsity pattern) {
  size_t bytes = aligned(2 * size_t(tokens) * size_t(in));
  if (!sparse_shape(out, in, tokens)) return bytes;
  const auto& fwd = SparseGemm24::get(SparseGemm24Problem::linear_activation_forward(out, in, tokens));
  size_t compressed = fwd.compressed_allocation_bytes();
  if (sparse_dw_shape(pattern, out, in, tokens)) {
    const auto& dw = SparseGemm24::get(SparseGemm24Problem::linear_activation_weight_grad(out, in, tokens));
    compressed = std::max(compressed, dw.compressed_allocation_bytes());
    bytes += aligned(2 * size_t(out) * size_t(in));  // the bf16 dW
  }
  return bytes + aligned(compressed);
}

struct SparseActivationLinear::Impl {
  ActivationSparsity pattern = ActivationSparsity::row_24;
  bool bias = false;
  int64_t out = 0, in = 0, tokens = 0;
  std::string name;  // pattern and shape, for messages
  std::string owner;

  bool dense_products = false, own = false, tuned = false;
  SparseGemm24* fwd = nullptr;  // the 2:4 forward's plan; null where it cannot run
  // tile_24: the weight gradient's 2:4 product (null where it cannot run) and its bf16 output.
  SparseGemm24* dwg = nullptr;
  bool dwg_tuned = false;
  bf16* dw_bf16 = nullptr;
  DeviceBuffer own_scratch, compress_scratch;
  Workspace24 workspace{"SparseActivationLinear"};  // named after the layer once it has a name
  bf16* xs = nullptr;          // [tokens, in], in the scratch
  void* compressed = nullptr;  // the 2:4 operand of the product running (Xs or Xsᵀ), in the scratch

  Gemm* gemm_ = nullptr;
  DeviceArena gemm_arena;
  std::unique_ptr<Gemm> own_gemm;
  Gemm& gemm() {
    if (!gemm_) {
      gemm_arena = DeviceArena(Gemm::kDefaultWorkspaceBytes + Gemm::kScratchBytes + 4096, owner + " GEMM");
      own_gemm = std::make_unique<Gemm>(gemm_arena);
      gemm_ = own_gemm.get();
    }
    return *gemm_;
  }

  // The first use of a product tunes it (Workspace24::tune_once).
  void run(SparseGemm24& g, bool& tuned_flag, bf16* out, const void* dense, cudaStream_t s) {
    workspace.tune_once(g, tuned_flag, {fwd, dwg}, out, compressed, dense, nullptr, s);
    g.matmul(out, compressed, dense, nullptr, workspace.get(), workspace.bytes(), s);
  }

  void check_rows(int64_t rows) const {
    ESPLAG_CHECK(rows >= 1 && rows <= tokens, "SparseActivationLinear ", name, ": ", rows,
                 " rows, outside [1, tokens = ", tokens, "]");
  }

  // Y = Xs · Wᵀ through cuSPARSELt: Xs compressed (with the pruning, in one pass, where
  // our writer has the library's layout), then the product.
  void sparse_forward(bf16* y, const bf16* x, const bf16* w, cudaStream_t s) {
    if (own && pattern == ActivationSparsity::row_24) {
      cusparselt24_prune_rows_compress(x, tokens, in, nullptr, compressed, s);
    } else if (own) {
      cusparselt24_prune_compress(x, tokens, in, nullptr, compressed, nullptr, s);
    } else {
      prune_activation(pattern, xs, x, tokens, in, s);
      fwd->compress(compressed, xs, compress_scratch.get(), compress_scratch.bytes(), s);
    }
    run(*fwd, tuned, y, w, s);
  }

  // tile_24: dW (fp32, = or +=) = dYᵀ · Xs as the 2:4 product of Xsᵀ, whose layout the
  // pruning kernel writes in its transposed orientation from X in one pass.
  void sparse_weight_grad(float* dw, const bf16* dy, const bf16* x, bool accumulate, cudaStream_t s) {
    cusparselt24_prune_compress(x, tokens, in, nullptr, nullptr, compressed, s);
    run(*dwg, dwg_tuned, dw_bf16, dy, s);
    widen_sparse_output(dw, dw_bf16, out * in, accumulate, s);
  }
};

SparseActivationLinear::SparseActivationLinear(const SparseActivationLinearOptions& o, int64_t out, int64_t in,
                                               int64_t tokens)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.pattern = o.pattern;
  m.bias = o.bias;
  m.out = out;
  m.in = in;
  m.tokens = tokens;
  m.gemm_ = o.gemm;
  m.name = activation_sparsity_name(o.pattern) + " [out " + std::to_string(out) + ", in " + std::to_string(in) +
           "] over " + std::to_string(tokens) + " tokens";
  m.owner = "SparseActivationLinear " + m.name;
  m.workspace = Workspace24(m.owner);
  ESPLAG_CHECK(out > 0 && in > 0 && tokens > 0, m.owner, ": sizes must be positive");
  ESPLAG_CHECK(out <= INT_MAX && in <= INT_MAX && tokens <= INT_MAX, m.owner,
               ": sizes must fit the dense GEMM's int arguments");
  ESPLAG_CHECK(in % 4 == 0, m.owner, ": in = ", in, " is not a multiple of 4 (2:4 groups of the input features)");

  if (!cusparselt_available()) warn_cusparselt_fallback_once("semi_sparse_activation");
  if (sparse_shape(out, in, tokens)) {
    m.fwd = &SparseGemm24::get(SparseGemm24Problem::linear_activation_forward(out, in, tokens));
    m.own = cusparselt24_layout_matches(*m.fwd);
    if (m.own && sparse_dw_shape(m.pattern, out, in, tokens)) {
      m.dwg = &SparseGemm24::get(SparseGemm24Problem::linear_activation_weight_grad(out, in, tokens));
      if (!cusparselt24_layout_matches(*m.dwg)) m.dwg = nullptr;  // nothing else writes Xsᵀ's layout
    }
    if (!m.own)  // cusparseLtSpMMACompress's scratch (our writer needs none)
      m.compress_scratch.allocate(m.fwd->compress_scratch_bytes(), m.owner, "the compression scratch");
    m.workspace.fit({m.fwd, m.dwg}, nullptr);  // the first allocation waits for nothing
  }
  uint8_t* scratch = static_cast<uint8_t*>(o.scratch);
  if (!scratch) {
    m.own_scratch.allocate(sparse_activation_scratch_bytes(out, in, tokens, o.pattern), m.owner, "the pruned input");
    scratch = static_cast<uint8_t*>(m.own_scratch.get());
  }
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(scratch) % kAlign == 0, m.owner, ": the scratch must be 256-byte aligned");
  m.xs = reinterpret_cast<bf16*>(scratch);
  scratch += aligned(2 * size_t(tokens) * size_t(in));
  if (m.dwg) {
    m.dw_bf16 = reinterpret_cast<bf16*>(scratch);
    scratch += aligned(2 * size_t(out) * size_t(in));
  }
  if (m.fwd) m.compressed = scratch;
}

SparseActivationLinear::~SparseActivationLinear() = default;

ActivationSparsity SparseActivationLinear::pattern() const { return impl_->pattern; }
int64_t SparseActivationLinear::out_features() const { return impl_->out; }
int64_t SparseActivationLinear::in_features() const { return impl_->in; }
int64_t SparseActivationLinear::tokens() const { return impl_->tokens; }
bool SparseActivationLinear::sparse() const { return impl_->fwd != nullptr; }
bool SparseActivationLinear::sparse_products() const { return sparse() && !impl_->dense_products; }
bool SparseActivationLinear::own_layout() const { return impl_->own; }
bool SparseActivationLinear::sparse_weight_grad() const { return impl_->dwg != nullptr; }
bool SparseActivationLinear::sparse_forward_for(int64_t rows) const {
  return sparse_products() && rows == impl_->tokens;
}
bool SparseActivationLinear::sparse_weight_grad_for(int64_t rows, bool bias_grad) const {
  return sparse_weight_grad() && !bias_grad && sparse_forward_for(rows);
}
void SparseActivationLinear::use_dense_products(bool on) { impl_->dense_products = on; }

void SparseActivationLinear::forward(bf16* y, const bf16* x, const bf16* w, const bf16* bias, int64_t rows,
                                     cudaStream_t s) {
  Impl& m = *impl_;
  m.check_rows(rows);
  ESPLAG_CHECK(y && x && w, m.owner, ": forward needs y, x and the weight");
  ESPLAG_CHECK((bias != nullptr) == m.bias, m.owner, m.bias ? ": the layer has a bias and none was given"
                                                            : ": a bias was given to a layer built without one");
  if (!sparse_forward_for(rows)) {
    prune_activation(m.pattern, m.xs, x, rows, m.in, s);
    m.gemm().forward(y, m.xs, w, bias, int(rows), int(m.in), int(m.out), s);
    return;
  }
  m.sparse_forward(y, x, w, s);
  if (bias) {
    const int64_t n = rows * (m.out / 2);
    add_bias_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(y, bias, rows, m.out);
    CUDA_CHECK_LAUNCH("SparseActivationLinear (bias)");
  }
}

void SparseActivationLinear::backward(bf16* dx, float* dw, float* db, const bf16* dy, const bf16* x, const bf16* w,
                                      int64_t rows, bool accumulate_dw, cudaStream_t s) {
  Impl& m = *impl_;
  m.check_rows(rows);
  ESPLAG_CHECK(dy && (!dx || w) && (!dw || x), m.owner, ": backward needs dy, the weight for dx and x for dw");
  ESPLAG_CHECK(!db || dw, m.owner, ": the bias gradient comes with the weight gradient's product (give dw with db)");
  if (dx) m.gemm().backward_input(dx, dy, w, int(rows), int(m.in), int(m.out), false, s);
  if (!dw) return;
  if (sparse_weight_grad_for(rows, db != nullptr)) {
    m.sparse_weight_grad(dw, dy, x, accumulate_dw, s);
    return;
  }
  prune_activation(m.pattern, m.xs, x, rows, m.in, s);  // the forward's Xs again
  m.gemm().backward_weight(dw, db, dy, m.xs, int(rows), int(m.in), int(m.out), accumulate_dw, s);
}

SparseActivationLinear::ProductTimes SparseActivationLinear::time_products(const bf16* w, cudaStream_t s, int iters) {
  Impl& m = *impl_;
  ESPLAG_CHECK(m.fwd && iters > 0 && w, m.owner, ": time_products needs the 2:4 forward (cuSPARSELt) and a weight");
  const bool was_dense = m.dense_products;
  const size_t nx = size_t(m.tokens) * size_t(m.in), ny = size_t(m.tokens) * size_t(m.out);
  DeviceBuffer x(2 * nx, m.owner, "the timing input"), y(2 * ny, m.owner, "the timing output"), b, dy, dw;
  if (m.bias) {
    b.allocate(2 * size_t(m.out), m.owner, "the timing bias");
    CUDA_CHECK(cudaMemsetAsync(b.get(), 0, b.bytes(), s));
  }
  // Non-zero inputs whose low mantissa bits vary: the pruning and the products' speed do
  // not depend on the values, but all-zero inputs could take shortcuts.
  CUDA_CHECK(cudaMemsetAsync(x.get(), 0x3C, 2 * nx, s));
  if (m.dwg) {  // the weight gradient differs between the two ways too
    dy.allocate(2 * ny, m.owner, "the timing output gradient");
    dw.allocate(4 * size_t(m.out) * size_t(m.in), m.owner, "the timing weight gradient");
    CUDA_CHECK(cudaMemsetAsync(dy.get(), 0x3B, 2 * ny, s));
  }
  auto median_ms = [&](bool dense) {
    use_dense_products(dense);
    return median_event_ms(
        [&](int) {
          forward(y.bf(), x.bf(), w, b.bf(), m.tokens, s);
          if (m.dwg) backward(nullptr, dw.f32(), nullptr, dy.bf(), x.bf(), w, m.tokens, false, s);
        },
        2, iters, s);
  };
  ProductTimes r;
  r.sparse_ms = median_ms(false);
  r.dense_ms = median_ms(true);
  use_dense_products(was_dense);
  CUDA_CHECK(cudaStreamSynchronize(s));
  return r;
}

size_t SparseActivationLinear::device_bytes() const {
  const Impl& m = *impl_;
  return m.own_scratch.bytes() + m.compress_scratch.bytes() + m.workspace.bytes() + m.gemm_arena.capacity();
}

}  // namespace esplag::gpu
