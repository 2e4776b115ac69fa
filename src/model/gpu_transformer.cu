// GpuTransformer: the dense training step on the GPU (see model/gpu_transformer.h).
//
// Data flow of one micro-batch (N = B·T rows, every tensor row-major [N, ·]):
//   embed -> res_in[0]
//   block l:  ln1 = norm1(res_in[l])           (for l > 0 fused with the residual add
//                                                res_in[l] = res_mid[l-1] + branch)
//             qkv = ln1 Wqkvᵀ (+b); RoPE in place; atty = attention(qkv) (+ lse)
//             branch = atty Wprojᵀ (+b)
//             ln2 = norm2(res_mid[l] = res_in[l] + branch)
//             fc = ln2 Wfcᵀ (+b); act = gelu / swiglu / relu²(fc)   (GELU fused in the GEMM)
//             branch = act Wmprojᵀ (+b)
//   lnf = norm_f(res_f = res_mid[L-1] + branch)
//   LM head in chunks of rows: logits = lnf Wheadᵀ (bf16) -> cross-entropy in place ->
//   dlogits -> dlnf (chunk rows) and dWhead (accumulated); full logits never exist.
// Backward mirrors it, the residual-stream gradient living in one buffer (dres) that the
// norm backwards add into.
//
// Buffers shared across the step (the header's memory section says what is saved):
//   s0 [N, C]: lnf at the end of forward and in the head; dres in backward
//   s1 [N, C]: the branch output in forward; dlnf in the head; dln in backward
//   U (the shared region), in turn:
//     forward    ln1 / ln2 / the SwiGLU or ReLU² output (with recompute) at offset 0,
//                the attention forward's workspace at offset 0 (ln1 is dead by then)
//     head       the logits chunk
//     MLP bwd    GELU: dfc, then ln2 (recomputed) after it;
//                SwiGLU / ReLU²: dact, overwritten by the recomputed act, then by ln2
//                (dfc goes over the layer's saved fc)
//     attn bwd   the attention workspace; dqkv and datty (then the recomputed ln1) too
//                unless they fit in the layer's dead fc storage
#include "model/gpu_transformer.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/error.h"
#include "core/op_trace.h"
#include "core/parallel.h"
#include "model/linear_slope.h"
#include "ops/gpu.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/kept_values.h"
#include "sparse/cuda/sparse_activation_linear.h"
#include "sparse/cuda/sparse_linear.h"
#include "sparse/cuda/sparsify.h"

namespace esplag {

using gpu::bf16;

namespace {

// ---------------------------------------------------------------------------------------
// Small kernels of the model itself

constexpr int kThreads = 256;

__global__ void add_kernel(float* dst, const float* src, int64_t n, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) dst[i] = accumulate ? dst[i] + src[i] : src[i];
}

// ---------------------------------------------------------------------------------------
// Op names for the profiler (core/op_trace.h), from the op-timing names of the marks.

// The block Linear behind a GEMM's short name.
const char* linear_module(std::string_view short_name) {
  if (short_name == "qkv") return "attn.qkv";
  if (short_name == "proj") return "attn.proj";
  if (short_name == "fc") return "mlp.fc";
  if (short_name == "mproj") return "mlp.proj";
  return nullptr;
}

// The CPU model's naming: "blocks.3.mlp.fc.fwd", ".bwd.dx", ".bwd.dw" for a Linear's
// products (dense or 2:4: the category tells them apart), "lm_head.fwd" and so on for the
// head; any other op "blocks.3." + its timing name with '.' for ' ' ("blocks.3.attention.bwd"),
// without the prefix outside the blocks ("adamw", "embedding.fwd").
std::string op_trace_name(const std::string& kind, int layer) {
  std::string_view k = kind;
  if (k.rfind("sparse ", 0) == 0) k.remove_prefix(7);
  const std::string block = layer >= 0 ? "blocks." + std::to_string(layer) + "." : "";
  auto phase = [](std::string_view p) -> std::string {
    if (p.rfind("fwd", 0) == 0) return "fwd";
    if (p.rfind("dX", 0) == 0) return "bwd.dx";
    if (p.rfind("dW", 0) == 0) return "bwd.dw";
    return std::string(p);
  };
  if (k.rfind("gemm ", 0) == 0) {
    const std::string_view rest = k.substr(5);
    const size_t sp = rest.find(' ');
    if (const char* module = linear_module(rest.substr(0, sp)); module && sp != std::string_view::npos)
      return block + module + "." + phase(rest.substr(sp + 1));
  }
  if (k.rfind("head gemm ", 0) == 0) return "lm_head." + phase(k.substr(10));
  std::string name(k.substr(0, k.find(" (")));
  std::replace(name.begin(), name.end(), ' ', '.');
  return block + name;
}

OpCategory op_trace_category(const std::string& kind) {
  auto starts = [&](const char* p) { return kind.rfind(p, 0) == 0; };
  if (starts("sparse gemm")) return OpCategory::sparse_gemm;
  if (kind.find("gemm") != std::string::npos) return OpCategory::dense_gemm;
  if (starts("attention")) return OpCategory::attention;
  if (starts("norm")) return OpCategory::norm;
  if (starts("cross-entropy") || starts("mean loss")) return OpCategory::loss;
  if (starts("adamw") || starts("grad norm")) return OpCategory::optimizer;
  if (starts("memset")) return OpCategory::memcpy;
  if (starts("sparse prepare")) return OpCategory::other;
  return OpCategory::elementwise;
}

// Zeroes the gradient ranges of a table (what zero_grad writes), one block per entry.
struct ZeroChunk {
  int64_t offset, n;
};
constexpr int64_t kZeroChunk = 16384;
__global__ void zero_chunks_kernel(const ZeroChunk* table, float* grad) {
  const ZeroChunk c = table[blockIdx.x];
  for (int64_t i = threadIdx.x; i < c.n; i += kThreads) grad[c.offset + i] = 0.f;
}

// Zeroes the entries of x [rows, cols] (and of x2 when given) whose bit is 0 in `bits`
// ([rows, ceil(cols / 32)] words, bit c % 32 of word c / 32 for column c): a masked
// layer's pruned gradients, or its pruned weights (x the master's high halves, x2 the low
// ones). A thread per column, blocks of rows along y: no division per element, a warp's
// 32 columns share one mask word, and only pruned entries are written.
template <typename T, typename U>
__global__ void apply_mask_kernel(T* x, U* x2, const uint32_t* bits, int64_t rows, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t words = (cols + 31) / 32;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    if ((bits[r * words + c / 32] >> (c % 32)) & 1u) continue;
    x[r * cols + c] = T{};
    if (x2) x2[r * cols + c] = U{};
  }
}

__global__ void fill_kernel(float* p, int64_t n, float value) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) p[i] = value;
}

__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Counter-based normals: element i of a tensor draws one 64-bit hash of (key, i), split
// into two 24-bit uniforms for Box-Muller, so the values do not depend on the launch (nor
// on the chunks the tensor is generated in: p holds elements [base, base + n)).
__global__ void normal_kernel(float* p, int64_t n, int64_t base, uint64_t key, float stddev) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const uint64_t h = splitmix64(key ^ splitmix64(static_cast<uint64_t>(base + i)));
  const float u1 = (static_cast<float>(h >> 40) + 1.f) * (1.f / 16777216.f);  // (0, 1]
  const float u2 = static_cast<float>(h & 0xFFFFFFull) * (1.f / 16777216.f);  // [0, 1)
  p[i] = stddev * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

// Mean of the per-row losses into *out (fp64), one block, fixed summation order.
constexpr int kLossThreads = 1024;
__global__ void __launch_bounds__(kLossThreads) mean_loss_kernel(double* out, const float* losses, int64_t n) {
  __shared__ double sh[kLossThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kLossThreads) acc += losses[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kLossThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0] / static_cast<double>(n);
}

unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
size_t aligned(size_t bytes) { return round_up(bytes, DeviceArena::kDefaultAlignment); }

// Either counts what an allocation sequence needs (arena == null) or performs it, so the
// memory plan and the real layout can never disagree.
struct Take {
  DeviceArena* arena = nullptr;
  size_t* bucket = nullptr;
  template <typename T>
  T* arr(const std::string& name, size_t count) {
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
    if (bucket) *bucket += aligned(bytes);
    return arena ? arena->allocate_array<T>(name, std::max<size_t>(count, 1)) : nullptr;
  }
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The LM head works on a vocabulary padded to a multiple of 128: an odd row length (GPT-2's
// 50257) leaves cuBLASLt only its slow 2-byte-aligned kernels, which cost more than all
// the other GEMMs of the step together. Padding rows of the head weight are zero and the
// cross-entropy writes zero gradients there, so the padding changes no result.
int padded_vocab(const ModelConfig& c) {
  return c.vocab_size % 64 == 0 ? c.vocab_size : static_cast<int>(round_up(size_t(c.vocab_size), 128));
}

// The flat-layout segments AdamW updates, and the index of the head weight's segment.
std::vector<gpu::ParamSegment> segments_of(const std::vector<ParamInfo>& infos) {
  std::vector<gpu::ParamSegment> segs;
  for (const auto& i : infos) segs.push_back({int64_t(i.offset), int64_t(i.numel), i.decay});
  return segs;
}

// The gradient ranges zero_grad writes: every tensor but the Linear weights of the blocks
// and the LM head's weight, which the next backward's GEMMs (or the padded head's
// gradient copy) overwrite. Cut into chunks of at most kZeroChunk, adjacent tensors merged.
std::vector<ZeroChunk> zero_table(const ModelConfig& c, const std::vector<ParamInfo>& infos) {
  const std::string head = c.tie_embeddings ? "embed.tokens.weight" : "lm_head.weight";
  auto overwritten = [&](const std::string& n) {
    if (n == head) return true;
    if (n.rfind("blocks.", 0) != 0 || !ends_with(n, ".weight")) return false;
    return n.find(".attn.") != std::string::npos || n.find(".mlp.") != std::string::npos;
  };
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& i : infos) {
    if (overwritten(i.name) || i.numel == 0) continue;
    const int64_t o = int64_t(i.offset), n = int64_t(i.numel);
    if (!ranges.empty() && ranges.back().first + ranges.back().second == o)
      ranges.back().second += n;
    else
      ranges.push_back({o, n});
  }
  std::vector<ZeroChunk> table;
  for (const auto& [o, n] : ranges)
    for (int64_t k = 0; k < n; k += kZeroChunk) table.push_back({o + k, std::min(kZeroChunk, n - k)});
  return table;
}

// The entry of tensor `name` (which must be there).
const ParamInfo& info_named(const std::vector<ParamInfo>& infos, const std::string& name) {
  const auto it = std::find_if(infos.begin(), infos.end(), [&](const ParamInfo& i) { return i.name == name; });
  ESPLAG_CHECK(it != infos.end(), "GpuTransformer: no tensor named ", name);
  return *it;
}

// The block index and the module of a block Linear's weight name (set_linear_kind checked
// it): "blocks.3.mlp.fc.weight" -> 3, "blocks.3.mlp.fc".
int layer_of(const std::string& weight_name) { return std::stoi(weight_name.substr(std::string("blocks.").size())); }
std::string module_of(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string(".weight").size());
}

int head_segment(const ModelConfig& c, const std::vector<ParamInfo>& infos) {
  const ParamInfo& head = info_named(infos, c.tie_embeddings ? "embed.tokens.weight" : "lm_head.weight");
  return static_cast<int>(&head - infos.data());
}

// Sizes of the shared scratch region's uses for micro-batches of up to B x T.
struct SharedSizes {
  size_t attn_ws = 0;       // the attention workspace (forward and backward)
  size_t dqkv = 0;          // dqkv in the attention backward
  size_t datty_slot = 0;    // datty, then (with recompute) ln1
  bool attn_in_fc = false;  // dqkv + datty slot fit in a layer's fc storage
  size_t gelu_dfc = 0;      // GELU: dfc in the MLP backward (ln2 follows it)
  size_t other = 0;         // the region's size without the LM head
  int head_rows = 0;
  size_t total = 0;
};

SharedSizes shared_sizes(const ModelConfig& c, int B, int T, const GpuModelOptions& o) {
  const size_t N = size_t(B) * T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim(), b = sizeof(bf16);
  const bool rc = o.recompute, gelu = c.mlp == MlpKind::gelu;
  SharedSizes z;
  z.attn_ws =
      aligned(gpu::attention_workspace_bytes(B, T, c.n_head, c.n_kv_head, c.head_dim(), o.attention));
  const size_t fwd_tmp = rc ? aligned(b * N * (gelu ? C : std::max(C, H))) : 0;
  const size_t fwd = std::max(fwd_tmp, z.attn_ws);
  size_t mlp;
  if (gelu) {
    z.gelu_dfc = aligned(b * N * F);
    mlp = z.gelu_dfc + (rc ? aligned(b * N * C) : 0);
  } else {
    mlp = aligned(b * N * (rc ? std::max(H, C) : H));
  }
  z.dqkv = aligned(b * N * Q);
  z.datty_slot = aligned(b * N * (rc ? std::max(AC, C) : AC));
  z.attn_in_fc = z.dqkv + z.datty_slot <= aligned(b * N * F);
  const size_t attn = z.attn_in_fc ? z.attn_ws : z.dqkv + z.datty_slot + z.attn_ws;
  z.other = std::max({fwd, mlp, attn, size_t(1) << 20});  // >= 1 MiB: also the staging of parameter copies

  ESPLAG_CHECK(o.head_chunk_rows >= 0, "GpuModelOptions.head_chunk_rows must be >= 0, got ", o.head_chunk_rows);
  const size_t row_bytes = b * static_cast<size_t>(padded_vocab(c));
  int rows = o.head_chunk_rows;
  if (rows == 0) {
    // A workspace the attention needs anyway may hold a larger chunk (fewer passes over the
    // head's weight gradient). Not the other phases' sizes: the rows, and with them the
    // gradient's summation order, must not depend on `recompute`.
    const size_t fit = std::max(o.head_chunk_bytes, z.attn_ws) / row_bytes;
    rows = static_cast<int>(std::max<size_t>(128, std::min<size_t>(fit, size_t(1) << 20) / 128 * 128));
  }
  z.head_rows = std::max(1, std::min<int>(rows, static_cast<int>(N)));
  z.total = std::max(z.other, aligned(row_bytes * z.head_rows));
  return z;
}

}  // namespace

// ---------------------------------------------------------------------------------------

struct GpuTransformer::Impl {
  struct Norm {
    const bf16 *w = nullptr, *b = nullptr;
    float *dw = nullptr, *db = nullptr;
  };
  struct Lin {
    const bf16 *w = nullptr, *b = nullptr;
    float *dw = nullptr, *db = nullptr;
    // semi_sparse and slope (set_linear_kind): the layer's 2:4 products; null for dense.
    gpu::SparseLinear* sp = nullptr;
    // semi_sparse_activation: the layer's input pruning and its forward product.
    gpu::SparseActivationLinear* act = nullptr;
    bool slope = false;
    bool dense_products = false;  // slope, per-layer dispatch: cuBLASLt products of W1 and W2
    // masked: the kept positions as bits ([out, ceil(in / 32)] words), device memory.
    const uint32_t* mask = nullptr;
    // slope's low-rank adapter (rank 0: none): L [out, rank], R [rank, in] and their
    // gradients, and T = X·Rᵀ [tokens, rank], saved by the forward for the backward.
    int rank = 0;
    const bf16 *lora_l = nullptr, *lora_r = nullptr;
    float *dlora_l = nullptr, *dlora_r = nullptr;
    bf16* lora_t = nullptr;
    bool sparse_for(int N) const { return sp && !dense_products && sp->sparse_products() && sp->tokens() == N; }
  };
  // A slope layer's schedule of backward-mask refreshes (SlopeLinear::on_step_begin).
  struct Slope {
    int mask_change_freq = 0;
    int64_t refresh_step = 0;  // the step whose forward first used the current backward mask
    bool due(int64_t step) const { return mask_change_freq > 0 && step - refresh_step >= mask_change_freq; }
  };
  struct Block {
    Norm n1, n2;
    Lin qkv, proj, fc, mproj;
  };
  // Saved for backward, per layer (ln1, ln2, act null when recomputed).
  struct Layer {
    bf16 *res_in = nullptr, *ln1 = nullptr, *qkv = nullptr, *atty = nullptr, *res_mid = nullptr, *ln2 = nullptr,
         *fc = nullptr, *act = nullptr;
    float *ln1_mean = nullptr, *ln1_rstd = nullptr, *lse = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr;
  };

