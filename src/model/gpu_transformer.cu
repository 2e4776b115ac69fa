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
//   s1 [N, C]: the branch output in forward (and in the forward that full checkpointing
//              runs again before a block's backward); dlnf in the head; dln in backward
//   U (the shared region), in turn:
//     forward    ln1 / ln2 / the SwiGLU or ReLU² output (with recompute) at offset 0,
//                the attention forward's workspace at offset 0 (ln1 is dead by then);
//                the same in a block's forward run again
//     head       the logits chunk
//     MLP bwd    GELU: dfc, then ln2 (recomputed) after it;
//                SwiGLU / ReLU²: dact, overwritten by the recomputed act, then by ln2
//                (dfc goes over the layer's saved fc)
//     attn bwd   the attention workspace; dqkv and datty (then the recomputed ln1) too
//                unless they fit in the layer's dead fc storage
#include "model/gpu_transformer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"
#include "model/cuda/device_linear_dense.h"
#include "model/cuda/gpu_transformer_impl.h"
#include "ops/gpu.h"
#include "ops/gpu_fp8.h"
#include "ops/gpu_fused.h"

namespace esplag {

using namespace gpu_model;

namespace {

__global__ void add_kernel(float* dst, const float* src, int64_t n, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) dst[i] = accumulate ? dst[i] + src[i] : src[i];
}

// *out = the sum of parts[0, n), in that order (the sharded gradient norm's slices).
__global__ void sum_parts_kernel(float* out, const float* parts, int n) {
  float sum = 0.f;
  for (int k = 0; k < n; ++k) sum += parts[k];
  *out = sum;
}

// Mean of the per-row losses into *out (fp64), one block, fixed summation order.
constexpr int kLossThreads = 1024;
// Block k: out[k] = the mean of the n values at losses + k·stride (the losses, and a
// distillation's cross-entropies and KL divergences after them).
__global__ void __launch_bounds__(kLossThreads)
    mean_loss_kernel(double* out, const float* losses, int64_t n, int64_t stride) {
  __shared__ double sh[kLossThreads];
  losses += blockIdx.x * stride;
  out += blockIdx.x;
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


// Whether block l recomputes its norm outputs and its SwiGLU / ReLU² output in the backward
// instead of keeping them: `recompute`, or the block is checkpointed selectively.
bool recomputes_cheap_ops(const GpuModelOptions& o, int l) {
  return o.recompute || (o.checkpointing.mode == CheckpointMode::selective && o.checkpointing.checkpoints(l));
}

SharedSizes shared_sizes(const ModelConfig& c, int B, int T, const GpuModelOptions& o) {
  const size_t N = size_t(B) * T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim(), b = sizeof(bf16);
  // Block 0 recomputes them when any block does (checkpointing always includes block 0).
  const bool rc = recomputes_cheap_ops(o, 0), gelu = c.mlp == MlpKind::gelu;
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


// Every device allocation of the step arena, in one order, for counting and for real.
// Returns the buffers in `im` when take.arena is set.
void lay_out(const ModelConfig& c, int B, int T, const GpuModelOptions& o, GpuTransformer::Impl& im,
             GpuMemoryPlan& plan, Take take, int32_t** tokens, int32_t** targets, double** loss, float** norm_sq) {
  const size_t N = size_t(B) * T, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim(), S = size_t(B) * c.n_head * T;
  const bool ln = c.norm == NormKind::layernorm, gelu = c.mlp == MlpKind::gelu;
  const ActivationCheckpointing& ck = o.checkpointing;
  ESPLAG_CHECK(ck.every >= 1, "GpuModelOptions.checkpointing.every must be >= 1, got ", ck.every);

  im.Vp = padded_vocab(c);
  const bool pad = im.Vp != c.vocab_size;
  take.bucket = &plan.params;
  if (pad) im.head_pad = take.arr<bf16>("params.head_padded", size_t(im.Vp) * C);
  take.bucket = &plan.grads;
  if (pad && !o.forward_only) im.head_dw_pad = take.arr<float>("params.head_grad_padded", size_t(im.Vp) * C);
  take.bucket = &plan.optimizer;
  im.adam_params = take.arr<gpu::AdamWStepParams>("adamw.step_params", 1);

  take.bucket = &plan.activations;
  // What a block saves besides its input, into L (p: the buffers' name prefix).
  auto saved = [&](GpuTransformer::Impl::Layer& L, const std::string& p, bool rc) {
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
  };
  im.layers.assign(c.n_layer, {});
  bool any_recomputed = false;
  for (int l = 0; l < c.n_layer; ++l) {
    auto& L = im.layers[l];
    const std::string p = "act." + std::to_string(l) + ".";
    L.res_in = take.arr<bf16>(p + "res_in", N * C);
    L.recomputed = ck.mode == CheckpointMode::full && ck.checkpoints(l);
    any_recomputed |= L.recomputed;
    if (!L.recomputed) saved(L, p, recomputes_cheap_ops(o, l));
  }
  if (any_recomputed) {  // full checkpointing: one set for the recomputed blocks
    GpuTransformer::Impl::Layer set;
    saved(set, "act.recomputed.", o.recompute);
    for (auto& L : im.layers) {
      if (!L.recomputed) continue;
      bf16* res_in = L.res_in;
      L = set;
      L.res_in = res_in;
      L.recomputed = true;
    }
  }
  im.res_f = take.arr<bf16>("act.res_f", N * C);
  if (ln) im.lnf_mean = take.arr<float>("act.lnf_mean", N);
  im.lnf_rstd = take.arr<float>("act.lnf_rstd", N);

  take.bucket = &plan.scratch;
  im.s0 = take.arr<bf16>("step.s0", N * C);
  im.s1 = take.arr<bf16>("step.s1", N * C);
  im.sizes = shared_sizes(c, B, T, o);
  im.shared = take.arr<unsigned char>("step.shared", im.sizes.total);
  im.losses = take.arr<float>("head.losses", 3 * N);  // losses, then a distillation's CE and KL
  *tokens = take.arr<int32_t>("batch.tokens", N);
  *targets = take.arr<int32_t>("batch.targets", N);
  *loss = take.arr<double>("loss", 3);
  *norm_sq = take.arr<float>("grad_norm_sq", 1);
  if (o.precision.fp8) im.fp8_saturated = take.arr<uint64_t>("fp8.saturated", 1);
  if (o.precision.delayed())
    im.fp8_history_memory =
        take.arr<float>("fp8.amax_histories", DeviceFp8Histories::floats(int64_t(transformer_linear_names(c).size()),
                                                                         o.precision.amax_history));
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

// A norm's output over N rows again in the backward, from its saved input `inp`, for the
// layer `next` that takes it: with the forward's kernel (the same bits as the forward wrote;
// the statistics are recomputed the same way too), or where `next` takes its Xᵀ codes from
// their producer (fp8, delayed scaling) only those codes, from the saved statistics.
void norm_recompute(GpuTransformer::Impl& im, const ModelConfig& c, cudaStream_t s, DeviceLinear& next,
                    const GpuTransformer::Impl::Norm& n, bf16* out, const bf16* inp, const float* mean,
                    const float* rstd, int N) {
  im.marks.mark(s, "norm recompute");
  const bool ln = c.norm == NormKind::layernorm;
  if (next.takes_produced_fp8())
    gpu::fp8_norm_recompute(next.fp8_input_t_target(N), inp, n.w, ln ? n.b : nullptr, ln ? mean : nullptr, rstd, N,
                            c.d_model, s);
  else if (ln)
    gpu::layernorm_forward(out, nullptr, nullptr, nullptr, inp, nullptr, n.w, n.b, N, c.d_model, s, float(c.norm_eps));
  else
    gpu::rmsnorm_forward(out, nullptr, nullptr, inp, nullptr, n.w, N, c.d_model, s, float(c.norm_eps));
}

// Runs `body` on stream s as the graph g (core/cuda_graph.h; see the header).
void run_as_graph(ReplayedGraph& g, cudaStream_t s, int64_t& launches, const std::function<void()>& body) {
  g.run(s, launches, body, "GpuTransformer");
}

// A norm's forward over N rows (ops/gpu.h; with the residual add when b is given, b read
// with its pending scale b_scale). `next`: the layer that takes the output where the block
// keeps no bf16 copy of it (null: the output is kept, or goes to the LM head); where `next`
// takes its X codes from their producer (fp8, delayed scaling), only those codes are written.
void norm_forward(GpuTransformer::Impl& im, const ModelConfig& c, cudaStream_t s, DeviceLinear* next,
                  const GpuTransformer::Impl::Norm& n, bf16* out, float* mean, float* rstd, bf16* res, const bf16* a,
                  const bf16* b, gpu::PendingScale b_scale, int N) {
  im.marks.mark(s, "norm fwd");
  const bool ln = c.norm == NormKind::layernorm;
  const auto eps = float(c.norm_eps);
  if (next && next->takes_produced_fp8()) {
    const gpu::Fp8Target to = next->fp8_input_target(out, N);
    if (ln)
      gpu::fp8_layernorm_forward(to, mean, rstd, res, a, b, n.w, n.b, N, c.d_model, s, eps, b_scale);
    else
      gpu::fp8_rmsnorm_forward(to, rstd, res, a, b, n.w, N, c.d_model, s, eps, b_scale);
  } else if (ln) {
    gpu::layernorm_forward(out, mean, rstd, res, a, b, n.w, n.b, N, c.d_model, s, eps, b_scale);
  } else {
    gpu::rmsnorm_forward(out, rstd, res, a, b, n.w, N, c.d_model, s, eps, b_scale);
  }
}

// A norm's backward over N rows: dinp += its input gradient from dout (ops/gpu.h), with the
// fused norm backward where the model uses it (ops/gpu_fused.h: the norm's weight gradients
// and next_bias, the bias gradient of the Linear before it, in the same pass; dout read with
// its pending scale, which only that one takes).
void norm_backward(GpuTransformer::Impl& im, const ModelConfig& c, cudaStream_t s, const GpuTransformer::Impl::Norm& n,
                   bf16* dinp, const bf16* dout, gpu::PendingScale dout_scale, const bf16* inp, const float* mean,
                   const float* rstd, float* next_bias, int N) {
  const bool ln = c.norm == NormKind::layernorm;
  const int C = c.d_model;
  if (im.fused_norm && ln)
    gpu::fused_layernorm_backward(dinp, n.dw, n.db, next_bias, dout, dout_scale, inp, n.w, mean, rstd, N, C,
                                  im.fnorm_scratch, im.fnorm_scratch_bytes, s);
  else if (im.fused_norm)
    gpu::fused_rmsnorm_backward(dinp, n.dw, next_bias, dout, dout_scale, inp, n.w, rstd, N, C, im.fnorm_scratch,
                                im.fnorm_scratch_bytes, s);
  else if (ln)
    gpu::layernorm_backward(dinp, n.dw, n.db, dout, inp, n.w, mean, rstd, N, C, im.norm_scratch,
                            im.norm_scratch_bytes, s);
  else
    gpu::rmsnorm_backward(dinp, n.dw, dout, inp, n.w, rstd, N, C, im.norm_scratch, im.norm_scratch_bytes, s);
}

}  // namespace

std::string GpuMemoryPlan::describe() const {
  auto f = DeviceArena::format_bytes;
  return "parameters " + f(params) + ", gradients " + f(grads) + ", optimizer " + f(optimizer) + ", activations " +
         f(activations) + ", scratch " + f(scratch) + ", workspace " + f(workspace) +
         (host ? "; offloaded to pinned host memory " + f(host) : "");
}

std::vector<ParamInfo> GpuTransformer::param_layout(const ModelConfig& cfg) { return transformer_param_layout(cfg); }

namespace {

// The options as the model applies them: a forward-only model checkpoints every block.
GpuModelOptions effective(GpuModelOptions o) {
  if (o.forward_only) o.checkpointing = {CheckpointMode::full, 1};
  return o;
}

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

// The fp8 products' buffers outside the arena: each block Linear's weight codes and the
// scratch they share, for micro-batches of `tokens` rows, as the dense kind's for every layer
// (planned before the kinds change: the 2:4 kinds' compressed copies and scratch differ).
GpuMemoryPlan fp8_plan(const ModelConfig& config, int64_t tokens, const GpuModelOptions& options) {
  GpuMemoryPlan plan;
  if (!options.precision.fp8) return plan;
  const auto infos = transformer_param_layout(config);
  std::vector<std::pair<int64_t, int64_t>> shapes;  // every block has the same shapes
  const std::vector<std::string> names = transformer_linear_names(config);
  for (size_t k = 0; k < 4 && k < names.size(); ++k) {
    const ParamInfo& i = info_named(infos, names[k]);
    shapes.push_back({i.shape.at(0), i.shape.at(1)});
    plan.params += size_t(config.n_layer) * DeviceDenseLinear::fp8_layer_bytes(i.shape.at(0), i.shape.at(1));
  }
  plan.scratch = DeviceDenseLinear::fp8_scratch_bytes(shapes, tokens, swiglu_grad_codes(config, options));
  return plan;
}

}  // namespace

GpuMemoryPlan GpuTransformer::memory_plan(const ModelConfig& config, int max_batch, int max_seq_len,
                                          const GpuModelOptions& given) {
  const GpuModelOptions options = effective(given);
  // The state as lay_out_state stores it: kept values [out, in/2] for options.kept_values.
  std::vector<ParamInfo> stored = stored_param_layout(config, options.kept_values);
  std::vector<size_t> slices;
  size_t end = 0;
  const std::vector<GradientBucket> buckets = lay_out_buckets(config, options, stored, slices, end);
  ESPLAG_CHECK(max_batch > 0 && max_seq_len > 0, "GpuTransformer::memory_plan: bad micro-batch ", max_batch, " x ",
               max_seq_len);
  ESPLAG_CHECK(config.head_dim() <= gpu::kAttentionMaxHeadDim, "GpuTransformer: head dimension ", config.head_dim(),
               " exceeds the GPU attention's maximum ", gpu::kAttentionMaxHeadDim);
  GpuMemoryPlan state;
  Impl dummy;
  lay_out_state_buffers(config, stored, end, buckets, slices, options, dummy, state, Take{}, Take{});
  return step_arena_plan(config, max_batch, max_seq_len, options) + state +
         fp8_plan(config, int64_t(max_batch) * max_seq_len, options);
}

GpuTransformer::GpuTransformer(const ModelConfig& config, int max_batch, int max_seq_len,
                               const GpuModelOptions& options)
    : cfg_(config), opt_(effective(options)), impl_(std::make_unique<Impl>()) {
  cfg_.validate();
  ESPLAG_CHECK(max_batch > 0, "GpuTransformer: max_batch must be positive, got ", max_batch);
  ESPLAG_CHECK(max_seq_len > 0 && max_seq_len <= cfg_.max_seq_len, "GpuTransformer: sequence length ", max_seq_len,
               " outside [1, max_seq_len=", cfg_.max_seq_len, "]");
  ESPLAG_CHECK(int64_t(max_batch) * max_seq_len <= 0x7fffffff, "GpuTransformer: B·T = ",
               int64_t(max_batch) * max_seq_len, " rows do not fit int32");
  ESPLAG_CHECK(cfg_.head_dim() <= gpu::kAttentionMaxHeadDim, "GpuTransformer: head dimension ", cfg_.head_dim(),
               " exceeds the GPU attention's maximum ", gpu::kAttentionMaxHeadDim);
  ESPLAG_CHECK(!opt_.offload_master || opt_.offload_moments,
               "GpuTransformer: offloading the master weights needs the moments offloaded too");
  ESPLAG_CHECK(!opt_.shard_gradients || opt_.shard_optimizer,
               "GpuTransformer: shard_gradients (ZeRO stage 2) needs shard_optimizer");
  ESPLAG_CHECK(!opt_.shard_parameters || opt_.shard_gradients,
               "GpuTransformer: shard_parameters (ZeRO stage 3) needs shard_gradients");
  infos_ = param_layout(cfg_);
  nparams_ = infos_.back().offset + infos_.back().numel;
  max_b_ = max_batch;
  max_t_ = max_seq_len;
  const int N = max_b_ * max_t_;
  plan_ = memory_plan(cfg_, max_b_, max_t_, opt_);  // the largest state (GpuModelOptions::kept_values)

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
  im.fp8_plan = fp8_plan(cfg_, N, opt_);
  arena_ = std::make_unique<DeviceArena>(im.step_plan.total() + opt_.extra_arena_bytes, "model");
  stream_ = opt_.stream;
  if (!stream_) {
    CUDA_CHECK(cudaStreamCreate(&stream_));
    owns_stream_ = true;
  }

  GpuMemoryPlan counted;
  lay_out(cfg_, max_b_, max_t_, opt_, im, counted, Take{arena_.get(), nullptr}, &tokens_, &targets_, &loss_, &norm_sq_);
  head_chunk_ = im.sizes.head_rows;
  im.gemm = std::make_unique<gpu::Gemm>(*arena_);
  im.gemm->set_use_epilogues(opt_.gemm_epilogues);

  CUDA_CHECK(cudaMallocHost(&im.staging, sizeof(int32_t) * 2 * size_t(N)));
  CUDA_CHECK(cudaMallocHost(&im.host_loss, sizeof(double)));
  CUDA_CHECK(cudaMallocHost(&im.host_norm, sizeof(float)));
  CUDA_CHECK(cudaEventCreateWithFlags(&im.staged, cudaEventDisableTiming));
  if (opt_.reduce_gradients) {
    ESPLAG_CHECK(!opt_.forward_only, "GpuTransformer: a forward_only model has no gradients to reduce");
    ESPLAG_CHECK(!opt_.shard_optimizer || opt_.shard_optimizer == opt_.reduce_gradients,
                 "GpuTransformer: shard_optimizer and reduce_gradients must be the same ranks");
    im.slot_free.resize(opt_.shard_gradients ? GradientStorage::kRingSlots : 0);
    for (cudaEvent_t& e : im.slot_free) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    if (opt_.shard_parameters) {
      im.weights_gathered.resize(GradientStorage::kRingSlots);
      for (cudaEvent_t& e : im.weights_gathered) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      CUDA_CHECK(cudaEventCreateWithFlags(&im.slot_released, cudaEventDisableTiming));
    }
    // Its collectives should start as soon as a bucket is ready, ahead of queued compute.
    int lowest = 0, highest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&im.comm_stream, cudaStreamNonBlocking, highest));
    CUDA_CHECK(cudaEventCreateWithFlags(&im.grads_ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&im.comm_done, cudaEventDisableTiming));
  }

  if (im.head_pad) CUDA_CHECK(cudaMemsetAsync(im.head_pad, 0, sizeof(bf16) * size_t(im.Vp) * cfg_.d_model, stream_));
  CUDA_CHECK(cudaMemsetAsync(norm_sq_, 0, sizeof(float), stream_));
  CUDA_CHECK(cudaMemsetAsync(loss_, 0, 3 * sizeof(double), stream_));
  if (im.fp8_saturated) CUDA_CHECK(cudaMemsetAsync(im.fp8_saturated, 0, sizeof(uint64_t), stream_));
  if (im.fp8_history_memory)
    im.fp8_histories = std::make_unique<DeviceFp8Histories>(im.fp8_history_memory, transformer_linear_names(cfg_),
                                                            opt_.precision.amax_history, stream_);
  im.blocks.resize(cfg_.n_layer);
  make_linears();
  if (!opt_.defer_state) lay_out_state();
}

GpuTransformer::~GpuTransformer() {
  if (stream_) cudaStreamSynchronize(stream_);
  if (owns_stream_) cudaStreamDestroy(stream_);
}

size_t GpuTransformer::state_bytes() const { return impl_->state.capacity(); }

// --- timing and graphs ----------------------------------------------------------------------

void GpuTransformer::set_op_timing(bool on) { impl_->marks.set_timing(on); }

std::vector<GpuOpTime> GpuTransformer::op_times() const { return impl_->marks.totals(); }

int64_t GpuTransformer::graph_launches() const { return impl_->graph_launches; }

void GpuTransformer::fp8_histories_to_host(std::vector<Fp8AmaxHistory>& host) const {
  if (impl_->fp8_histories) impl_->fp8_histories->to_host(host, stream_);
}

void GpuTransformer::fp8_histories_from_host(const std::vector<Fp8AmaxHistory>& host) {
  Impl& im = *impl_;
  if (!im.fp8_histories) return;
  const bool was_warm = im.fp8_histories->warm();
  im.fp8_histories->from_host(host, stream_);
  if (im.fp8_histories->warm() != was_warm) im.step_graphs.clear();  // they cast the other way
}

int64_t GpuTransformer::fp8_saturated() const {
  if (!impl_->fp8_saturated) return 0;
  uint64_t n = 0;
  CUDA_CHECK(cudaMemcpyAsync(&n, impl_->fp8_saturated, sizeof n, cudaMemcpyDeviceToHost, stream_));
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  return static_cast<int64_t>(n);
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

void GpuTransformer::forward_backward_body(const int32_t* tokens, const int32_t* targets, int B, int T,
                                           double loss_scale, bool overwrite, const Distillation* distill,
                                           bool reduce, bool prepare) {
  if (distill) {
    impl_->marks.mark(stream_, "teacher fwd");  // the teacher's own marks stay off
    distill->teacher->forward_body(tokens, B, T, false);
  }
  forward_body(tokens, B, T, prepare);
  head(targets, B, T, true, loss_scale, overwrite, distill);
  backward_body(tokens, B, T, overwrite, reduce);
}

void GpuTransformer::check_trains(const char* who) const {
  ESPLAG_CHECK(!opt_.forward_only, "GpuTransformer::", who, ": the model runs forward only (a teacher)");
}

void GpuTransformer::check_teacher(const Distillation& d) const {
  const GpuTransformer* t = d.teacher;
  ESPLAG_CHECK(t && t->opt_.forward_only, "GpuTransformer: a distillation teacher must be a forward_only model");
  ESPLAG_CHECK(t->stream_ == stream_, "GpuTransformer: the distillation teacher must run on its student's stream");
  ESPLAG_CHECK(t->cfg_.vocab_size == cfg_.vocab_size, "GpuTransformer: the teacher's vocabulary (",
               t->cfg_.vocab_size, ") is not the student's (", cfg_.vocab_size, ")");
  ESPLAG_CHECK(t->head_chunk_ >= head_chunk_ && t->max_b_ >= max_b_ && t->max_t_ >= max_t_,
               "GpuTransformer: the distillation teacher was sized for ", t->max_b_, " x ", t->max_t_, " and ",
               t->head_chunk_, " head rows, the student needs ", max_b_, " x ", max_t_, " and ", head_chunk_);
  // alpha and temperature: gpu::distill_cross_entropy checks them (in the eager first run of a graph's key).
}

void GpuTransformer::forward_backward_device(const int32_t* tokens, const int32_t* targets, int B, int T,
                                             double loss_scale, const Distillation* distill, bool reduce) {
  check_trains("forward_backward_device");
  ESPLAG_CHECK(!reduce || opt_.reduce_gradients,
               "GpuTransformer::forward_backward_device: reduce needs GpuModelOptions::reduce_gradients");
  check_batch(B, T);
  ESPLAG_CHECK(tokens && targets, "GpuTransformer::forward_backward_device: null tokens or targets");
  if (distill) check_teacher(*distill);
  Impl& im = *impl_;
  // After zero_grad the weight GEMMs write their gradients instead of adding to them.
  const bool overwrite = im.zero_pending;
  im.zero_pending = false;
  if (reduce) im.grads_reduced = true;
  const bool prepare = std::exchange(im.prepare_in_forward, false);
  if (!opt_.cuda_graph || im.marks.timing() || im.marks.tracing()) {
    forward_backward_body(tokens, targets, B, T, loss_scale, overwrite, distill, reduce, prepare);
    im.marks.end_ops();
    im.marks.collect(stream_);
    return;
  }
  const Distillation teaching = distill ? *distill : Distillation{nullptr, 0, 0};
  auto it = std::find_if(im.step_graphs.begin(), im.step_graphs.end(), [&](const Impl::StepGraph& g) {
    return g.tokens == tokens && g.targets == targets && g.B == B && g.T == T && g.loss_scale == loss_scale &&
           g.overwrite == overwrite && g.distill == teaching && g.reduce == reduce && g.prepare == prepare;
  });
  if (it == im.step_graphs.end()) {
    constexpr size_t kMaxGraphs = 8;
    if (im.step_graphs.size() == kMaxGraphs) {  // forget the least recently used
      auto lru = std::min_element(im.step_graphs.begin(), im.step_graphs.end(),
                                  [](const auto& a, const auto& b) { return a.last_use < b.last_use; });
      im.step_graphs.erase(lru);
    }
    im.step_graphs.push_back(
        {tokens, targets, B, T, loss_scale, overwrite, teaching, reduce, prepare, std::make_unique<Impl::Graph>(), 0});
    it = im.step_graphs.end() - 1;
  }
  it->last_use = ++im.graph_uses;
  run_as_graph(*it->graph, stream_, im.graph_launches,
               [&] { forward_backward_body(tokens, targets, B, T, loss_scale, overwrite, distill, reduce, prepare); });
}

void GpuTransformer::forward_loss_device(const int32_t* tokens, const int32_t* targets, int B, int T) {
  check_batch(B, T);
  // The histories are the training steps': an evaluation casts with current scaling.
  const DeviceFp8Histories::Pause forward_only(impl_->fp8_histories.get());
  forward_body(tokens, B, T, std::exchange(impl_->prepare_in_forward, false));
  head(targets, B, T, false, 1.0);
  impl_->marks.end_ops();
  impl_->marks.collect(stream_);
}

void GpuTransformer::forward_body(const int32_t* tokens, int B, int T, bool prepare) {
  Impl& im = *impl_;
  im.marks.mark(stream_, "embedding fwd");
  gpu::embedding_forward(im.layers.front().res_in, tokens, im.wte, im.wpe, B, T, cfg_.d_model, cfg_.vocab_size,
                         stream_);
  if (prepare) prepare_at(-1);
  for (int l = 0; l < cfg_.n_layer; ++l) {
    gather_ring_weights(l, false);
    if (prepare && im.ring_lowest[size_t(l)] >= 0) prepare_at(im.ring_lowest[size_t(l)]);
    block_forward(l, B, T, false);
  }
  im.marks.layer = -1;
  norm_forward(im, cfg_, stream_, nullptr, im.nf, im.s0, im.lnf_mean, im.lnf_rstd, im.res_f, im.layers.back().res_mid,
               im.s1, im.s1_scale, B * T);
}

void GpuTransformer::block_forward(int l, int B, int T, bool again) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, NH = cfg_.n_head, KV = cfg_.n_kv_head, HD = cfg_.head_dim(), H = cfg_.d_ff;
  auto mark = [&](std::string_view name, double flops = 0) { im.marks.mark(s, name, flops); };
  const double attn_flops = 2.0 * B * NH * double(T) * T * HD;  // causal: QKᵀ and PV on half the square
  // out = act(in · Wᵀ + b) [N, out] from in [N, in], as the layer's kind computes it.
  auto linear = [&](Impl::Slot* lin, const char* name, bf16* out, const bf16* in,
                    gpu::Gemm::Act act = gpu::Gemm::Act::none, bf16* pre_gelu = nullptr) {
    lin->top().forward(out, in, N, act, pre_gelu, name);
  };
  // The same where the next op reads `out` with its pending scale (GpuModelOptions::
  // fp8_producers): a 2:4 fp8 product leaves its output unscaled for that op.
  auto linear_leaving_scale = [&](Impl::Slot* lin, const char* name, bf16* out, const bf16* in) {
    if (opt_.fp8_producers) return lin->top().forward_leaving_scale(out, in, N, name);
    linear(lin, name, out, in);
    return gpu::PendingScale{};
  };
  bf16* tmp = reinterpret_cast<bf16*>(im.shared);  // ln1 / ln2 / act where the block recomputes them
  bf16* branch = im.s1;  // the previous block's mlp.proj output in, this block's out (dead in the backward)
  auto& L = im.layers[l];
  const auto& blk = im.blocks[l];
  im.marks.layer = l;
  bf16* ln1 = L.ln1 ? L.ln1 : tmp;
  // Again, from the kept input, which the forward's residual add wrote: the same bits (the
  // norm reads the sum as stored).
  DeviceLinear* qkv_codes = L.ln1 ? nullptr : &blk.qkv->top();
  if (l == 0 || again)
    norm_forward(im, cfg_, s, qkv_codes, blk.n1, ln1, L.ln1_mean, L.ln1_rstd, nullptr, L.res_in, nullptr, {}, N);
  else
    norm_forward(im, cfg_, s, qkv_codes, blk.n1, ln1, L.ln1_mean, L.ln1_rstd, L.res_in, im.layers[l - 1].res_mid,
                 branch, im.s1_scale, N);
  if (cfg_.pos == PosKind::rope) {  // RoPE's kernel applies qkv's scale
    const gpu::PendingScale qkv_scale = linear_leaving_scale(blk.qkv, "gemm qkv fwd", L.qkv, ln1);
    mark("rope fwd");
    gpu::rope_forward(L.qkv, qkv_scale, B, T, NH, KV, HD, cfg_.rope_theta, s);
  } else {
    linear(blk.qkv, "gemm qkv fwd", L.qkv, ln1);
  }
  mark("attention fwd", attn_flops);
  gpu::attention_forward(L.atty, L.lse, L.qkv, B, T, NH, KV, HD, im.shared, im.sizes.attn_ws, s, opt_.attention);
  im.s1_scale = linear_leaving_scale(blk.proj, "gemm proj fwd", branch, L.atty);
  bf16* ln2 = L.ln2 ? L.ln2 : tmp;
  norm_forward(im, cfg_, s, L.ln2 ? nullptr : &blk.fc->top(), blk.n2, ln2, L.ln2_mean, L.ln2_rstd, L.res_mid,
               L.res_in, branch, im.s1_scale, N);
  bf16* act = L.act;
  switch (cfg_.mlp) {
    case MlpKind::gelu:
      linear(blk.fc, "gemm fc fwd (+gelu)", L.act, ln2, gpu::Gemm::Act::gelu, L.fc);
      break;
    case MlpKind::swiglu:
      L.fc_scale = linear_leaving_scale(blk.fc, "gemm fc fwd", L.fc, ln2);  // SwiGLU's kernels apply it
      if (again && !L.act) return;  // the backward recomputes the activation itself
      mark("swiglu fwd");
      act = L.act ? L.act : tmp;
      if (!L.act && blk.mproj->top().takes_produced_fp8())
        // fp8, delayed scaling: the activation only as mproj's X codes (the backward recomputes it)
        gpu::fp8_swiglu_forward(blk.mproj->top().fp8_input_target(act, N), L.fc, L.fc_scale, N, H, s);
      else
        gpu::fused_swiglu_forward(act, L.fc, L.fc_scale, N, H, s);
      break;
    case MlpKind::relu2:
      linear(blk.fc, "gemm fc fwd", L.fc, ln2);
      if (again && !L.act) return;
      mark("relu2 fwd");
      act = L.act ? L.act : tmp;
      gpu::fused_relu2_forward(act, L.fc, int64_t(N) * H, s);
      break;
  }
  // The output, the next block's input, is kept there (or in res_f): not recomputed.
  if (!again) im.s1_scale = linear_leaving_scale(blk.mproj, "gemm mproj fwd", branch, act);
}

void GpuTransformer::head(const int32_t* targets, int B, int T, bool train, double loss_scale, bool overwrite,
                          const Distillation* distill) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, Vp = im.Vp;
  const int64_t N_max = int64_t(max_b_) * max_t_;  // the stride of im.losses' three parts
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
    im.marks.mark(s, "head gemm fwd", fl);
    im.gemm->forward(logits, h, W, nullptr, rows, C, Vp, s);
    if (distill) {
      const auto* teacher = static_cast<const bf16*>(distill->teacher->teacher_logits(r0, rows));
      im.marks.mark(s, "distillation loss");
      gpu::distill_cross_entropy(im.losses + r0, im.losses + N_max + r0, im.losses + 2 * N_max + r0, logits, teacher,
                                 targets + r0, rows, V, Vp, distill->alpha, distill->temperature, dloss, train, s);
    } else {
      im.marks.mark(s, "cross-entropy");
      gpu::softmax_cross_entropy(im.losses + r0, logits, targets + r0, rows, V, Vp, dloss, train, s);
    }
    if (train) {
      // The chunk's dlogits (now in logits, zero in the padding) give its rows of dlnf and
      // add into the head's weight gradient; the padded gradient starts over with each
      // micro-batch, the real one after zero_grad (overwrite).
      im.marks.mark(s, "head gemm dX", fl);
      im.gemm->backward_input(dlnf + size_t(r0) * C, logits, W, rows, C, Vp, false, s);
      im.marks.mark(s, "head gemm dW", fl);
      im.gemm->backward_weight(dW, nullptr, logits, h, rows, C, Vp, !((pad || overwrite) && r0 == 0), s);
    }
  }
  if (train && pad) {
    im.marks.mark(s, "head grad unpad");
    const int64_t n = int64_t(V) * C;
    add_kernel<<<blocks(n), kThreads, 0, s>>>(im.head_dw, im.head_dw_pad, n, !overwrite);
    CUDA_CHECK_LAUNCH("GpuTransformer (LM head gradient)");
  }
  im.marks.mark(s, "mean loss");
  mean_loss_kernel<<<distill ? 3 : 1, kLossThreads, 0, s>>>(loss_, im.losses, N, N_max);
  CUDA_CHECK_LAUNCH("GpuTransformer (mean loss)");
}

