// The transformer on the GPU: the CUDA counterpart of Transformer<float>
// (model/transformer.h), with the same ModelConfig, the same parameter names and the same
// flat parameter layout, so a CPU model's (or checkpoint's) flat vector loads directly.
// Block Linear layers may be dense, masked, vnm, semi_sparse, semi_sparse_activation or
// slope (set_linear_kind), slope with its lazy low-rank adapter: each a DeviceLinear
// (model/device_linear.h) of its kind's class, which the model calls without knowing the kind.
//
// Device state, in two DeviceArenas. The parameter state: the bf16 weights that forward
// and backward read together with the low 16 bits of the fp32 master weights
// (ops/gpu_fused.h: the master is recovered exactly from the two halves, so weights cost 4
// bytes per parameter, not 6), fp32 gradients and AdamW moments (fp32), in the storage
// layout: the flat layout's tensors in its order, except that a slope layer's weight is
// stored as its kept values only ([out, in/2], set_linear_kind), so its master, gradient
// and moments take half the memory, then the slope layers' low-rank adapters; the arena
// is laid out again when layers become or stop being slope or an adapter changes. The
// step arena, sized up front for the largest (B, T) the model will see: the activations
// saved for backward, one scratch region shared by the phases of the step, and the GEMM
// workspace. A step allocates nothing and synchronises with the host only to read the
// loss back (in the host-pointer forward_backward / forward_loss);
// forward_backward_device and step_adamw never wait for the device.
//
// Memory of a step (N = B·T rows, C model width, Q qkv width, F fc width, H MLP hidden):
// - saved per layer: the residual stream before each half (2·N·C), qkv after RoPE (N·Q),
//   the attention output (N·C) and its log-sum-exp, the fc output (N·F: the MLP's
//   pre-activation) and the norms' statistics; without `recompute` also both norm outputs
//   (2·N·C) and the MLP activation (N·H); with GELU the activation always (it comes out of
//   the fc GEMM's epilogue). With full activation checkpointing a checkpointed layer keeps
//   its input (N·C) only, and the checkpointed layers share one set of the rest;
// - shared: two N·C buffers (the residual-stream gradient and the norm-input gradient in
//   backward, which hold the branch output and the final norm's output in forward and in
//   the LM head) and one scratch region used in turn by the forward's temporaries, the LM
//   head's logits chunk, the MLP backward and the attention backward (and its workspace).
//   The SwiGLU / ReLU² backward writes the pre-activation gradient over the layer's saved
//   fc output, and the attention backward then takes its dqkv and dout buffers from that
//   same dead fc storage when they fit, so backward needs no per-layer gradient buffers.
// - zero_grad is lazy for the weight gradients of the Linear layers and the LM head: the
//   next backward's GEMMs write them instead of adding (see zero_grad).
//
// LM head: when vocab_size is not a multiple of 64 the head runs on the vocabulary padded
// to a multiple of 128 (a zero-padded bf16 copy of the head weight, rewritten by AdamW in
// the same pass as the weight, and an fp32 gradient scratch of that size), because
// cuBLASLt has only slow kernels for rows of odd length; results are those of the
// unpadded head.
//
// CUDA graphs (GpuModelOptions::cuda_graph): forward_backward_device and step_adamw are
// each captured once and replayed. A forward_backward_device graph belongs to one
// (tokens, targets, B, T, loss_scale, whether it is the first micro-batch after
// zero_grad); the first call with such a key runs eagerly (it builds the cuBLASLt and
// attention plans and loads the kernels outside any capture), the second captures and
// replays, later ones replay; up to 8 keys are kept. step_adamw
// writes the step's hyper-parameters (learning rate, bias corrections, clipping, scale)
// into device memory before it replays, so nothing that changes from step to step is
// baked into the graph. Results are bit-identical to eager execution: the same kernels
// run on the same buffers. A capture that fails (a library refusing stream capture)
// leaves that call eager, with one warning on stderr.
//
// Numerics: activations and activation gradients are bf16 (the residual stream too:
// the fused norm kernels round a + b to bf16), every sum is fp32, parameter gradients
// accumulate in fp32. Deterministic: every kernel has a fixed summation order and
// cuBLASLt's algorithm is fixed per shape, so the same inputs give the same bits on the
// same GPU model and library version, with or without `recompute`, `cuda_graph` or checkpointing
// (`fused_norm_backward` sums the norm and bias gradients in another fixed order).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "model/gpu_transformer.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/device_arena.h"
#include "core/device_collectives.h"
#include "model/activation_checkpointing.h"
#include "model/config.h"
#include "model/linear_kinds.h"
#include "model/linear_precision.h"
#include "model/linear_semi_sparse.h"
#include "model/transformer.h"
#include "ops/gpu_attention.h"

