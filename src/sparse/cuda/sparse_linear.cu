#include "sparse/cuda/sparse_linear.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

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
#include "sparse/mvue_seed.h"

namespace esplag::gpu {

namespace {

// w1[r, 4g..4g+3] = w where the static tile mask keeps the value, 0 elsewhere; one thread
// per group of 4 (8-byte loads and stores: rows of in % 16 == 0 values keep that aligned).
// w1 may be w (in place: each thread reads its group before writing it).
__global__ void apply_tile_mask_kernel(bf16* w1, const bf16* w, const uint16_t* __restrict__ tile_mask, int64_t rows,
                                       int64_t groups) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * groups) return;
  const int64_t r = i / groups, g = i % groups;
  const unsigned nibble = (tile_mask[(r / 4) * groups + g] >> ((r % 4) * 4)) & 0xFu;
  const uint2 in = reinterpret_cast<const uint2*>(w)[i];
  uint2 o;
  o.x = ((nibble & 1u) ? (in.x & 0xFFFFu) : 0u) | ((nibble & 2u) ? (in.x & 0xFFFF0000u) : 0u);
  o.y = ((nibble & 4u) ? (in.y & 0xFFFFu) : 0u) | ((nibble & 8u) ? (in.y & 0xFFFF0000u) : 0u);
  reinterpret_cast<uint2*>(w1)[i] = o;
}

std::string shape_text(int64_t out, int64_t in, int64_t tokens) {
  return "[out " + std::to_string(out) + ", in " + std::to_string(in) + "] over " + std::to_string(tokens) +
         " tokens";
}

}  // namespace

std::string sparse_linear_kind_name(SparseLinearKind k) {
  switch (k) {
    case SparseLinearKind::dense: return "dense";
    case SparseLinearKind::semi_sparse: return "semi_sparse";
    case SparseLinearKind::slope: return "slope";
  }
  return "?";
}

SparseLinearKind parse_sparse_linear_kind(const std::string& name) {
  if (name == "dense") return SparseLinearKind::dense;
  if (name == "semi_sparse") return SparseLinearKind::semi_sparse;
  if (name == "slope") return SparseLinearKind::slope;
  fail("unknown sparse Linear kind '", name, "' (expected dense, semi_sparse or slope)");
}

namespace {

// state = {draws, seed}: seed = the seed of draw number `draws`, then draws + 1. One
// thread, in the stream ahead of the MVUE kernel that reads the seed: a CUDA graph that
// captures both takes a new draw at every replay.
__global__ void advance_mvue_draw_kernel(uint64_t* state, uint64_t base) {
  state[1] = mvue_draw_seed(base, state[0]);
  state[0] += 1;
}

}  // namespace

uint64_t sparse_dw_mvue_seed(uint64_t base, uint64_t draw) { return mvue_draw_seed(base, draw); }

namespace {
// sparse_dw's scratch: S's compressed buffer, then the bf16 dW at the next 256 bytes.
size_t dw_layout_bytes_aligned(int64_t out, int64_t tokens) {
  return (cusparselt24_layout_bytes(out, tokens) + 255) / 256 * 256;
}
}  // namespace

size_t sparse_dw_scratch_bytes(int64_t out, int64_t in, int64_t tokens) {
  if (out <= 0 || in <= 0 || tokens <= 0 || out % 64 || tokens % 64) return 0;
  return dw_layout_bytes_aligned(out, tokens) + 2 * size_t(out) * size_t(in);
}

struct SparseLinear::Impl {
  SparseLinearKind kind = SparseLinearKind::dense;
  bool sparse = false;
  bool dense_products = false;  // use_dense_products: semi_sparse's Ws through cuBLASLt
  bool bias = false;            // SparseLinearOptions::bias
  bool keep_pruned = true;      // SparseLinearOptions::keep_pruned
  bool weight_is_w1 = false;    // SparseLinearOptions::slope_weight_is_w1
  int64_t out = 0, in = 0, tokens = 0;
  const bf16* weight = nullptr;
  std::string name;   // kind and shape, for messages
  std::string owner;  // "SparseLinear <name>": who allocation errors name

