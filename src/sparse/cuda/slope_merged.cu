#include "sparse/cuda/slope_merged.h"

#include <algorithm>
#include <climits>
#include <string>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "ops/gpu.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/workspace_24.h"

namespace esplag::gpu {

namespace {

constexpr int kThreads = 256;

// Slot j of the adapter part (the groups of four that follow W1's columns) holds adapter
// column 2·(j / 4) + j % 4 when j % 4 < 2 and that column exists; -1 for the zero slots.
__device__ __forceinline__ int adapter_column(int64_t j, int rank) {
  const int64_t c = 2 * (j / 4) + (j % 4);
  return (j % 4 < 2 && c < rank) ? int(c) : -1;
}

// merged [out, in + 2p] = [W1 | L̃].
__global__ void merged_weight_kernel(bf16* merged, const bf16* w1, const bf16* l, int64_t out, int64_t in, int rank,
                                     int64_t stride) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= out * stride) return;
  const int64_t o = i / stride, c = i % stride;
  if (c < in) {
    merged[i] = w1[o * in + c];
  } else {
    const int a = adapter_column(c - in, rank);
    merged[i] = a >= 0 ? l[o * rank + a] : __float2bfloat16_rn(0.f);
  }
}

// r_tilde [2p, in]: row j holds R's row adapter_column(j), or zeros.
__global__ void adapter_rows_kernel(bf16* r_tilde, const bf16* r, int64_t in, int rank, int64_t rows) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * in) return;
  const int a = adapter_column(i / in, rank);
  r_tilde[i] = a >= 0 ? r[int64_t(a) * in + i % in] : __float2bfloat16_rn(0.f);
}

unsigned blocks_for(int64_t n) { return unsigned((n + kThreads - 1) / kThreads); }

}  // namespace

struct SlopeMergedLinear::Impl {
  int64_t out = 0, in = 0, tokens = 0, stride = 0;
  int rank = 0, padded = 0;
  bool bias = false;
  std::string name;
  SparseGemm24* product = nullptr;  // null: the dense fallback
  bool tuned = false;
  DeviceBuffer weight;  // compressed [W1 | L̃], or dense for the fallback
  DeviceBuffer r_tilde;
  Workspace24 workspace{"SlopeMergedLinear"};  // named after the layer once it has a name
  DeviceArena gemm_arena;
  std::unique_ptr<Gemm> gemm;
};