  // Per-op CUDA-event timing (set_op_timing): mark(name) ends the previous op's interval
  // and starts name's; collect() ends the last one and adds the intervals up.
  struct Timer {
    bool on = false;
    std::vector<cudaEvent_t> events;
    std::vector<int> kinds;  // the op kind of the interval starting at events[i]
    std::vector<double> flops;
    size_t used = 0;
    std::vector<GpuOpTime> totals;
    std::map<std::string, int> index;

    void mark(cudaStream_t s, const std::string& name, double fl = 0) {
      if (!on) return;
      auto it = index.find(name);
      if (it == index.end()) {
        it = index.emplace(name, static_cast<int>(totals.size())).first;
        totals.push_back(GpuOpTime{name, 0, 0, 0});
      }
      record(s);
      kinds.push_back(it->second);
      flops.push_back(fl);
    }
    void record(cudaStream_t s) {
      if (used == events.size()) {
        cudaEvent_t e = nullptr;
        CUDA_CHECK(cudaEventCreate(&e));
        events.push_back(e);
      }
      CUDA_CHECK(cudaEventRecord(events[used++], s));
    }
    void collect(cudaStream_t s) {
      if (!on || kinds.empty()) return;
      record(s);
      CUDA_CHECK(cudaEventSynchronize(events[used - 1]));
      for (size_t i = 0; i < kinds.size(); ++i) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, events[i], events[i + 1]));
        GpuOpTime& t = totals[static_cast<size_t>(kinds[i])];
        ++t.calls;
        t.ms += ms;
        t.flops += flops[i];
      }
      kinds.clear();
      flops.clear();
      used = 0;
    }
    ~Timer() {
      for (auto e : events) cudaEventDestroy(e);
    }
  };

  // One captured graph and the state of its capture.
  struct Graph {
    bool seen = false;    // ran once eagerly
    bool failed = false;  // capture refused: stays eager
    cudaGraphExec_t exec = nullptr;
    void reset() {
      if (exec) cudaGraphExecDestroy(exec);
      exec = nullptr;
      seen = failed = false;
    }
    ~Graph() { reset(); }
  };
  struct StepGraph {
    const int32_t* tokens = nullptr;
    const int32_t* targets = nullptr;
    int B = 0, T = 0;
    double loss_scale = 0;
    bool overwrite = false;
    std::unique_ptr<Graph> graph;
    uint64_t last_use = 0;
  };

  std::unique_ptr<gpu::Gemm> gemm;
  std::unique_ptr<gpu::SplitAdamWPlan> adamw;
  // The semi_sparse layers by weight name (Lin::sp points into it) and the dispatch
  // decisions by layer shape.
  std::map<std::string, std::unique_ptr<gpu::SparseLinear>> sparse;
  std::vector<GpuTransformer::SparseDispatch> dispatch;
  // The semi_sparse_activation layers by weight name (Lin::act points into them) and the
  // scratch they share (the pruned input and its compressed form, for the largest block
  // Linear; one stream orders their uses).
  std::map<std::string, std::unique_ptr<gpu::SparseActivationLinear>> activation;
  DeviceArena activation_scratch;
  // The slope layers by weight name, and the scratch all of them share (sized for the
  // largest; one stream orders their uses): W1 expanded from its kept values (slope_w1),
  // W2 and W2ᵀ (SparseLinearOptions::slope_scratch), and the dense fp32 dW (slope_dw).
  std::map<std::string, Slope> slope;
  DeviceArena slope_scratch;
  // The scratch every sparse_dw layer's backward uses (gpu::SparseLinearOptions::dw_scratch),
  // sized for the largest block Linear.
  DeviceArena dw_scratch;
  void* dw_buffers = nullptr;
  void* dw_scratch_for(const GpuTransformer& model, int64_t tokens);
  bf16* slope_w1 = nullptr;
  bf16* slope_w2 = nullptr;
  float* slope_dw = nullptr;
  // The slope layers' adapter ranks by weight name (rank > 0 only); their buffers: each
  // layer's saved T (Lin::lora_t) and the dT = dY·L [tokens, largest rank] they share, which
  // holds the dT of the layer lora_dt_of (a layer's dX and dW run one after the other).
  std::map<std::string, int> lora;
  DeviceArena lora_scratch;
  bf16* lora_dt = nullptr;
  const Lin* lora_dt_of = nullptr;
  // y [N, OC] += (x [N, K] · Rᵀ) · Lᵀ, T saved in lin.lora_t.
  void adapter_forward(const Lin& lin, bf16* y, const bf16* x, int N, int K, int OC, cudaStream_t s) {
    gemm->forward(lin.lora_t, x, lin.lora_r, nullptr, N, K, lin.rank, s);
    gemm->forward_strided(y, OC, lin.lora_t, lin.rank, lin.lora_l, N, lin.rank, OC, true, s);
  }
  // dT = dout [N, OC] · L of `lin`, computed once for its dX and dW.
  const bf16* adapter_dt(const Lin& lin, const bf16* dout, int N, int OC, cudaStream_t s) {
    if (lora_dt_of != &lin) gemm->backward_input(lora_dt, dout, lin.lora_l, N, lin.rank, OC, false, s);
    lora_dt_of = &lin;
    return lora_dt;
  }
  // The masked layers by weight name: their bit masks (Lin::mask points into them) and shapes.
  struct Masked {
    std::string kind;  // masked or vnm
    DeviceArena bits;
    int64_t out = 0, in = 0;
  };
  std::map<std::string, Masked> masks;
  // Zeroes a masked layer's pruned entries of x [out, in] (and of x2).
  template <typename T, typename U = T>
  static void apply_mask(T* x, const Lin& lin, int64_t out, int64_t in, cudaStream_t s, U* x2 = nullptr) {
    const dim3 grid(static_cast<unsigned>((in + kThreads - 1) / kThreads),
                    static_cast<unsigned>(std::min<int64_t>(out, 65535)));
    apply_mask_kernel<T, U><<<grid, kThreads, 0, s>>>(x, x2, lin.mask, out, in);
    CUDA_CHECK_LAUNCH("GpuTransformer (masked layer)");
  }
  // Which slope layers (in `slope`'s order) the preparation running now refreshes.
  std::vector<bool> refreshing;
  // Ws of a semi_sparse layer whose 2:4 layers keep no pruned copy, made when a product
  // has to run dense (a micro-batch of another size): as large as the largest such layer.
  DeviceArena prune_scratch;

  // The weight a dense product of `lin` reads: W, the pruned Ws the layer keeps (dense
  // dispatch), or Ws pruned now into prune_scratch (stream order keeps it until the
  // product has read it).
  const bf16* dense_weight(const Lin& lin, int out, int in, cudaStream_t s) {
    if (!lin.sp) return lin.w;
    if (lin.slope) return expand_w1(lin, s);
    if (const bf16* p = lin.sp->pruned_weight()) return p;
    bf16* ws = reinterpret_cast<bf16*>(prune_scratch.base());
    gpu::transposable_24(lin.w, out, in, gpu::Sparse24Out{ws}, gpu::Sparse24Out{}, nullptr, s);
    return ws;
  }
  // A slope layer's W1 [out, in] from its stored kept values, in slope_w1.
  const bf16* expand_w1(const Lin& lin, cudaStream_t s) {
    gpu::scatter_kept_24(slope_w1, lin.w, lin.sp->forward_tile_mask(), lin.sp->out_features(), lin.sp->in_features(),
                         s);
    return slope_w1;
  }
  gpu::AdamWStepParams* adam_params = nullptr;  // device

  ZeroChunk* zero_chunks = nullptr;  // zero_grad's table (device)
  int64_t num_zero_chunks = 0;
  bool zero_pending = false;  // zero_grad ran; the backward is to overwrite the rest

  // The parameter state (GpuTransformer::lay_out_state) in the storage layout `stored`:
  // the flat layout's tensors, a slope weight as its kept values [out, in/2].
  std::vector<ParamInfo> stored;
  DeviceArena state;
  GpuMemoryPlan step_plan;   // the step arena's share of the memory plan
  bf16* w = nullptr;         // bf16 weights (the high halves of the master weights)
  int16_t* w_lo = nullptr;   // low halves
  float *grad = nullptr, *m = nullptr, *v = nullptr;

  std::vector<Block> blocks;
  Norm nf;
  int Vp = 0;                     // padded vocabulary of the LM head
  bf16* head_pad = nullptr;       // [Vp, C] zero-padded copy of the head weight (when Vp > V)
  float* head_dw_pad = nullptr;   // [Vp, C] head weight gradient of one micro-batch (when Vp > V)
  const bf16 *wte = nullptr, *wpe = nullptr, *head_w = nullptr;
  float *dwte = nullptr, *dwpe = nullptr, *head_dw = nullptr;

  std::vector<Layer> layers;
  bf16* res_f = nullptr;
  float *lnf_mean = nullptr, *lnf_rstd = nullptr;
  bf16 *s0 = nullptr, *s1 = nullptr;
  unsigned char* shared = nullptr;
  SharedSizes sizes;
  float* losses = nullptr;
  void *norm_scratch = nullptr, *gnorm_scratch = nullptr, *emb_ws = nullptr;
  size_t norm_scratch_bytes = 0, emb_ws_bytes = 0;
  bool fused_norm = false;  // GpuModelOptions::fused_norm_backward, where d_model allows it
  void *fnorm_scratch = nullptr, *colsum_scratch = nullptr;
  size_t fnorm_scratch_bytes = 0, colsum_scratch_bytes = 0;

  int32_t* staging = nullptr;  // pinned host, 2 · max N
  double* host_loss = nullptr;
  float* host_norm = nullptr;
  cudaEvent_t staged = nullptr;

  Timer timer;
  // The profiler's view (core/op_trace.h), while a tracer is installed: each mark closes
  // the open op and opens the next one on the stream, named after the module it belongs
  // to as the CPU model names its ops (op_trace_name), so that profiles of both backends
  // read alike and `esplag profile --validate` can match a dense and a sparse GPU step.
  std::optional<ScopedOp> trace_op;
  int layer = -1;  // the block the ops being marked belong to; -1 outside the blocks

  // Starts the op `kind` (the op-timing table's name) on stream s; `trace_name` overrides
  // the derived name in the trace. Nothing is built unless timing or tracing is on.
  void mark(cudaStream_t s, std::string_view kind, double flops = 0, std::string_view trace_name = {}) {
    if (!marking()) [[likely]]
      return;
    const std::string k(kind);
    timer.mark(s, k, flops);
    trace_op.reset();
    if (tracing())
      trace_op.emplace(trace_name.empty() ? op_trace_name(k, layer) : std::string(trace_name), op_trace_category(k),
                       layer, flops, 0, BufferList{}, BufferList{}, OpStream(s));
  }
  // Closes the last op of a call (the timer's intervals are collected separately).
  void end_ops() { trace_op.reset(); }
  bool tracing() const { return current_op_tracer() != nullptr; }
  bool marking() const { return timer.on || tracing(); }

  std::vector<StepGraph> step_graphs;
  // AdamW + the 2:4 preparation, one graph per set of slope layers refreshing their
  // backward masks in it (`refreshing`; usually none, or all of them).
  std::map<std::vector<bool>, Graph> adam_graphs;
  uint64_t graph_uses = 0;
  int64_t graph_launches = 0;

  ~Impl() {
    if (staging) cudaFreeHost(staging);
    if (host_loss) cudaFreeHost(host_loss);
    if (host_norm) cudaFreeHost(host_norm);
    if (staged) cudaEventDestroy(staged);
  }
};