  // The dense products (dense kind, fallback, dW), made at their first use: a layer whose
  // owner computes dW itself never pays the GEMM workspace (36 MB).
  DeviceArena gemm_arena;
  std::unique_ptr<Gemm> gemm_;
  Gemm& gemm() {
    if (!gemm_) {
      gemm_arena = DeviceArena(Gemm::kDefaultWorkspaceBytes + Gemm::kScratchBytes + 4096, "sparse linear gemm");
      gemm_ = std::make_unique<Gemm>(gemm_arena);
    }
    return *gemm_;
  }

  // cuSPARSELt products (process-wide cached plans): the forward (W as A, K = in) and the
  // input gradient (K = out): the forward-form product of W2ᵀ (slope) or Wsᵀ (semi_sparse
  // with the own layout) [in, out], else semi_sparse's backward_data of Ws.
  SparseGemm24* fwd = nullptr;
  SparseGemm24* bwd = nullptr;
  bool fwd_tuned = false, bwd_tuned = false;
  // Whether cusparselt_layout's writer replaces cusparseLtSpMMACompress for each product
  // (decided once per problem by comparing both on a random matrix of the layer's shape).
  bool own_fwd = false, own_bwd = false;

  DeviceBuffer pruned;         // Ws [out, in]; slope: W1 or W2 [out, in] and W2ᵀ [in, out], unless shared
  DeviceBuffer pruned_t;       // (SparseLinearOptions::slope_scratch)
  bf16* w1 = nullptr;          // slope: W1, then W2 (pruned or the shared scratch)
  bf16* w2t = nullptr;         // slope: W2ᵀ (pruned_t or the shared scratch)
  DeviceBuffer tile_mask;      // slope: the static forward mask W1's, [out/4, in/4]
  DeviceBuffer bwd_tile_mask;  // slope: W2's (in W's orientation), [out/4, in/4], from the last refresh

  void apply_tile_mask(bf16* dst, const bf16* src, const DeviceBuffer& mask, cudaStream_t s) const {
    const int64_t groups = in / 4, n = out * groups;
    const int threads = 256;
    apply_tile_mask_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, s>>>(
        dst, src, mask.u16(), out, groups);
    CUDA_CHECK_LAUNCH("apply_tile_mask_kernel");
  }
  DeviceBuffer c_fwd, c_bwd, scratch;
  Workspace24 workspace{"SparseLinear"};  // named after the layer once it has a name

  // sparse_dw: the weight-gradient product (S = MVUE(dYᵀ) as A, K = tokens), S's
  // compressed buffer (written by cusparselt24_compress_mvue_t at every backward), the
  // product's bf16 dW [out, in] (in own_dw, or the caller's dw_scratch), the base seed
  // and, in device memory, the draws made so far and the current draw's seed
  // (sparse_dw_mvue_seed(dw_seed, draws)).
  SparseGemm24* dwg = nullptr;
  bool dwg_tuned = false;
  DeviceBuffer own_dw, dw_state;
  void* c_dw = nullptr;
  bf16* dw_bf16 = nullptr;
  uint64_t dw_seed = 0;

  // Before a product of g: the workspace fitted to the plans (another layer's search may
  // have grown one since), and g tuned at its first use here (Workspace24::tune_once).
  void tune(SparseGemm24& g, bool& done, bf16* out, const void* compressed, const bf16* dense, const bf16* b,
            cudaStream_t s) {
    workspace.tune_once(g, done, {fwd, bwd, dwg}, out, compressed, dense, b, s);
  }
};