namespace esplag {

class DeviceLinear;
struct DeviceLinearParams;
struct DeviceTensorView;

struct GpuModelOptions {
  // Rows of the LM head computed at once (logits chunk [rows, vocab] in bf16). 0: the
  // largest multiple of 128 whose chunk fits in head_chunk_bytes (or in the shared
  // scratch region, when the backward makes that larger), at least 128.
  int head_chunk_rows = 0;
  size_t head_chunk_bytes = size_t(1) << 30;  // fewer chunks: fewer passes over the head's fp32 gradient
  // Recompute in backward what is cheap to recompute instead of saving it: both norm
  // outputs of every layer (from the saved input and statistics, with the forward's own
  // kernel) and the SwiGLU / ReLU² output (in the pass that computes its gradient). The
  // gradients are bit-identical to recompute = false; it costs about one extra pass over
  // 2·N·C per layer and saves 2·N·C + N·H bf16 per layer.
  bool recompute = true;
  // Activation checkpointing (docs/config.md, train.checkpointing): which blocks keep less
  // for the backward. Blocks 0, every, 2·every, ... are checkpointed (every >= 1).
  // - full: a checkpointed block keeps its input (res_in, N·C) only; all else it saves lives
  //   in one set of buffers the checkpointed blocks share, and its backward first runs its
  //   forward again into that set from the kept input (the norms, the qkv, attn.proj and fc
  //   Linear forwards, RoPE, the attention, and the MLP activation where `recompute` does
  //   not recompute it anyway; not mlp.proj, whose output is the next block's input).
  // - selective: a checkpointed block keeps the outputs of its Linear layers (qkv after
  //   RoPE, fc), the attention output with its log-sum-exp and the residual stream, and
  //   recomputes both norms and the SwiGLU / ReLU² output as `recompute` does: with
  //   recompute on that is what every block does already (the attention keeps no
  //   probabilities), so it saves memory only with recompute off.
  // Gradients are bit-identical to `none`: the same kernels run on the same inputs.
  ActivationCheckpointing checkpointing;
  // Optimizer offload (docs/memory.md, train.offload): the AdamW moments (offload_moments)
  // and also the low halves of the master weights (offload_master, which needs
  // offload_moments) live in pinned host memory mapped into the device (DeviceArena::Memory::
  // pinned_host) instead of the parameter arena: 8 (10) of the 16 bytes a parameter takes on
  // the device. Every kernel reaches them with the same pointers, so results are
  // bit-identical to no offload; the AdamW update then streams them across PCIe (8 bytes read
  // and 8 written per offloaded parameter for the moments, 2 and 2 for the master halves).
  bool offload_moments = false;
  bool offload_master = false;
  // ZeRO stage 1 (docs/distributed.md): the data-parallel ranks of `shard_optimizer` share
  // the AdamW moments. Every gradient bucket (one of the whole storage layout without
  // reduce_gradients) is padded to one equal slice per rank, a multiple of 64 elements
  // (model/gradient_buckets.h, shard_gradient_buckets); a rank keeps the moments of its
  // slices only (on the device, or offloaded), 8/ranks bytes per parameter instead of 8.
  // The backward (with reduce_gradients) or step_adamw reduce-scatters each bucket's
  // gradients (the mean over the ranks); step_adamw takes the global gradient norm from
  // every slice's sum of squares, updates its slices and all-gathers the updated bf16
  // weights, so every rank holds them whole, as without sharding; the master weights' low
  // halves are all-gathered only when something reads them whole (gather_master_low).
  // Whatever needs the moments in the whole layout (their host copies, a kind change that
  // lays the state out again) gathers them first into pinned host memory
  // (gather_optimizer_state), a collective; the next step_adamw drops that copy.
  // Null: no sharding. The communicator must outlive the model.
  DeviceCollectives* shard_optimizer = nullptr;
  // ZeRO stage 2 (needs shard_optimizer): the gradients sharded too. A rank keeps the mean
  // gradient of its slices only (4/ranks bytes per parameter); the buckets launched after a
  // block's backward (reduce_gradients' buckets) are written into a ring of two slots
  // (model/gradient_buckets.h, GradientStorage) and reduce-scattered from there in every
  // micro-batch's backward, adding into the rank's slices; the rest keeps a buffer of its
  // own, accumulated over the micro-batches and reduce-scattered with the last one (or by
  // step_adamw). So every forward_backward_device call is a collective, and every rank
  // must make the same calls. The whole gradients exist nowhere: what reads them
  // (grads_to_host, device_gradients) is refused, lora_state leaves them out. Without
  // reduce_gradients' buckets every gradient is the rest's: stage 1's memory.
  bool shard_gradients = false;
  // ZeRO stage 3 (needs shard_gradients): the parameters sharded too. A rank keeps the master
  // weights (both halves) of its slices only (4/ranks bytes per parameter); the bf16 weights
  // of the blocks' buckets exist only while they are used: each is all-gathered into the
  // ring slot its gradients use (the same two slots' worth of bf16), in the forward one
  // bucket ahead of the block that needs it, and again in the backward (but for the two
  // buckets the forward left in the slots), on the collectives' stream. The rest (the
  // embeddings, the final norm and the LM head) stays whole on every rank, all-gathered
  // after each update as in stage 1. So the forward (forward_loss too) is a collective.
  // Layers that prepare per step (slope, semi_sparse, fp8's casts) prepare in the next
  // forward, each bucket's layers from the gather there (after an update that refreshes a
  // mask, and after set_params / init_weights: at once, bucket by bucket). What reads or
  // writes the whole master weights (params_to_host, set_params, stored_to_host /
  // stored_from_host of weights) assembles them over the ranks, a collective. Refused under
  // stage 3 (set_linear_kinds): layers that rewrite their weights after the update (masked,
  // vnm) or own extra tensors (adapters), and any kind change once the weights are set.
  // Without block buckets it keeps stage 2's memory.
  bool shard_parameters = false;
  // Data parallel (docs/distributed.md): the ranks whose mean gradient every step takes. A
  // forward_backward_device call that reduces (a step's last micro-batch) averages each
  // bucket of gradients over them (model/gradient_buckets.h: consecutive blocks of at least
  // bucket_bytes) on a stream of its own as soon as the backward has finished the bucket, so
  // that the collectives run during the rest of the backward; the call's work ends when the
  // last one has. bucket_bytes 0: one collective over every gradient after the backward.
  // With shard_optimizer (the same ranks) each bucket is reduce-scattered instead, and
  // step_adamw takes the rank's slices of the averaged gradients as they are. Null: the
  // caller averages them, if anyone.
  // The communicator must outlive the model.
  DeviceCollectives* reduce_gradients = nullptr;
  size_t bucket_bytes = size_t(25) << 20;
  // Delayed fp8 scaling (precision.delayed()), data parallel: the ranks whose largest amaxes
  // each step's histories take before step_adamw rolls them, so that every rank scales alike
  // (as one process running all the ranks' batches would). Null: one process. The
  // communicator must outlive the model.
  DeviceCollectives* fp8_amax_ranks = nullptr;
  // The block Linear layers' products (train.precision, docs/fp8.md): with precision.fp8 a
  // dense layer (and masked, vnm: the dense products of their masked weights) multiplies
  // e4m3 activations and weights and precision.grad output gradients on cuBLASLt's fp8 GEMMs
  // (fp32 accumulation; cuBLASLt's fast accumulation in the forward product only), and slope
  // and semi_sparse e4m3 2:4 products on cuSPARSELt (or the dense fp8 ones where slope's timed
  // dispatch picks them). Each operand has a per-tensor scale from its current amax, or for X
  // and dY from its amax history (precision.delayed(), model/cuda/fp8_histories.h). The LM
  // head, attention and the other ops stay bf16.
  LinearPrecision precision;
  // With delayed fp8 scaling, warm: the ops that make the fp8 layers' operands (dense, masked,
  // vnm, slope, semi_sparse) write their fp8 codes themselves (SwiGLU's forward and backward,
  // the norms' forward and the backward's recomputed norms, where the block does not keep
  // their outputs) instead of bf16 values that the layers then cast; the
  // same codes bit for bit, fewer passes over memory (docs/fp8.md). With any fp8 scaling,
  // the ops that read a 2:4 fp8 product's output also apply its scale as they load it
  // (gpu::PendingScale), so the product's own pass over its output does not run: SwiGLU
  // (fc's forward, mproj's input gradient), RoPE (qkv's forward), the norms' residual add
  // (the forwards of attn.proj and mproj) and the fused norm backward (the input gradients
  // of qkv and fc). false: the casts and those passes (tests hold the two ways to the same
  // bits).
  bool fp8_producers = true;
  // Replay forward_backward_device and step_adamw as CUDA graphs (see the top of the file).
  bool cuda_graph = true;
  // Norm backwards in one pass that also sums the norm's weight (and bias) gradients and
  // the bias gradient of the Linear layer before the norm's input (ops/gpu_fused.h), and
  // the other bias gradients as column sums, instead of the op kernels' separate
  // reduction passes and cuBLASLt's bias-gradient epilogue. Used where d_model % 8 == 0
  // and d_model <= 2048. Another summation order for those gradients, not other results.
  bool fused_norm_backward = true;
  // Fused cuBLASLt epilogues (bias, GELU); off forces the separate kernels.
  bool gemm_epilogues = true;
  gpu::AttentionPath attention = gpu::AttentionPath::automatic;
  // Per-layer dispatch of semi_sparse, semi_sparse_activation and slope layers: the first
  // layer of each kind and shape times its 2:4 products (with their per-step compression)
  // against cuBLASLt's products of the same pruned operands (semi_sparse: Ws; slope: W1 and
  // W2ᵀ expanded from the kept values for each product; semi_sparse_activation: the
  // forward of the pruned input) and every layer of that kind and shape takes the faster
  // (sparse_dispatch()). Off: the 2:4 products everywhere.
  bool sparse_dispatch = true;
  // A kind change that lays the parameter state out again moves it on the device when there
  // is room for both layouts. Off: always through the host (what a device without that
  // room does).
  bool kind_change_on_device = true;
  // Block Linear weights stored as their kept values ([out, in/2], slope) in the largest
  // layout the model will hold: memory_plan, and the constructor's check of the device's
  // free memory, count them so (else every weight dense, the largest layout of any run).
  std::set<std::string> kept_values;
  // The parameter state laid out by the first set_linear_kinds (or set_params) instead of
  // the constructor, for the kinds set then: a caller that sets its layers' kinds first never
  // holds the all-dense state (a slope llama-7b with the offload could not hold both on the
  // host). Nothing else may run before.
  bool defer_state = false;
  // Added to the computed arena size (e.g. for callers that allocate from arena()).
  size_t extra_arena_bytes = 0;
  // A model that runs forward only (a distillation teacher, Distillation below): no
  // gradients and no AdamW moments are allocated, every block keeps only its input (full
  // activation checkpointing of every block: the rest of the forward lives in one set of
  // buffers the blocks share), and what trains (forward_backward*, step_adamw, zero_grad,
  // set_linear_kinds, the moments) throws Error. Its weights cost 4 bytes per parameter.
  bool forward_only = false;
  // The stream the model queues its work on, not owned (null: a stream of its own). A
  // teacher shares its student's: the teacher's forward is then part of the student's
  // step, in the same CUDA graph.
  cudaStream_t stream = nullptr;
};

// One AdamW step's hyper-parameters, as OptimizerConfig plus the learning rate.
struct GpuAdamW {
  double lr = 3e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;   // max global gradient norm; <= 0 turns clipping off
  double grad_scale = 1.0;  // gradients are multiplied by this before clipping's factor
};

// Memory the model would take for (config, B, T), by part, in bytes.
struct GpuMemoryPlan {
  size_t params = 0;       // bf16 weights + the low halves of the fp32 master weights
  size_t grads = 0;        // fp32
  size_t optimizer = 0;    // AdamW m and v
  size_t activations = 0;  // saved for backward
  size_t scratch = 0;      // shared step buffers, LM-head chunk, attention workspace, losses
  size_t workspace = 0;    // cuBLASLt workspace and bias scratch
  size_t host = 0;         // pinned host memory of the optimizer offload (not in total())
  size_t total() const { return params + grads + optimizer + activations + scratch + workspace; }
  std::string describe() const;
};

// Time spent in one kind of op (see GpuTransformer::set_op_timing).
struct GpuOpTime {
  std::string op;
  int64_t calls = 0;
  double ms = 0;     // summed over the calls
  double flops = 0;  // summed, for the matrix products and attention (0 for the others)
};

class GpuTransformer {
 public:
  // Reserves everything for micro-batches of up to max_batch sequences of up to
  // max_seq_len tokens (at most config.max_seq_len). Throws Error with the memory plan
  // when the device does not have that much free memory. Parameters start at zero:
  // call init_weights or set_params.
  GpuTransformer(const ModelConfig& config, int max_batch, int max_seq_len, const GpuModelOptions& options = {});
  ~GpuTransformer();
  GpuTransformer(const GpuTransformer&) = delete;
  GpuTransformer& operator=(const GpuTransformer&) = delete;