const void* GpuTransformer::teacher_logits(int row0, int rows) {
  Impl& im = *impl_;
  const int C = cfg_.d_model, Vp = im.Vp;
  bf16* logits = reinterpret_cast<bf16*>(im.shared);  // idle once the forward is done
  im.marks.mark(stream_, "teacher head gemm fwd", 2.0 * rows * C * Vp);
  im.gemm->forward(logits, im.s0 + size_t(row0) * C, im.head_pad ? im.head_pad : im.head_w, nullptr, rows, C, Vp,
                   stream_);
  return logits;
}

void GpuTransformer::backward_body(const int32_t* tokens, int B, int T, bool overwrite, bool reduce) {
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int N = B * T, C = cfg_.d_model, V = cfg_.vocab_size, NH = cfg_.n_head, KV = cfg_.n_kv_head,
            HD = cfg_.head_dim(), Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff;
  bf16* dres = im.s0;  // the residual-stream gradient
  bf16* dln = im.s1;   // the gradient w.r.t. a norm's output
  auto mark = [&](std::string_view name, double flops = 0) { im.marks.mark(s, name, flops); };
  // dinp = dout · W (times gelu'(pre_gelu) when given), as the layer's kind computes it.
  auto linear_dx = [&](Impl::Slot* lin, const char* name, bf16* dinp, const bf16* dout,
                       const bf16* pre_gelu = nullptr) { lin->top().backward_dx(dinp, dout, N, pre_gelu, name); };
  // The same where the next op reads dinp with its pending scale (`takes`, and GpuModelOptions::
  // fp8_producers): a 2:4 fp8 product leaves dinp unscaled for that op.
  auto linear_dx_leaving_scale = [&](Impl::Slot* lin, const char* name, bf16* dinp, const bf16* dout, bool takes) {
    if (takes && opt_.fp8_producers) return lin->top().backward_dx_leaving_scale(dinp, dout, N, name);
    linear_dx(lin, name, dinp, dout);
    return gpu::PendingScale{};
  };
  // Bias gradients: with the fused norm backward, those of attn.proj and mlp.proj (whose
  // output gradient is dres right after a norm backward) come out of that norm backward
  // (next_bias), those of qkv and fc from column sums; otherwise from the GEMM epilogue.
  const bool fz = im.fused_norm;
  auto bias_sum = [&](float* db, const bf16* dout, int OC) {
    if (!fz || !db) return;
    mark("bias grad");
    gpu::column_sum_add(db, dout, N, OC, im.colsum_scratch, im.colsum_scratch_bytes, s);
  };
  // dres += the norm's input gradient from dln (with its pending scale: fused norm backward only).
  auto norm_bwd = [&](const Impl::Norm& n, const bf16* inp, const float* mean, const float* rstd, float* next_bias,
                      gpu::PendingScale dln_scale) {
    mark("norm bwd");
    norm_backward(im, cfg_, s, n, dres, dln, dln_scale, inp, mean, rstd, next_bias, N);
  };
  auto norm_again = [&](Impl::Slot* next, const Impl::Norm& n, bf16* out, const bf16* inp, const float* mean,
                        const float* rstd) { norm_recompute(im, cfg_, s, next->top(), n, out, inp, mean, rstd, N); };
  unsigned char* const shared = im.shared;
  const SharedSizes& z = im.sizes;
  // ZeRO stage 2: the blocks' gradients go into the ring's slots, fresh in every micro-batch.
  const bool ring = im.grad_shard != nullptr;
  // The Linear weight gradients: add, or write after zero_grad (or into a slot).
  const bool acc = !overwrite && !ring;
  // Collectives during the backward: every bucket's in the step's last micro-batch, the
  // ring's in every one.
  const bool collect = reduce || ring;
  // dW (+)= doutᵀ · inp, and the bias gradient unless the fused norm backward gives it.
  auto linear_dw = [&](Impl::Slot* lin, const char* name, const bf16* dout, const bf16* inp) {
    lin->top().backward_dw(dout, inp, N, acc, !fz, name);
  };

  for (auto& [name, slot] : im.linears) slot.top().begin_backward();
  ready_ring_slot_below(cfg_.n_layer);
  mark("memset dres");
  CUDA_CHECK(cudaMemsetAsync(dres, 0, sizeof(bf16) * size_t(N) * C, s));
  norm_bwd(im.nf, im.res_f, im.lnf_mean, im.lnf_rstd, im.blocks.back().mproj->db, {});  // dln holds dlnf from the head
  if (collect) reduce_buckets_after(GradientBucket::kAfterHead, reduce, overwrite);
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    im.marks.layer = l;
    auto& L = im.layers[l];
    const auto& blk = im.blocks[l];
    gather_ring_weights(l, true);
    // Full checkpointing: the block's forward again, into the buffers the recomputed blocks
    // share (the last such block's backward is done with them). It uses s1 and the shared
    // region, both dead between two blocks' backwards; dres (s0) is untouched.
    if (L.recomputed) block_forward(l, B, T, true);
    // MLP half: dres = d(res_out) = d(res_mid) through the residual.
    const bf16* ln2 = L.ln2;
    gpu::PendingScale dln_scale;  // of fc's and then qkv's dX in dln, for the fused norm backward
    if (cfg_.mlp == MlpKind::gelu) {
      bf16* dfc = reinterpret_cast<bf16*>(shared);
      linear_dw(blk.mproj, "gemm mproj dW", dres, L.act);
      linear_dx(blk.mproj, "gemm mproj dX (+dgelu)", dfc, dres, L.fc);  // dfc = (dres · Wmproj) ∘ gelu'(fc)
      if (!ln2) {
        bf16* t = reinterpret_cast<bf16*>(shared + z.gelu_dfc);
        norm_again(blk.fc, blk.n2, t, L.res_mid, L.ln2_mean, L.ln2_rstd);
        ln2 = t;
      }
      linear_dw(blk.fc, "gemm fc dW", dfc, ln2);
      bias_sum(blk.fc->db, dfc, F);
      dln_scale = linear_dx_leaving_scale(blk.fc, "gemm fc dX", dln, dfc, fz);
    } else {
      // dact, then (recompute) the activation over it, then ln2; dfc replaces fc.
      bf16* dact = reinterpret_cast<bf16*>(shared);
      DeviceLinear &fc = blk.fc->top(), &mproj = blk.mproj->top();
      const gpu::PendingScale dact_scale =  // SwiGLU's backward applies it
          linear_dx_leaving_scale(blk.mproj, "gemm mproj dX", dact, dres, cfg_.mlp == MlpKind::swiglu);
      bf16* act_out = L.act ? nullptr : dact;
      mark(cfg_.mlp == MlpKind::swiglu ? "swiglu bwd" : "relu2 bwd");
      if (cfg_.mlp == MlpKind::relu2)
        gpu::fused_relu2_backward(L.fc, act_out, L.fc, dact, int64_t(N) * H, s);
      else if (!blk.fc->db && fc.takes_produced_fp8() && mproj.takes_produced_fp8())
        // fp8, delayed scaling: fc's dY and the activation again (mproj's Xᵀ) only as codes
        gpu::fp8_swiglu_backward(fc.fp8_grad_target(L.fc, N), mproj.fp8_input_t_target(N), L.fc, L.fc_scale, dact,
                                 dact_scale, N, H, s);
      else
        gpu::fused_swiglu_backward(L.fc, act_out, L.fc, L.fc_scale, dact, dact_scale, N, H, s);
      linear_dw(blk.mproj, "gemm mproj dW", dres, L.act ? L.act : act_out);
      if (!ln2) {
        bf16* t = reinterpret_cast<bf16*>(shared);
        norm_again(blk.fc, blk.n2, t, L.res_mid, L.ln2_mean, L.ln2_rstd);
        ln2 = t;
      }
      const bf16* dfc = L.fc;
      linear_dw(blk.fc, "gemm fc dW", dfc, ln2);
      bias_sum(blk.fc->db, dfc, F);
      dln_scale = linear_dx_leaving_scale(blk.fc, "gemm fc dX", dln, dfc, fz);
    }
    norm_bwd(blk.n2, L.res_mid, L.ln2_mean, L.ln2_rstd, blk.proj->db, dln_scale);
    // Attention half: dres = d(res_mid) = d(res_in) through the residual. dqkv and datty
    // go into the layer's fc storage (dead now) when they fit, else into the shared region.
    unsigned char* region = z.attn_in_fc ? reinterpret_cast<unsigned char*>(L.fc) : shared;
    bf16* dqkv = reinterpret_cast<bf16*>(region);
    bf16* datty = reinterpret_cast<bf16*>(region + z.dqkv);
    void* ws = z.attn_in_fc ? shared : shared + z.dqkv + z.datty_slot;
    linear_dw(blk.proj, "gemm proj dW", dres, L.atty);
    linear_dx(blk.proj, "gemm proj dX", datty, dres);
    mark("attention bwd", 5.0 * B * NH * double(T) * T * HD);
    gpu::attention_backward(dqkv, datty, L.qkv, L.atty, L.lse, B, T, NH, KV, HD, ws, z.attn_ws, s, opt_.attention);
    if (cfg_.pos == PosKind::rope) {
      mark("rope bwd");
      gpu::rope_backward(dqkv, B, T, NH, KV, HD, cfg_.rope_theta, s);
    }
    const bf16* ln1 = L.ln1;
    if (!ln1) {
      norm_again(blk.qkv, blk.n1, datty, L.res_in, L.ln1_mean, L.ln1_rstd);  // datty is dead after the attention bwd
      ln1 = datty;
    }
    linear_dw(blk.qkv, "gemm qkv dW", dqkv, ln1);
    bias_sum(blk.qkv->db, dqkv, Q);
    dln_scale = linear_dx_leaving_scale(blk.qkv, "gemm qkv dX", dln, dqkv, fz);
    ready_ring_slot_below(l);
    norm_bwd(blk.n1, L.res_in, L.ln1_mean, L.ln1_rstd, l > 0 ? im.blocks[l - 1].mproj->db : nullptr, dln_scale);
    if (collect) reduce_buckets_after(l, reduce, overwrite);
  }
  im.marks.layer = -1;
  mark("embedding bwd");
  gpu::embedding_backward(im.dwte, im.dwpe, dres, tokens, B, T, C, V, im.emb_ws, im.emb_ws_bytes, s);
  if (collect) reduce_buckets_after(GradientBucket::kAfterBackward, reduce, overwrite);
}

