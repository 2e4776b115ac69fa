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
#include "model/gpu_transformer.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/gpu.h"

namespace esplag {

using gpu::bf16;

namespace {

// ---------------------------------------------------------------------------------------
// Small kernels of the model itself

constexpr int kThreads = 256;

__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void add_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) dst[i] += src[i];
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
// into two 24-bit uniforms for Box-Muller, so the values do not depend on the launch.
__global__ void normal_kernel(float* p, int64_t n, uint64_t key, float stddev) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const uint64_t h = splitmix64(key ^ splitmix64(static_cast<uint64_t>(i)));
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

// Either counts what an allocation sequence needs (arena == null) or performs it, so the
// memory plan and the real layout can never disagree.
struct Take {
  DeviceArena* arena = nullptr;
  size_t* bucket = nullptr;
  template <typename T>
  T* arr(const std::string& name, size_t count) {
    const size_t bytes = std::max<size_t>(count, 1) * sizeof(T);
    if (bucket) *bucket += round_up(bytes, DeviceArena::kDefaultAlignment);
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

int choose_head_chunk(const ModelConfig& c, int N, const GpuModelOptions& o) {
  ESPLAG_CHECK(o.head_chunk_rows >= 0, "GpuModelOptions.head_chunk_rows must be >= 0, got ", o.head_chunk_rows);
  int rows = o.head_chunk_rows;
  if (rows == 0) {
    const size_t fit = o.head_chunk_bytes / (sizeof(bf16) * static_cast<size_t>(padded_vocab(c)));
    rows = static_cast<int>(std::max<size_t>(128, std::min<size_t>(fit, size_t(1) << 20) / 128 * 128));
  }
  return std::max(1, std::min(rows, N));
}

// AdamWPlan's device table: one 16-byte entry per chunk of at most 16384 elements of a
// segment; counted here with chunks of 4096 so the plan stays an upper bound.
size_t adamw_table_bound(const std::vector<ParamInfo>& infos) {
  size_t chunks = 0;
  for (const auto& i : infos) chunks += i.numel / 4096 + 1;
  return round_up(chunks * 16, DeviceArena::kDefaultAlignment);
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
  };
  struct Block {
    Norm n1, n2;
    Lin qkv, proj, fc, mproj;
  };
  // Saved for backward, per layer.
  struct Layer {
    bf16 *res_in = nullptr, *ln1 = nullptr, *qkv = nullptr, *atty = nullptr, *res_mid = nullptr, *ln2 = nullptr,
         *fc = nullptr, *act = nullptr;
    float *ln1_mean = nullptr, *ln1_rstd = nullptr, *lse = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr;
  };

  std::unique_ptr<gpu::Gemm> gemm;
  std::unique_ptr<gpu::AdamWPlan> adamw;

  float *master = nullptr, *grad = nullptr, *m = nullptr, *v = nullptr;
  bf16* w = nullptr;

  std::vector<Block> blocks;
  Norm nf;
  int Vp = 0;                     // padded vocabulary of the LM head
  bf16* head_pad = nullptr;       // [Vp, C] zero-padded copy of the head weight (when Vp > V)
  float* head_dw_pad = nullptr;   // [Vp, C] head weight gradient of one micro-batch (when Vp > V)
  const bf16 *wte = nullptr, *wpe = nullptr, *head_w = nullptr;
  float *dwte = nullptr, *dwpe = nullptr, *head_dw = nullptr;

  std::vector<Layer> layers;
  bf16 *res_f = nullptr, *lnf = nullptr;
  float *lnf_mean = nullptr, *lnf_rstd = nullptr;
  bf16 *branch = nullptr, *dres = nullptr, *dln = nullptr, *datty = nullptr, *dqkv = nullptr, *dact = nullptr,
       *dfc = nullptr, *logits = nullptr;
  float* losses = nullptr;
  void *norm_scratch = nullptr, *gnorm_scratch = nullptr, *emb_ws = nullptr, *attn_scratch = nullptr;
  size_t norm_scratch_bytes = 0, emb_ws_bytes = 0, attn_scratch_bytes = 0;

  int32_t* staging = nullptr;  // pinned host, 2 · max N
  double* host_loss = nullptr;
  float* host_norm = nullptr;
  cudaEvent_t staged = nullptr;

  ~Impl() {
    if (staging) cudaFreeHost(staging);
    if (host_loss) cudaFreeHost(host_loss);
    if (host_norm) cudaFreeHost(host_norm);
    if (staged) cudaEventDestroy(staged);
  }
};

namespace {

// Every device allocation of the model, in one order, for counting and for real.
// Returns the buffers in `im` when take.arena is set.
void lay_out(const ModelConfig& c, int B, int T, int head_chunk, size_t nparams, GpuTransformer::Impl& im,
             GpuMemoryPlan& plan, Take take, int32_t** tokens, int32_t** targets, double** loss, float** norm_sq) {
  const size_t N = size_t(B) * T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim(), S = size_t(B) * c.n_head * T;
  const bool ln = c.norm == NormKind::layernorm;

  take.bucket = &plan.params;
  im.master = take.arr<float>("params.master", nparams);
  im.w = take.arr<bf16>("params.bf16", nparams);
  im.Vp = padded_vocab(c);
  const bool pad = im.Vp != c.vocab_size;
  if (pad) im.head_pad = take.arr<bf16>("params.head_padded", size_t(im.Vp) * C);
  take.bucket = &plan.grads;
  im.grad = take.arr<float>("params.grad", nparams);
  if (pad) im.head_dw_pad = take.arr<float>("params.head_grad_padded", size_t(im.Vp) * C);
  take.bucket = &plan.optimizer;
  im.m = take.arr<float>("adamw.m", nparams);
  im.v = take.arr<float>("adamw.v", nparams);

  take.bucket = &plan.activations;
  im.layers.assign(c.n_layer, {});
  for (int l = 0; l < c.n_layer; ++l) {
    auto& L = im.layers[l];
    const std::string p = "act." + std::to_string(l) + ".";
    L.res_in = take.arr<bf16>(p + "res_in", N * C);
    L.ln1 = take.arr<bf16>(p + "ln1", N * C);
    if (ln) L.ln1_mean = take.arr<float>(p + "ln1_mean", N);
    L.ln1_rstd = take.arr<float>(p + "ln1_rstd", N);
    L.qkv = take.arr<bf16>(p + "qkv", N * Q);
    L.atty = take.arr<bf16>(p + "atty", N * AC);
    L.lse = take.arr<float>(p + "lse", S);
    L.res_mid = take.arr<bf16>(p + "res_mid", N * C);
    L.ln2 = take.arr<bf16>(p + "ln2", N * C);
    if (ln) L.ln2_mean = take.arr<float>(p + "ln2_mean", N);
    L.ln2_rstd = take.arr<float>(p + "ln2_rstd", N);
    L.fc = take.arr<bf16>(p + "fc", N * F);
    L.act = take.arr<bf16>(p + "act", N * H);
  }
  im.res_f = take.arr<bf16>("act.res_f", N * C);
  im.lnf = take.arr<bf16>("act.lnf", N * C);
  if (ln) im.lnf_mean = take.arr<float>("act.lnf_mean", N);
  im.lnf_rstd = take.arr<float>("act.lnf_rstd", N);

  take.bucket = &plan.scratch;
  im.branch = take.arr<bf16>("scratch.branch", N * C);
  im.dres = take.arr<bf16>("grad.res", N * C);
  im.dln = take.arr<bf16>("grad.ln", N * C);
  im.datty = take.arr<bf16>("grad.atty", N * AC);
  im.dqkv = take.arr<bf16>("grad.qkv", N * Q);
  if (c.mlp != MlpKind::gelu) im.dact = take.arr<bf16>("grad.act", N * H);  // GELU's is fused into the GEMM
  im.dfc = take.arr<bf16>("grad.fc", N * F);
  im.logits = take.arr<bf16>("head.logits", size_t(head_chunk) * im.Vp);
  im.losses = take.arr<float>("head.losses", N);
  *tokens = take.arr<int32_t>("batch.tokens", N);
  *targets = take.arr<int32_t>("batch.targets", N);
  *loss = take.arr<double>("loss", 1);
  *norm_sq = take.arr<float>("grad_norm_sq", 1);
  im.norm_scratch_bytes = gpu::norm_backward_scratch_bytes(static_cast<int>(N), c.d_model);
  im.norm_scratch = take.arr<unsigned char>("scratch.norm", im.norm_scratch_bytes);
  im.gnorm_scratch = take.arr<unsigned char>("scratch.grad_norm", gpu::global_norm_scratch_bytes());
  im.emb_ws_bytes = gpu::embedding_backward_workspace_bytes(B, T, c.d_model, c.vocab_size);
  im.emb_ws = take.arr<unsigned char>("scratch.embedding", im.emb_ws_bytes);
  im.attn_scratch_bytes = gpu::attention_backward_scratch_bytes(B, T, c.n_head);
  im.attn_scratch = take.arr<unsigned char>("scratch.attention", im.attn_scratch_bytes);
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

GpuMemoryPlan GpuTransformer::memory_plan(const ModelConfig& config, int max_batch, int max_seq_len,
                                          const GpuModelOptions& options) {
  const auto infos = param_layout(config);
  const size_t P = infos.empty() ? 0 : infos.back().offset + infos.back().numel;
  const int head_chunk = choose_head_chunk(config, max_batch * max_seq_len, options);
  GpuMemoryPlan plan;
  Impl dummy;
  int32_t *tok = nullptr, *tgt = nullptr;
  double* loss = nullptr;
  float* nsq = nullptr;
  lay_out(config, max_batch, max_seq_len, head_chunk, P, dummy, plan, Take{}, &tok, &tgt, &loss, &nsq);
  plan.optimizer += adamw_table_bound(infos);
  plan.workspace = round_up(gpu::Gemm::kDefaultWorkspaceBytes, DeviceArena::kDefaultAlignment) +
                   round_up(gpu::Gemm::kScratchBytes, DeviceArena::kDefaultAlignment);
  return plan;
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
  head_chunk_ = choose_head_chunk(cfg_, N, opt_);
  plan_ = memory_plan(cfg_, max_b_, max_t_, opt_);

  const size_t need = plan_.total() + opt_.extra_arena_bytes;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (need > free_b)
    fail("GpuTransformer: model '", cfg_.preset, "' (", nparams_, " parameters) with micro-batch ", max_b_, " x ",
         max_t_, " needs ", DeviceArena::format_bytes(need), " of device memory (", plan_.describe(), ") but only ",
         DeviceArena::format_bytes(free_b), " of ", DeviceArena::format_bytes(total_b),
         " is free; lower the batch size or the sequence length");
  arena_ = std::make_unique<DeviceArena>(need, "model");
  CUDA_CHECK(cudaStreamCreate(&stream_));

  Impl& im = *impl_;
  GpuMemoryPlan counted;
  lay_out(cfg_, max_b_, max_t_, head_chunk_, nparams_, im, counted, Take{arena_.get(), nullptr}, &tokens_, &targets_,
          &loss_, &norm_sq_);
  im.gemm = std::make_unique<gpu::Gemm>(*arena_);
  im.gemm->set_use_epilogues(opt_.gemm_epilogues);
  std::vector<gpu::ParamSegment> segs;
  for (const auto& i : infos_) segs.push_back({int64_t(i.offset), int64_t(i.numel), i.decay});
  im.adamw = std::make_unique<gpu::AdamWPlan>(segs, *arena_);

  CUDA_CHECK(cudaMallocHost(&im.staging, sizeof(int32_t) * 2 * size_t(N)));
  CUDA_CHECK(cudaMallocHost(&im.host_loss, sizeof(double)));
  CUDA_CHECK(cudaMallocHost(&im.host_norm, sizeof(float)));
  CUDA_CHECK(cudaEventCreateWithFlags(&im.staged, cudaEventDisableTiming));

  // Parameter views. The flat buffers never move, so the pointers are fixed.
  std::map<std::string, const ParamInfo*> by_name;
  for (const auto& i : infos_) by_name[i.name] = &i;
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
  auto lin = [&](const std::string& n) {
    return Impl::Lin{wp(n + ".weight"), wp(n + ".bias"), gp(n + ".weight"), gp(n + ".bias")};
  };
  im.wte = wp("embed.tokens.weight");
  im.dwte = gp("embed.tokens.weight");
  im.wpe = wp("embed.positions.weight");
  im.dwpe = gp("embed.positions.weight");
  im.head_w = cfg_.tie_embeddings ? im.wte : wp("lm_head.weight");
  im.head_dw = cfg_.tie_embeddings ? im.dwte : gp("lm_head.weight");
  im.nf = norm("norm_f");
  im.blocks.resize(cfg_.n_layer);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".";
    auto& blk = im.blocks[l];
    blk.n1 = norm(b + "norm1");
    blk.n2 = norm(b + "norm2");
    blk.qkv = lin(b + "attn.qkv");
    blk.proj = lin(b + "attn.proj");
    blk.fc = lin(b + "mlp.fc");
    blk.mproj = lin(b + "mlp.proj");
  }

  // A defined start: zero parameters, gradients and moments.
  CUDA_CHECK(cudaMemsetAsync(im.master, 0, sizeof(float) * nparams_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.w, 0, sizeof(bf16) * nparams_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.grad, 0, sizeof(float) * nparams_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.m, 0, sizeof(float) * nparams_, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.v, 0, sizeof(float) * nparams_, stream_));
  if (im.head_pad) CUDA_CHECK(cudaMemsetAsync(im.head_pad, 0, sizeof(bf16) * size_t(im.Vp) * cfg_.d_model, stream_));
  CUDA_CHECK(cudaMemsetAsync(norm_sq_, 0, sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(loss_, 0, sizeof(double), stream_));
  synchronize();
}

GpuTransformer::~GpuTransformer() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

void GpuTransformer::synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

// --- parameters ---------------------------------------------------------------------------

void GpuTransformer::set_params(const float* host, size_t n) {
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_params: got ", n, " values, the model has ", nparams_,
               " parameters");
  Impl& im = *impl_;
  CUDA_CHECK(cudaMemcpyAsync(im.master, host, sizeof(float) * n, cudaMemcpyHostToDevice, stream_));
  f32_to_bf16_kernel<<<blocks(int64_t(n)), kThreads, 0, stream_>>>(im.w, im.master, int64_t(n));
  CUDA_CHECK_LAUNCH("GpuTransformer::set_params (bf16 copy)");
  refresh_head_copy();
  synchronize();
}

std::vector<float> GpuTransformer::params_to_host() const {
  std::vector<float> h(nparams_);
  CUDA_CHECK(cudaMemcpyAsync(h.data(), impl_->master, sizeof(float) * nparams_, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return h;
}

std::vector<float> GpuTransformer::grads_to_host() const {
  std::vector<float> h(nparams_);
  CUDA_CHECK(cudaMemcpyAsync(h.data(), impl_->grad, sizeof(float) * nparams_, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return h;
}

void GpuTransformer::set_optimizer_state(const float* m, const float* v, size_t n, int64_t steps) {
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_optimizer_state: got ", n, " moments, the model has ", nparams_,
               " parameters");
  ESPLAG_CHECK(steps >= 0, "GpuTransformer::set_optimizer_state: negative step count ", steps);
  CUDA_CHECK(cudaMemcpyAsync(impl_->m, m, sizeof(float) * n, cudaMemcpyHostToDevice, stream_));
  CUDA_CHECK(cudaMemcpyAsync(impl_->v, v, sizeof(float) * n, cudaMemcpyHostToDevice, stream_));
  synchronize();
  step_ = steps;
}

void GpuTransformer::optimizer_state_to_host(std::vector<float>& m, std::vector<float>& v) const {
  m.resize(nparams_);
  v.resize(nparams_);
  CUDA_CHECK(cudaMemcpyAsync(m.data(), impl_->m, sizeof(float) * nparams_, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaMemcpyAsync(v.data(), impl_->v, sizeof(float) * nparams_, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTransformer::init_weights(uint64_t seed) {
  Impl& im = *impl_;
  const double residual_scale = 1.0 / std::sqrt(2.0 * cfg_.n_layer);
  for (size_t k = 0; k < infos_.size(); ++k) {
    const ParamInfo& info = infos_[k];
    float* p = im.master + info.offset;
    const int64_t n = static_cast<int64_t>(info.numel);
    const bool is_norm = info.name.find("norm") != std::string::npos;
    if (ends_with(info.name, ".bias") || is_norm) {
      fill_kernel<<<blocks(n), kThreads, 0, stream_>>>(p, n, ends_with(info.name, ".bias") ? 0.f : 1.f);
    } else {
      const bool residual_out = info.name.find("attn.proj.weight") != std::string::npos ||
                                info.name.find("mlp.proj.weight") != std::string::npos;
      const double stddev = cfg_.init_std * (residual_out ? residual_scale : 1.0);
      normal_kernel<<<blocks(n), kThreads, 0, stream_>>>(p, n, splitmix64(seed) ^ splitmix64(k + 1),
                                                           static_cast<float>(stddev));
    }
    CUDA_CHECK_LAUNCH("GpuTransformer::init_weights");
  }
  f32_to_bf16_kernel<<<blocks(int64_t(nparams_)), kThreads, 0, stream_>>>(im.w, im.master, int64_t(nparams_));
  CUDA_CHECK_LAUNCH("GpuTransformer::init_weights (bf16 copy)");
  refresh_head_copy();
  synchronize();
}

void GpuTransformer::refresh_head_copy() {
  const Impl& im = *impl_;
  if (!im.head_pad) return;
  CUDA_CHECK(cudaMemcpyAsync(im.head_pad, im.head_w, sizeof(bf16) * size_t(cfg_.vocab_size) * cfg_.d_model,
                             cudaMemcpyDeviceToDevice, stream_));
}

void GpuTransformer::zero_grad() {
  CUDA_CHECK(cudaMemsetAsync(impl_->grad, 0, sizeof(float) * nparams_, stream_));
}

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

void GpuTransformer::forward_backward_device(const int32_t* tokens, const int32_t* targets, int B, int T,
                                             double loss_scale) {
  check_batch(B, T);
  forward_body(tokens, B, T);
  head(targets, B, T, true, loss_scale);
  backward_body(tokens, B, T);
}

void GpuTransformer::forward_loss_device(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_batch(B, T);
  forward_body(tokens, B, T);
  head(targets, B, T, false, 1.0);
}

void GpuTransformer::forward_body(const int32_t* tokens, int B, int T) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, NH = cfg_.n_head, KV = cfg_.n_kv_head,
            HD = cfg_.head_dim(), Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff, AC = NH * HD;
  const bool ln = cfg_.norm == NormKind::layernorm;
  auto norm = [&](const Impl::Norm& n, bf16* out, float* mean, float* rstd, bf16* res, const bf16* a, const bf16* b) {
    if (ln)
      gpu::layernorm_forward(out, mean, rstd, res, a, b, n.w, n.b, N, C, s);
    else
      gpu::rmsnorm_forward(out, rstd, res, a, b, n.w, N, C, s);
  };
  gpu::Gemm& gemm = *im.gemm;

  gpu::embedding_forward(im.layers.front().res_in, tokens, im.wte, im.wpe, B, T, C, V, s);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    auto& L = im.layers[l];
    const auto& blk = im.blocks[l];
    if (l == 0)
      norm(blk.n1, L.ln1, L.ln1_mean, L.ln1_rstd, nullptr, L.res_in, nullptr);
    else
      norm(blk.n1, L.ln1, L.ln1_mean, L.ln1_rstd, L.res_in, im.layers[l - 1].res_mid, im.branch);
    gemm.forward(L.qkv, L.ln1, blk.qkv.w, blk.qkv.b, N, C, Q, s);
    if (cfg_.pos == PosKind::rope) gpu::rope_forward(L.qkv, B, T, NH, KV, HD, cfg_.rope_theta, s);
    gpu::attention_forward(L.atty, L.lse, L.qkv, B, T, NH, KV, HD, s, opt_.attention);
    gemm.forward(im.branch, L.atty, blk.proj.w, blk.proj.b, N, AC, C, s);
    norm(blk.n2, L.ln2, L.ln2_mean, L.ln2_rstd, L.res_mid, L.res_in, im.branch);
    switch (cfg_.mlp) {
      case MlpKind::gelu:
        gemm.forward(L.act, L.ln2, blk.fc.w, blk.fc.b, N, C, F, s, gpu::Gemm::Act::gelu, L.fc);
        break;
      case MlpKind::swiglu:
        gemm.forward(L.fc, L.ln2, blk.fc.w, blk.fc.b, N, C, F, s);
        gpu::swiglu_forward(L.act, L.fc, N, H, s);
        break;
      case MlpKind::relu2:
        gemm.forward(L.fc, L.ln2, blk.fc.w, blk.fc.b, N, C, F, s);
        gpu::relu2_forward(L.act, L.fc, int64_t(N) * H, s);
        break;
    }
    gemm.forward(im.branch, L.act, blk.mproj.w, blk.mproj.b, N, H, C, s);
  }
  norm(im.nf, im.lnf, im.lnf_mean, im.lnf_rstd, im.res_f, im.layers.back().res_mid, im.branch);
}

void GpuTransformer::head(const int32_t* targets, int B, int T, bool train, double loss_scale) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, Vp = im.Vp;
  const float dloss = static_cast<float>(loss_scale / N);
  const bool pad = im.head_pad != nullptr;
  const bf16* W = pad ? im.head_pad : im.head_w;
  float* dW = pad ? im.head_dw_pad : im.head_dw;
  for (int r0 = 0; r0 < N; r0 += head_chunk_) {
    const int rows = std::min(head_chunk_, N - r0);
    const bf16* h = im.lnf + size_t(r0) * C;
    im.gemm->forward(im.logits, h, W, nullptr, rows, C, Vp, s);
    gpu::softmax_cross_entropy(im.losses + r0, im.logits, targets + r0, rows, V, Vp, dloss, train, s);
    if (train) {
      // The chunk's dlogits (now in im.logits, zero in the padding) give its rows of dlnf
      // (kept in dln) and add into the head's weight gradient; the padded gradient
      // starts over with each micro-batch.
      im.gemm->backward_input(im.dln + size_t(r0) * C, im.logits, W, rows, C, Vp, false, s);
      im.gemm->backward_weight(dW, nullptr, im.logits, h, rows, C, Vp, !(pad && r0 == 0), s);
    }
  }
  if (train && pad) {
    const int64_t n = int64_t(V) * C;
    add_kernel<<<blocks(n), kThreads, 0, s>>>(im.head_dw, im.head_dw_pad, n);
    CUDA_CHECK_LAUNCH("GpuTransformer (LM head gradient)");
  }
  mean_loss_kernel<<<1, kLossThreads, 0, s>>>(loss_, im.losses, N);
  CUDA_CHECK_LAUNCH("GpuTransformer (mean loss)");
}

void GpuTransformer::backward_body(const int32_t* tokens, int B, int T) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, NH = cfg_.n_head, KV = cfg_.n_kv_head,
            HD = cfg_.head_dim(), Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff, AC = NH * HD;
  const bool ln = cfg_.norm == NormKind::layernorm;
  gpu::Gemm& gemm = *im.gemm;
  // dinp += the norm's input gradient; dinp is the residual-stream gradient.
  auto norm_bwd = [&](const Impl::Norm& n, const bf16* dout, const bf16* inp, const float* mean, const float* rstd) {
    if (ln)
      gpu::layernorm_backward(im.dres, n.dw, n.db, dout, inp, n.w, mean, rstd, N, C, im.norm_scratch,
                              im.norm_scratch_bytes, s);
    else
      gpu::rmsnorm_backward(im.dres, n.dw, dout, inp, n.w, rstd, N, C, im.norm_scratch, im.norm_scratch_bytes, s);
  };

  CUDA_CHECK(cudaMemsetAsync(im.dres, 0, sizeof(bf16) * size_t(N) * C, s));
  norm_bwd(im.nf, im.dln, im.res_f, im.lnf_mean, im.lnf_rstd);  // dln holds dlnf from the head
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    auto& L = im.layers[l];
    const auto& blk = im.blocks[l];
    // MLP half: dres = d(res_out) = d(res_mid) through the residual.
    gemm.backward_weight(blk.mproj.dw, blk.mproj.db, im.dres, L.act, N, H, C, true, s);
    switch (cfg_.mlp) {
      case MlpKind::gelu:  // dfc = (dres · Wmproj) ∘ gelu'(fc), in the GEMM's epilogue
        gemm.backward_input(im.dfc, im.dres, blk.mproj.w, N, H, C, false, s, L.fc);
        break;
      case MlpKind::swiglu:
        gemm.backward_input(im.dact, im.dres, blk.mproj.w, N, H, C, false, s);
        gpu::swiglu_backward(im.dfc, L.fc, im.dact, N, H, false, s);
        break;
      case MlpKind::relu2:
        gemm.backward_input(im.dact, im.dres, blk.mproj.w, N, H, C, false, s);
        gpu::relu2_backward(im.dfc, L.fc, im.dact, int64_t(N) * H, false, s);
        break;
    }
    gemm.backward_weight(blk.fc.dw, blk.fc.db, im.dfc, L.ln2, N, C, F, true, s);
    gemm.backward_input(im.dln, im.dfc, blk.fc.w, N, C, F, false, s);
    norm_bwd(blk.n2, im.dln, L.res_mid, L.ln2_mean, L.ln2_rstd);
    // Attention half: dres = d(res_mid) = d(res_in) through the residual.
    gemm.backward_weight(blk.proj.dw, blk.proj.db, im.dres, L.atty, N, AC, C, true, s);
    gemm.backward_input(im.datty, im.dres, blk.proj.w, N, AC, C, false, s);
    gpu::attention_backward(im.dqkv, im.datty, L.qkv, L.atty, L.lse, B, T, NH, KV, HD, im.attn_scratch,
                            im.attn_scratch_bytes, s, opt_.attention);
    if (cfg_.pos == PosKind::rope) gpu::rope_backward(im.dqkv, B, T, NH, KV, HD, cfg_.rope_theta, s);
    gemm.backward_weight(blk.qkv.dw, blk.qkv.db, im.dqkv, L.ln1, N, C, Q, true, s);
    gemm.backward_input(im.dln, im.dqkv, blk.qkv.w, N, C, Q, false, s);
    norm_bwd(blk.n1, im.dln, L.res_in, L.ln1_mean, L.ln1_rstd);
  }
  gpu::embedding_backward(im.dwte, im.dwpe, im.dres, tokens, B, T, C, V, im.emb_ws, im.emb_ws_bytes, s);
}

// --- optimizer ------------------------------------------------------------------------------

void GpuTransformer::step_adamw(const GpuAdamW& hyper) {
  Impl& im = *impl_;
  gpu::global_norm_squared(norm_sq_, im.grad, int64_t(nparams_), im.gnorm_scratch, stream_);
  gpu::AdamWConfig c;
  c.lr = static_cast<float>(hyper.lr);
  c.beta1 = static_cast<float>(hyper.beta1);
  c.beta2 = static_cast<float>(hyper.beta2);
  c.eps = static_cast<float>(hyper.eps);
  c.weight_decay = static_cast<float>(hyper.weight_decay);
  c.step = step_ + 1;
  c.grad_scale = static_cast<float>(hyper.grad_scale);
  if (hyper.grad_clip > 0) {
    c.clip_norm_sq = norm_sq_;
    c.max_grad_norm = static_cast<float>(hyper.grad_clip);
  }
  gpu::adamw_update(*im.adamw, im.master, im.m, im.v, im.grad, im.w, c, stream_);
  refresh_head_copy();
  ++step_;
}

double GpuTransformer::last_grad_norm() {
  CUDA_CHECK(cudaMemcpyAsync(impl_->host_norm, norm_sq_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return std::sqrt(static_cast<double>(*impl_->host_norm));
}

}  // namespace esplag