  // The parameter layout of Transformer<T>(config): transformer_param_layout.
  static std::vector<ParamInfo> param_layout(const ModelConfig& config);
  static GpuMemoryPlan memory_plan(const ModelConfig& config, int max_batch, int max_seq_len,
                                   const GpuModelOptions& options = {});

  const ModelConfig& config() const { return cfg_; }
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  size_t num_params() const { return nparams_; }
  int max_batch() const { return max_b_; }
  int max_seq_len() const { return max_t_; }
  int head_chunk_rows() const { return head_chunk_; }

  // --- parameters and state (host copies in the CPU flat layout) ----------------------
  // A slope layer's weight, gradient and moments read back as dense tensors with zeros
  // where its forward mask prunes; written, they keep the kept positions only.
  // Master weights (and their bf16 copy) from a flat host vector of num_params() floats.
  // Under GpuModelOptions::shard_optimizer, after a step, params_to_host (and whatever reads
  // or writes the whole master weights: lora_state, set_lora_state, a kind change) is a
  // collective (gather_master_low): every rank calls it, at the same step. set_params is
  // not: every rank writes the same values (the gather after it takes the owners').
  void set_params(const float* host, size_t n);
  std::vector<float> params_to_host() const;
  void params_to_host(float* out) const;  // into num_params() floats
  std::vector<float> grads_to_host() const;
  // AdamW state: moments in the flat layout and the number of steps taken.
  void set_optimizer_state(const float* m, const float* v, size_t n, int64_t steps);
  void optimizer_state_to_host(std::vector<float>& m, std::vector<float>& v) const;
  // The moments of flat tensor k (param_infos()[k]) in its dense form, numel floats each.
  void tensor_moments_to_host(size_t k, float* m, float* v) const;
  // Where the optimizer state is offloaded (GpuModelOptions::offload_moments) and flat tensor
  // k is stored as it is: its moments in the pinned host memory, readable by the host once
  // the device is idle (synchronize()). {null, null} otherwise.
  // With sharded moments: into the whole copy gather_optimizer_state made, while it lasts.
  std::pair<const float*, const float*> offloaded_moments(size_t k) const;
  // With GpuModelOptions::shard_optimizer: every rank's slices of the moments into a copy of
  // the whole moments in pinned host memory, which optimizer_state_to_host,
  // tensor_moments_to_host and offloaded_moments read (they refuse sharded moments
  // otherwise), kept until the next step_adamw. A collective: every rank calls it with the
  // same `root`: -1, every rank keeps the copy; r >= 0, rank r alone does (a checkpoint that
  // rank r writes: the others spare the host memory). Without sharding, nothing to do.
  void gather_optimizer_state(int root = -1);
  int64_t optimizer_steps() const { return step_; }
  // GPT-2 initialisation with the CPU's rules (N(0, init_std), residual projections
  // scaled by 1/sqrt(2·n_layer), biases 0, norm weights 1), drawn on the device from a
  // counter-based generator: deterministic in the seed, but not the same numbers as
  // Transformer::init_weights (copy a CPU model's parameters with set_params for that).
  void init_weights(uint64_t seed);
  // Zeroes the gradients (asynchronous). Lazily for the large ones: the weight gradients
  // of the Linear layers and the LM head are not written here but overwritten (not added
  // to) by the next micro-batch's backward, which saves a pass over most of the gradient
  // memory and the GEMMs' reads of it; whatever reads the gradients before a backward
  // (step_adamw, grads_to_host) zeroes them first.
  void zero_grad();