void GpuTransformer::reduce_buckets_after(int l, bool reduce, bool overwrite) {
  Impl& im = *impl_;
  // For the profiler, each bucket is a buffer (named by its first element): a zero-length
  // op on stream_ writes it where it is ready, its collective on the comm stream reads and
  // writes it, and a zero-length op on stream_ after the join reads them all, so that the
  // graph has the edges across the two streams (docs/profiler.md). The zero-length ops are
  // of category other, so that a what-if on comm counts the collectives only.
  const bool tracing = im.marks.tracing();
  if (tracing) im.marks.end_ops();
  const int layer = std::max(l, -1);  // the ops' block (-1: none)
  bool forked = false;
  for (size_t i = 0; i < im.buckets.size(); ++i) {
    const GradientBucket& b = im.buckets[i];
    const int slot = im.grad_storage.slot[i];
    if (b.after_block != l || (!reduce && slot < 0)) continue;
    float* data = im.grad + im.grad_storage.offset[i];
    const double bytes = sizeof(float) * double(b.end - b.begin);
    const std::string name = tracing ? "grad_buckets." + std::to_string(i) : std::string();
    { ScopedOp ready({name, "ready"}, OpCategory::other, layer, 0, 0, {}, {data}, OpStream(stream_)); }
    if (!forked) {  // the bucket's gradients are queued on stream_ before this point
      CUDA_CHECK(cudaEventRecord(im.grads_ready, stream_));
      CUDA_CHECK(cudaStreamWaitEvent(im.comm_stream, im.grads_ready));
      forked = true;
    }
    if (DeviceCollectives* ranks = opt_.shard_optimizer) {  // ZeRO: this rank's slice (impl.h, Impl::slices)
      const Impl::Slice& sl = im.slices[i];
      float* mine = data + size_t(ranks->rank()) * sl.size;  // in place
      ScopedOp op({name, "reduce_scatter"}, OpCategory::comm, layer, 0, bytes, {data}, {data},
                  OpStream(im.comm_stream));
      if (!im.grad_shard) {
        ranks->reduce_scatter_mean(data, mine, sl.size, im.comm_stream);
      } else if (slot < 0 || overwrite) {
        ranks->reduce_scatter_mean(data, im.grad_shard + sl.shard_at, sl.size, im.comm_stream);
      } else {  // a later micro-batch's mean adds into the slices'
        ranks->reduce_scatter_mean(data, mine, sl.size, im.comm_stream);
        add_kernel<<<blocks(int64_t(sl.size)), kThreads, 0, im.comm_stream>>>(im.grad_shard + sl.shard_at, mine,
                                                                              int64_t(sl.size), true);
        CUDA_CHECK_LAUNCH("GpuTransformer (sharded gradient accumulation)");
      }
      if (slot >= 0) CUDA_CHECK(cudaEventRecord(im.slot_free[size_t(slot)], im.comm_stream));
    } else {
      ScopedOp op({name, "all_reduce"}, OpCategory::comm, layer, 0, bytes, {data}, {data}, OpStream(im.comm_stream));
      opt_.reduce_gradients->all_reduce_mean(data, b.end - b.begin, im.comm_stream);
    }
  }
  if (l != GradientBucket::kAfterBackward) return;
  // Joins stream_ (and so a captured graph) with every collective queued.
  CUDA_CHECK(cudaEventRecord(im.comm_done, im.comm_stream));
  CUDA_CHECK(cudaStreamWaitEvent(stream_, im.comm_done));
  if (tracing) {
    std::vector<const void*> all;
    for (size_t i = 0; i < im.buckets.size(); ++i) all.push_back(im.grad + im.grad_storage.offset[i]);
    ScopedOp joined({"grad_buckets", "joined"}, OpCategory::other, -1, 0, 0, BufferList(all), {}, OpStream(stream_));
  }
}

