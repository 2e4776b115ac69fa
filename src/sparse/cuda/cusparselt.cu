// cuSPARSELt 2:4 GEMMs: the plans of one problem (SparseGemm24) and the products they run.
// The loader (cusparselt_loader.h), the problems and their checks (cusparselt_problem.cu),
// the plan cache (cusparselt_plan_cache.cu) and the tuning cache (cusparselt_tuning_cache.h)
// are files of their own. See sparse/cuda/cusparselt.h for the API.
//
// Descriptors of the four (product, operand) combinations of a weight's products. W
// [out, in] row-major is always the structured descriptor (rows = out, cols = in, ld = in,
// row order); only the operation applied to it changes, so the pruned W is compressed
// straight from memory:
//
//   product  W as  m    n    k    A                         B                          D (= C)
//   fwd      A     out  N    in   W  row, op N              X [N,in] row, op T          [out,N] col, ld out
//   fwd      B     N    out  in   X [N,in] row, op N        W  row, op T                [N,out] row, ld out
//   bwd      A     in   N    out  W  row, op T              dY [N,out] row, op T        [in,N] col, ld in
//   bwd      B     N    in   out  dY [N,out] row, op N      W  row, op N                [N,in] row, ld in
//
// A column-major [m, N] D with ld = m is the row-major [N, m] the model uses, so no
// transpose runs anywhere. The BIAS epilogue adds one value per row of D (per m), which
// is a per-feature bias only when W is A.
//
// The weight gradient (structured operand S = the 2:4 estimate of dYᵀ, A only):
//
//   dw       S as A  out  in  N   S [out,N] row, op N       X [N,in] row, op N          [out,in] row, ld in
//
// semi_sparse_activation's forward (structured operand Xs, the input pruned 2:4 along its
// features, A only):
//
//   xfwd     Xs as A N   out  in   Xs [N,in] row, op N       W [out,in] = [in,out] col, op N   [N,out] row, ld out
//
// Both operands K-major (the layout of tensor-core GEMMs), Y as the model holds it. Its weight
// gradient where Xs is 2:4 along the tokens too (tile_24), the structured operand Xsᵀ as
// the fused pruning kernel writes its layout (the transposed orientation, from X as it lies):
//
//   xdw      Xsᵀ as A  in  out  N   Xsᵀ [in,N] row, op N     dY [N,out] row, op N       [in,out] col, ld in
//
// a column-major [in, out] D being the row-major dW [out, in] the optimizer holds.
//
// S is op N because that is the layout the fused MVUE kernel writes (cusparselt_layout.h's
// forward form, checked byte for byte against the library per problem; the library's op T
// layout is a different one). With m = out and n = in, dW [out, in] as the optimizer holds
// it is D row-major, so D cannot be column-major here as in the weight's products (that
// would be dWᵀ). X [N, in] as it lies is op(B) = [k = N, n = in] with op N; the same bytes
// described column-major [in, N] with op T would be equivalent, and row-major with op N is
// the combination PyTorch's cuSPARSELt binding uses for a contiguous dense operand with a
// row-major output. cuSPARSELt could still refuse it for some size: descriptor and plan
// initialisation go through LT_CHECK like every other problem, so that surfaces as an
// Error with the status and the problem key, never as a silent fallback.
//
// Element types: A and B bf16 (or both fp8 e4m3 for the forward with W as A, whose layout
// above reads both operands K-major as fp8 tensor cores need), C = D bf16, compute fp32.
#include "sparse/cuda/cusparselt.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "ops/gpu_pending_scale.h"

#ifdef ESPLAG_HAVE_CUSPARSELT
#include "sparse/cuda/cusparselt_loader.h"
#endif