  // --- compute ------------------------------------------------------------------------
  // One micro-batch from host token arrays ([B·T] each): forward, loss, backward; adds
  // d(mean loss · loss_scale)/dθ into the gradients and returns the mean loss (one host
  // synchronisation). Tokens and targets outside [0, vocab) throw before anything runs.
  double forward_backward(const int32_t* tokens, const int32_t* targets, int B, int T, double loss_scale);
  // Mean loss without gradients (one host synchronisation).
  double forward_loss(const int32_t* tokens, const int32_t* targets, int B, int T);

  // Knowledge distillation (the recipe's distill entry, docs/recipes.md): the loss of each
  // row becomes (1 - alpha)·CE + alpha·temperature²·KL(teacher_T || student_T), as the CPU's
  // (ops/distill.h). The teacher runs its forward on the same tokens first, then its LM
  // head chunk by chunk beside the student's (the full logits of neither ever exist); it
  // gets no gradient. The teacher: a forward_only model on this model's stream, of the
  // same vocabulary, whose head_chunk_rows() is at least this model's (Error otherwise).
  struct Distillation {
    GpuTransformer* teacher = nullptr;
    double alpha = 0.5, temperature = 2.0;
    bool operator==(const Distillation&) const = default;
  };

  // The same with tokens and targets already on the device ([B·T] int32 each, e.g. in
  // device_tokens() / device_targets()); nothing waits for the device. The mean loss is
  // left in device_loss(); read_loss() waits for it. Bad ids give a NaN loss. With
  // `distill`, the loss is distillation's and device_loss() holds its parts after it. With
  // `reduce` (GpuModelOptions::reduce_gradients set), the accumulated gradients are averaged
  // over the ranks as the backward produces them: the step's last micro-batch. Under
  // GpuModelOptions::shard_gradients every call reduce-scatters the blocks' gradients.
  void forward_backward_device(const int32_t* tokens, const int32_t* targets, int B, int T, double loss_scale,
                               const Distillation* distill = nullptr, bool reduce = false);
  void forward_loss_device(const int32_t* tokens, const int32_t* targets, int B, int T);
  // Three doubles: the mean loss, then, after a distilling forward_backward_device, the
  // mean cross-entropy and the mean KL divergence (their values before it otherwise).
  const double* device_loss() const { return loss_; }
  double read_loss();
  // Device buffers of max_batch·max_seq_len int32 each that callers may fill.
  int32_t* device_tokens() { return tokens_; }
  int32_t* device_targets() { return targets_; }
  // Copies host tokens into device_tokens()/device_targets() (validated, asynchronous
  // through a pinned staging buffer; it waits only for the previous upload's copies to
  // leave that buffer). targets may be null.
  void upload_batch(const int32_t* tokens, const int32_t* targets, int B, int T);