namespace {

// The parameter state of a storage layout (GpuTransformer::lay_out_state), in one order,
// for counting (take.arena null) and for real (then also AdamW's chunk table and
// zero_grad's table, the buffers in `im`).
void lay_out_state_buffers(const ModelConfig& c, const std::vector<ParamInfo>& stored, GpuTransformer::Impl& im,
                           GpuMemoryPlan& plan, Take take) {
  const size_t n = stored.empty() ? 0 : stored.back().offset + stored.back().numel;
  const auto segments = segments_of(stored);
  const auto zeros = zero_table(c, stored);
  take.bucket = &plan.params;
  im.w = take.arr<bf16>("params.bf16", n);
  im.w_lo = take.arr<int16_t>("params.master_low", n);
  take.bucket = &plan.grads;
  im.grad = take.arr<float>("params.grad", n);
  im.zero_chunks = take.arr<ZeroChunk>("grad.zero_table", zeros.size());
  take.bucket = &plan.optimizer;
  im.m = take.arr<float>("adamw.m", n);
  im.v = take.arr<float>("adamw.v", n);
  plan.optimizer += gpu::SplitAdamWPlan::table_bytes_bound(segments);
  if (!take.arena) return;
  im.adamw = std::make_unique<gpu::SplitAdamWPlan>(segments, *take.arena, im.head_pad ? head_segment(c, stored) : -1);
  im.num_zero_chunks = static_cast<int64_t>(zeros.size());
  if (!zeros.empty())
    CUDA_CHECK(cudaMemcpy(im.zero_chunks, zeros.data(), zeros.size() * sizeof(ZeroChunk), cudaMemcpyHostToDevice));
}

GpuMemoryPlan operator+(const GpuMemoryPlan& a, const GpuMemoryPlan& b) {
  GpuMemoryPlan r;
  r.params = a.params + b.params;
  r.grads = a.grads + b.grads;
  r.optimizer = a.optimizer + b.optimizer;
  r.activations = a.activations + b.activations;
  r.scratch = a.scratch + b.scratch;
  r.workspace = a.workspace + b.workspace;
  return r;
}

// Every device allocation of the step arena, in one order, for counting and for real.
// Returns the buffers in `im` when take.arena is set.
void lay_out(const ModelConfig& c, int B, int T, const GpuModelOptions& o, GpuTransformer::Impl& im,
             GpuMemoryPlan& plan, Take take, int32_t** tokens, int32_t** targets, double** loss, float** norm_sq) {
  const size_t N = size_t(B) * T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim(), S = size_t(B) * c.n_head * T;
  const bool ln = c.norm == NormKind::layernorm, rc = o.recompute, gelu = c.mlp == MlpKind::gelu;

  im.Vp = padded_vocab(c);
  const bool pad = im.Vp != c.vocab_size;
  take.bucket = &plan.params;
  if (pad) im.head_pad = take.arr<bf16>("params.head_padded", size_t(im.Vp) * C);
  take.bucket = &plan.grads;
  if (pad) im.head_dw_pad = take.arr<float>("params.head_grad_padded", size_t(im.Vp) * C);
  take.bucket = &plan.optimizer;
  im.adam_params = take.arr<gpu::AdamWStepParams>("adamw.step_params", 1);

  take.bucket = &plan.activations;
  im.layers.assign(c.n_layer, {});
  for (int l = 0; l < c.n_layer; ++l) {
    auto& L = im.layers[l];
    const std::string p = "act." + std::to_string(l) + ".";
    L.res_in = take.arr<bf16>(p + "res_in", N * C);
    if (!rc) L.ln1 = take.arr<bf16>(p + "ln1", N * C);
    if (ln) L.ln1_mean = take.arr<float>(p + "ln1_mean", N);
    L.ln1_rstd = take.arr<float>(p + "ln1_rstd", N);
    L.qkv = take.arr<bf16>(p + "qkv", N * Q);
    L.atty = take.arr<bf16>(p + "atty", N * AC);
    L.lse = take.arr<float>(p + "lse", S);
    L.res_mid = take.arr<bf16>(p + "res_mid", N * C);
    if (!rc) L.ln2 = take.arr<bf16>(p + "ln2", N * C);
    if (ln) L.ln2_mean = take.arr<float>(p + "ln2_mean", N);
    L.ln2_rstd = take.arr<float>(p + "ln2_rstd", N);
    L.fc = take.arr<bf16>(p + "fc", N * F);
    if (gelu || !rc) L.act = take.arr<bf16>(p + "act", N * H);
  }
  im.res_f = take.arr<bf16>("act.res_f", N * C);
  if (ln) im.lnf_mean = take.arr<float>("act.lnf_mean", N);
  im.lnf_rstd = take.arr<float>("act.lnf_rstd", N);

  take.bucket = &plan.scratch;
  im.s0 = take.arr<bf16>("step.s0", N * C);
  im.s1 = take.arr<bf16>("step.s1", N * C);
  im.sizes = shared_sizes(c, B, T, o);
  im.shared = take.arr<unsigned char>("step.shared", im.sizes.total);
  im.losses = take.arr<float>("head.losses", N);
  *tokens = take.arr<int32_t>("batch.tokens", N);
  *targets = take.arr<int32_t>("batch.targets", N);
  *loss = take.arr<double>("loss", 1);
  *norm_sq = take.arr<float>("grad_norm_sq", 1);
  im.fused_norm = o.fused_norm_backward && gpu::fused_norm_backward_supported(c.d_model);
  // Column sums give bias gradients with the fused norm backward, and a slope or sparse_dw
  // layer's wherever (its dW product writes a scratch, without the bias epilogue).
  if (c.bias) {
    im.colsum_scratch_bytes = gpu::column_sum_scratch_bytes(int64_t(N), static_cast<int>(std::max({Q, F, C})));
    im.colsum_scratch = take.arr<unsigned char>("scratch.bias_grad", im.colsum_scratch_bytes);
  }
  if (im.fused_norm) {
    im.fnorm_scratch_bytes = gpu::fused_norm_backward_scratch_bytes(static_cast<int>(N), c.d_model);
    im.fnorm_scratch = take.arr<unsigned char>("scratch.norm_fused", im.fnorm_scratch_bytes);
  } else {
    im.norm_scratch_bytes = gpu::norm_backward_scratch_bytes(static_cast<int>(N), c.d_model);
    im.norm_scratch = take.arr<unsigned char>("scratch.norm", im.norm_scratch_bytes);
  }
  im.gnorm_scratch = take.arr<unsigned char>("scratch.grad_norm", gpu::sum_squares_scratch_bytes());
  im.emb_ws_bytes = gpu::embedding_backward_workspace_bytes(B, T, c.d_model, c.vocab_size);
  im.emb_ws = take.arr<unsigned char>("scratch.embedding", im.emb_ws_bytes);
}

// Runs `body` on stream s as the graph g: eagerly the first time, captured the second,
// replayed from then on (see the header). A capture the libraries refuse leaves g eager.
void run_as_graph(GpuTransformer::Impl::Graph& g, cudaStream_t s, int64_t& launches,
                  const std::function<void()>& body) {
  if (g.failed) return body();
  if (!g.exec) {
    if (!g.seen) {
      g.seen = true;
      return body();
    }
    auto give_up = [&](const std::string& why) {
      g.failed = true;
      (void)cudaGetLastError();  // capture errors are not sticky; leave none behind
      std::fprintf(stderr, "esplag: warning: GpuTransformer: CUDA graph capture failed (%s); running eagerly\n",
                   why.c_str());
      body();
    };
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (const std::exception& e) {
      if (cudaStreamEndCapture(s, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      return give_up(e.what());
    }
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    if (end != cudaSuccess || !graph) return give_up(cudaGetErrorString(end));
    const cudaError_t inst = cudaGraphInstantiateWithFlags(&g.exec, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) {
      g.exec = nullptr;
      return give_up(cudaGetErrorString(inst));
    }
  }
  CUDA_CHECK(cudaGraphLaunch(g.exec, s));
  ++launches;
}

}  // namespace

std::string GpuMemoryPlan::describe() const {
  auto f = DeviceArena::format_bytes;
  return "parameters " + f(params) + ", gradients " + f(grads) + ", optimizer " + f(optimizer) + ", activations " +
         f(activations) + ", scratch " + f(scratch) + ", workspace " + f(workspace);
}

std::vector<ParamInfo> GpuTransformer::param_layout(const ModelConfig& cfg) {
  cfg.validate();
  std::vector<ParamInfo> infos;
  auto add = [&](const std::string& name, const Shape& shape, bool decay) {
    ParamInfo i;
    i.name = name;
    i.shape = shape;
    i.numel = static_cast<size_t>(shape_numel(shape));
    i.decay = decay;
    i.offset = infos.empty() ? 0 : infos.back().offset + infos.back().numel;
    infos.push_back(std::move(i));
  };
  // The order of Transformer's constructor: the flat layouts must match.
  const int C = cfg.d_model, V = cfg.vocab_size;
  const bool ln = cfg.norm == NormKind::layernorm;
  add("embed.tokens.weight", {V, C}, true);
  if (cfg.pos == PosKind::learned) add("embed.positions.weight", {cfg.max_seq_len, C}, true);
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    auto linear = [&](const std::string& name, int out, int in) {
      add(b + name + ".weight", {out, in}, true);
      if (cfg.bias) add(b + name + ".bias", {out}, false);
    };
    add(b + "norm1.weight", {C}, false);
    if (ln) add(b + "norm1.bias", {C}, false);
    linear("attn.qkv", cfg.qkv_dim(), C);
    linear("attn.proj", C, cfg.n_head * cfg.head_dim());
    add(b + "norm2.weight", {C}, false);
    if (ln) add(b + "norm2.bias", {C}, false);
    linear("mlp.fc", cfg.fc_dim(), C);
    linear("mlp.proj", C, cfg.d_ff);
  }
  add("norm_f.weight", {C}, false);
  if (ln) add("norm_f.bias", {C}, false);
  if (!cfg.tie_embeddings) add("lm_head.weight", {V, C}, true);
  return infos;
}

namespace {

// The step arena's share of the memory plan (lay_out's buffers and the GEMM workspace).
GpuMemoryPlan step_arena_plan(const ModelConfig& config, int B, int T, const GpuModelOptions& options) {
  GpuMemoryPlan step;
  GpuTransformer::Impl dummy;
  int32_t *tok = nullptr, *tgt = nullptr;
  double* loss = nullptr;
  float* nsq = nullptr;
  lay_out(config, B, T, options, dummy, step, Take{}, &tok, &tgt, &loss, &nsq);
  step.workspace = aligned(gpu::Gemm::kDefaultWorkspaceBytes) + aligned(gpu::Gemm::kScratchBytes);
  return step;
}

}  // namespace

GpuMemoryPlan GpuTransformer::memory_plan(const ModelConfig& config, int max_batch, int max_seq_len,
                                          const GpuModelOptions& options) {
  const auto infos = param_layout(config);
  ESPLAG_CHECK(max_batch > 0 && max_seq_len > 0, "GpuTransformer::memory_plan: bad micro-batch ", max_batch, " x ",
               max_seq_len);
  ESPLAG_CHECK(config.head_dim() <= gpu::kAttentionMaxHeadDim, "GpuTransformer: head dimension ", config.head_dim(),
               " exceeds the GPU attention's maximum ", gpu::kAttentionMaxHeadDim);
  GpuMemoryPlan state;
  Impl dummy;
  lay_out_state_buffers(config, infos, dummy, state, Take{});
  return step_arena_plan(config, max_batch, max_seq_len, options) + state;
}

GpuTransformer::GpuTransformer(const ModelConfig& config, int max_batch, int max_seq_len,
                               const GpuModelOptions& options)
    : cfg_(config), opt_(options), impl_(std::make_unique<Impl>()) {
  cfg_.validate();
  ESPLAG_CHECK(max_batch > 0, "GpuTransformer: max_batch must be positive, got ", max_batch);
  ESPLAG_CHECK(max_seq_len > 0 && max_seq_len <= cfg_.max_seq_len, "GpuTransformer: sequence length ", max_seq_len,
               " outside [1, max_seq_len=", cfg_.max_seq_len, "]");
  ESPLAG_CHECK(int64_t(max_batch) * max_seq_len <= 0x7fffffff, "GpuTransformer: B·T = ",
               int64_t(max_batch) * max_seq_len, " rows do not fit int32");
  ESPLAG_CHECK(cfg_.head_dim() <= gpu::kAttentionMaxHeadDim, "GpuTransformer: head dimension ", cfg_.head_dim(),
               " exceeds the GPU attention's maximum ", gpu::kAttentionMaxHeadDim);
  infos_ = param_layout(cfg_);
  nparams_ = infos_.back().offset + infos_.back().numel;
  max_b_ = max_batch;
  max_t_ = max_seq_len;
  const int N = max_b_ * max_t_;
  plan_ = memory_plan(cfg_, max_b_, max_t_, opt_);  // all dense: the largest state

  const size_t need = plan_.total() + opt_.extra_arena_bytes;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (need > free_b)
    fail("GpuTransformer: model '", cfg_.preset, "' (", nparams_, " parameters) with micro-batch ", max_b_, " x ",
         max_t_, " needs ", DeviceArena::format_bytes(need), " of device memory (", plan_.describe(), ") but only ",
         DeviceArena::format_bytes(free_b), " of ", DeviceArena::format_bytes(total_b),
         " is free; lower the batch size or the sequence length");
  Impl& im = *impl_;
  im.step_plan = step_arena_plan(cfg_, max_b_, max_t_, opt_);
  arena_ = std::make_unique<DeviceArena>(im.step_plan.total() + opt_.extra_arena_bytes, "model");
  CUDA_CHECK(cudaStreamCreate(&stream_));

  GpuMemoryPlan counted;
  lay_out(cfg_, max_b_, max_t_, opt_, im, counted, Take{arena_.get(), nullptr}, &tokens_, &targets_, &loss_, &norm_sq_);
  head_chunk_ = im.sizes.head_rows;
  im.gemm = std::make_unique<gpu::Gemm>(*arena_);
  im.gemm->set_use_epilogues(opt_.gemm_epilogues);

  CUDA_CHECK(cudaMallocHost(&im.staging, sizeof(int32_t) * 2 * size_t(N)));
  CUDA_CHECK(cudaMallocHost(&im.host_loss, sizeof(double)));
  CUDA_CHECK(cudaMallocHost(&im.host_norm, sizeof(float)));
  CUDA_CHECK(cudaEventCreateWithFlags(&im.staged, cudaEventDisableTiming));

  if (im.head_pad) CUDA_CHECK(cudaMemsetAsync(im.head_pad, 0, sizeof(bf16) * size_t(im.Vp) * cfg_.d_model, stream_));
  CUDA_CHECK(cudaMemsetAsync(norm_sq_, 0, sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(loss_, 0, sizeof(double), stream_));
  im.blocks.resize(cfg_.n_layer);
  lay_out_state();
}

GpuTransformer::~GpuTransformer() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

size_t GpuTransformer::state_bytes() const { return impl_->state.capacity(); }

void GpuTransformer::lay_out_state() {
  Impl& im = *impl_;
  synchronize();  // nothing queued may still use the old state
  im.stored = infos_;
  size_t offset = 0;
  for (auto& i : im.stored) {
    if (im.slope.count(i.name)) {  // the kept values of W1
      i.shape = {i.shape.at(0), i.shape.at(1) / 2};
      i.numel /= 2;
    }
    i.offset = offset;
    offset += i.numel;
  }
  // The adapters after every flat tensor, so that the flat tensors keep their indices.
  for (const auto& [weight, rank] : im.lora) {
    const ParamInfo& w = info_named(infos_, weight);
    const std::string module = module_of(weight);
    for (const auto& [suffix, shape] : {std::pair<const char*, Shape>{".lora_l", {w.shape.at(0), rank}},
                                        std::pair<const char*, Shape>{".lora_r", {rank, w.shape.at(1)}}}) {
      ParamInfo a;
      a.name = module + suffix;
      a.shape = shape;
      a.numel = size_t(shape_numel(shape));
      a.decay = true;
      a.offset = offset;
      offset += a.numel;
      im.stored.push_back(std::move(a));
    }
  }
  nstored_ = offset;
  // The old state goes first, so that the device never holds both.
  im.adamw.reset();
  im.state = DeviceArena();
  GpuMemoryPlan state;
  lay_out_state_buffers(cfg_, im.stored, im, state, Take{});
  im.state = DeviceArena(state.total(), "parameter state");
  GpuMemoryPlan counted;
  lay_out_state_buffers(cfg_, im.stored, im, counted, Take{&im.state, nullptr});
  plan_ = im.step_plan + state;

  // Parameter views, fixed until the next layout.
  std::map<std::string, const ParamInfo*> by_name;
  for (const auto& i : im.stored) by_name[i.name] = &i;
  auto wp = [&](const std::string& n) -> const bf16* {
    auto it = by_name.find(n);
    return it == by_name.end() ? nullptr : im.w + it->second->offset;
  };
  auto gp = [&](const std::string& n) -> float* {
    auto it = by_name.find(n);
    return it == by_name.end() ? nullptr : im.grad + it->second->offset;
  };
  auto norm = [&](const std::string& n) {
    return Impl::Norm{wp(n + ".weight"), wp(n + ".bias"), gp(n + ".weight"), gp(n + ".bias")};
  };
  auto lin = [&](Impl::Lin& l, const std::string& n) {  // keeps the layer's kind
    l.w = wp(n + ".weight");
    l.b = wp(n + ".bias");
    l.dw = gp(n + ".weight");
    l.db = gp(n + ".bias");
    if (l.sp && !l.slope) l.sp->set_weight(l.w);  // a slope layer's reads slope_w1
    const auto ad = im.lora.find(n + ".weight");
    l.rank = ad == im.lora.end() ? 0 : ad->second;
    l.lora_l = wp(n + ".lora_l");
    l.lora_r = wp(n + ".lora_r");
    l.dlora_l = gp(n + ".lora_l");
    l.dlora_r = gp(n + ".lora_r");
  };
  im.wte = wp("embed.tokens.weight");
  im.dwte = gp("embed.tokens.weight");
  im.wpe = wp("embed.positions.weight");
  im.dwpe = gp("embed.positions.weight");
  im.head_w = cfg_.tie_embeddings ? im.wte : wp("lm_head.weight");
  im.head_dw = cfg_.tie_embeddings ? im.dwte : gp("lm_head.weight");
  im.nf = norm("norm_f");
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    auto& blk = im.blocks[l];
    blk.n1 = norm(b + "norm1");
    blk.n2 = norm(b + "norm2");
    lin(blk.qkv, b + "attn.qkv");
    lin(blk.proj, b + "attn.proj");
    lin(blk.fc, b + "mlp.fc");
    lin(blk.mproj, b + "mlp.proj");
  }

  // A defined start: zero parameters, gradients and moments.
  CUDA_CHECK(cudaMemsetAsync(im.w, 0, sizeof(bf16) * nstored_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.w_lo, 0, sizeof(int16_t) * nstored_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.grad, 0, sizeof(float) * nstored_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.m, 0, sizeof(float) * nstored_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.v, 0, sizeof(float) * nstored_, stream_));
  im.zero_pending = false;
  // The captured graphs baked the old buffers in.
  im.step_graphs.clear();
  im.adam_graphs.clear();
  synchronize();
}

void GpuTransformer::synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

// --- parameters ---------------------------------------------------------------------------
//
// Host copies of the parameter state go through the shared scratch region in fp32 chunks
// (it is idle between steps, and stream order keeps it so), tensor by tensor: a slope
// weight's chunks are whole groups of 4 rows, gathered to (or scattered from) its kept
// values in the second part of the region.

struct GpuTransformer::Transfer {
  // Elements [o, o + n) of flat tensor k, dense fp32 in `stage` (device): written there
  // (into the storage layout) or handed over (out of it).
  std::function<void(size_t k, size_t o, size_t n, float* stage)> dense;
  // n values of the storage layout at offset `at`: written from `buf` (into the storage
  // layout) or read into `buf` (out of it), device fp32.
  std::function<void(size_t at, float* buf, size_t n)> stored;
};

namespace {

// The chunk of a tensor's elements one transfer moves; `kept`: stored as kept values.
size_t transfer_chunk(const ParamInfo& info, bool kept, size_t stage_floats) {
  if (!kept) return stage_floats;
  const size_t cols = size_t(info.shape.at(1));
  const size_t rows = stage_floats * 2 / 3 / cols / 4 * 4;  // dense rows + their kept values
  ESPLAG_CHECK(rows > 0, "GpuTransformer: rows of ", info.name, " (", cols,
               " columns) do not fit the shared scratch region for host copies");
  return rows * cols;
}

}  // namespace

void GpuTransformer::transfer(const Transfer& t, bool to_store) const {
  const Impl& im = *impl_;
  float* stage = reinterpret_cast<float*>(im.shared);
  const size_t floats = im.sizes.total / sizeof(float);
  for (size_t k = 0; k < infos_.size(); ++k) {
    const ParamInfo& info = infos_[k];
    const size_t at = im.stored[k].offset;
    const bool kept = im.stored[k].numel != info.numel;
    const size_t chunk = transfer_chunk(info, kept, floats);
    for (size_t o = 0; o < info.numel; o += chunk) {
      const size_t n = std::min(chunk, info.numel - o);
      if (to_store) t.dense(k, o, n, stage);
      if (!kept) {
        t.stored(at + o, stage, n);
      } else {  // the kept values in the stage after the dense chunk
        const int64_t cols = info.shape.at(1), row0 = int64_t(o) / cols, rows = int64_t(n) / cols;
        const uint16_t* tiles = im.sparse.at(info.name)->forward_tile_mask() + (row0 / 4) * (cols / 4);
        if (to_store) gpu::gather_kept_24(stage + n, stage, tiles, rows, cols, false, stream_);
        t.stored(at + o / 2, stage + n, n / 2);
        if (!to_store) gpu::scatter_kept_24(stage, stage + n, tiles, rows, cols, stream_);
      }
      if (!to_store) t.dense(k, o, n, stage);
    }
  }
}

namespace {

// A Transfer::dense that copies the chunk into the host flat vector h (and waits: the
// stage is reused by the next chunk).
std::function<void(size_t, size_t, size_t, float*)> to_host(std::vector<float>& h, const std::vector<ParamInfo>& infos,
                                                            cudaStream_t s) {
  return [&h, &infos, s](size_t k, size_t o, size_t n, float* stage) {
    CUDA_CHECK(cudaMemcpyAsync(h.data() + infos[k].offset + o, stage, sizeof(float) * n, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  };
}

// A Transfer::stored that copies device fp32 values between buf and base.
std::function<void(size_t, float*, size_t)> copy_stored(float* base, bool into_base, cudaStream_t s) {
  return [base, into_base, s](size_t at, float* buf, size_t n) {
    CUDA_CHECK(cudaMemcpyAsync(into_base ? base + at : buf, into_base ? buf : base + at, sizeof(float) * n,
                               cudaMemcpyDeviceToDevice, s));
  };
}

std::function<void(size_t, size_t, size_t, float*)> from_host(const float* h, const std::vector<ParamInfo>& infos,
                                                              cudaStream_t s) {
  return [h, &infos, s](size_t k, size_t o, size_t n, float* stage) {
    CUDA_CHECK(cudaMemcpyAsync(stage, h + infos[k].offset + o, sizeof(float) * n, cudaMemcpyHostToDevice, s));
  };
}

// A Transfer::stored that writes fp32 values into the split master weights (hi, lo).
std::function<void(size_t, float*, size_t)> split_into_master(GpuTransformer::Impl& im, cudaStream_t s) {
  return [&im, s](size_t at, float* buf, size_t n) { gpu::master_split(im.w + at, im.w_lo + at, buf, int64_t(n), s); };
}

}  // namespace

void GpuTransformer::set_params(const float* host, size_t n) {
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_params: got ", n, " values, the model has ", nparams_,
               " parameters");
  Impl& im = *impl_;
  transfer({from_host(host, infos_, stream_), split_into_master(im, stream_)}, true);
  refresh_head_copy();
  prepare_sparse();
  synchronize();
}

std::vector<float> GpuTransformer::params_to_host() const {
  const Impl& im = *impl_;
  std::vector<float> h(nparams_);
  transfer(
      {to_host(h, infos_, stream_),
       [&](size_t at, float* buf, size_t n) { gpu::master_join(buf, im.w + at, im.w_lo + at, int64_t(n), stream_); }},
      false);
  return h;
}

std::vector<float> GpuTransformer::grads_to_host() const {
  settle_zero_grad();
  std::vector<float> h(nparams_);
  transfer({to_host(h, infos_, stream_), copy_stored(impl_->grad, false, stream_)}, false);
  return h;
}

void GpuTransformer::set_optimizer_state(const float* m, const float* v, size_t n, int64_t steps) {
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_optimizer_state: got ", n, " moments, the model has ", nparams_,
               " parameters");
  ESPLAG_CHECK(steps >= 0, "GpuTransformer::set_optimizer_state: negative step count ", steps);
  transfer({from_host(m, infos_, stream_), copy_stored(impl_->m, true, stream_)}, true);
  transfer({from_host(v, infos_, stream_), copy_stored(impl_->v, true, stream_)}, true);
  synchronize();
  step_ = steps;
}

void GpuTransformer::optimizer_state_to_host(std::vector<float>& m, std::vector<float>& v) const {
  m.assign(nparams_, 0.f);
  v.assign(nparams_, 0.f);
  transfer({to_host(m, infos_, stream_), copy_stored(impl_->m, false, stream_)}, false);
  transfer({to_host(v, infos_, stream_), copy_stored(impl_->v, false, stream_)}, false);
}

void GpuTransformer::init_weights(uint64_t seed) {
  Impl& im = *impl_;
  const double residual_scale = 1.0 / std::sqrt(2.0 * cfg_.n_layer);
  // Elements [o, o + cnt) of tensor k, drawn as if the tensor were drawn whole.
  auto draw = [&](size_t k, size_t o, size_t cnt, float* stage) {
    const ParamInfo& info = infos_[k];
    const bool is_norm = info.name.find("norm") != std::string::npos;
    const bool bias = ends_with(info.name, ".bias");
    const bool residual_out = info.name.find("attn.proj.weight") != std::string::npos ||
                              info.name.find("mlp.proj.weight") != std::string::npos;
    const double stddev = cfg_.init_std * (residual_out ? residual_scale : 1.0);
    const uint64_t key = splitmix64(seed) ^ splitmix64(k + 1);
    const int64_t n = int64_t(cnt);
    if (bias || is_norm)
      fill_kernel<<<blocks(n), kThreads, 0, stream_>>>(stage, n, bias ? 0.f : 1.f);
    else
      normal_kernel<<<blocks(n), kThreads, 0, stream_>>>(stage, n, int64_t(o), key, static_cast<float>(stddev));
    CUDA_CHECK_LAUNCH("GpuTransformer::init_weights");
  };
  transfer({draw, split_into_master(im, stream_)}, true);
  refresh_head_copy();
  prepare_sparse();
  synchronize();
}

void GpuTransformer::refresh_head_copy() {
  const Impl& im = *impl_;
  if (!im.head_pad) return;
  CUDA_CHECK(cudaMemcpyAsync(im.head_pad, im.head_w, sizeof(bf16) * size_t(cfg_.vocab_size) * cfg_.d_model,
                             cudaMemcpyDeviceToDevice, stream_));
}

void GpuTransformer::zero_grad() {
  Impl& im = *impl_;
  if (im.zero_pending) return;
  if (im.num_zero_chunks > 0) {
    zero_chunks_kernel<<<static_cast<unsigned>(im.num_zero_chunks), kThreads, 0, stream_>>>(im.zero_chunks, im.grad);
    CUDA_CHECK_LAUNCH("GpuTransformer::zero_grad");
  }
  im.zero_pending = true;
}

void GpuTransformer::settle_zero_grad() const {
  Impl& im = *impl_;
  if (!im.zero_pending) return;
  CUDA_CHECK(cudaMemsetAsync(im.grad, 0, sizeof(float) * nstored_, stream_));
  im.zero_pending = false;
}

// --- timing and graphs ----------------------------------------------------------------------

void GpuTransformer::set_op_timing(bool on) {
  Impl::Timer& t = impl_->timer;
  if (on && !t.on) {
    t.totals.clear();
    t.index.clear();
  }
  t.on = on;
}

std::vector<GpuOpTime> GpuTransformer::op_times() const { return impl_->timer.totals; }

int64_t GpuTransformer::graph_launches() const { return impl_->graph_launches; }

// --- compute --------------------------------------------------------------------------------

void GpuTransformer::check_batch(int B, int T) const {
  ESPLAG_CHECK(B > 0 && B <= max_b_, "GpuTransformer: batch size ", B, " outside [1, ", max_b_,
               "] (the model was sized for ", max_b_, " x ", max_t_, ")");
  ESPLAG_CHECK(T > 0 && T <= max_t_, "GpuTransformer: sequence length ", T, " outside [1, ", max_t_,
               "] (the model was sized for ", max_b_, " x ", max_t_, ")");
}

void GpuTransformer::upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_batch(B, T);
  const int N = B * T, V = cfg_.vocab_size;
  for (int i = 0; i < N; ++i) {
    ESPLAG_CHECK(tokens[i] >= 0 && tokens[i] < V, "input token ", tokens[i], " at position ", i,
                 " is outside the vocabulary [0, ", V, ")");
    ESPLAG_CHECK(!targets || (targets[i] >= 0 && targets[i] < V), "target token ", targets ? targets[i] : 0,
                 " at position ", i, " is outside the vocabulary [0, ", V, ")");
  }
  Impl& im = *impl_;
  // The staging buffer may still feed the previous batch's copies.
  CUDA_CHECK(cudaEventSynchronize(im.staged));
  std::copy(tokens, tokens + N, im.staging);
  CUDA_CHECK(cudaMemcpyAsync(tokens_, im.staging, sizeof(int32_t) * N, cudaMemcpyHostToDevice, stream_));
  if (targets) {
    std::copy(targets, targets + N, im.staging + N);
    CUDA_CHECK(cudaMemcpyAsync(targets_, im.staging + N, sizeof(int32_t) * N, cudaMemcpyHostToDevice, stream_));
  }
  CUDA_CHECK(cudaEventRecord(im.staged, stream_));
}