void GpuTransformer::gather_ring_weights(int l, bool backward) {
  const Impl& im = *impl_;
  if (!im.w_own) return;
  const int p = backward ? im.ring_highest[size_t(l)] : im.ring_lowest[size_t(l)];
  if (p >= 0) gather_ring_at(p, backward, l);
}

void GpuTransformer::gather_ring_at(int p, bool backward, int l) {
  Impl& im = *impl_;
  const int K = int(im.ring_order.size()), S = im.grad_storage.slots;
  // The positions in ring_order to gather now, into slots whose buckets stream_ is done with.
  std::vector<int> due;
  if (!backward && p == 0) {
    for (int q = 0; q < std::min(S, K); ++q) due.push_back(q);
  } else if (!backward) {
    if (p + S - 1 < K) due.push_back(p + S - 1);  // into the slot of bucket p - 1
  } else if (p + 1 < K && p + 1 - S >= 0 && p + 1 - S < K - S) {
    due.push_back(p + 1 - S);  // into the slot of bucket p + 1; the forward left the top S there
  }
  const bool tracing = im.marks.tracing();
  if (tracing) im.marks.end_ops();
  if (!due.empty()) {
    CUDA_CHECK(cudaEventRecord(im.slot_released, stream_));
    CUDA_CHECK(cudaStreamWaitEvent(im.comm_stream, im.slot_released));
  }
  for (int q : due) {
    const size_t i = im.ring_order[size_t(q)];
    const size_t bytes = sizeof(bf16) * im.slices[i].size;
    bf16* slot = im.bucket_weights(i);
    const std::string name = tracing ? "weight_buckets." + std::to_string(i) : std::string();
    {
      ScopedOp op({name, "all_gather"}, OpCategory::comm, l, 0, double(bytes) * opt_.shard_optimizer->size(),
                  {im.master_hi(i)}, {slot}, OpStream(im.comm_stream));
      gather_bucket_weights(i, im.comm_stream);
    }
    CUDA_CHECK(cudaEventRecord(im.weights_gathered[size_t(im.grad_storage.slot[i])], im.comm_stream));
  }
  im.marks.mark(stream_, "weight ring slot");
  CUDA_CHECK(cudaStreamWaitEvent(stream_, im.weights_gathered[size_t(im.grad_storage.slot[im.ring_order[size_t(p)]])]));
}