namespace esplag::gpu {

namespace {

__global__ void widen_kernel(float* __restrict__ dst, const bf16* __restrict__ src, int64_t n, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __bfloat162float(src[i]);
  dst[i] = accumulate ? dst[i] + v : v;
}

}  // namespace

void widen_sparse_output(float* dst, const bf16* src, int64_t n, bool accumulate, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 256;
  widen_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(dst, src, n, accumulate);
  CUDA_CHECK_LAUNCH("widen_sparse_output");
}

bool cusparselt_tuning_lookup(const SparseGemm24Problem& p, SparseGemm24Config* config) {
  if (!cusparselt_available()) return false;
  CusparseltTuningEntry e;
  if (!find_cusparselt_tuning(current_gpu_name(), cusparselt_version(), p.key(), &e)) return false;
  if (config) *config = e.config;
  return true;
}

#ifdef ESPLAG_HAVE_CUSPARSELT

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// One matmul descriptor + algorithm selection + plan. The plan may refer to the
// descriptor and the selection by address, so a Bound never moves (held by unique_ptr).
struct Bound {
  const cusparseLtHandle_t* handle = nullptr;
  cusparseLtMatmulDescriptor_t matmul{};
  cusparseLtMatmulAlgSelection_t alg{};
  cusparseLtMatmulPlan_t plan{};
  bool has_alg = false, has_plan = false;
  size_t workspace = 0;

  Bound() = default;
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;
  ~Bound() {
    const CusparseltApi& a = cusparselt_library().api;
    if (has_plan) a.MatmulPlanDestroy(&plan);
    if (has_alg) a.MatmulAlgSelectionDestroy(&alg);
  }
};

}  // namespace

struct SparseGemm24::Impl {
  SparseGemm24Problem p;
  Algorithm which = Algorithm::tuned;
  std::string ctx;  // the problem, for messages
  CusparseltLibrary* lib = nullptr;

  cusparseLtMatDescriptor_t a{}, b{}, c{};
  bool has_a = false, has_b = false, has_c = false;
  cusparseOperation_t op_a = CUSPARSE_OPERATION_NON_TRANSPOSE, op_b = CUSPARSE_OPERATION_NON_TRANSPOSE;
  bool weight_is_a = true;
  cusparseOperation_t op_w = CUSPARSE_OPERATION_NON_TRANSPOSE;

  size_t compressed = 0, compress_scratch = 0;
  bool have_config = false;  // config holds a chosen (searched or cached) configuration
  SparseGemm24Config config;
  bool tuned = false, from_cache = false;
  int max_alg_id = 0;
  size_t workspace_hint = 0;  // of the plan built with the current configuration and no bias
  double plan_ms = 0, search_ms = 0;

  mutable std::mutex mu;
  // Plans per bias pointer: whether a plan reads BIAS_POINTER from the descriptor at
  // matmul time or copies it when initialised is not specified, so each bias address
  // gets a plan initialised with it (one per layer, once), which is right either way.
  mutable std::map<const void*, std::unique_ptr<Bound>> bound;
  int* d_valid = nullptr;  // PruneCheck's device flag

  cusparseLtMatDescriptor_t* weight_descr() { return weight_is_a ? &a : &b; }
  // Elements of the output.
  int64_t output_elements() const {
    return (p.product == SparseProduct::backward_data ? p.in : p.out) * p.tokens;
  }
  const cusparseLtMatDescriptor_t* weight_descr() const { return weight_is_a ? &a : &b; }

  ~Impl() {
    bound.clear();
    const CusparseltApi& api = cusparselt_library().api;
    if (has_a) api.MatDescriptorDestroy(&a);
    if (has_b) api.MatDescriptorDestroy(&b);
    if (has_c) api.MatDescriptorDestroy(&c);
    if (d_valid) cudaFree(d_valid);
  }