double GpuTransformer::read_loss() {
  CUDA_CHECK(cudaMemcpyAsync(impl_->host_loss, loss_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return *impl_->host_loss;
}

double GpuTransformer::forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T,
                                        double loss_scale) {
  ESPLAG_CHECK(tokens && targets, "GpuTransformer::forward_backward: null tokens or targets");
  upload_batch(tokens, targets, B, T);
  forward_backward_device(tokens_, targets_, B, T, loss_scale);
  return read_loss();
}

double GpuTransformer::forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T) {
  ESPLAG_CHECK(tokens && targets, "GpuTransformer::forward_loss: null tokens or targets");
  upload_batch(tokens, targets, B, T);
  forward_loss_device(tokens_, targets_, B, T);
  return read_loss();
}

void GpuTransformer::forward_backward_body(const int32_t* tokens, const int32_t* targets, int B, int T,
                                           double loss_scale, bool overwrite) {
  forward_body(tokens, B, T);
  head(targets, B, T, true, loss_scale, overwrite);
  backward_body(tokens, B, T, overwrite);
}

void GpuTransformer::forward_backward_device(const int32_t* tokens, const int32_t* targets, int B, int T,
                                             double loss_scale) {
  check_batch(B, T);
  ESPLAG_CHECK(tokens && targets, "GpuTransformer::forward_backward_device: null tokens or targets");
  Impl& im = *impl_;
  // After zero_grad the weight GEMMs write their gradients instead of adding to them.
  const bool overwrite = im.zero_pending;
  im.zero_pending = false;
  if (!opt_.cuda_graph || im.timer.on || im.tracing()) {
    forward_backward_body(tokens, targets, B, T, loss_scale, overwrite);
    im.end_ops();
    im.timer.collect(stream_);
    return;
  }
  auto it = std::find_if(im.step_graphs.begin(), im.step_graphs.end(), [&](const Impl::StepGraph& g) {
    return g.tokens == tokens && g.targets == targets && g.B == B && g.T == T && g.loss_scale == loss_scale &&
           g.overwrite == overwrite;
  });
  if (it == im.step_graphs.end()) {
    constexpr size_t kMaxGraphs = 8;
    if (im.step_graphs.size() == kMaxGraphs) {  // forget the least recently used
      auto lru = std::min_element(im.step_graphs.begin(), im.step_graphs.end(),
                                  [](const auto& a, const auto& b) { return a.last_use < b.last_use; });
      im.step_graphs.erase(lru);
    }
    im.step_graphs.push_back({tokens, targets, B, T, loss_scale, overwrite, std::make_unique<Impl::Graph>(), 0});
    it = im.step_graphs.end() - 1;
  }
  it->last_use = ++im.graph_uses;
  run_as_graph(*it->graph, stream_, im.graph_launches,
               [&] { forward_backward_body(tokens, targets, B, T, loss_scale, overwrite); });
}

void GpuTransformer::forward_loss_device(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_batch(B, T);
  forward_body(tokens, B, T);
  head(targets, B, T, false, 1.0);
  impl_->end_ops();
  impl_->timer.collect(stream_);
}