SparseLinear::SparseLinear(const SparseLinearOptions& o, int64_t out, int64_t in, int64_t tokens, const bf16* weight,
                           cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.kind = o.kind;
  m.out = out;
  m.in = in;
  m.tokens = tokens;
  m.weight = weight;
  m.bias = o.bias;
  m.keep_pruned = o.keep_pruned;
  m.weight_is_w1 = o.kind == SparseLinearKind::slope && o.slope_weight_is_w1;
  m.name = sparse_linear_kind_name(o.kind) + " " + shape_text(out, in, tokens);
  m.owner = "SparseLinear " + m.name;
  m.workspace = Workspace24(m.owner);
  ESPLAG_CHECK(out > 0 && in > 0 && tokens > 0, "SparseLinear ", m.name, ": sizes must be positive");
  ESPLAG_CHECK(out <= INT_MAX && in <= INT_MAX && tokens <= INT_MAX, "SparseLinear ", m.name,
               ": sizes must fit the dense GEMM's int arguments");
  ESPLAG_CHECK(weight != nullptr, "SparseLinear ", m.name, ": the weight pointer is null");
  m.dw_seed = o.dw_seed;
  // sparse_dw's rules are checked whether or not cuSPARSELt is loaded, so that a
  // configuration fails the same way on every machine.
  ESPLAG_CHECK(!o.sparse_dw || o.kind != SparseLinearKind::dense, "SparseLinear ", m.name,
               ": sparse_dw (dW from the 2:4 MVUE of dY^T) is for the 2:4 kinds semi_sparse and slope; the dense "
               "kind computes the exact dW");
  ESPLAG_CHECK(!o.sparse_dw || (out % 64 == 0 && tokens % 64 == 0), "SparseLinear ", m.name,
               ": sparse_dw needs out and tokens to be multiples of 64 (the fused MVUE kernel writes dY^T [out, "
               "tokens]'s compressed layout in 64x64 tiles)");
  if (o.kind != SparseLinearKind::dense) {
    ESPLAG_CHECK(out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0, "SparseLinear ", m.name,
                 ": the 2:4 kinds need out, in and tokens to be multiples of 16 (cuSPARSELt)");
    ESPLAG_CHECK(reinterpret_cast<uintptr_t>(weight) % 16 == 0, "SparseLinear ", m.name,
                 ": the weight must be 16-byte aligned");
  }
  if (o.kind == SparseLinearKind::dense) return;
  if (!cusparselt_available()) {
    warn_cusparselt_fallback_once("SparseLinear (" + sparse_linear_kind_name(o.kind) + ")");
    return;
  }
  const bool slope = o.kind == SparseLinearKind::slope;
  m.fwd = &SparseGemm24::get(SparseGemm24Problem::linear_forward(out, in, tokens, o.bias));
  m.own_fwd = cusparselt24_layout_matches(*m.fwd);
  // The input gradient as the forward-form product of Wᵀ [in, out] (op N): slope holds W2ᵀ;
  // semi_sparse takes it too when the writer's layout is checked for it, since the writer
  // gives Wsᵀ's buffer straight from Ws. Otherwise semi_sparse keeps backward_data (op T
  // of Ws) compressed by the library.
  m.bwd = &SparseGemm24::get(SparseGemm24Problem::linear_forward(in, out, tokens));
  m.own_bwd = cusparselt24_layout_matches(*m.bwd);
  if (!slope && !m.own_bwd) m.bwd = &SparseGemm24::get(SparseGemm24Problem::linear_backward_data(out, in, tokens));
  const size_t n_w = size_t(out) * size_t(in);
  if (!slope && (m.keep_pruned || !(m.own_fwd && m.own_bwd)))
    m.pruned.allocate(2 * n_w, m.owner, "the pruned weight");
  if (slope) {
    if (o.slope_scratch) {
      m.w1 = o.slope_scratch;
      m.w2t = o.slope_scratch + n_w;
    } else {
      m.pruned.allocate(2 * n_w, m.owner, "W1");
      m.pruned_t.allocate(2 * n_w, m.owner, "W2^T");
      m.w1 = m.pruned.bf();
      m.w2t = m.pruned_t.bf();
    }
    m.tile_mask.allocate(size_t(out / 4) * size_t(in / 4) * 2, m.owner, "the forward tile mask");
    m.bwd_tile_mask.allocate(size_t(out / 4) * size_t(in / 4) * 2, m.owner, "the backward tile mask");
  }
  if (o.sparse_dw) {
    // S = MVUE(dYᵀ) is only ever written by the fused kernel, so the problem must have
    // our layout (there is no dense S for cusparseLtSpMMACompress to fall back on).
    m.dwg = &SparseGemm24::get(SparseGemm24Problem::linear_weight_grad(out, in, tokens));
    ESPLAG_CHECK(cusparselt24_layout_matches(*m.dwg), "SparseLinear ", m.name,
                 ": sparse_dw needs cuSPARSELt ", cusparselt_version(), "'s compressed layout for ",
                 m.dwg->problem().key(),
                 " to be the one the fused MVUE kernel writes, and the check at construction found it is not (or "
                 "ESPLAG_CUSPARSELT_OWN_LAYOUT=0 turned the writer off); run this layer without sparse_dw");
    uint8_t* scratch = static_cast<uint8_t*>(o.dw_scratch);
    if (!scratch) {
      m.own_dw.allocate(sparse_dw_scratch_bytes(out, in, tokens), m.owner, "the compressed MVUE of dY^T and bf16 dW");
      scratch = static_cast<uint8_t*>(m.own_dw.get());
    }
    ESPLAG_CHECK(reinterpret_cast<uintptr_t>(scratch) % 256 == 0, "SparseLinear ", m.name,
                 ": the sparse_dw scratch must be 256-byte aligned");
    m.c_dw = scratch;
    m.dw_bf16 = reinterpret_cast<bf16*>(scratch + dw_layout_bytes_aligned(out, tokens));
    m.dw_state.allocate(2 * sizeof(uint64_t), m.owner, "the MVUE draw count and seed");
    CUDA_CHECK(cudaMemset(m.dw_state.get(), 0, m.dw_state.bytes()));
  }
  m.c_fwd.allocate(m.fwd->compressed_allocation_bytes(), m.owner, "the forward's compressed weight");
  m.c_bwd.allocate(m.bwd->compressed_allocation_bytes(), m.owner, "the input gradient's compressed weight");
  m.scratch.allocate(std::max(m.fwd->compress_scratch_bytes(), m.bwd->compress_scratch_bytes()),
                     m.owner, "the compression scratch");
  m.workspace.fit({m.fwd, m.bwd, m.dwg}, stream);
  if (slope)  // the static forward mask (row-wise 2:4 of the weight as it is now) and W2's
    double_prune_24(weight, out, in, Sparse24Out{}, Sparse24Out{}, m.tile_mask.u16(), m.bwd_tile_mask.u16(), stream);
  m.sparse = true;
}