  void apply_config(Bound& bd, const SparseGemm24Config& cfg) const {
    const CusparseltApi& api = lib->api;
    LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &cfg.alg_id,
                                       sizeof(cfg.alg_id)),
             ctx);
    // Split-k attributes only where they differ from what this algorithm starts with, so
    // that an unsplit configuration never sets values (such as an "invalid" mode) that
    // the library only reports.
    const SparseGemm24Config start = read_config(bd);
    if (cfg.split_k != start.split_k)
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K, &cfg.split_k,
                                         sizeof(cfg.split_k)),
               ctx);
    if (cfg.split_k_mode != start.split_k_mode) {
      const cusparseLtSplitKMode_t mode = static_cast<cusparseLtSplitKMode_t>(cfg.split_k_mode);
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &mode, sizeof(mode)),
               ctx);
    }
    if (cfg.split_k_buffers != start.split_k_buffers)
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS,
                                         &cfg.split_k_buffers, sizeof(cfg.split_k_buffers)),
               ctx);
  }

  SparseGemm24Config read_config(const Bound& bd) const {
    const CusparseltApi& api = lib->api;
    SparseGemm24Config cfg;
    LT_CHECK(api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &cfg.alg_id,
                                       sizeof(cfg.alg_id)),
             ctx);
    int v = 0;
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K, &v, sizeof(v)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k = std::max(v, 1);
    cusparseLtSplitKMode_t mode{};
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &mode, sizeof(mode)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k_mode = static_cast<int>(mode);
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS, &v, sizeof(v)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k_buffers = v;
    return cfg;
  }

  // A new descriptor + selection + plan for `bias` with `cfg` (null: the library default).
  std::unique_ptr<Bound> make_bound(const bf16* bias, const SparseGemm24Config* cfg) const {
    const CusparseltApi& api = lib->api;
    auto bd = std::make_unique<Bound>();
    LT_CHECK(api.MatmulDescriptorInit(&lib->handle, &bd->matmul, op_a, op_b, &a, &b, &c, &c, CUSPARSE_COMPUTE_32F),
             ctx);
    const int on = 1;
    if (p.activation != SparseActivation::none) {
      const auto attr = p.activation == SparseActivation::relu ? CUSPARSELT_MATMUL_ACTIVATION_RELU
                                                               : CUSPARSELT_MATMUL_ACTIVATION_GELU;
      const cusparseStatus_t st = api.MatmulDescSetAttribute(&lib->handle, &bd->matmul, attr, &on, sizeof(on));
      ESPLAG_CHECK(st == CUSPARSE_STATUS_SUCCESS, ctx, ": cuSPARSELt ", lib->version, " has no ",
                   p.activation == SparseActivation::relu ? "ReLU" : "GELU", " epilogue for bf16 operands (",
                   api.GetErrorName(st), "); run the GEMM without activation and apply it separately");
    }
    if (p.bias) {
      const void* ptr = bias;
      LT_CHECK(api.MatmulDescSetAttribute(&lib->handle, &bd->matmul, CUSPARSELT_MATMUL_BIAS_POINTER, &ptr,
                                          sizeof(ptr)),
               ctx);
    }
    LT_CHECK(api.MatmulAlgSelectionInit(&lib->handle, &bd->alg, &bd->matmul, CUSPARSELT_MATMUL_ALG_DEFAULT), ctx);
    bd->has_alg = true;
    if (cfg) apply_config(*bd, *cfg);
    LT_CHECK(api.MatmulPlanInit(&lib->handle, &bd->plan, &bd->matmul, &bd->alg), ctx);
    bd->has_plan = true;
    LT_CHECK(api.MatmulGetWorkspace(&lib->handle, &bd->plan, &bd->workspace), ctx);
    return bd;
  }

  // The plan for `bias`, built on first use (caller holds mu).
  Bound& bound_for(const bf16* bias) const {
    auto it = bound.find(bias);
    if (it != bound.end()) return *it->second;
    auto bd = make_bound(bias, have_config ? &config : nullptr);
    Bound& ref = *bd;
    bound.emplace(bias, std::move(bd));
    return ref;
  }

  void check_operands(const void* compressed_w, const void* dense, const bf16* out, const bf16* bias) const {
    ESPLAG_CHECK(compressed_w && dense && out, ctx, ": null operand (compressed ", compressed_w, ", dense ",
                 static_cast<const void*>(dense), ", out ", static_cast<const void*>(out), ")");
    if (p.bias)
      ESPLAG_CHECK(bias, ctx, ": the problem has a bias but no bias pointer was given");
    else
      ESPLAG_CHECK(!bias, ctx, ": a bias pointer was given but the problem has no bias (make it with bias = true)");
    const void* ptrs[] = {compressed_w, dense, out, bias};
    for (const void* q : ptrs)
      ESPLAG_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0, ctx, ": operand ", q, " is not 16-byte aligned");
  }
};