void GpuTransformer::forward_body(const int32_t* tokens, int B, int T) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, NH = cfg_.n_head, KV = cfg_.n_kv_head,
            HD = cfg_.head_dim(), Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff, AC = NH * HD;
  const bool ln = cfg_.norm == NormKind::layernorm, rc = opt_.recompute;
  auto norm = [&](const Impl::Norm& n, bf16* out, float* mean, float* rstd, bf16* res, const bf16* a, const bf16* b) {
    im.mark(s, "norm fwd");
    if (ln)
      gpu::layernorm_forward(out, mean, rstd, res, a, b, n.w, n.b, N, C, s);
    else
      gpu::rmsnorm_forward(out, rstd, res, a, b, n.w, N, C, s);
  };
  auto mark = [&](std::string_view name, double flops = 0) { im.mark(s, name, flops); };
  const double n2 = 2.0 * N;
  const double attn_flops = 2.0 * B * NH * double(T) * T * HD;  // causal: QKᵀ and PV on half the square
  gpu::Gemm& gemm = *im.gemm;
  // out = act(in · Wᵀ + b) [N, OC] from in [N, K]: the 2:4 product of a semi_sparse or
  // slope layer with the bias in its epilogue and GELU as a separate pass, else cuBLASLt with
  // its epilogues; a slope layer's adapter adds its products before the GELU.
  auto linear = [&](const Impl::Lin& lin, const char* name, bf16* out, const bf16* in, int K, int OC,
                    gpu::Gemm::Act act = gpu::Gemm::Act::none, bf16* pre_gelu = nullptr) {
    const double fl = n2 * K * OC;
    const bool gelu = act == gpu::Gemm::Act::gelu;
    if (lin.act) {  // the input pruned, then the 2:4 product (or cuBLASLt's of the pruned input)
      if (!lin.act->sparse_forward_for(N))
        mark(name, fl);
      else if (im.marking())
        mark(std::string("sparse ") + name, fl);
      bf16* y = gelu ? pre_gelu : out;
      lin.act->forward(y, in, lin.w, lin.b, N, s);
      if (gelu) {
        mark("gelu fwd");
        gpu::gelu_forward(out, y, int64_t(N) * OC, s);
      }
      return;
    }
    if (!lin.sparse_for(N) && lin.rank == 0) {
      mark(name, fl);
      gemm.forward(out, in, im.dense_weight(lin, OC, K, s), lin.b, N, K, OC, s, act, pre_gelu);
      return;
    }
    bf16* y = gelu ? pre_gelu : out;
    if (lin.sparse_for(N)) {
      if (im.marking()) mark(std::string("sparse ") + name, fl);
      lin.sp->forward(y, in, s, lin.b);  // the bias in cuSPARSELt's epilogue
    } else {
      mark(name, fl);
      gemm.forward(y, in, im.dense_weight(lin, OC, K, s), lin.b, N, K, OC, s);
    }
    if (lin.rank > 0) {
      im.mark(s, "gemm lora fwd", n2 * lin.rank * (K + OC),
              im.tracing() ? op_trace_name(name, im.layer) + ".lora" : "");
      im.adapter_forward(lin, y, in, N, K, OC, s);
    }
    if (gelu) {
      mark("gelu fwd");
      gpu::gelu_forward(out, y, int64_t(N) * OC, s);
    }
  };
  bf16* tmp = reinterpret_cast<bf16*>(im.shared);  // ln1 / ln2 / act with recompute
  bf16* branch = im.s1;

  mark("embedding fwd");
  gpu::embedding_forward(im.layers.front().res_in, tokens, im.wte, im.wpe, B, T, C, V, s);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    im.layer = l;
    auto& L = im.layers[l];
    const auto& blk = im.blocks[l];
    bf16* ln1 = rc ? tmp : L.ln1;
    if (l == 0)
      norm(blk.n1, ln1, L.ln1_mean, L.ln1_rstd, nullptr, L.res_in, nullptr);
    else
      norm(blk.n1, ln1, L.ln1_mean, L.ln1_rstd, L.res_in, im.layers[l - 1].res_mid, branch);
    linear(blk.qkv, "gemm qkv fwd", L.qkv, ln1, C, Q);
    if (cfg_.pos == PosKind::rope) {
      mark("rope fwd");
      gpu::rope_forward(L.qkv, B, T, NH, KV, HD, cfg_.rope_theta, s);
    }
    mark("attention fwd", attn_flops);
    gpu::attention_forward(L.atty, L.lse, L.qkv, B, T, NH, KV, HD, im.shared, im.sizes.attn_ws, s, opt_.attention);
    linear(blk.proj, "gemm proj fwd", branch, L.atty, AC, C);
    bf16* ln2 = rc ? tmp : L.ln2;
    norm(blk.n2, ln2, L.ln2_mean, L.ln2_rstd, L.res_mid, L.res_in, branch);
    bf16* act = L.act;
    switch (cfg_.mlp) {
      case MlpKind::gelu:
        linear(blk.fc, "gemm fc fwd (+gelu)", L.act, ln2, C, F, gpu::Gemm::Act::gelu, L.fc);
        break;
      case MlpKind::swiglu:
        linear(blk.fc, "gemm fc fwd", L.fc, ln2, C, F);
        mark("swiglu fwd");
        act = rc ? tmp : L.act;
        gpu::fused_swiglu_forward(act, L.fc, N, H, s);
        break;
      case MlpKind::relu2:
        linear(blk.fc, "gemm fc fwd", L.fc, ln2, C, F);
        mark("relu2 fwd");
        act = rc ? tmp : L.act;
        gpu::fused_relu2_forward(act, L.fc, int64_t(N) * H, s);
        break;
    }
    linear(blk.mproj, "gemm mproj fwd", branch, act, H, C);
  }
  im.layer = -1;
  norm(im.nf, im.s0, im.lnf_mean, im.lnf_rstd, im.res_f, im.layers.back().res_mid, branch);
}

void GpuTransformer::head(const int32_t* targets, int B, int T, bool train, double loss_scale, bool overwrite) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, Vp = im.Vp;
  const float dloss = static_cast<float>(loss_scale / N);
  const bool pad = im.head_pad != nullptr;
  const bf16* W = pad ? im.head_pad : im.head_w;
  float* dW = pad ? im.head_dw_pad : im.head_dw;
  const bf16* lnf = im.s0;
  bf16* dlnf = im.s1;
  bf16* logits = reinterpret_cast<bf16*>(im.shared);
  for (int r0 = 0; r0 < N; r0 += head_chunk_) {
    const int rows = std::min(head_chunk_, N - r0);
    const double fl = 2.0 * rows * C * Vp;
    const bf16* h = lnf + size_t(r0) * C;
    im.mark(s, "head gemm fwd", fl);
    im.gemm->forward(logits, h, W, nullptr, rows, C, Vp, s);
    im.mark(s, "cross-entropy");
    gpu::softmax_cross_entropy(im.losses + r0, logits, targets + r0, rows, V, Vp, dloss, train, s);
    if (train) {
      // The chunk's dlogits (now in logits, zero in the padding) give its rows of dlnf and
      // add into the head's weight gradient; the padded gradient starts over with each
      // micro-batch, the real one after zero_grad (overwrite).
      im.mark(s, "head gemm dX", fl);
      im.gemm->backward_input(dlnf + size_t(r0) * C, logits, W, rows, C, Vp, false, s);
      im.mark(s, "head gemm dW", fl);
      im.gemm->backward_weight(dW, nullptr, logits, h, rows, C, Vp, !((pad || overwrite) && r0 == 0), s);
    }
  }
  if (train && pad) {
    im.mark(s, "head grad unpad");
    const int64_t n = int64_t(V) * C;
    add_kernel<<<blocks(n), kThreads, 0, s>>>(im.head_dw, im.head_dw_pad, n, !overwrite);
    CUDA_CHECK_LAUNCH("GpuTransformer (LM head gradient)");
  }
  im.mark(s, "mean loss");
  mean_loss_kernel<<<1, kLossThreads, 0, s>>>(loss_, im.losses, N);
  CUDA_CHECK_LAUNCH("GpuTransformer (mean loss)");
}

void GpuTransformer::backward_body(const int32_t* tokens, int B, int T, bool overwrite) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, NH = cfg_.n_head, KV = cfg_.n_kv_head,
            HD = cfg_.head_dim(), Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff, AC = NH * HD;
  const bool ln = cfg_.norm == NormKind::layernorm, rc = opt_.recompute;
  gpu::Gemm& gemm = *im.gemm;
  bf16* dres = im.s0;  // the residual-stream gradient
  bf16* dln = im.s1;   // the gradient w.r.t. a norm's output
  auto mark = [&](std::string_view name, double flops = 0) { im.mark(s, name, flops); };
  const double n2 = 2.0 * N;
  // dinp [N, K] = dout [N, OC] · W (times gelu'(pre_gelu) when given): the 2:4 product of
  // a semi_sparse layer (then the GELU gradient as a separate pass), else cuBLASLt. The
  // weight gradients stay dense GEMMs (straight through the pruning).
  auto weight_dx = [&](const Impl::Lin& lin, const char* name, bf16* dinp, const bf16* dout, int K, int OC,
                       const bf16* pre_gelu) {
    const double fl = n2 * K * OC;
    if (lin.slope && !lin.sparse_for(N)) {
      // dinp = dout · W2 as the forward-form product of W2ᵀ [K, OC], made again now (the
      // slope layers share the scratch it lives in), then the GELU gradient if any.
      mark("sparse prepare (2:4 prune + compress)");
      im.expand_w1(lin, s);
      const bf16* w2t = lin.sp->refill_backward_weight_t(s);
      mark(name, fl);
      gemm.forward(dinp, dout, w2t, nullptr, N, OC, K, s);
      if (pre_gelu) {
        mark("gelu bwd");
        gpu::gelu_backward(dinp, pre_gelu, dinp, int64_t(N) * K, false, s);
      }
      return;
    }
    if (!lin.sparse_for(N)) {
      mark(name, fl);
      gemm.backward_input(dinp, dout, im.dense_weight(lin, OC, K, s), N, K, OC, false, s, pre_gelu);
      return;
    }
    if (im.marking()) mark(std::string("sparse ") + name, fl);
    lin.sp->backward(dinp, nullptr, dout, nullptr, false, s);
    if (pre_gelu) {
      mark("gelu bwd");
      gpu::gelu_backward(dinp, pre_gelu, dinp, int64_t(N) * K, false, s);
    }
  };
  // The same plus a slope adapter's part, dT = dout · L, dinp += dT · R, ahead of the GELU
  // gradient.
  auto linear_dx = [&](const Impl::Lin& lin, const char* name, bf16* dinp, const bf16* dout, int K, int OC,
                       const bf16* pre_gelu = nullptr) {
    if (lin.rank == 0) return weight_dx(lin, name, dinp, dout, K, OC, pre_gelu);
    weight_dx(lin, name, dinp, dout, K, OC, nullptr);
    const int r = lin.rank;
    im.mark(s, "gemm lora dX", n2 * r * (K + OC), im.tracing() ? op_trace_name(name, im.layer) + ".lora" : "");
    gemm.backward_input(dinp, im.adapter_dt(lin, dout, N, OC, s), lin.lora_r, N, K, r, true, s);
    if (pre_gelu) {
      mark("gelu bwd");
      gpu::gelu_backward(dinp, pre_gelu, dinp, int64_t(N) * K, false, s);
    }
  };
  // Bias gradients: with the fused norm backward, those of attn.proj and mlp.proj (whose
  // output gradient is dres right after a norm backward) come out of that norm backward
  // (next_bias), those of qkv and fc from column sums; otherwise from the GEMM epilogue.
  const bool fz = im.fused_norm;
  auto gemm_bias = [&](float* db) { return fz ? nullptr : db; };
  auto bias_sum = [&](float* db, const bf16* dout, int OC) {
    if (!fz || !db) return;
    mark("bias grad");
    gpu::column_sum_add(db, dout, N, OC, im.colsum_scratch, im.colsum_scratch_bytes, s);
  };
  // dres += the norm's input gradient.
  auto norm_bwd = [&](const Impl::Norm& n, const bf16* inp, const float* mean, const float* rstd, float* next_bias) {
    mark("norm bwd");
    if (fz) {
      if (ln)
        gpu::fused_layernorm_backward(dres, n.dw, n.db, next_bias, dln, inp, n.w, mean, rstd, N, C, im.fnorm_scratch,
                                      im.fnorm_scratch_bytes, s);
      else
        gpu::fused_rmsnorm_backward(dres, n.dw, next_bias, dln, inp, n.w, rstd, N, C, im.fnorm_scratch,
                                    im.fnorm_scratch_bytes, s);
    } else if (ln) {
      gpu::layernorm_backward(dres, n.dw, n.db, dln, inp, n.w, mean, rstd, N, C, im.norm_scratch,
                              im.norm_scratch_bytes, s);
    } else {
      gpu::rmsnorm_backward(dres, n.dw, dln, inp, n.w, rstd, N, C, im.norm_scratch, im.norm_scratch_bytes, s);
    }
  };
  // The norm's output again, from its saved input, with the forward's kernel: the same
  // bits as the forward wrote (the statistics are recomputed the same way too).
  auto norm_again = [&](const Impl::Norm& n, bf16* out, const bf16* inp) {
    mark("norm recompute");
    if (ln)
      gpu::layernorm_forward(out, nullptr, nullptr, nullptr, inp, nullptr, n.w, n.b, N, C, s);
    else
      gpu::rmsnorm_forward(out, nullptr, nullptr, inp, nullptr, n.w, N, C, s);
  };
  unsigned char* const shared = im.shared;
  const SharedSizes& z = im.sizes;
  const bool acc = !overwrite;  // the Linear weight gradients: add, or write after zero_grad
  // dW [OC, K] (+)= doutᵀ · inp, with the bias gradient from the epilogue where gemm_bias
  // gives one. A slope layer's GEMM writes the dense dW into slope_dw, whose kept positions
  // are then gathered into the layer's stored gradient (its bias gradient then comes from
  // column sums).
  auto weight_dw = [&](const Impl::Lin& lin, const char* name, const bf16* dout, const bf16* inp, int K, int OC) {
    if (lin.act) {  // dW = doutᵀ · the input pruned again (the forward's Xs), 2:4 where it can be
      if (!lin.act->sparse_weight_grad_for(N, gemm_bias(lin.db) != nullptr))
        mark(name, n2 * K * OC);
      else if (im.marking())
        mark(std::string("sparse ") + name, n2 * K * OC);
      lin.act->backward(nullptr, lin.dw, gemm_bias(lin.db), dout, inp, nullptr, N, acc, s);
      return;
    }
    mark(name, n2 * K * OC);
    if (lin.sp && lin.sp->sparse_dw() && lin.sp->tokens() == N) {
      // The 2:4 product of the MVUE of doutᵀ (one draw), widened into dW or slope_dw.
      lin.sp->backward(nullptr, lin.slope ? im.slope_dw : lin.dw, dout, inp, !lin.slope && acc, s);
      if (gemm_bias(lin.db)) {
        mark("bias grad");
        gpu::column_sum_add(lin.db, dout, N, OC, im.colsum_scratch, im.colsum_scratch_bytes, s);
      }
      if (lin.slope) {
        im.mark(s, "slope grad gather", 0, im.tracing() ? op_trace_name(name, im.layer) + ".gather" : "");
        gpu::gather_kept_24(lin.dw, im.slope_dw, lin.sp->forward_tile_mask(), OC, K, acc, s);
      }
      return;
    }
    if (!lin.slope) {
      gemm.backward_weight(lin.dw, gemm_bias(lin.db), dout, inp, N, K, OC, acc, s);
      return;
    }
    gemm.backward_weight(im.slope_dw, nullptr, dout, inp, N, K, OC, false, s);
    if (gemm_bias(lin.db)) {
      mark("bias grad");
      gpu::column_sum_add(lin.db, dout, N, OC, im.colsum_scratch, im.colsum_scratch_bytes, s);
    }
    // Traced as part of the Linear's backward ("blocks.3.mlp.fc.bwd.dw.gather").
    im.mark(s, "slope grad gather", 0, im.tracing() ? op_trace_name(name, im.layer) + ".gather" : "");
    gpu::gather_kept_24(lin.dw, im.slope_dw, lin.sp->forward_tile_mask(), OC, K, acc, s);
  };
  // The same plus a slope adapter's gradients (zero_grad zeroes them; they always add):
  // dL += doutᵀ · T (the forward's), dR += dTᵀ · inp.
  auto linear_dw = [&](const Impl::Lin& lin, const char* name, const bf16* dout, const bf16* inp, int K, int OC) {
    weight_dw(lin, name, dout, inp, K, OC);
    if (lin.mask) {  // masked: pruned weights get no gradient
      mark("masked grad");
      Impl::apply_mask(lin.dw, lin, OC, K, s);
    }
    if (lin.rank == 0) return;
    const int r = lin.rank;
    im.mark(s, "gemm lora dW", n2 * r * (K + 2 * OC), im.tracing() ? op_trace_name(name, im.layer) + ".lora" : "");
    const bf16* dt = im.adapter_dt(lin, dout, N, OC, s);
    gemm.backward_weight(lin.dlora_l, nullptr, dout, lin.lora_t, N, r, OC, true, s);
    gemm.backward_weight(lin.dlora_r, nullptr, dt, inp, N, K, r, true, s);
  };

  im.lora_dt_of = nullptr;  // lora_dt holds a dT of the last micro-batch
  mark("memset dres");
  CUDA_CHECK(cudaMemsetAsync(dres, 0, sizeof(bf16) * size_t(N) * C, s));
  norm_bwd(im.nf, im.res_f, im.lnf_mean, im.lnf_rstd, im.blocks.back().mproj.db);  // dln holds dlnf from the head
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    im.layer = l;
    auto& L = im.layers[l];
    const auto& blk = im.blocks[l];
    // MLP half: dres = d(res_out) = d(res_mid) through the residual.
    const bf16* ln2 = L.ln2;
    if (cfg_.mlp == MlpKind::gelu) {
      bf16* dfc = reinterpret_cast<bf16*>(shared);
      linear_dw(blk.mproj, "gemm mproj dW", dres, L.act, H, C);
      linear_dx(blk.mproj, "gemm mproj dX (+dgelu)", dfc, dres, H, C, L.fc);  // dfc = (dres · Wmproj) ∘ gelu'(fc)
      if (rc) {
        bf16* t = reinterpret_cast<bf16*>(shared + z.gelu_dfc);
        norm_again(blk.n2, t, L.res_mid);
        ln2 = t;
      }
      linear_dw(blk.fc, "gemm fc dW", dfc, ln2, C, F);
      bias_sum(blk.fc.db, dfc, F);
      linear_dx(blk.fc, "gemm fc dX", dln, dfc, C, F);
    } else {
      // dact, then (recompute) the activation over it, then ln2; dfc replaces fc.
      bf16* dact = reinterpret_cast<bf16*>(shared);
      linear_dx(blk.mproj, "gemm mproj dX", dact, dres, H, C);
      bf16* act_out = rc ? dact : nullptr;
      if (cfg_.mlp == MlpKind::swiglu) {
        mark("swiglu bwd");
        gpu::fused_swiglu_backward(L.fc, act_out, L.fc, dact, N, H, s);
      } else {
        mark("relu2 bwd");
        gpu::fused_relu2_backward(L.fc, act_out, L.fc, dact, int64_t(N) * H, s);
      }
      linear_dw(blk.mproj, "gemm mproj dW", dres, rc ? act_out : L.act, H, C);
      if (rc) {
        bf16* t = reinterpret_cast<bf16*>(shared);
        norm_again(blk.n2, t, L.res_mid);
        ln2 = t;
      }
      const bf16* dfc = L.fc;
      linear_dw(blk.fc, "gemm fc dW", dfc, ln2, C, F);
      bias_sum(blk.fc.db, dfc, F);
      linear_dx(blk.fc, "gemm fc dX", dln, dfc, C, F);
    }
    norm_bwd(blk.n2, L.res_mid, L.ln2_mean, L.ln2_rstd, blk.proj.db);
    // Attention half: dres = d(res_mid) = d(res_in) through the residual. dqkv and datty
    // go into the layer's fc storage (dead now) when they fit, else into the shared region.
    unsigned char* region = z.attn_in_fc ? reinterpret_cast<unsigned char*>(L.fc) : shared;
    bf16* dqkv = reinterpret_cast<bf16*>(region);
    bf16* datty = reinterpret_cast<bf16*>(region + z.dqkv);
    void* ws = z.attn_in_fc ? shared : shared + z.dqkv + z.datty_slot;
    linear_dw(blk.proj, "gemm proj dW", dres, L.atty, AC, C);
    linear_dx(blk.proj, "gemm proj dX", datty, dres, AC, C);
    mark("attention bwd", 5.0 * B * NH * double(T) * T * HD);
    gpu::attention_backward(dqkv, datty, L.qkv, L.atty, L.lse, B, T, NH, KV, HD, ws, z.attn_ws, s, opt_.attention);
    if (cfg_.pos == PosKind::rope) {
      mark("rope bwd");
      gpu::rope_backward(dqkv, B, T, NH, KV, HD, cfg_.rope_theta, s);
    }
    const bf16* ln1 = L.ln1;
    if (rc) {
      norm_again(blk.n1, datty, L.res_in);  // datty is dead after the attention backward
      ln1 = datty;
    }
    linear_dw(blk.qkv, "gemm qkv dW", dqkv, ln1, C, Q);
    bias_sum(blk.qkv.db, dqkv, Q);
    linear_dx(blk.qkv, "gemm qkv dX", dln, dqkv, C, Q);
    norm_bwd(blk.n1, L.res_in, L.ln1_mean, L.ln1_rstd, l > 0 ? im.blocks[l - 1].mproj.db : nullptr);
  }
  im.layer = -1;
  mark("embedding bwd");
  gpu::embedding_backward(im.dwte, im.dwpe, dres, tokens, B, T, C, V, im.emb_ws, im.emb_ws_bytes, s);
}