void GpuTransformer::adamw_body() {
  Impl& im = *impl_;
  // Over the storage layout: a Linear weight in its layer's form (slope: the kept values
  // only, the CPU's sparse AdamW).
  if (DeviceCollectives* ranks = opt_.shard_optimizer) {
    // ZeRO stage 1: this rank's slices of the mean gradient, the norm over every slice, the
    // slices' update, and every rank's updated bf16 weights (the low halves when needed).
    if (!im.grads_reduced) {  // else the backward averaged them all already (the ring's, always)
      im.marks.mark(stream_, "reduce-scatter (gradients)");
      ranks->group_begin();
      for (size_t k = 0; k < im.slices.size(); ++k)
        if (im.grad_storage.slot[k] < 0)
          ranks->reduce_scatter_mean(im.grad + im.grad_storage.offset[k], im.slice_grad(k), im.slices[k].size, stream_);
      ranks->group_end();
    }
    im.marks.mark(stream_, "grad norm");
    for (size_t k = 0; k < im.slices.size(); ++k)
      gpu::sum_squares(im.norm_parts + k, im.slice_grad(k), int64_t(im.slices[k].size), im.gnorm_scratch, stream_);
    sum_parts_kernel<<<1, 1, 0, stream_>>>(norm_sq_, im.norm_parts, int(im.slices.size()));
    CUDA_CHECK_LAUNCH("GpuTransformer (gradient norm)");
    ranks->all_reduce_sum(norm_sq_, 1, stream_);
    im.marks.mark(stream_, "adamw");
    for (size_t k = 0; k < im.slices.size(); ++k) {
      const Impl::Slice& sl = im.slices[k];
      gpu::adamw_update_split(*im.adamw[k], im.master_hi(k), im.master_lo(k), im.m_shard + sl.shard_at,
                              im.v_shard + sl.shard_at, im.slice_grad(k), im.adam_params, norm_sq_, nullptr, nullptr,
                              stream_);
    }
    im.marks.mark(stream_, "all-gather (weights)");
    if (im.w_own) {  // ZeRO stage 3: the blocks' weights are gathered where they are used
      gather_rest_weights();
    } else {
      ranks->group_begin();
      for (size_t k = 0; k < im.slices.size(); ++k) gather_bucket_weights(k, stream_);
      ranks->group_end();
      im.lo_stale = true;
    }
    refresh_head_copy();
  } else {
    im.marks.mark(stream_, "grad norm");
    gpu::sum_squares(norm_sq_, im.grad, int64_t(nstored_), im.gnorm_scratch, stream_);
    im.marks.mark(stream_, "adamw");
    gpu::adamw_update_split(*im.adamw.front(), im.w, im.w_lo, im.m, im.v, im.grad, im.adam_params, norm_sq_,
                            im.head_pad, im.weight_amax, stream_);
    for (const auto& [k, slot] : im.weight_amax_takers) {  // still takers: a kind may have changed since the plan
      DeviceLinear& layer = slot->top();
      if (layer.takes_weight_amax()) layer.weight_amax_taken(im.weight_amax + k);
    }
  }
  // The layers' own work after the update (a masked layer zeroes its pruned weights), then
  // their preparation for the next step.
  const char* after = nullptr;
  for (auto& [name, slot] : im.linears)
    if (!after) after = slot.top().after_optimizer_step_op();
  if (after) im.marks.mark(stream_, after);
  for (auto& [name, slot] : im.linears) slot.top().after_optimizer_step();
  const bool refreshes = std::find(im.refreshing.begin(), im.refreshing.end(), true) != im.refreshing.end();
  if (im.w_own && !refreshes && any_prepares())
    im.prepare_in_forward = true;  // saves gathering every bucket once more
  else
    prepare_layers();
}