namespace {

// cusparseLtMatmul of a checked call, alpha 1.
void run_matmul(const SparseGemm24::Impl& m, bf16* out, const void* compressed, const void* dense, const bf16* bias,
                void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(m.mu);
  Bound& bd = m.bound_for(bias);
  ESPLAG_CHECK(workspace_bytes >= bd.workspace, m.ctx, ": the plan needs ", bd.workspace,
               " bytes of workspace, got ", workspace_bytes);
  const float one = 1.f, beta = 0.f;
  const void* A = m.weight_is_a ? compressed : static_cast<const void*>(dense);
  const void* B = m.weight_is_a ? static_cast<const void*>(dense) : compressed;
  cudaStream_t streams[1] = {stream};
  LT_CHECK(m.lib->api.Matmul(&m.lib->handle, &bd.plan, &one, A, B, &beta, out, out,
                             bd.workspace ? workspace : nullptr, streams, 1),
           m.ctx);
}

}  // namespace

SparseGemm24::SparseGemm24(const SparseGemm24Problem& p, Algorithm alg) : impl_(std::make_unique<Impl>()) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  m.p = p;
  m.which = alg;
  m.ctx = "2:4 sparse GEMM (" + p.key() + ")";
  check_sparse_gemm24_problem(p);
  m.lib = &usable_cusparselt_library(m.ctx);
  const CusparseltApi& api = m.lib->api;
  const cusparseLtHandle_t* h = &m.lib->handle;
  const cusparseOperation_t N = CUSPARSE_OPERATION_NON_TRANSPOSE, T = CUSPARSE_OPERATION_TRANSPOSE;
  constexpr uint32_t kAlign = 16;
  const int64_t out = p.out, in = p.in, tok = p.tokens;
  const bool fwd = p.product == SparseProduct::forward;
  m.weight_is_a = p.weight_operand == SparseOperand::a;
  const cudaDataType in_type = p.dtype == SparseDtype::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;

  // The tables at the top of this file. The structured operand is always row-major as it
  // lies in memory: W [out, in], or S [out, tokens] for weight_grad.
  auto structured = [&](cusparseLtMatDescriptor_t* d) {
    const int64_t rows = p.structured_rows(), cols = p.structured_cols();
    LT_CHECK(api.StructuredDescriptorInit(h, d, rows, cols, cols, kAlign, in_type, CUSPARSE_ORDER_ROW,
                                          CUSPARSELT_SPARSITY_50_PERCENT),
             m.ctx);
  };
  // The input operands in the problem's type; the output (C = D) always bf16.
  auto dense = [&](cusparseLtMatDescriptor_t* d, int64_t rows, int64_t cols, int64_t ld, cusparseOrder_t order,
                   cudaDataType type) {
    LT_CHECK(api.DenseDescriptorInit(h, d, rows, cols, ld, kAlign, type, order), m.ctx);
  };
  const int64_t feat_in = fwd ? in : out;    // features of the token-side input
  const int64_t feat_out = fwd ? out : in;   // features of the output
  if (p.product == SparseProduct::activation_forward) {
    structured(&m.a);  // Xs [N, in] row-major, op N
    m.has_a = true;
    dense(&m.b, in, out, in, CUSPARSE_ORDER_COL, in_type);  // W [out, in] as column-major [in, out], op N
    m.has_b = true;
    dense(&m.c, tok, out, out, CUSPARSE_ORDER_ROW, CUDA_R_16BF);  // Y [N, out] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (p.product == SparseProduct::activation_weight_grad) {
    structured(&m.a);  // Xs^T [in, N] row-major, op N
    m.has_a = true;
    dense(&m.b, tok, out, out, CUSPARSE_ORDER_ROW, in_type);  // dY [N, out] row-major, op N
    m.has_b = true;
    dense(&m.c, in, out, in, CUSPARSE_ORDER_COL, CUDA_R_16BF);  // dW^T [in, out] column-major = dW [out, in] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (p.product == SparseProduct::weight_grad) {
    structured(&m.a);  // S [out, N] row-major, op N
    m.has_a = true;
    dense(&m.b, tok, in, in, CUSPARSE_ORDER_ROW, in_type);  // X [N, in] row-major, op N
    m.has_b = true;
    dense(&m.c, out, in, in, CUSPARSE_ORDER_ROW, CUDA_R_16BF);  // dW [out, in] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (m.weight_is_a) {
    structured(&m.a);
    m.has_a = true;
    dense(&m.b, tok, feat_in, feat_in, CUSPARSE_ORDER_ROW, in_type);
    m.has_b = true;
    dense(&m.c, feat_out, tok, feat_out, CUSPARSE_ORDER_COL, CUDA_R_16BF);
    m.has_c = true;
    m.op_a = fwd ? N : T;
    m.op_b = T;
    m.op_w = m.op_a;
  } else {
    dense(&m.a, tok, feat_in, feat_in, CUSPARSE_ORDER_ROW, in_type);
    m.has_a = true;
    structured(&m.b);
    m.has_b = true;
    dense(&m.c, tok, feat_out, feat_out, CUSPARSE_ORDER_ROW, CUDA_R_16BF);
    m.has_c = true;
    m.op_a = N;
    m.op_b = fwd ? T : N;
    m.op_w = m.op_b;
  }
  LT_CHECK(api.SpMMACompressedSize2(h, m.weight_descr(), &m.compressed, &m.compress_scratch), m.ctx);

  if (alg == Algorithm::tuned) {
    CusparseltTuningEntry e;
    if (find_cusparselt_tuning(current_gpu_name(), m.lib->version, p.key(), &e)) {
      m.config = e.config;
      m.have_config = true;
    }
  }
  // The plan without bias pointer (or with null) is built now, so that shape errors
  // surface here and workspace_bytes() is known; a stale tuning entry that the library
  // rejects falls back to the default configuration.
  std::lock_guard<std::mutex> lock(m.mu);
  std::unique_ptr<Bound> first;
  if (m.have_config) {
    try {
      first = m.make_bound(nullptr, &m.config);
      m.tuned = m.from_cache = true;
    } catch (const Error& e) {
      std::cerr << "esplag: warning: the tuned cuSPARSELt configuration (alg " << m.config.alg_id << ", split-k "
                << m.config.split_k << ") of " << p.key() << " was rejected (" << e.what()
                << "); using the default configuration" << std::endl;
      m.have_config = false;
    }
  }
  if (!first) first = m.make_bound(nullptr, nullptr);
  if (!m.have_config) m.config = m.read_config(*first);
  int max_id = 0;
  if (api.MatmulAlgGetAttribute(h, &first->alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, &max_id, sizeof(max_id)) ==
      CUSPARSE_STATUS_SUCCESS)
    m.max_alg_id = max_id;
  m.workspace_hint = first->workspace;
  if (!p.bias) m.bound.emplace(nullptr, std::move(first));
  CUDA_CHECK(cudaMalloc(&m.d_valid, sizeof(int)));
  m.plan_ms = ms_since(t0);
}