  // Global gradient norm and clipping (computed on the device, no host round trip) and
  // one AdamW step over every parameter; the bf16 weights are rewritten in the same pass.
  // Increments optimizer_steps() (the step number for the bias corrections).
  void step_adamw(const GpuAdamW& hyper);
  // The gradient norm before clipping of the last step_adamw (waits for the device).
  double last_grad_norm();
  // The gradients in the storage layout (fp32, stored_params() of them, contiguous), for a
  // data-parallel collective between the last micro-batch's backward and step_adamw. Lazy
  // zeroing is settled first (asynchronous).
  float* device_gradients();
  size_t stored_params() const { return nstored_; }

  // --- Linear kinds ---------------------------------------------------------------------
  // The kind of a block Linear layer, by its weight's name ("blocks.3.mlp.fc.weight"):
  // "dense" (the default), "masked", "vnm", "semi_sparse", "semi_sparse_activation" or
  // "slope". Other kinds, or semi_sparse and slope without cuSPARSELt, throw Error.
  // Changing a kind waits for the device and drops the captured graphs. Each sparse layer
  // is tuned at its first forward (one cuSPARSELt search per shape and process, or the
  // tuning cache's entry).
  //
  // vnm (model/linear_vnm.h: VENOM's layers after kernel replacement, the mask frozen) is
  // trained as masked is, with the mask it is given when it becomes vnm and its moments
  // started from zero (the CPU trains its kept values, a new tensor): AdamW is elementwise
  // and the pruned entries' gradients, moments and weights stay 0, so the kept values
  // take the CPU's updates. Its products are the dense ones of the masked weight, not the
  // V:N:M kernel (sparse/cuda/vnm_gemm.h), which measured slower than cuBLASLt's on the
  // GPU (0.55-0.96x).
  //
  // masked (model/linear_masked.h: gradual magnitude pruning on dense kernels): the layer
  // takes the mask given (LinearKindSetting::mask, u8 [out, in], 1 = kept: the host
  // model's, chosen by magnitude there; required when the layer becomes masked, null
  // afterwards keeps it, a new one replaces it) as bits on the device (1/8 byte per
  // weight). Its products are the dense ones of the masked weight; the weight gradient is
  // masked after each dW product, and the pruned weights are zeroed when the mask is set
  // and after every AdamW step, as MaskedLinear::after_optimizer_step does. The parameter
  // state stays dense (no new layout).
  //
  // semi_sparse (model/linear_semi_sparse.h's runtime 2:4): after every AdamW step, and
  // after set_params / init_weights, the transposable 4×4-tile 2:4 of the current W is
  // taken (Ws) and compressed for cuSPARSELt; the forward and dX products are 2:4 GEMMs of
  // Ws, dW stays the dense dYᵀ·X, the master weight stays dense. Micro-batches of another
  // size than max_batch × max_seq_len run the dense products of Ws (the 2:4 plans are per
  // token count; Ws is then pruned again into a scratch as large as the largest layer).
  // Each layer holds its two compressed copies (2.25 bytes per weight), and Ws (2 more)
  // where dispatch chose the dense products or cuSPARSELt's layout is not the writer's,
  // all outside the arena (sparse_device_bytes).
  //
  // semi_sparse_activation (model/linear_semi_sparse.h's SemiSparseActivationLinear, with
  // LinearKindSetting::activation's pattern): the weight stays dense and is trained
  // densely; the layer's input is pruned 2:4 along the features at every forward
  // (sparse/cuda/sparse_activation_linear.h), whose product is cuSPARSELt's 2:4 GEMM of the
  // pruned input for full-size micro-batches where cuSPARSELt and the shape allow it
  // (multiples of 16) and per-layer dispatch found it faster, else cuBLASLt's product of
  // the pruned input; a bias is a separate pass after the 2:4 product, GELU too. dX is the
  // dense dY·W (straight through), dW = dYᵀ·Xs with Xs pruned again from the saved input.
  // Nothing is stored per layer: all such layers share one scratch (Xs and its compressed
  // form) sized for the largest block Linear. Without cuSPARSELt the kind runs its
  // cuBLASLt products after one warning. in_features must be a multiple of 4.
  //
  // slope (model/linear_slope.h's SLoPe): the forward mask is the row-wise 2:4 of W when
  // the layer becomes slope, and never changes; the weight is W1 = W ⊙ that mask, stored
  // as its kept values only: master, gradient and moments take [out, in/2] each
  // (sparse/cuda/kept_values.h), so the gradient norm and AdamW over the stored state are
  // the CPU's sparse AdamW over "<weight>.values". The forward is the 2:4 GEMM of W1, dX
  // the 2:4 GEMM of W2 = W1 pruned again 2:4 down each column (the backward mask, chosen
  // again from W1 every mask_change_freq steps as SlopeLinear::on_step_begin does; <= 0:
  // never); dW is the dense GEMM into a scratch, whose kept positions are gathered into the
  // stored gradient. After each AdamW step both compressed copies are written from the
  // kept values in one pass (W1 is expanded into a dense scratch for a refresh, for a
  // product at another micro-batch size, which runs the dense products of W1 and of W2,
  // and where cuSPARSELt's layout is not our writer's). The moments start from zero when a
  // layer becomes or stops being slope. Updates equal the CPU's. Each layer holds 8 bytes
  // of state per kept value (4 per weight), its two compressed copies and both masks (2.5
  // bytes per weight); all slope layers share one scratch of 10 bytes per weight of the
  // largest (W1 expanded, W2 and W2ᵀ, the fp32 dW). Masks are chosen from the bf16
  // weights; the CPU ranks fp32 values, so near ties may differ: `slope_masks`
  // (slope_state's form; its mask_change_freq is ignored) gives the layer masks chosen
  // elsewhere (the CPU's, a checkpoint's) instead, also to a layer that is slope already
  // (its values outside the new forward mask are dropped); masks that are not 2:4 as
  // slope_state says (the forward one keeping exactly 2 of every 4 along each row) throw
  // Error naming the layer and the first bad tile.
  //
  // slope's lazy low-rank adapter (lora_rank > 0; model/linear_slope.h): the layer's output
  // becomes X·W1ᵀ + (X·Rᵀ)·Lᵀ with L [out, r] and R [r, in] trained next to the kept values
  // (stored after every flat tensor, as "<module>.lora_l" and "<module>.lora_r": fp32
  // master, gradient and moments, with weight decay, as the CPU's owned parameters). A new
  // adapter starts as SlopeLinear::enable_lora starts it from lora_seed (L = N(0, 1/r)
  // from that seed, R = 0: the layer's output is unchanged) with zero moments;
  // set_lora_state replaces it. The 2:4 products stay as they are; the adapter adds
  // cuBLASLt products of rank r: T = X·Rᵀ and Y += T·Lᵀ in the forward (before a GELU
  // MLP's activation), dT = dY·L, dX += dT·R (before the GELU gradient), dL += dYᵀ·T and
  // dR += dTᵀ·X in the backward. Each adapter keeps its T [tokens, r] bf16 from the forward
  // for the backward; dT is one buffer of the largest rank. A change of rank lays the
  // state out again (the other adapters keep their values and moments); the rank of a
  // layer that keeps its kind is changed like its kind. Only kind slope takes an adapter
  // (Error otherwise).
  //
  // A kind change that makes layers become or stop being slope (or gives a slope layer new
  // masks) lays the parameter state out again: weights and moments go to the host and come
  // back in the new layout (a pass over the state each way; the gradients restart at zero);
  // set_linear_kinds does it once for many layers.
  //
  // sparse_dw (semi_sparse and slope; model/linear_semi_sparse.h's MvueWeightGrad): the
  // weight gradient of full-size micro-batches is the 2:4 product of the MVUE of dYᵀ
  // (sparse/cuda/sparse_linear.h), draw k of the layer taking the seed
  // mvue_draw_seed(dw_seed, k) as the CPU's does; dw_draws is the draw count to go on from
  // (a resumed run's), sparse_dw_draws() the count now. Micro-batches of another size take
  // the dense dW. Needs out and max_batch·max_seq_len to be multiples of 64 (Error
  // otherwise). All sparse_dw layers share one scratch for the compressed MVUE and the
  // bf16 dW, sized for the largest block Linear (out·tokens·9/8 + 2·out·in bytes). Turning
  // sparse_dw on or off rebuilds the layer (a slope layer keeps its masks).
  struct SlopeState;
  // A layer's kind and options as the CPU's (LinearOptions: kind, mask_change_freq,
  // activation, sparse_dw, and lora_rank, the rank of the adapter it has: the GPU does not
  // read lora_enabled, pattern, sparsity, lora_alpha or seed), plus what only the device
  // takes: masks chosen elsewhere and the layer's seeds as the CPU layer derives them.
  struct LinearKindSetting : LinearOptions {
    LinearKindSetting() = default;
    LinearKindSetting(std::string weight_name, LinearOptions options)
        : LinearOptions(std::move(options)), weight_name(std::move(weight_name)) {}