// --- optimizer ------------------------------------------------------------------------------

namespace {

// The block Linear named by its weight ("blocks.3.mlp.fc.weight"), or null.
GpuTransformer::Impl::Lin* find_linear(GpuTransformer::Impl& im, const std::string& weight_name) {
  static const std::pair<const char*, GpuTransformer::Impl::Lin GpuTransformer::Impl::Block::*> kSuffixes[] = {
      {".attn.qkv.weight", &GpuTransformer::Impl::Block::qkv},
      {".attn.proj.weight", &GpuTransformer::Impl::Block::proj},
      {".mlp.fc.weight", &GpuTransformer::Impl::Block::fc},
      {".mlp.proj.weight", &GpuTransformer::Impl::Block::mproj}};
  if (weight_name.rfind("blocks.", 0) != 0) return nullptr;
  const size_t dot = weight_name.find('.', 7);
  if (dot == std::string::npos || dot == 7) return nullptr;
  const std::string index = weight_name.substr(7, dot - 7);
  if (index.find_first_not_of("0123456789") != std::string::npos || index.size() > 6) return nullptr;
  const size_t l = std::stoul(index);
  if (l >= im.blocks.size()) return nullptr;
  for (const auto& [suffix, member] : kSuffixes)
    if (weight_name.compare(dot, std::string::npos, suffix) == 0) return &(im.blocks[l].*member);
  return nullptr;
}

}  // namespace

void GpuTransformer::adamw_body() {
  Impl& im = *impl_;
  // Over the storage layout: a slope layer's kept values only (the CPU's sparse AdamW).
  im.mark(stream_, "grad norm");
  gpu::sum_squares(norm_sq_, im.grad, int64_t(nstored_), im.gnorm_scratch, stream_);
  im.mark(stream_, "adamw");
  gpu::adamw_update_split(*im.adamw, im.w, im.w_lo, im.m, im.v, im.grad, im.adam_params, norm_sq_, im.head_pad,
                          stream_);
  if (!im.masks.empty()) im.mark(stream_, "masked weights");
  mask_weights();
  prepare_sparse();
}

void GpuTransformer::mask_weights() {
  Impl& im = *impl_;
  // Neither weight decay nor moments from before a mask change revive a pruned weight.
  for (const auto& [name, m] : im.masks) {
    const Impl::Lin& lin = *find_linear(im, name);
    const ptrdiff_t at = lin.w - im.w;
    Impl::apply_mask(im.w + at, lin, m.out, m.in, stream_, im.w_lo + at);
  }
}

void GpuTransformer::prepare_sparse() {
  Impl& im = *impl_;
  if (im.sparse.empty()) return;
  size_t k = 0;  // index into im.refreshing, in im.slope's (= im.sparse's) order
  for (auto& [name, sp] : im.sparse) {
    im.layer = layer_of(name);
    im.mark(stream_, "sparse prepare (2:4 prune + compress)", 0, im.tracing() ? module_of(name) + ".sparsify" : "");
    if (sp->kind() == gpu::SparseLinearKind::slope) {
      // From the stored kept values in one pass; a refresh (or the library's layouts)
      // needs the dense W1.
      const Impl::Lin& lin = *find_linear(im, name);
      const bool refresh = k < im.refreshing.size() && im.refreshing[k++];
      if (lin.dense_products && !refresh) continue;  // its products expand W1 and W2ᵀ themselves
      if (refresh || !sp->prepare_from_kept(lin.w, stream_)) {
        im.expand_w1(lin, stream_);
        sp->prepare(stream_, refresh);
      }
    } else {
      sp->prepare(stream_);
    }
  }
  im.layer = -1;
}

// --- Linear kinds ---------------------------------------------------------------------------

namespace {

// Median time of the separate GELU pass over n values (forward, or the gradient given the
// pre-activation), on scratch buffers; synchronises the stream.
double time_gelu_pass(int64_t n, bool forward, cudaStream_t s) {
  DeviceArena scratch(2 * sizeof(bf16) * size_t(n) + 2 * DeviceArena::kDefaultAlignment, "GELU timing");
  bf16* a = scratch.allocate_array<bf16>("a", size_t(n));
  bf16* b = scratch.allocate_array<bf16>("b", size_t(n));
  CUDA_CHECK(cudaMemsetAsync(a, 0x3C, sizeof(bf16) * size_t(n), s));
  CUDA_CHECK(cudaMemsetAsync(b, 0x3B, sizeof(bf16) * size_t(n), s));
  return median_event_ms(
      [&](int) {
        if (forward)
          gpu::gelu_forward(b, a, n, s);
        else
          gpu::gelu_backward(b, a, b, n, false, s);
      },
      2, 5, s);
}

// Both ways of a slope layer's per-step products (median of 10 after two untimed rounds
// that tune them) on scratch inputs: the 2:4 way as prepare_sparse and the step run it
// (both compressed copies from the kept values, or W1 expanded and compressed; the forward
// and dX 2:4 products), the dense way as a layer with dense products runs it (W1 expanded
// for cuBLASLt's forward, W1 and W2ᵀ again for its dX). The 2:4 way runs last, so the
// layer's compressed copies are its weight's afterwards. Synchronises the stream.
gpu::SparseLinear::ProductTimes time_slope_products(GpuTransformer::Impl& im, const GpuTransformer::Impl::Lin& lin,
                                                    cudaStream_t s) {
  gpu::SparseLinear& sp = *lin.sp;
  const int N = static_cast<int>(sp.tokens()), out = static_cast<int>(sp.out_features()),
            in = static_cast<int>(sp.in_features());
  const size_t nx = size_t(N) * size_t(in), ny = size_t(N) * size_t(out);
  DeviceArena scratch(2 * sizeof(bf16) * (nx + ny) + 4 * DeviceArena::kDefaultAlignment, "slope dispatch timing");
  bf16* x = scratch.allocate_array<bf16>("x", nx);
  bf16* dx = scratch.allocate_array<bf16>("dx", nx);
  bf16* y = scratch.allocate_array<bf16>("y", ny);
  bf16* dy = scratch.allocate_array<bf16>("dy", ny);
  CUDA_CHECK(cudaMemsetAsync(x, 0x3C, sizeof(bf16) * nx, s));  // non-zero inputs: no shortcuts
  CUDA_CHECK(cudaMemsetAsync(dy, 0x3B, sizeof(bf16) * ny, s));
  gpu::SparseLinear::ProductTimes t;
  t.dense_ms = median_event_ms(
      [&](int) {
        im.gemm->forward(y, x, im.expand_w1(lin, s), lin.b, N, in, out, s);
        im.expand_w1(lin, s);
        im.gemm->forward(dx, dy, sp.refill_backward_weight_t(s), nullptr, N, out, in, s);
      },
      2, 10, s);
  t.sparse_ms = median_event_ms(
      [&](int) {
        if (!sp.prepare_from_kept(lin.w, s)) {
          im.expand_w1(lin, s);
          sp.prepare(s, false);
        }
        sp.forward(y, x, s, lin.b);
        sp.backward(dx, nullptr, dy, nullptr, false, s);
      },
      2, 10, s);
  return t;
}

// Masks given for a slope layer [out, in] (GpuTransformer::SlopeState) that the layer can
// take: the forward one row-wise 2:4 (exactly 2 of every 4 along each row: the kept values
// fill [out, in/2]), the backward one inside it with at most 2 of every 4 down each column.
void check_slope_masks(const std::string& weight_name, const GpuTransformer::SlopeState& st, int64_t out, int64_t in) {
  const int64_t groups = in / 4;
  const size_t tiles = size_t(out / 4) * size_t(groups);
  ESPLAG_CHECK(st.forward_tiles.size() == tiles && st.backward_tiles.size() == tiles, "GpuTransformer: ", weight_name,
               ": slope masks of ", st.forward_tiles.size(), " and ", st.backward_tiles.size(), " tiles for a ", out,
               "x", in, " weight (", tiles, " tiles)");
  for (size_t t = 0; t < tiles; ++t) {
    const unsigned f = st.forward_tiles[t], b = st.backward_tiles[t];
    bool ok = (b & ~f) == 0;
    for (int j = 0; j < 4 && ok; ++j)  // rows of the forward mask, columns of the backward one
      ok = std::popcount((f >> (4 * j)) & 0xFu) == 2 && std::popcount(b & (0x1111u << j)) <= 2;
    ESPLAG_CHECK(ok, "GpuTransformer: ", weight_name, ": slope mask tile ", t, " (row ", t / groups * 4, ", column ",
                 t % groups * 4, ") is not 2:4 (forward 0x", std::hex, f, ", backward 0x", b, std::dec,
                 "; the forward mask keeps exactly 2 of every 4 along each row, the backward one lies inside it, "
                 "2 of every 4 down each column)");
  }
}

}  // namespace