SparseGemm24::~SparseGemm24() = default;

const SparseGemm24Problem& SparseGemm24::problem() const { return impl_->p; }
size_t SparseGemm24::compressed_bytes() const { return impl_->compressed; }
size_t SparseGemm24::compress_scratch_bytes() const { return impl_->compress_scratch; }

size_t SparseGemm24::workspace_bytes() const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  size_t ws = m.workspace_hint;
  for (const auto& [ptr, bd] : m.bound) ws = std::max(ws, bd->workspace);
  return ws;
}

void SparseGemm24::prune(void* pruned, const void* dense, cudaStream_t stream) const {
  const Impl& m = *impl_;
  ESPLAG_CHECK(pruned && dense, m.ctx, ": prune needs device pointers");
  LT_CHECK(m.lib->api.SpMMAPrune2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, dense, pruned,
                                  CUSPARSELT_PRUNE_SPMMA_TILE, stream),
           m.ctx);
}

bool SparseGemm24::is_pruned(const void* w, cudaStream_t stream) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  // cuSPARSELt only writes the flag when it finds a violation: clear it first.
  CUDA_CHECK(cudaMemsetAsync(m.d_valid, 0, sizeof(int), stream));
  LT_CHECK(m.lib->api.SpMMAPruneCheck2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, w,
                                       m.d_valid, stream),
           m.ctx);
  int invalid = 1;
  CUDA_CHECK(cudaMemcpyAsync(&invalid, m.d_valid, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return invalid == 0;  // cuSPARSELt writes 0 when the matrix is 2:4
}

void SparseGemm24::compress(void* compressed, const void* pruned, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) const {
  const Impl& m = *impl_;
  ESPLAG_CHECK(compressed && pruned, m.ctx, ": compress needs device pointers");
  ESPLAG_CHECK(scratch_bytes >= m.compress_scratch, m.ctx, ": compress needs ", m.compress_scratch,
               " bytes of scratch, got ", scratch_bytes);
  LT_CHECK(m.lib->api.SpMMACompress2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, pruned,
                                     compressed, scratch, stream),
           m.ctx);
}