    std::string weight_name;
    const SlopeState* slope_masks = nullptr;
    const std::vector<uint8_t>* mask = nullptr;  // masked, vnm: [out, in], 1 = kept (null: keep the layer's)
    uint64_t dw_seed = 0, dw_draws = 0;          // sparse_dw's base seed and the draws to go on from
    uint64_t lora_seed = 0;                      // a new adapter's seed
  };
  // Whether any layer changed (kind, masks or adapter; not only a schedule).
  bool set_linear_kinds(const std::vector<LinearKindSetting>& settings);
  void set_linear_kind(const std::string& weight_name, const std::string& kind, int mask_change_freq = 100,
                       const SlopeState* slope_masks = nullptr) {
    LinearOptions o;
    o.kind = kind;
    o.mask_change_freq = mask_change_freq;
    LinearKindSetting st(weight_name, o);
    st.slope_masks = slope_masks;
    set_linear_kinds({st});
  }
  std::string linear_kind(const std::string& weight_name) const;
  // The block Linear layer of that weight (its adapter when it has one; model/device_linear.h).
  DeviceLinear& linear(const std::string& weight_name);
  // That layer's own tensors (an adapter's) from its CPU twin, with their moments where m, v
  // hold them (DeviceLinear::extras_from_twin); sharded moments are written into the whole
  // copy (gathered first: a collective when the layer has such tensors).
  using NamedMoments = std::map<std::string, std::vector<float>>;  // NamedValues (model/device_linear.h)
  void extras_from_twin(const std::string& weight_name, Linear<float>& twin, const NamedMoments* m,
                        const NamedMoments* v);
  // What the last set_linear_kinds that changed a layer spent its time on ("" before one).
  const std::string& kind_change_report() const { return kind_change_report_; }
  // A semi_sparse_activation layer's pattern (Error for other layers).
  ActivationSparsity activation_sparsity(const std::string& weight_name) const;
  // Whether the layer computes a sparse dW (sparse_dw above), and the draws it has taken
  // (waits for the device; 0 without sparse_dw).
  bool sparse_dw(const std::string& weight_name) const;
  uint64_t sparse_dw_draws(const std::string& weight_name) const;
  size_t sparse_device_bytes() const;
  // A slope layer's masks and refresh schedule (Error for other layers). The masks are
  // 4×4 tile bits [out/4, in/4] (sparse/masks.h's tile_bits): the forward mask (W1's) and
  // the backward one (W2's, in W's orientation, inside the forward one). refresh_step is
  // the step whose forward first used the backward mask (optimizer_steps() at the time).
  struct SlopeState {
    std::vector<uint16_t> forward_tiles, backward_tiles;
    int64_t refresh_step = 0;
    int mask_change_freq = 100;
  };
  SlopeState slope_state(const std::string& weight_name) const;
  // A slope layer's low-rank adapter in fp32 (host copies; row-major L [out, rank] and R
  // [rank, in]): values, AdamW moments and gradients (none when they are sharded:
  // GpuModelOptions::shard_gradients). lora_state throws Error for a layer without one.
  // set_lora_state writes values and moments (empty moments: zero; the gradients given are
  // ignored) and checks the rank and sizes.
  struct LoraState {
    int rank = 0;
    std::vector<float> l, r, m_l, v_l, m_r, v_r, grad_l, grad_r;
  };
  int lora_rank(const std::string& weight_name) const;
  LoraState lora_state(const std::string& weight_name) const;
  void set_lora_state(const std::string& weight_name, const LoraState& state);
  // The dispatch decisions so far (GpuModelOptions::sparse_dispatch), one per layer kind
  // and shape in the order they were made, and a one-line summary of them ("" when none).
  // With a GELU MLP, the 2:4 path runs the GELU of mlp.fc's output (forward) and its
  // gradient before mlp.proj's dX (backward) as separate passes where cuBLASLt fuses them
  // into the dense products' epilogues: that pass is timed too and counted against the
  // 2:4 products of those layers (`gelu_pass`; semi_sparse_activation's, masked's and vnm's
  // mlp.fc only, their dX being the dense product). semi_sparse_activation, masked and vnm
  // time their forward only (their backward is the same either way).
  struct SparseDispatch {
    std::string kind;  // semi_sparse, semi_sparse_activation, slope, "slope fp8" / "semi_sparse fp8"
                       // (train.precision fp8), or masked and vnm with 2:4 masks (their forward)
    int64_t out = 0, in = 0, tokens = 0;
    bool gelu_pass = false;              // the layer's 2:4 path adds a GELU pass
    double sparse_ms = 0, dense_ms = 0;  // what the kind times (dispatch_times; + that pass), median
    bool sparse = true;                  // the 2:4 path was faster
  };
  const std::vector<SparseDispatch>& sparse_dispatch() const;
  std::string sparse_dispatch_summary() const;