void GpuTransformer::set_linear_kinds(const std::vector<LinearKindSetting>& settings) {
  Impl& im = *impl_;
  // Everything is checked before anything changes.
  struct Change {
    const LinearKindSetting* setting;
    Impl::Lin* lin;
    const ParamInfo* info;  // the weight's, in the flat layout
    std::string was;
    int64_t out, in;
  };
  std::vector<Change> changes;
  bool relayout = false;  // the set of slope layers (or a slope layer's masks) changes
  bool lora_change = false;  // an adapter comes, goes or changes its rank
  for (const auto& st : settings) {
    Impl::Lin* lin = find_linear(im, st.weight_name);
    ESPLAG_CHECK(lin, "GpuTransformer: '", st.weight_name, "' is not the weight of a block Linear layer");
    const bool masked = st.kind == "masked" || st.kind == "vnm";
    const bool activation = st.kind == "semi_sparse_activation";
    ESPLAG_CHECK(st.kind == "dense" || masked || activation || st.kind == "semi_sparse" || st.kind == "slope",
                 "GpuTransformer: ", st.weight_name, ": Linear kind '", st.kind,
                 "' is not available on the GPU (dense, masked, vnm, semi_sparse, semi_sparse_activation and slope "
                 "are)");
    ESPLAG_CHECK(!st.slope_masks || st.kind == "slope", "GpuTransformer: ", st.weight_name, ": masks given for kind ",
                 st.kind);
    const ParamInfo* info = &info_named(infos_, st.weight_name);
    const int64_t out = info->shape.at(0), in = info->shape.at(1);
    if (st.slope_masks) check_slope_masks(st.weight_name, *st.slope_masks, out, in);
    ESPLAG_CHECK(!st.mask || masked, "GpuTransformer: ", st.weight_name, ": a mask given for kind ", st.kind);
    ESPLAG_CHECK(!st.mask || st.mask->size() == size_t(out) * size_t(in), "GpuTransformer: ", st.weight_name,
                 ": a mask of ", st.mask ? st.mask->size() : 0, " entries for a ", out, "x", in, " weight");
    ESPLAG_CHECK(st.lora_rank == 0 || st.kind == "slope", "GpuTransformer: ", st.weight_name,
                 ": a low-rank adapter (lora_rank ", st.lora_rank, ") is for kind slope only, not ", st.kind);
    ESPLAG_CHECK(st.lora_rank >= 0 && st.lora_rank <= std::min(out, in), "GpuTransformer: ", st.weight_name,
                 ": adapter rank ", st.lora_rank, " is outside [0, min(out, in) = ", std::min(out, in), "]");
    lora_change = lora_change || st.lora_rank != lora_rank(st.weight_name);
    const std::string was = linear_kind(st.weight_name);
    const int64_t tokens = int64_t(max_b_) * max_t_;
    ESPLAG_CHECK(!st.sparse_dw || st.kind == "semi_sparse" || st.kind == "slope", "GpuTransformer: ", st.weight_name,
                 ": sparse_dw (the weight gradient from the MVUE 2:4 of dY^T) is for the kinds semi_sparse and slope");
    ESPLAG_CHECK(!st.sparse_dw || (out % 64 == 0 && tokens % 64 == 0), "GpuTransformer: ", st.weight_name,
                 ": sparse_dw needs the layer's outputs (", out, ") and the micro-batch's tokens (", tokens,
                 ") to be multiples of 64");
    if (st.kind == was && !st.slope_masks && !st.mask && st.sparse_dw == (lin->sp && lin->sp->sparse_dw()) &&
        (!activation || lin->act->pattern() == st.activation))
      continue;
    ESPLAG_CHECK(!masked || st.mask, "GpuTransformer: ", st.weight_name, ": kind ", st.kind,
                 " needs its mask (LinearKindSetting::mask)");
    ESPLAG_CHECK(!activation || in % 4 == 0, "GpuTransformer: ", st.weight_name, ": semi_sparse_activation needs ",
                 "the layer's input features (", in, ") to be a multiple of 4 (2:4 groups of the input)");
    if (masked || activation) {  // dense products of the masked weight; the input pruned
      changes.push_back({&st, lin, info, was, out, in});
      relayout = relayout || was == "slope";
      continue;
    }
    ESPLAG_CHECK(st.kind == "dense" || gpu::cusparselt_available(), "GpuTransformer: ", st.weight_name, ": ", st.kind,
                 " on the GPU needs cuSPARSELt: ", gpu::cusparselt_unavailable_reason());
    ESPLAG_CHECK(st.kind == "dense" || (out % 16 == 0 && in % 16 == 0 && tokens % 16 == 0),
                 "GpuTransformer: ", st.weight_name, ": ", st.kind, " needs the layer's shape (", out, "x", in,
                 ") and the micro-batch's tokens (", tokens, ") to be multiples of 16 (cuSPARSELt)");
    relayout = relayout || was == "slope" || st.kind == "slope";
    changes.push_back({&st, lin, info, was, out, in});
  }
  // A slope layer rebuilt as slope (sparse_dw turned on or off) keeps its masks unless
  // given new ones: its weight is stored as kept values, so they cannot be chosen again.
  std::vector<LinearKindSetting> kept_masks;
  std::vector<SlopeState> kept_states;
  kept_masks.reserve(changes.size());
  kept_states.reserve(changes.size());  // no reallocation: the settings point into it
  for (Change& c : changes)
    if (c.was == "slope" && c.setting->kind == "slope" && !c.setting->slope_masks) {
      kept_states.push_back(slope_state(c.setting->weight_name));
      kept_masks.push_back(*c.setting);
      kept_masks.back().slope_masks = &kept_states.back();
      c.setting = &kept_masks.back();
    }
  for (const auto& st : settings)
    if (auto it = im.slope.find(st.weight_name); it != im.slope.end() && st.kind == "slope")
      it->second.mask_change_freq = st.mask_change_freq;
  if (changes.empty() && !lora_change) return;
  relayout = relayout || lora_change;
  synchronize();  // nothing queued may still use a layer that goes away

  // A new layout: the state goes to the host in the flat layout and comes back into the
  // new one. slope trains other tensors than the dense weight (the CPU's "<weight>.values"):
  // its moments start from zero whenever the layer becomes or stops being slope, as the
  // CPU trainer's do for a tensor it has not seen.
  std::vector<float> params, m, v;
  std::map<std::string, LoraState> kept_lora;  // the adapters there are now
  if (relayout) {
    params = params_to_host();
    optimizer_state_to_host(m, v);
    for (const auto& [weight, rank] : im.lora) kept_lora[weight] = lora_state(weight);
  }
  for (const Change& c : changes) {
    if (relayout && (c.was == "slope") != (c.setting->kind == "slope")) {
      std::fill_n(m.begin() + ptrdiff_t(c.info->offset), c.info->numel, 0.f);
      std::fill_n(v.begin() + ptrdiff_t(c.info->offset), c.info->numel, 0.f);
    }
    c.lin->sp = nullptr;
    c.lin->act = nullptr;
    c.lin->slope = false;
    c.lin->dense_products = false;
    c.lin->mask = nullptr;
    im.masks.erase(c.setting->weight_name);
    im.sparse.erase(c.setting->weight_name);
    im.activation.erase(c.setting->weight_name);
    im.slope.erase(c.setting->weight_name);
  }

  // New slope layers, before the new layout (it gathers their kept values by their masks).
  for (const Change& c : changes) {
    const LinearKindSetting& st = *c.setting;
    if (st.kind != "slope") continue;
    if (im.slope_scratch.capacity() == 0) {
      size_t largest = 0;
      for (const auto& i : infos_)
        if (find_linear(im, i.name)) largest = std::max(largest, i.numel);
      const size_t a = DeviceArena::kDefaultAlignment;
      im.slope_scratch = DeviceArena(3 * (sizeof(bf16) * largest + a) + sizeof(float) * largest + a, "slope scratch");
      im.slope_w2 = im.slope_scratch.allocate_array<bf16>("W2, W2^T", 2 * largest);
      im.slope_w1 = im.slope_scratch.allocate_array<bf16>("W1", largest);
      im.slope_dw = im.slope_scratch.allocate_array<float>("dW", largest);
    }
    gpu::SparseLinearOptions o;
    o.kind = gpu::SparseLinearKind::slope;
    o.bias = c.lin->b != nullptr;
    o.slope_scratch = im.slope_w2;
    o.slope_weight_is_w1 = true;  // the layer reads slope_w1, expanded from the kept values
    o.sparse_dw = st.sparse_dw;
    o.dw_seed = st.dw_seed;
    if (st.sparse_dw) o.dw_scratch = im.dw_scratch_for(*this, int64_t(max_b_) * max_t_);
    // The masks come from W as it is now (dense: the layer was not slope), the forward one
    // row-wise 2:4, the backward one W1's double pruning, unless given.
    const size_t n_w = size_t(c.out) * size_t(c.in);
    if (st.slope_masks)
      CUDA_CHECK(cudaMemsetAsync(im.slope_w1, 0, sizeof(bf16) * n_w, stream_));
    else
      CUDA_CHECK(cudaMemcpyAsync(im.slope_w1, c.lin->w, sizeof(bf16) * n_w, cudaMemcpyDeviceToDevice, stream_));
    c.lin->sp = im.sparse
                    .emplace(st.weight_name, std::make_unique<gpu::SparseLinear>(
                                                 o, c.out, c.in, int64_t(max_b_) * max_t_, im.slope_w1, stream_))
                    .first->second.get();
    c.lin->slope = true;
    if (st.sparse_dw) c.lin->sp->set_dw_seed(st.dw_seed, st.dw_draws);
    if (st.slope_masks)
      c.lin->sp->set_tile_masks(st.slope_masks->forward_tiles.data(), st.slope_masks->backward_tiles.data(), stream_);
    im.slope[st.weight_name] = Impl::Slope{st.mask_change_freq, st.slope_masks ? st.slope_masks->refresh_step : step_};
  }
  // The adapters of the new layout and the scratch their products share.
  std::map<std::string, uint64_t> lora_seeds;
  for (const auto& st : settings) {
    if (st.lora_rank > 0)
      im.lora[st.weight_name] = st.lora_rank;
    else
      im.lora.erase(st.weight_name);
    lora_seeds[st.weight_name] = st.lora_seed;
  }
  const size_t tokens = size_t(max_b_) * max_t_;
  int max_rank = 0;
  size_t lora_bytes = 0;
  for (const auto& [weight, rank] : im.lora) {
    max_rank = std::max(max_rank, rank);
    lora_bytes += aligned(sizeof(bf16) * tokens * size_t(rank));
  }
  lora_bytes += aligned(sizeof(bf16) * tokens * size_t(max_rank));
  for (auto& blk : im.blocks)
    for (Impl::Lin* lin : {&blk.qkv, &blk.proj, &blk.fc, &blk.mproj}) lin->lora_t = nullptr;
  im.lora_scratch = DeviceArena();
  im.lora_dt = nullptr;
  im.lora_dt_of = nullptr;
  if (max_rank > 0) {
    im.lora_scratch = DeviceArena(lora_bytes, "low-rank adapter T and dT");
    for (const auto& [weight, rank] : im.lora)
      find_linear(im, weight)->lora_t = im.lora_scratch.allocate_array<bf16>(weight + " T", tokens * size_t(rank));
    im.lora_dt = im.lora_scratch.allocate_array<bf16>("dT", tokens * size_t(max_rank));
  }
  if (relayout) {
    const int64_t steps = step_;
    lay_out_state();
    set_params(params.data(), params.size());  // also prepares every sparse layer
    set_optimizer_state(m.data(), v.data(), m.size(), steps);
    for (const auto& [weight, rank] : im.lora) {
      auto kept = kept_lora.find(weight);
      if (kept != kept_lora.end() && kept->second.rank == rank) {
        set_lora_state(weight, kept->second);
        continue;
      }
      const ParamInfo& info = info_named(infos_, weight);
      LoraState fresh;  // as SlopeLinear::enable_lora starts one
      fresh.rank = rank;
      fresh.l = SlopeLinear<float>::initial_lora_l(info.shape.at(0), rank, lora_seeds.at(weight));
      fresh.r.assign(size_t(rank) * size_t(info.shape.at(1)), 0.f);
      set_lora_state(weight, fresh);
    }
  }

  // A layer that becomes or stops being vnm trains another tensor on the CPU (its kept
  // values, "<weight>.values"): its moments start from zero, as the CPU trainer's do.
  for (const Change& c : changes)
    if ((c.was == "vnm") != (c.setting->kind == "vnm")) {
      const ParamInfo& at = info_named(im.stored, c.setting->weight_name);
      CUDA_CHECK(cudaMemsetAsync(im.m + at.offset, 0, sizeof(float) * at.numel, stream_));
      CUDA_CHECK(cudaMemsetAsync(im.v + at.offset, 0, sizeof(float) * at.numel, stream_));
    }
  // New masked and vnm layers: the mask as bits, and the weight masked at once.
  for (const Change& c : changes) {
    if (c.setting->kind != "masked" && c.setting->kind != "vnm") continue;
    const int64_t words = (c.in + 31) / 32;
    std::vector<uint32_t> bits(size_t(c.out * words), 0u);
    const std::vector<uint8_t>& mask = *c.setting->mask;
    parallel_for(c.out, [&](int64_t o0, int64_t o1) {  // rows own their words
      for (int64_t o = o0; o < o1; ++o)
        for (int64_t i = 0; i < c.in; ++i)
          if (mask[size_t(o * c.in + i)]) bits[size_t(o * words + i / 32)] |= 1u << (i % 32);
    });
    Impl::Masked& m = im.masks[c.setting->weight_name];
    m.kind = c.setting->kind;
    m.out = c.out;
    m.in = c.in;
    m.bits = DeviceArena(sizeof(uint32_t) * bits.size() + DeviceArena::kDefaultAlignment, "mask bits");
    uint32_t* dev = m.bits.allocate_array<uint32_t>("bits", bits.size());
    CUDA_CHECK(cudaMemcpy(dev, bits.data(), sizeof(uint32_t) * bits.size(), cudaMemcpyHostToDevice));
    c.lin->mask = dev;
  }
  mask_weights();

  // Per-layer dispatch: whether layers of `kind` and this one's shape run their 2:4
  // products, timed (`time`) for the first of them. With a GELU MLP, fc's forward and
  // mproj's dX carry a GELU pass on the 2:4 path (over fc's output, [tokens, out] of fc =
  // [tokens, in] of mproj), timed and counted against it.
  auto sparse_is_faster = [&](const std::string& kind, const std::string& weight_name, int64_t out, int64_t in,
                              const std::function<gpu::SparseLinear::ProductTimes()>& time) {
    const int64_t tokens = int64_t(max_b_) * max_t_;
    const bool is_fc = weight_name.find(".mlp.fc.") != std::string::npos;
    // semi_sparse_activation's dX is cuBLASLt's, with the GELU gradient in its epilogue.
    const bool gelu_pass = cfg_.mlp == MlpKind::gelu && weight_name.find(".mlp.") != std::string::npos &&
                           (is_fc || kind != "semi_sparse_activation");
    auto it = std::find_if(im.dispatch.begin(), im.dispatch.end(), [&](const SparseDispatch& d) {
      return d.kind == kind && d.out == out && d.in == in && d.tokens == tokens && d.gelu_pass == gelu_pass;
    });
    if (it == im.dispatch.end()) {
      const gpu::SparseLinear::ProductTimes t = time();
      const double extra = gelu_pass ? time_gelu_pass(tokens * (is_fc ? out : in), is_fc, stream_) : 0.0;
      im.dispatch.push_back(
          {kind, out, in, tokens, gelu_pass, t.sparse_ms + extra, t.dense_ms, t.sparse_ms + extra < t.dense_ms});
      it = im.dispatch.end() - 1;
    }
    return it->sparse;
  };
  if (opt_.sparse_dispatch)  // the new slope layers, now that their kept values are stored
    for (const Change& c : changes)
      if (c.setting->kind == "slope")
        c.lin->dense_products = !sparse_is_faster("slope", c.setting->weight_name, c.out, c.in,
                                                  [&] { return time_slope_products(im, *c.lin, stream_); });

  // New semi_sparse layers, which read the weight where it now lives.
  for (const Change& c : changes) {
    const LinearKindSetting& st = *c.setting;
    if (st.kind != "semi_sparse") continue;
    const int64_t out = c.out, in = c.in, tokens = int64_t(max_b_) * max_t_;
    gpu::SparseLinearOptions o;
    o.kind = gpu::SparseLinearKind::semi_sparse;
    o.bias = c.lin->b != nullptr;
    o.keep_pruned = false;  // dense_weight prunes on demand
    o.sparse_dw = st.sparse_dw;
    o.dw_seed = st.dw_seed;
    if (st.sparse_dw) o.dw_scratch = im.dw_scratch_for(*this, tokens);
    auto sp = std::make_unique<gpu::SparseLinear>(o, out, in, tokens, c.lin->w, stream_);
    if (st.sparse_dw) sp->set_dw_seed(st.dw_seed, st.dw_draws);
    if (opt_.sparse_dispatch)
      sp->use_dense_products(
          !sparse_is_faster("semi_sparse", st.weight_name, out, in, [&] { return sp->time_products(stream_); }));
    sp->prepare(stream_);
    const size_t w_bytes = sizeof(bf16) * size_t(out) * size_t(in);
    if (!sp->pruned_weight() && im.prune_scratch.capacity() < w_bytes + DeviceArena::kDefaultAlignment)
      im.prune_scratch = DeviceArena(w_bytes + DeviceArena::kDefaultAlignment, "semi_sparse pruning scratch");
    c.lin->sp = sp.get();
    im.sparse[st.weight_name] = std::move(sp);
  }
  // New semi_sparse_activation layers: their shared scratch (for the largest block Linear
  // and the pattern needing more, tile_24, made with the first of them), and the dispatch.
  for (const Change& c : changes) {
    const LinearKindSetting& st = *c.setting;
    if (st.kind != "semi_sparse_activation") continue;
    const int64_t tokens = int64_t(max_b_) * max_t_;
    if (im.activation_scratch.capacity() == 0) {
      size_t largest = 0;
      for (const auto& i : infos_)
        if (find_linear(im, i.name))
          largest = std::max(largest, gpu::sparse_activation_scratch_bytes(i.shape.at(0), i.shape.at(1), tokens,
                                                                            ActivationSparsity::tile_24));
      im.activation_scratch = DeviceArena(largest + DeviceArena::kDefaultAlignment, "semi_sparse_activation scratch");
    }
    gpu::SparseActivationLinearOptions o;
    o.pattern = st.activation;
    o.bias = c.lin->b != nullptr;
    o.scratch = im.activation_scratch.base();
    o.gemm = im.gemm.get();
    auto act = std::make_unique<gpu::SparseActivationLinear>(o, c.out, c.in, tokens);
    if (opt_.sparse_dispatch && act->sparse())
      act->use_dense_products(!sparse_is_faster("semi_sparse_activation", st.weight_name, c.out, c.in,
                                                [&] { return act->time_products(c.lin->w, stream_); }));
    c.lin->act = act.get();
    im.activation[st.weight_name] = std::move(act);
  }
  if (im.activation.empty()) im.activation_scratch = DeviceArena();
  // Scratch nobody needs any more.
  const bool any_semi = std::any_of(im.sparse.begin(), im.sparse.end(), [](const auto& e) {
    return e.second->kind() == gpu::SparseLinearKind::semi_sparse;
  });
  if (!any_semi) im.prune_scratch = DeviceArena();
  if (std::none_of(im.sparse.begin(), im.sparse.end(), [](const auto& e) { return e.second->sparse_dw(); })) {
    im.dw_scratch = DeviceArena();
    im.dw_buffers = nullptr;
  }
  if (im.slope.empty()) {
    im.slope_scratch = DeviceArena();
    im.slope_w1 = im.slope_w2 = nullptr;
    im.slope_dw = nullptr;
  }
  // The captured steps baked the old products in.
  im.step_graphs.clear();
  im.adam_graphs.clear();
  synchronize();
}