void SparseGemm24::matmul(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) const {
  impl_->check_operands(compressed, dense, out, bias);
  run_matmul(*impl_, out, compressed, dense, bias, workspace, workspace_bytes, stream);
}

void SparseGemm24::matmul_scaled(bf16* out, const void* compressed, const void* dense, const float* scale_a,
                                 const float* scale_b, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) const {
  const Impl& m = *impl_;
  ESPLAG_CHECK(m.p.device_scale, m.ctx, ": matmul_scaled needs a problem with device_scale");
  ESPLAG_CHECK(scale_a && scale_b, m.ctx, ": matmul_scaled without its two scales");
  m.check_operands(compressed, dense, out, nullptr);
  run_matmul(m, out, compressed, dense, nullptr, workspace, workspace_bytes, stream);
  apply_pending_scale(out, m.output_elements(), PendingScale{scale_a, scale_b}, stream);
}

void SparseGemm24::search(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  Impl& m = *impl_;
  m.check_operands(compressed, dense, out, bias);
  std::lock_guard<std::mutex> lock(m.mu);
  // Search from the default configuration on a plan of its own; the plans in use are
  // replaced afterwards by ones built from the configuration found.
  auto bd = m.make_bound(bias, nullptr);
  ESPLAG_CHECK(workspace_bytes >= bd->workspace, m.ctx, ": the search needs ", bd->workspace,
               " bytes of workspace, got ", workspace_bytes);
  const float one = 1.f, beta = 0.f;
  const void* A = m.weight_is_a ? compressed : static_cast<const void*>(dense);
  const void* B = m.weight_is_a ? static_cast<const void*>(dense) : compressed;
  cudaStream_t streams[1] = {stream};
  const auto t0 = std::chrono::steady_clock::now();
  LT_CHECK(m.lib->api.MatmulSearch(&m.lib->handle, &bd->plan, &one, A, B, &beta, out, out,
                                   bd->workspace ? workspace : nullptr, streams, 1),
           m.ctx);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  m.search_ms = ms_since(t0);
  m.config = m.read_config(*bd);
  m.have_config = true;
  m.tuned = true;
  m.from_cache = false;
  m.bound.clear();
  // The plan without bias is rebuilt at once (workspace_bytes() reads it); bias plans on use.
  auto fresh = m.make_bound(nullptr, &m.config);
  m.workspace_hint = fresh->workspace;
  if (!m.p.bias) m.bound.emplace(nullptr, std::move(fresh));
  CusparseltTuningEntry e;
  e.gpu = current_gpu_name();
  e.version = m.lib->version;
  e.problem = m.p.key();
  e.config = m.config;
  e.max_alg_id = m.max_alg_id;
  e.search_ms = m.search_ms;
  store_cusparselt_tuning(e);
}