  // --- where the time goes ------------------------------------------------------------
  // While on, every op of forward_backward_device and step_adamw is bracketed by CUDA
  // events and the calls wait for the device at their end; the step runs eagerly (no
  // graph). op_times() sums the times by op kind since timing was switched on, in the
  // order the kinds first ran; switching on clears the sums.
  void set_op_timing(bool on);
  std::vector<GpuOpTime> op_times() const;
  // Graph launches so far (0 without cuda_graph).
  int64_t graph_launches() const;
  // Operand values the block linears' fp8 casts saturated so far (infinities, with scales
  // from the current amax; 0 in bf16). Counted per cast, and the GPU casts some operands
  // once for two products where the CPU's emulation casts them twice (docs/fp8.md), so the
  // two counts of one run differ. Waits for the stream.
  int64_t fp8_saturated() const;
  // Delayed fp8 scaling (GpuModelOptions::precision.delayed(), model/cuda/fp8_histories.h):
  // the block linears' amax histories, rolled by step_adamw, to and from the host model's
  // (Transformer::fp8_histories, for checkpoints; no-ops in other precisions). to_host waits
  // for the stream.
  void fp8_histories_to_host(std::vector<Fp8AmaxHistory>& host) const;
  void fp8_histories_from_host(const std::vector<Fp8AmaxHistory>& host);

  cudaStream_t stream() const { return stream_; }
  // The step arena (activations, scratch, workspace; callers may allocate from it, see
  // extra_arena_bytes) and the parameter state's bytes (in the storage layout).
  DeviceArena& arena() { return *arena_; }
  const DeviceArena& arena() const { return *arena_; }
  size_t state_bytes() const;
  // The memory plan: params, grads and optimizer of the storage layout in use.
  const GpuMemoryPlan& plan() const { return plan_; }
  // Waits for everything queued on the model's stream.
  void synchronize();

  struct Impl;
  struct RetiredState;