bool GpuTransformer::any_prepares() const {
  for (const auto& [name, slot] : impl_->linears)
    if (slot.top().prepares()) return true;
  return false;
}

void GpuTransformer::prepare_layers() {
  Impl& im = *impl_;
  im.prepare_in_forward = false;
  if (!any_prepares()) return;
  prepare_at(-1);
  // Under ZeRO stage 3 in the forward's order, each bucket gathered one ahead while the bucket
  // before prepares, as in the forward.
  for (int p = 0; p < int(im.ring_order.size()); ++p) {
    gather_ring_at(p, false, int(im.buckets[im.ring_order[size_t(p)]].after_block));
    prepare_at(p);
  }
}

void GpuTransformer::prepare_at(int p) {
  Impl& im = *impl_;
  size_t k = 0;  // index into im.refreshing and im.ring_position, in im.linears' order
  for (auto& [name, slot] : im.linears) {
    const bool refresh = k < im.refreshing.size() && im.refreshing[k];
    if (im.ring_position[k++] != p || !slot.top().prepares()) continue;
    im.marks.layer = layer_of(name);
    im.marks.mark(stream_, "sparse prepare (2:4 prune + compress)", 0,
                  im.marks.tracing() ? module_of(name) + ".sparsify" : "");
    slot.top().prepare(refresh);
  }
  im.marks.layer = -1;
}