SparseLinear::~SparseLinear() = default;

SparseLinearKind SparseLinear::kind() const { return impl_->kind; }
bool SparseLinear::sparse() const { return impl_->sparse; }
int64_t SparseLinear::out_features() const { return impl_->out; }
int64_t SparseLinear::in_features() const { return impl_->in; }
int64_t SparseLinear::tokens() const { return impl_->tokens; }
const bf16* SparseLinear::pruned_weight() const {
  return impl_->kind == SparseLinearKind::slope ? impl_->w1 : impl_->pruned.bf();
}
const bf16* SparseLinear::backward_weight_t() const { return impl_->w2t; }
const uint16_t* SparseLinear::forward_tile_mask() const { return impl_->tile_mask.u16(); }
const uint16_t* SparseLinear::backward_tile_mask() const { return impl_->bwd_tile_mask.u16(); }

void SparseLinear::set_tile_masks(const uint16_t* forward, const uint16_t* backward, cudaStream_t s) {
  Impl& m = *impl_;
  ESPLAG_CHECK(m.kind == SparseLinearKind::slope && m.sparse, "SparseLinear ", m.name,
               ": tile masks are set on slope layers with cuSPARSELt");
  const size_t bytes = m.tile_mask.bytes();
  CUDA_CHECK(cudaMemcpyAsync(m.tile_mask.get(), forward, bytes, cudaMemcpyDefault, s));
  CUDA_CHECK(cudaMemcpyAsync(m.bwd_tile_mask.get(), backward, bytes, cudaMemcpyDefault, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // the caller's host arrays may go away
}
bool SparseLinear::own_layout_forward() const { return impl_->own_fwd; }
bool SparseLinear::own_layout_backward() const { return impl_->own_bwd; }

size_t SparseLinear::device_bytes() const {
  const Impl& m = *impl_;
  return m.gemm_arena.capacity() + m.pruned.bytes() + m.pruned_t.bytes() + m.tile_mask.bytes() +
         m.bwd_tile_mask.bytes() + m.c_fwd.bytes() + m.c_bwd.bytes() + m.scratch.bytes() + m.workspace.bytes() +
         m.own_dw.bytes();
}

bool SparseLinear::sparse_dw() const { return impl_->dwg != nullptr; }
void SparseLinear::set_dw_seed(uint64_t seed, uint64_t draws) {
  Impl& m = *impl_;
  m.dw_seed = seed;
  if (!m.dw_state.get()) return;
  CUDA_CHECK(cudaDeviceSynchronize());  // no backward in flight still reads the count
  const uint64_t state[2] = {draws, 0};
  CUDA_CHECK(cudaMemcpy(m.dw_state.get(), state, sizeof state, cudaMemcpyHostToDevice));
}
uint64_t SparseLinear::dw_draws() const {
  const Impl& m = *impl_;
  if (!m.dw_state.get()) return 0;
  uint64_t draws = 0;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(&draws, m.dw_state.get(), sizeof draws, cudaMemcpyDeviceToHost));
  return draws;
}

void SparseLinear::use_dense_products(bool on) {
  Impl& m = *impl_;
  ESPLAG_CHECK(!on || (m.sparse && m.kind == SparseLinearKind::semi_sparse), "SparseLinear ", m.name,
               ": dense products of the pruned weight are for semi_sparse layers with cuSPARSELt");
  m.dense_products = on;
  if (on && !m.pruned.get()) m.pruned.allocate(2 * size_t(m.out) * size_t(m.in), m.owner, "the pruned weight");
  if (!on && !m.keep_pruned && m.own_fwd && m.own_bwd) m.pruned.reset();
}

bool SparseLinear::sparse_products() const { return impl_->sparse && !impl_->dense_products; }

SparseLinear::ProductTimes SparseLinear::time_products(cudaStream_t s, int iters) {
  Impl& m = *impl_;
  ESPLAG_CHECK(m.sparse && m.kind == SparseLinearKind::semi_sparse && iters > 0, "SparseLinear ", m.name,
               ": time_products is for semi_sparse layers with cuSPARSELt");
  const bool was_dense = m.dense_products;
  DeviceBuffer x, y, dy, dx, b;
  const size_t nx = size_t(m.tokens) * size_t(m.in), ny = size_t(m.tokens) * size_t(m.out);
  if (m.bias) {
    b.allocate(2 * size_t(m.out), m.owner, "the timing bias");
    CUDA_CHECK(cudaMemsetAsync(b.get(), 0, 2 * size_t(m.out), s));
  }
  x.allocate(2 * nx, m.owner, "the timing input");
  dx.allocate(2 * nx, m.owner, "the timing input gradient");
  y.allocate(2 * ny, m.owner, "the timing output");
  dy.allocate(2 * ny, m.owner, "the timing output gradient");
  // Non-zero inputs (0x3C00 = 1.0 with varying low mantissa bits): the products' speed
  // does not depend on the values, but all-zero inputs could take shortcuts.
  CUDA_CHECK(cudaMemsetAsync(x.get(), 0x3C, 2 * nx, s));
  CUDA_CHECK(cudaMemsetAsync(dy.get(), 0x3B, 2 * ny, s));
  auto median_ms = [&](bool dense) {
    use_dense_products(dense);
    // Two untimed rounds tune the products (a cuSPARSELt search or cuBLASLt's autotuning).
    return median_event_ms(
        [&](int) {
          prepare(s);
          forward(y.bf(), x.bf(), s, b.bf());
          backward(dx.bf(), nullptr, dy.bf(), nullptr, false, s);
        },
        2, iters, s);
  };
  ProductTimes r;
  r.sparse_ms = median_ms(false);
  r.dense_ms = median_ms(true);
  use_dense_products(was_dense);
  prepare(s);  // the layer's own buffers again, from its weight
  CUDA_CHECK(cudaStreamSynchronize(s));
  m.gemm_.reset();  // the dense timing's GEMM workspace: not the layer's to keep
  m.gemm_arena = DeviceArena();
  return r;
}

void SparseLinear::set_weight(const bf16* weight) {
  Impl& m = *impl_;
  ESPLAG_CHECK(weight != nullptr, "SparseLinear ", m.name, ": the weight pointer is null");
  ESPLAG_CHECK(m.kind == SparseLinearKind::dense || reinterpret_cast<uintptr_t>(weight) % 16 == 0, "SparseLinear ",
               m.name, ": the weight must be 16-byte aligned");
  m.weight = weight;
}

void SparseLinear::prepare(cudaStream_t s, bool refresh_backward_mask) {
  Impl& m = *impl_;
  if (!m.sparse) return;
  if (m.kind == SparseLinearKind::semi_sparse && m.dense_products) {
    transposable_24(m.weight, m.out, m.in, Sparse24Out{m.pruned.bf()}, Sparse24Out{}, nullptr, s);
    return;
  }
  if (m.kind == SparseLinearKind::semi_sparse) {
    // One transposable mask serves both products: Ws is 2:4 along its rows (the forward's
    // K) and along its columns (the input gradient's K).
    // Where the layout check passed for both products: the pruning and both compressed
    // buffers (the forward's: Ws's layout; the input gradient's, the forward-form product
    // of Wsᵀ: that of Wsᵀ, read down Ws's columns) in one pass over W.
    if (m.own_fwd && m.own_bwd) {
      cusparselt24_prune_compress(m.weight, m.out, m.in, m.pruned.bf(), m.c_fwd.get(), m.c_bwd.get(), s);
      return;
    }
    transposable_24(m.weight, m.out, m.in, Sparse24Out{m.pruned.bf()}, Sparse24Out{}, nullptr, s);
    if (m.own_fwd || m.own_bwd)
      cusparselt24_compress(m.pruned.bf(), m.out, m.in, m.own_fwd ? m.c_fwd.get() : nullptr,
                            m.own_bwd ? m.c_bwd.get() : nullptr, s);
    if (!m.own_fwd) m.fwd->compress(m.c_fwd.get(), m.pruned.bf(), m.scratch.get(), m.scratch.bytes(), s);
    if (!m.own_bwd) m.bwd->compress(m.c_bwd.get(), m.pruned.bf(), m.scratch.get(), m.scratch.bytes(), s);
    return;
  }
  // slope. W1 = W ⊙ static mask (W itself when the caller keeps it pruned), compressed for
  // the forward.
  const bf16* w1 = m.weight;
  if (!m.weight_is_w1) {
    m.apply_tile_mask(m.w1, m.weight, m.tile_mask, s);
    w1 = m.w1;
  }
  if (m.own_fwd)
    cusparselt24_compress(w1, m.out, m.in, m.c_fwd.get(), nullptr, s);
  else
    m.fwd->compress(m.c_fwd.get(), w1, m.scratch.get(), m.scratch.bytes(), s);
  // A refresh chooses the backward mask again from W1 (double_prune_24's column step over
  // W1, whose row step keeps W1's values). W2 = W1 ⊙ backward mask, 2:4 down its columns:
  // the writer's transposed layout of W2 is the input gradient's operand W2ᵀ; the
  // library's compression needs W2ᵀ written out first.
  if (refresh_backward_mask)
    double_prune_24(w1, m.out, m.in, Sparse24Out{}, Sparse24Out{}, nullptr, m.bwd_tile_mask.u16(), s);
  m.apply_tile_mask(m.w1, w1, m.bwd_tile_mask, s);
  if (m.own_bwd) {
    cusparselt24_compress(m.w1, m.out, m.in, nullptr, m.c_bwd.get(), s);
  } else {
    double_prune_24(m.w1, m.out, m.in, Sparse24Out{}, Sparse24Out{m.w2t}, nullptr, nullptr, s);
    m.bwd->compress(m.c_bwd.get(), m.w2t, m.scratch.get(), m.scratch.bytes(), s);
  }
}

bool SparseLinear::prepare_from_kept(const bf16* kept_values, cudaStream_t s) {
  Impl& m = *impl_;
  ESPLAG_CHECK(m.kind == SparseLinearKind::slope, "SparseLinear ", m.name, ": kept values are slope's stored form");
  if (!m.sparse || !m.own_fwd || !m.own_bwd || reinterpret_cast<uintptr_t>(kept_values) % 4 != 0) return false;
  cusparselt24_compress_kept(kept_values, m.tile_mask.u16(), m.bwd_tile_mask.u16(), m.out, m.in, m.c_fwd.get(),
                             m.c_bwd.get(), s);
  return true;
}

const bf16* SparseLinear::refill_backward_weight_t(cudaStream_t s) {
  Impl& m = *impl_;
  ESPLAG_CHECK(m.kind == SparseLinearKind::slope && m.sparse, "SparseLinear ", m.name,
               ": W2^T is made by slope layers with cuSPARSELt");
  // W2 = W ⊙ forward mask ⊙ backward mask (a refresh over zeros of W1 may keep positions
  // outside the forward mask: their W1 is 0), then double_prune_24 of W2, which keeps its
  // values, writes W2ᵀ.
  if (m.weight_is_w1) {
    m.apply_tile_mask(m.w1, m.weight, m.bwd_tile_mask, s);
  } else {
    m.apply_tile_mask(m.w1, m.weight, m.tile_mask, s);
    m.apply_tile_mask(m.w1, m.w1, m.bwd_tile_mask, s);
  }
  double_prune_24(m.w1, m.out, m.in, Sparse24Out{}, Sparse24Out{m.w2t}, nullptr, nullptr, s);
  return m.w2t;
}

void SparseLinear::forward(bf16* y, const bf16* x, cudaStream_t s, const bf16* bias) {
  Impl& m = *impl_;
  ESPLAG_CHECK(y && x, "SparseLinear ", m.name, ": forward needs x and y");
  ESPLAG_CHECK((bias != nullptr) == m.bias, "SparseLinear ", m.name, ": the layer was built ",
               m.bias ? "with" : "without", " a bias, and forward got ", bias ? "one" : "none");
  if (!m.sparse || m.dense_products) {
    m.gemm().forward(y, x, m.sparse ? m.pruned.bf() : m.weight, bias, int(m.tokens), int(m.in), int(m.out), s);
    return;
  }
  m.tune(*m.fwd, m.fwd_tuned, y, m.c_fwd.get(), x, bias, s);
  m.fwd->matmul(y, m.c_fwd.get(), x, bias, m.workspace.get(), m.workspace.bytes(), s);
}

void SparseLinear::backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, bool accumulate_dw, cudaStream_t s) {
  Impl& m = *impl_;
  ESPLAG_CHECK(dy, "SparseLinear ", m.name, ": backward needs dy");
  if (dx) {
    if (!m.sparse || m.dense_products) {
      m.gemm().backward_input(dx, dy, m.sparse ? m.pruned.bf() : m.weight, int(m.tokens), int(m.in), int(m.out),
                              false, s);
    } else {
      m.tune(*m.bwd, m.bwd_tuned, dx, m.c_bwd.get(), dy, nullptr, s);
      m.bwd->matmul(dx, m.c_bwd.get(), dy, nullptr, m.workspace.get(), m.workspace.bytes(), s);
    }
  }
  if (dw) {
    ESPLAG_CHECK(x, "SparseLinear ", m.name, ": the weight gradient needs x");
    if (m.dwg) {
      // The unbiased 2:4 estimate: S = MVUE(dYᵀ) straight into its compressed layout, the
      // 2:4 product S · X in bf16, widened into dW (sparse_linear.h).
      uint64_t* state = static_cast<uint64_t*>(m.dw_state.get());
      advance_mvue_draw_kernel<<<1, 1, 0, s>>>(state, m.dw_seed);
      CUDA_CHECK_LAUNCH("advance_mvue_draw_kernel");
      cusparselt24_compress_mvue_t(dy, m.tokens, m.out, state + 1, m.c_dw, s);
      m.tune(*m.dwg, m.dwg_tuned, m.dw_bf16, m.c_dw, x, nullptr, s);
      m.dwg->matmul(m.dw_bf16, m.c_dw, x, nullptr, m.workspace.get(), m.workspace.bytes(), s);
      widen_sparse_output(dw, m.dw_bf16, m.out * m.in, accumulate_dw, s);
      return;
    }
    // Straight through the pruning (semi_sparse) / the optimizer keeps the kept slots
    // (slope): dW = dYᵀ · X, dense.
    m.gemm().backward_weight(dw, nullptr, dy, x, int(m.tokens), int(m.in), int(m.out), accumulate_dw, s);
  }
}

}  // namespace esplag::gpu