std::string GpuTransformer::linear_kind(const std::string& weight_name) const {
  Impl::Lin* lin = find_linear(*impl_, weight_name);
  ESPLAG_CHECK(lin, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  if (lin->mask) return impl_->masks.at(weight_name).kind;
  if (lin->act) return "semi_sparse_activation";
  return lin->slope ? "slope" : lin->sp ? "semi_sparse" : "dense";
}

ActivationSparsity GpuTransformer::activation_sparsity(const std::string& weight_name) const {
  Impl::Lin* lin = find_linear(*impl_, weight_name);
  ESPLAG_CHECK(lin && lin->act, "GpuTransformer: ", weight_name, " is not a semi_sparse_activation layer");
  return lin->act->pattern();
}

GpuTransformer::SlopeState GpuTransformer::slope_state(const std::string& weight_name) const {
  const Impl& im = *impl_;
  auto it = im.slope.find(weight_name);
  ESPLAG_CHECK(it != im.slope.end(), "GpuTransformer: ", weight_name, " is not a slope layer");
  const gpu::SparseLinear& sp = *im.sparse.at(weight_name);
  const size_t tiles = size_t(sp.out_features() / 4) * size_t(sp.in_features() / 4);
  SlopeState st;
  st.forward_tiles.resize(tiles);
  st.backward_tiles.resize(tiles);
  CUDA_CHECK(cudaMemcpyAsync(st.forward_tiles.data(), sp.forward_tile_mask(), 2 * tiles, cudaMemcpyDeviceToHost,
                             stream_));
  CUDA_CHECK(cudaMemcpyAsync(st.backward_tiles.data(), sp.backward_tile_mask(), 2 * tiles, cudaMemcpyDeviceToHost,
                             stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  // A refresh over zero-valued W1 entries may keep pruned positions (ties among zeros):
  // their W2 is 0 either way, and the mask reported stays inside the forward one.
  for (size_t t = 0; t < tiles; ++t) st.backward_tiles[t] &= st.forward_tiles[t];
  st.refresh_step = it->second.refresh_step;
  st.mask_change_freq = it->second.mask_change_freq;
  return st;
}

int GpuTransformer::lora_rank(const std::string& weight_name) const {
  ESPLAG_CHECK(find_linear(*impl_, weight_name), "GpuTransformer: '", weight_name,
               "' is not the weight of a block Linear layer");
  const auto it = impl_->lora.find(weight_name);
  return it == impl_->lora.end() ? 0 : it->second;
}

namespace {

// The storage layout's entries of a layer's adapter: L, then R.
std::pair<const ParamInfo*, const ParamInfo*> lora_entries(const std::vector<ParamInfo>& stored,
                                                           const std::string& weight_name) {
  const std::string module = module_of(weight_name);
  return {&info_named(stored, module + ".lora_l"), &info_named(stored, module + ".lora_r")};
}

}  // namespace

GpuTransformer::LoraState GpuTransformer::lora_state(const std::string& weight_name) const {
  const int rank = lora_rank(weight_name);
  ESPLAG_CHECK(rank > 0, "GpuTransformer: ", weight_name, " has no low-rank adapter");
  const auto [l, r] = lora_entries(impl_->stored, weight_name);
  LoraState st;
  st.rank = rank;
  for (const auto& [info, value, m, v, grad] :
       {std::tuple{l, &st.l, &st.m_l, &st.v_l, &st.grad_l}, std::tuple{r, &st.r, &st.m_r, &st.v_r, &st.grad_r}})
    for (const auto& [field, out] : {std::pair{StateField::weight, value}, std::pair{StateField::m, m},
                                     std::pair{StateField::v, v}, std::pair{StateField::grad, grad}}) {
      out->resize(info->numel);
      stored_to_host(field, info->offset, info->numel, out->data());
    }
  return st;
}

void GpuTransformer::set_lora_state(const std::string& weight_name, const LoraState& st) {
  const int rank = lora_rank(weight_name);
  ESPLAG_CHECK(rank > 0 && st.rank == rank, "GpuTransformer: ", weight_name, ": adapter of rank ", st.rank,
               " given for a layer whose adapter has rank ", rank);
  const auto [l, r] = lora_entries(impl_->stored, weight_name);
  for (const auto& [info, value, m, v, what] : {std::tuple{l, &st.l, &st.m_l, &st.v_l, "L"},
                                                std::tuple{r, &st.r, &st.m_r, &st.v_r, "R"}}) {
    ESPLAG_CHECK(value->size() == info->numel && (m->empty() || m->size() == info->numel) &&
                     (v->empty() || v->size() == info->numel),
                 "GpuTransformer: ", weight_name, ": adapter ", what, " of ", value->size(), " values (moments ",
                 m->size(), ", ", v->size(), ") for ", info->numel);
    const std::vector<float> zeros(m->empty() || v->empty() ? info->numel : 0, 0.f);
    stored_from_host(StateField::weight, info->offset, info->numel, value->data());
    stored_from_host(StateField::m, info->offset, info->numel, m->empty() ? zeros.data() : m->data());
    stored_from_host(StateField::v, info->offset, info->numel, v->empty() ? zeros.data() : v->data());
  }
  synchronize();
}

void GpuTransformer::stored_to_host(StateField f, size_t at, size_t n, float* host) const {
  const Impl& im = *impl_;
  if (f == StateField::weight) {  // joined in the shared region, chunk by chunk
    float* stage = reinterpret_cast<float*>(im.shared);
    const size_t chunk = im.sizes.total / sizeof(float);
    for (size_t o = 0; o < n; o += chunk) {
      const size_t k = std::min(chunk, n - o);
      gpu::master_join(stage, im.w + at + o, im.w_lo + at + o, int64_t(k), stream_);
      CUDA_CHECK(cudaMemcpyAsync(host + o, stage, sizeof(float) * k, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  if (f == StateField::grad) settle_zero_grad();
  const float* base = f == StateField::grad ? im.grad : f == StateField::m ? im.m : im.v;
  CUDA_CHECK(cudaMemcpyAsync(host, base + at, sizeof(float) * n, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTransformer::stored_from_host(StateField f, size_t at, size_t n, const float* host) {
  Impl& im = *impl_;
  if (f == StateField::weight) {  // split from the shared region, chunk by chunk
    float* stage = reinterpret_cast<float*>(im.shared);
    const size_t chunk = im.sizes.total / sizeof(float);
    for (size_t o = 0; o < n; o += chunk) {
      const size_t k = std::min(chunk, n - o);
      CUDA_CHECK(cudaMemcpyAsync(stage, host + o, sizeof(float) * k, cudaMemcpyHostToDevice, stream_));
      gpu::master_split(im.w + at + o, im.w_lo + at + o, stage, int64_t(k), stream_);
    }
  } else {
    float* base = f == StateField::grad ? im.grad : f == StateField::m ? im.m : im.v;
    CUDA_CHECK(cudaMemcpyAsync(base + at, host, sizeof(float) * n, cudaMemcpyHostToDevice, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

const std::vector<GpuTransformer::SparseDispatch>& GpuTransformer::sparse_dispatch() const { return impl_->dispatch; }

std::string GpuTransformer::sparse_dispatch_summary() const {
  std::string s;
  for (const std::string kind : {"semi_sparse", "semi_sparse_activation", "slope"}) {
    std::string shapes;
    for (const auto& d : impl_->dispatch) {
      if (d.kind != kind) continue;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s%lldx%lld: %s (2:4 %.3f ms%s, dense %.3f ms)", shapes.empty() ? "" : "; ",
                    static_cast<long long>(d.out), static_cast<long long>(d.in), d.sparse ? "2:4" : "dense",
                    d.sparse_ms, d.gelu_pass ? " with its GELU pass" : "", d.dense_ms);
      shapes += buf;
    }
    if (!shapes.empty())
      s += (s.empty() ? "" : " | ") + kind + " products by layer shape (" +
           (kind == "semi_sparse_activation" ? "input pruning + forward" : "prepare + forward + dX") +
           " per step): " + shapes;
  }
  return s;
}

bool GpuTransformer::sparse_dw(const std::string& weight_name) const {
  Impl::Lin* lin = find_linear(*impl_, weight_name);
  ESPLAG_CHECK(lin, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return lin->sp && lin->sp->sparse_dw();
}

uint64_t GpuTransformer::sparse_dw_draws(const std::string& weight_name) const {
  Impl::Lin* lin = find_linear(*impl_, weight_name);
  ESPLAG_CHECK(lin, "GpuTransformer: '", weight_name, "' is not the weight of a block Linear layer");
  return lin->sp ? lin->sp->dw_draws() : 0;
}

void* GpuTransformer::Impl::dw_scratch_for(const GpuTransformer& model, int64_t tokens) {
  if (!dw_buffers) {
    size_t largest = 0;
    for (const auto& i : model.param_infos())
      if (find_linear(*this, i.name))
        largest = std::max(largest, gpu::sparse_dw_scratch_bytes(i.shape.at(0), i.shape.at(1), tokens));
    dw_scratch = DeviceArena(largest + 256, "sparse_dw scratch");
    dw_buffers = dw_scratch.allocate("sparse_dw buffers", largest, 256);
  }
  return dw_buffers;
}

size_t GpuTransformer::sparse_device_bytes() const {
  size_t n = impl_->prune_scratch.capacity() + impl_->slope_scratch.capacity() + impl_->dw_scratch.capacity() +
             impl_->lora_scratch.capacity();
  for (const auto& [name, m] : impl_->masks) n += m.bits.capacity();
  for (const auto& [name, sp] : impl_->sparse) n += sp->device_bytes();
  n += impl_->activation_scratch.capacity();
  for (const auto& [name, act] : impl_->activation) n += act->device_bytes();
  return n;
}

void GpuTransformer::step_adamw(const GpuAdamW& hyper) {
  Impl& im = *impl_;
  settle_zero_grad();
  gpu::AdamWConfig c;
  c.lr = static_cast<float>(hyper.lr);
  c.beta1 = static_cast<float>(hyper.beta1);
  c.beta2 = static_cast<float>(hyper.beta2);
  c.eps = static_cast<float>(hyper.eps);
  c.weight_decay = static_cast<float>(hyper.weight_decay);
  c.step = step_ + 1;
  c.grad_scale = static_cast<float>(hyper.grad_scale);
  c.max_grad_norm = hyper.grad_clip > 0 ? static_cast<float>(hyper.grad_clip) : 0.f;
  // Validated and written to device memory, ahead of the update (eager or replayed).
  gpu::set_adamw_step_params(im.adam_params, gpu::make_adamw_step_params(c), stream_);
  // The preparation serves step step_ + 1: the slope layers due then choose new backward masks.
  im.refreshing.clear();
  for (const auto& [name, sl] : im.slope) im.refreshing.push_back(sl.due(step_ + 1));
  if (!opt_.cuda_graph || im.timer.on || im.tracing()) {
    adamw_body();
    im.end_ops();
    im.timer.collect(stream_);
  } else {
    run_as_graph(im.adam_graphs[im.refreshing], stream_, im.graph_launches, [&] { adamw_body(); });
  }
  size_t k = 0;
  for (auto& [name, sl] : im.slope)
    if (im.refreshing[k++]) sl.refresh_step = step_ + 1;
  im.refreshing.clear();
  ++step_;
}

double GpuTransformer::last_grad_norm() {
  CUDA_CHECK(cudaMemcpyAsync(impl_->host_norm, norm_sq_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return std::sqrt(static_cast<double>(*impl_->host_norm));
}

}  // namespace esplag