bool SparseGemm24::tune(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  if (impl_->which != Algorithm::tuned || impl_->tuned || !cusparselt_search_enabled()) return false;
  search(out, compressed, dense, bias, workspace, workspace_bytes, stream);
  return true;
}

bool sparse_gemm24_activation_supported(SparseActivation act) {
  if (act == SparseActivation::none) return cusparselt_available();
  static std::mutex mu;
  static std::map<SparseActivation, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(act);
  if (it != known.end()) return it->second;
  bool ok = false;
  if (cusparselt_available()) {
    try {
      SparseGemm24 probe(SparseGemm24Problem::linear_forward(16, 16, 16, false, act),
                         SparseGemm24::Algorithm::library_default);
      ok = true;
    } catch (const Error&) {
    }
  }
  known[act] = ok;
  return ok;
}

bool SparseGemm24::tuned() const { return impl_->tuned; }
bool SparseGemm24::from_tuning_cache() const { return impl_->from_cache; }
SparseGemm24Config SparseGemm24::config() const { return impl_->config; }
int SparseGemm24::max_alg_id() const { return impl_->max_alg_id; }
double SparseGemm24::plan_build_ms() const { return impl_->plan_ms; }
double SparseGemm24::search_ms() const { return impl_->search_ms; }
size_t SparseGemm24::plans() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bound.size();
}

#else  // !ESPLAG_HAVE_CUSPARSELT

// Built without cusparseLt.h: every sparse GEMM throws (cusparselt_unavailable_reason() says
// why); callers see cusparselt_available() == false and run dense.

struct SparseGemm24::Impl {
  SparseGemm24Problem p;
};

SparseGemm24::SparseGemm24(const SparseGemm24Problem& p, Algorithm) : impl_(std::make_unique<Impl>()) {
  impl_->p = p;
  check_sparse_gemm24_problem(p);
  fail("2:4 sparse GEMM (", p.key(), "): cuSPARSELt is not available: ", cusparselt_unavailable_reason());
}
SparseGemm24::~SparseGemm24() = default;
const SparseGemm24Problem& SparseGemm24::problem() const { return impl_->p; }
size_t SparseGemm24::compressed_bytes() const { return 0; }
size_t SparseGemm24::compress_scratch_bytes() const { return 0; }
size_t SparseGemm24::workspace_bytes() const { return 0; }
void SparseGemm24::prune(void*, const void*, cudaStream_t) const { fail(cusparselt_unavailable_reason()); }
bool SparseGemm24::is_pruned(const void*, cudaStream_t) const { fail(cusparselt_unavailable_reason()); }
void SparseGemm24::compress(void*, const void*, void*, size_t, cudaStream_t) const {
  fail(cusparselt_unavailable_reason());
}
void SparseGemm24::matmul(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) const {
  fail(cusparselt_unavailable_reason());
}
void SparseGemm24::search(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) {
  fail(cusparselt_unavailable_reason());
}
bool SparseGemm24::tune(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) { return false; }
bool sparse_gemm24_activation_supported(SparseActivation) { return false; }
bool SparseGemm24::tuned() const { return false; }
bool SparseGemm24::from_tuning_cache() const { return false; }
SparseGemm24Config SparseGemm24::config() const { return {}; }
int SparseGemm24::max_alg_id() const { return 0; }
double SparseGemm24::plan_build_ms() const { return 0; }
double SparseGemm24::search_ms() const { return 0; }
size_t SparseGemm24::plans() const { return 0; }

#endif  // ESPLAG_HAVE_CUSPARSELT

}  // namespace esplag::gpu