void GpuTransformer::step_adamw(const GpuAdamW& hyper) {
  check_trains("step_adamw");
  // With eps 0, a zero gradient on zero moments divides 0 by 0 (a vnm layer's pruned
  // weights, which the step is trusted to keep at zero; embedding rows no token used).
  ESPLAG_CHECK(hyper.eps > 0, "GpuTransformer::step_adamw: eps must be > 0, got ", hyper.eps);
  Impl& im = *impl_;
  settle_zero_grad();
  settle_moments();
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
  // The preparation serves step step_ + 1: the layers due then choose new masks.
  im.refreshing.clear();
  for (const auto& [name, slot] : im.linears) im.refreshing.push_back(slot.top().refresh_due(step_ + 1));
  // Sharded, the step runs eagerly: its collectives stay out of captured graphs, as the
  // data-parallel all-reduce does.
  if (!opt_.cuda_graph || opt_.shard_optimizer || im.marks.timing() || im.marks.tracing()) {
    adamw_body();
    im.marks.end_ops();
    im.marks.collect(stream_);
  } else {
    run_as_graph(im.adam_graphs[im.refreshing], stream_, im.graph_launches, [&] { adamw_body(); });
  }
  if (DeviceFp8Histories* h = im.fp8_histories.get()) {
    if (opt_.fp8_amax_ranks) h->reduce_max(*opt_.fp8_amax_ranks, stream_);
    const bool was_warm = h->warm();
    h->roll(stream_);
    if (!was_warm) {  // the step graphs captured so far run the first step's amax passes
      synchronize();
      im.step_graphs.clear();
    }
  }
  size_t k = 0;
  for (auto& [name, slot] : im.linears)
    if (im.refreshing[k++]) slot.top().masks_refreshed(step_ + 1);
  im.refreshing.clear();
  im.grads_reduced = false;
  ++step_;
}

double GpuTransformer::last_grad_norm() {
  CUDA_CHECK(cudaMemcpyAsync(impl_->host_norm, norm_sq_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return std::sqrt(static_cast<double>(*impl_->host_norm));
}

}  // namespace esplag