SlopeMergedLinear::SlopeMergedLinear(int64_t out, int64_t in, int rank, int64_t tokens, bool bias, const bf16* w1,
                                     const bf16* lora_l, const bf16* lora_r, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.name = "SLoPe merged inference " + std::to_string(out) + "x" + std::to_string(in) + " rank " +
           std::to_string(rank) + " over " + std::to_string(tokens) + " tokens";
  m.workspace = Workspace24(m.name);
  ESPLAG_CHECK(out > 0 && in > 0 && tokens > 0 && out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0, m.name,
               ": out, in and tokens must be positive multiples of 16 (cuSPARSELt's rule for bf16 operands)");
  ESPLAG_CHECK(rank >= 0 && rank <= std::min(out, in), m.name,
               ": the adapter rank must lie in [0, min(out, in) = ", std::min(out, in), "]");
  ESPLAG_CHECK(w1 && (rank == 0 || (lora_l && lora_r)), m.name, ": needs W1, and L and R for a rank above 0");
  m.out = out;
  m.in = in;
  m.tokens = tokens;
  m.rank = rank;
  m.padded = (rank + 7) / 8 * 8;
  m.stride = in + 2 * m.padded;
  m.bias = bias;
  ESPLAG_CHECK(m.stride <= INT_MAX && out <= INT_MAX && tokens <= INT_MAX, m.name,
               ": sizes must fit the dense GEMM's int arguments");

  m.gemm_arena = DeviceArena(Gemm::kDefaultWorkspaceBytes + Gemm::kScratchBytes + 4096, "slope merged gemm");
  m.gemm = std::make_unique<Gemm>(m.gemm_arena);

  DeviceBuffer merged(size_t(out) * m.stride * sizeof(bf16), m.name, "the merged weight [W1 | L~]");
  merged_weight_kernel<<<blocks_for(out * m.stride), kThreads, 0, stream>>>(merged.bf(), w1, lora_l, out, in, rank,
                                                                            m.stride);
  CUDA_CHECK_LAUNCH("merged_weight_kernel");
  if (m.padded > 0) {
    m.r_tilde.allocate(size_t(2 * m.padded) * in * sizeof(bf16), m.name, "the adapter rows R~");
    adapter_rows_kernel<<<blocks_for(2 * m.padded * in), kThreads, 0, stream>>>(m.r_tilde.bf(), lora_r, in, rank,
                                                                                2 * m.padded);
    CUDA_CHECK_LAUNCH("adapter_rows_kernel");
  }

  if (!cusparselt_available()) {
    warn_cusparselt_fallback_once("SLoPe merged inference");
    m.weight = std::move(merged);
    return;
  }
  m.product = &SparseGemm24::get(SparseGemm24Problem::linear_forward(out, m.stride, tokens, bias));
  // [W1 | L̃] is 2:4 exactly when W1 is: the adapter part is by construction.
  ESPLAG_CHECK(m.product->is_pruned(merged.bf(), stream), m.name,
               ": W1 is not 2:4 along its rows (some group of 4 input features keeps more than 2 values)");
  m.weight.allocate(m.product->compressed_allocation_bytes(), m.name, "the compressed merged weight");
  DeviceBuffer scratch(m.product->compress_scratch_bytes(), m.name, "the compression scratch");
  m.product->compress(m.weight.get(), merged.bf(), scratch.get(), scratch.bytes(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));  // before `merged` and `scratch` are freed
}

SlopeMergedLinear::~SlopeMergedLinear() = default;

int64_t SlopeMergedLinear::out_features() const { return impl_->out; }
int64_t SlopeMergedLinear::in_features() const { return impl_->in; }
int64_t SlopeMergedLinear::tokens() const { return impl_->tokens; }
int SlopeMergedLinear::rank() const { return impl_->rank; }
int SlopeMergedLinear::padded_rank() const { return impl_->padded; }
int64_t SlopeMergedLinear::input_stride() const { return impl_->stride; }
bool SlopeMergedLinear::sparse() const { return impl_->product != nullptr; }

void SlopeMergedLinear::forward(bf16* y, bf16* x_wide, const bf16* bias, cudaStream_t stream) {
  Impl& m = *impl_;
  ESPLAG_CHECK(y && x_wide, m.name, ": forward needs y and x_wide");
  ESPLAG_CHECK((bias != nullptr) == m.bias, m.name, ": the layer was built ", m.bias ? "with" : "without",
               " a bias, and forward got ", bias ? "one" : "none");
  const int N = int(m.tokens), K = int(m.stride);
  if (m.padded > 0)  // T̃ = X · R̃ᵀ into the columns after X
    m.gemm->forward_strided(x_wide + m.in, K, x_wide, K, m.r_tilde.bf(), N, int(m.in), 2 * m.padded, false, stream);
  if (!m.product) {
    m.gemm->forward(y, x_wide, m.weight.bf(), bias, N, K, int(m.out), stream);
    return;
  }
  m.workspace.tune_once(*m.product, m.tuned, {m.product}, y, m.weight.get(), x_wide, bias, stream);
  m.product->matmul(y, m.weight.get(), x_wide, bias, m.workspace.get(), m.workspace.bytes(), stream);
}

size_t SlopeMergedLinear::device_bytes() const {
  const Impl& m = *impl_;
  return m.weight.bytes() + m.r_tilde.bytes() + m.workspace.bytes() + m.gemm_arena.capacity();
}

}  // namespace esplag::gpu