 private:
  void check_batch(int B, int T) const;
  // `prepare`: the layers prepare bucket by bucket first (ZeRO stage 3, Impl::prepare_in_forward).
  void forward_body(const int32_t* tokens, int B, int T, bool prepare);
  // Block l's forward; `again`: full checkpointing's recompute before its backward, from
  // its kept input, without mlp.proj (and without the MLP activation where the backward
  // recomputes that anyway).
  void block_forward(int l, int B, int T, bool again);
  void head(const int32_t* targets, int B, int T, bool train, double loss_scale, bool overwrite = false,
            const Distillation* distill = nullptr);
  // A teacher's logits for rows [row0, row0 + rows) of its last forward_body, into its
  // scratch region ([rows, padded vocabulary] bf16, valid until its next forward).
  const void* teacher_logits(int row0, int rows);
  // Error when `distill` cannot teach this model (see Distillation).
  void check_teacher(const Distillation& distill) const;
  // With `reduce`, the gradients averaged over the ranks of reduce_gradients as it goes.
  void backward_body(const int32_t* tokens, int B, int T, bool overwrite, bool reduce);
  void forward_backward_body(const int32_t* tokens, const int32_t* targets, int B, int T, double loss_scale,
                             bool overwrite, const Distillation* distill, bool reduce, bool prepare);
  // Queues the mean over the ranks of the gradient buckets due after block l's backward
  // (GradientBucket::kAfterHead: the head's and the final norm's; kAfterBackward: after the
  // whole backward, which then also waits for every collective): with `reduce`
  // (the step's last micro-batch) all of them, else those in ZeRO stage 2's ring only, whose
  // means add into the rank's slices unless the micro-batch is the step's first
  // (`overwrite`).
  void reduce_buckets_after(int l, bool reduce, bool overwrite);
  // ZeRO stage 2, before the norm backward below block l (l = n_layer: the final norm's):
  // when that writes the first gradient of the next ring bucket (the bias gradient of block
  // l - 1's last Linear layer, block l being its bucket's lowest), that bucket's slot made
  // ready for this micro-batch: free of the reduce-scatter that read it last, the tensors
  // the backward adds into and the bucket's padding zeroed.
  void ready_ring_slot_below(int l);
  // ZeRO stage 3, at the start of block l (the forward: its bucket's lowest block; the
  // backward: its highest): stream_ waits for the bucket's bf16 weights in its ring slot,
  // and the next bucket's gather is queued into the slot the blocks before have finished
  // with (the forward gathers every bucket; the backward all but the two it left there).
  void gather_ring_weights(int l, bool backward);
  // The same at position p of the ring's order (Impl::ring_order); l names the block in a trace.
  void gather_ring_at(int p, bool backward, int l);
  // Error naming `who` in a forward_only model.
  void check_trains(const char* who) const;
  // Finishes a zero_grad whose zeros the backward was to write.
  void settle_zero_grad() const;
  void adamw_body();
  // The Linear layers' per-step work from the current weights (prepare), refreshing the
  // masks of the layers `impl_->refreshing` says (none when it is empty).
  void prepare_layers();
  // prepare_layers for the layers whose weights are at position p of the ring's order
  // (ZeRO stage 3, Impl::ring_position; -1: the layers outside the ring, all of them without
  // stage 3).
  void prepare_at(int p);
  // True when a Linear layer prepares per step.
  bool any_prepares() const;
  // The block Linear layers, all of the first kind (dense), and what they share.
  void make_linears();
  // The parameter state laid out again for the current Linear layers (zeroed). The old
  // state is freed first, or with `keep` moved there (both are on the device a while).
  void lay_out_state(RetiredState* keep = nullptr);
  // Whether the device has room for a second parameter state as large as this one and
  // more (a kind change that lays the state out again then moves it on the device).
  bool room_for_second_state() const;
  // The weights and moments of `old` into the current layout, on the device (tensors whose
  // stored form changes go through their dense form, mapped by the old and new layers);
  // the layers' own tensors carried over by name where their size is kept, else new.
  void move_state_from(const RetiredState& old);
  // The same through the host: the state into `old`'s host copy before the new layout, and
  // from it after.
  void state_to_host(RetiredState& old) const;
  void state_from_host(const RetiredState& old);
  // Views of a tensor of the storage layout (empty when there is none), and a block Linear's
  // (with the extra tensors of `layer` when given).
  DeviceTensorView view(const std::string& name) const;
  DeviceLinearParams linear_views(const std::string& weight_name, const DeviceLinear* layer) const;
  // Every tensor, chunk by chunk, from the flat layout into the storage layout (to_store)
  // or back, through the shared scratch region.
  struct Transfer;
  // Over the flat tensors [first, last) (default: all).
  void transfer(const Transfer& t, bool to_store, size_t first = 0, size_t last = SIZE_MAX) const;
  // n fp32 values of the storage layout at `at` (a tensor after the flat ones) to or from
  // the host, through the shared scratch region: the master weights (split / joined), the
  // gradients or a moment.
  enum class StateField { weight, grad, m, v };
  void stored_to_host(StateField f, size_t at, size_t n, float* host) const;
  void stored_from_host(StateField f, size_t at, size_t n, const float* host);
  // The padded bf16 head weight follows set_params and init_weights (AdamW writes it too).
  void refresh_head_copy();
  // Sharded (GpuModelOptions::shard_optimizer): the master weights' low halves outside this
  // rank's slices, stale since step_adamw (which all-gathers the bf16 weights only, half
  // the bytes), from every rank: a collective, before anything reads or writes the whole
  // master weights (host copies, a kind change). Every rank is stale after the same step,
  // so every rank calls the collective or none does.
  void gather_master_low() const;
  // Under GpuModelOptions::shard_parameters: error once the weights are set (a kind change
  // would read and write the whole master weights through the layers' views), and for a
  // layer that rewrites its weights after the update or owns extra tensors.
  void check_kind_change_allowed() const;
  void check_shardable(const std::string& weight_name, const DeviceLinear& layer) const;
  // n master weights of the storage layout from `at`, joined into (or split from) device
  // fp32 `buf`. Under ZeRO stage 3 joining is a collective (each rank fills in its slices,
  // a sum over the ranks the rest), splitting writes this rank's slices only, and
  // gather_rest_weights then makes the whole bf16 weights of the rest again (a collective).
  void join_master(size_t at, float* buf, size_t n) const;
  void split_master(size_t at, const float* buf, size_t n);
  void gather_rest_weights();
  // All-gathers bucket k's bf16 weights from every rank's slice of the master (ZeRO) on `s`.
  void gather_bucket_weights(size_t k, cudaStream_t s);
  // Sharded moments (GpuModelOptions::shard_optimizer): the whole moments are about to be
  // written (gathered first, and marked to be cut into this rank's slices again), or are
  // done with (cut into the slices where they were written, then dropped).
  void whole_moments_for_write();
  void settle_moments();
  // A whole copy (uninitialised, or of zeros: a state laid out anew), without gathering.
  void allocate_whole_moments();
  void fresh_whole_moments();
  // Error unless the moments are whole (not sharded, or gathered).
  void check_whole_moments(const char* who) const;
  // Error naming `who` when the gradients are sharded (ZeRO stage 2) or the model trains not.
  void check_whole_gradients(const char* who) const;
  // Every block Linear layer's views of the current state (lay_out_state; sharded, again
  // whenever the whole moments appear or go).
  void bind_layers();
  // Zeroes the moments of [at, at + n) of the storage layout, in this rank's slices and in
  // the whole copy where there is one.
  void zero_moments(size_t at, size_t n);

  ModelConfig cfg_;
  GpuModelOptions opt_;
  std::vector<ParamInfo> infos_;
  size_t nparams_ = 0;  // in the flat layout
  size_t nstored_ = 0;  // in the storage layout
  int max_b_ = 0, max_t_ = 0, head_chunk_ = 0;
  bool owns_stream_ = false;
  int64_t step_ = 0;
  // Weights or moments were given (set_params, init_weights, set_optimizer_state): until then
  // the state is zero and a new layout has nothing to move.
  bool state_written_ = false;
  GpuMemoryPlan plan_;
  std::string kind_change_report_;
  std::unique_ptr<DeviceArena> arena_;
  cudaStream_t stream_ = nullptr;
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  double* loss_ = nullptr;
  float* norm_sq_ = nullptr;
  std::unique_ptr<Impl> impl_;
};

}  // namespace esplag
