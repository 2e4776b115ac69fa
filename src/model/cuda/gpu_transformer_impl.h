// GpuTransformer's insides, shared by the files that implement it (model/gpu_transformer.cu:
// construction, the step and AdamW; model/cuda/gpu_transformer_state.cu: the parameter state
// and its host copies; model/cuda/gpu_transformer_kinds.cu: Linear kind changes).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_graph.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "model/cuda/fp8_histories.h"
#include "model/cuda/step_marks.h"
#include "model/device_linear.h"
#include "model/gradient_buckets.h"
#include "model/gpu_transformer.h"
#include "ops/gpu.h"
#include "ops/gpu_attention.h"
#include "ops/gpu_fused.h"

namespace esplag {
namespace gpu_model {

constexpr int kThreads = 256;

inline unsigned blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

inline size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
inline size_t aligned(size_t bytes) { return round_up(bytes, DeviceArena::kDefaultAlignment); }

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

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The LM head works on a vocabulary padded to a multiple of 128: an odd row length (GPT-2's
// 50257) leaves cuBLASLt only its slow 2-byte-aligned kernels, which cost more than all
// the other GEMMs of the step together. Padding rows of the head weight are zero and the
// cross-entropy writes zero gradients there, so the padding changes no result.
inline int padded_vocab(const ModelConfig& c) {
  return c.vocab_size % 64 == 0 ? c.vocab_size : static_cast<int>(round_up(size_t(c.vocab_size), 128));
}

// The entry of tensor `name` (which must be there).
inline const ParamInfo& info_named(const std::vector<ParamInfo>& infos, const std::string& name) {
  const auto it = std::find_if(infos.begin(), infos.end(), [&](const ParamInfo& i) { return i.name == name; });
  ESPLAG_CHECK(it != infos.end(), "GpuTransformer: no tensor named ", name);
  return *it;
}

// The block index and the module of a block Linear's weight name (a block Linear's): "blocks.3.mlp.fc.weight" -> 3, "blocks.3.mlp.fc".
inline int layer_of(const std::string& weight_name) { return std::stoi(weight_name.substr(std::string("blocks.").size())); }
inline std::string module_of(const std::string& weight_name) {
  return weight_name.substr(0, weight_name.size() - std::string(".weight").size());
}

struct ZeroChunk {  // gradient elements a table of zeroing writes
  float* at;
  int64_t n;
};
constexpr int64_t kZeroChunk = 16384;

// Whether the fp8 producers run (GpuModelOptions::fp8_producers, with delayed scaling), and
// whether SwiGLU's backward then writes fc's dY codes: the second pair of dY code buffers
// (DeviceLinearContext::fp8_producers, swiglu_grad_codes).
inline bool fp8_producers_run(const GpuModelOptions& o) { return o.fp8_producers && o.precision.delayed(); }
inline bool swiglu_grad_codes(const ModelConfig& c, const GpuModelOptions& o) {
  return fp8_producers_run(o) && c.mlp == MlpKind::swiglu;
}

inline GpuMemoryPlan operator+(const GpuMemoryPlan& a, const GpuMemoryPlan& b) {
  GpuMemoryPlan r;
  r.params = a.params + b.params;
  r.grads = a.grads + b.grads;
  r.optimizer = a.optimizer + b.optimizer;
  r.activations = a.activations + b.activations;
  r.scratch = a.scratch + b.scratch;
  r.workspace = a.workspace + b.workspace;
  r.host = a.host + b.host;
  return r;
}

// Sizes of the shared scratch region's uses for micro-batches of up to B x T.
struct SharedSizes {
  size_t attn_ws = 0;       // the attention workspace (forward and backward)
  size_t dqkv = 0;          // dqkv in the attention backward
  size_t datty_slot = 0;    // datty, then (where a block recomputes its norms) ln1
  bool attn_in_fc = false;  // dqkv + datty slot fit in a layer's fc storage
  size_t gelu_dfc = 0;      // GELU: dfc in the MLP backward (ln2 follows it)
  size_t other = 0;         // the region's size without the LM head
  int head_rows = 0;
  size_t total = 0;
};

}  // namespace gpu_model

struct GpuTransformer::Impl {
  struct Norm {
    const bf16 *w = nullptr, *b = nullptr;
    float *dw = nullptr, *db = nullptr;
  };
  // A block Linear: its layer (the adapter around it when it has one) and its bias gradient.
  struct Slot {
    std::unique_ptr<DeviceLinear> base, adapter;
    float* db = nullptr;
    DeviceLinear& top() const { return adapter ? *adapter : *base; }
  };
  struct Block {
    Norm n1, n2;
    Slot *qkv = nullptr, *proj = nullptr, *fc = nullptr, *mproj = nullptr;
  };
  // Saved for backward, per layer (ln1, ln2, act null when recomputed). A block that full
  // activation checkpointing recomputes (`recomputed`) owns res_in only; its other buffers
  // are the set all such blocks share, which its backward first fills again.
  struct Layer {
    bf16 *res_in = nullptr, *ln1 = nullptr, *qkv = nullptr, *atty = nullptr, *res_mid = nullptr, *ln2 = nullptr,
         *fc = nullptr, *act = nullptr;
    float *ln1_mean = nullptr, *ln1_rstd = nullptr, *lse = nullptr, *ln2_mean = nullptr, *ln2_rstd = nullptr;
    gpu::PendingScale fc_scale;  // the scale fc's output is stored without (SwiGLU's kernels apply it)
    bool recomputed = false;
  };

  using Graph = ReplayedGraph;
  struct StepGraph {
    const int32_t* tokens = nullptr;
    const int32_t* targets = nullptr;
    int B = 0, T = 0;
    double loss_scale = 0;
    bool overwrite = false;
    Distillation distill;  // teacher null: none
    bool reduce = false;
    bool prepare = false;  // the forward prepares the layers (a replay does so every time)
    std::unique_ptr<Graph> graph;
    uint64_t last_use = 0;
  };

  std::unique_ptr<gpu::Gemm> gemm;
  // What the Linear layers share (declared before them: they hold its scratch), and the
  // layers by weight name (the order of their preparation and of the storage layout's extra
  // tensors).
  StepMarks marks;
  DeviceLinearContext ctx;
  std::map<std::string, Slot> linears;
  // Which layers (in `linears`' order) the preparation running now refreshes the masks of.
  std::vector<bool> refreshing;
  // ZeRO stage 3: the step's preparation is left to the next forward, which prepares each
  // bucket's layers from the gather it makes anyway (set after an update refreshing no mask;
  // taken by the forward's entry points, a key of the captured step graphs).
  bool prepare_in_forward = false;
  Slot* find_linear(const std::string& weight_name) {
    auto it = linears.find(weight_name);
    return it == linears.end() ? nullptr : &it->second;
  }
  const Slot* find_linear(const std::string& weight_name) const {
    auto it = linears.find(weight_name);
    return it == linears.end() ? nullptr : &it->second;
  }
  gpu::AdamWStepParams* adam_params = nullptr;  // device

  // zero_grad's table (device): its first num_zero_chunks entries; under ZeRO stage 2, then
  // each ring bucket's (bucket_zeros), zeroed before a micro-batch writes its slot.
  gpu_model::ZeroChunk* zero_chunks = nullptr;
  int64_t num_zero_chunks = 0;
  bool zero_pending = false;  // zero_grad ran; the backward is to overwrite the rest

  // The parameter state (GpuTransformer::lay_out_state) in the storage layout `stored`:
  // the flat layout's tensors, a slope weight as its kept values [out, in/2].
  std::vector<ParamInfo> stored;
  DeviceArena state;
  DeviceArena state_host;    // the offloaded part (GpuModelOptions::offload_moments), pinned host memory
  GpuMemoryPlan step_plan;   // the step arena's share of the memory plan
  GpuMemoryPlan fp8_plan;    // the fp8 layers' weight codes and shared scratch (fp8_plan), outside the arena
  bf16* w = nullptr;         // bf16 weights (the high halves of the master weights)
  int16_t* w_lo = nullptr;   // low halves
  // The gradients: the storage layout's (grad_elements = padded), or under ZeRO stage 2
  // (GpuModelOptions::shard_gradients, when there are block buckets) the storage of
  // grad_storage: the ring's slots, then the rest's buffers; grad_shard then holds the mean
  // gradient of this rank's slices (shard_size), slot_free[s] is recorded on the comm stream
  // once the reduce-scatter of the bucket that used slot s last has read it, and bucket_zeros
  // gives, per bucket, its [first, first + count) entries of zero_chunks (none for the rest).
  float* grad = nullptr;
  size_t grad_elements = 0;
  GradientStorage grad_storage;
  float* grad_shard = nullptr;
  std::vector<cudaEvent_t> slot_free;
  std::vector<std::pair<int64_t, int64_t>> bucket_zeros;
  float *m = nullptr, *v = nullptr;
  // The part of the storage layout this rank updates, whose moments m_shard, v_shard hold
  // (shard_size elements): under GpuModelOptions::shard_optimizer its slice of every bucket
  // (model/gradient_buckets.h, shard_gradient_buckets: the layout is padded with zeros to
  // `padded` elements, each bucket to ranks equal slices), else one slice of the whole
  // layout (m_shard = m). Sharded, m and v point into `gathered` (the whole moments, pinned
  // host) while it exists, else are null; `gathered_written`: the whole copy changed since
  // it was made; `gathered_root`: -1 when every rank holds the whole copy (or none does),
  // else the one rank that holds it (gather_optimizer_state(root)), the same on every rank.
  struct Slice {
    size_t bucket = 0;    // the bucket's first element (sharded: ranks · size elements from there)
    size_t at = 0;        // this rank's slice [at, at + size) of the layout
    size_t size = 0;
    size_t shard_at = 0;  // its offset in m_shard and v_shard
  };
  std::vector<Slice> slices;
  // Sharded: w_lo outside this rank's slices is stale (GpuTransformer::gather_master_low).
  bool lo_stale = false;
  size_t shard_size = 0, padded = 0;
  float *m_shard = nullptr, *v_shard = nullptr;
  // Slice k's mean gradient, which AdamW reads.
  float* slice_grad(size_t k) const { return grad_shard ? grad_shard + slices[k].shard_at : grad + slices[k].at; }
  // ZeRO stage 3 (GpuModelOptions::shard_parameters, with the ring): `w` holds the bf16
  // weights in grad_storage's layout, the blocks' buckets in the ring's slots while they
  // are gathered there, the rest whole; the master halves of this rank's slices are w_own
  // (high) and w_lo (low), shard_size elements each. ring_order lists the ring's buckets,
  // lowest block first; ring_lowest[l] / ring_highest[l] is the position there of the
  // bucket whose lowest / highest block is l (-1: none). weights_gathered[s] is recorded on
  // the comm stream after a gather into slot s, slot_released on stream_ where the blocks
  // before are done with their slot.
  bf16* w_own = nullptr;
  std::vector<size_t> ring_order;
  std::vector<int> ring_lowest, ring_highest;
  // Each Linear layer's position in ring_order (in linears' order; -1: outside the ring,
  // every layer without stage 3), set with the layout.
  std::vector<int> ring_position;
  std::vector<cudaEvent_t> weights_gathered;
  cudaEvent_t slot_released = nullptr;
  // Slice k's master weights (the halves AdamW updates).
  bf16* master_hi(size_t k) const { return w_own ? w_own + slices[k].shard_at : w + slices[k].at; }
  int16_t* master_lo(size_t k) const { return w_own ? w_lo + slices[k].shard_at : w_lo + slices[k].at; }
  // Where bucket k's bf16 weights are (stage 3: its ring slot, when gathered there).
  bf16* bucket_weights(size_t k) const { return w_own ? w + grad_storage.offset[k] : w + slices[k].bucket; }
  std::vector<std::unique_ptr<gpu::SplitAdamWPlan>> adamw;  // per slice
  // Unsharded fp8: AdamW's amax of stored tensor k into weight_amax[k], for each (k, its
  // layer's slot) in weight_amax_takers (DeviceLinear::takes_weight_amax).
  float* weight_amax = nullptr;
  std::vector<std::pair<size_t, Slot*>> weight_amax_takers;
  float* norm_parts = nullptr;  // per slice, its gradients' sum of squares (device; sharded)
  DeviceArena gathered;
  bool gathered_written = false;
  int gathered_root = -1;

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
  gpu::PendingScale s1_scale;  // the scale a block's output in s1 is stored without (the next norm applies it)
  unsigned char* shared = nullptr;
  gpu_model::SharedSizes sizes;
  float* losses = nullptr;
  void *norm_scratch = nullptr, *gnorm_scratch = nullptr, *emb_ws = nullptr;
  size_t norm_scratch_bytes = 0, emb_ws_bytes = 0;
  bool fused_norm = false;  // GpuModelOptions::fused_norm_backward, where d_model allows it
  void *fnorm_scratch = nullptr, *colsum_scratch = nullptr;
  size_t fnorm_scratch_bytes = 0, colsum_scratch_bytes = 0;
  uint64_t* fp8_saturated = nullptr;  // values the block linears' fp8 casts saturated (precision.fp8)
  float* fp8_history_memory = nullptr;  // precision.delayed(): the amax histories' device array
  std::unique_ptr<DeviceFp8Histories> fp8_histories;

  int32_t* staging = nullptr;  // pinned host, 2 · max N
  double* host_loss = nullptr;
  float* host_norm = nullptr;
  cudaEvent_t staged = nullptr;

  // Data parallel (GpuModelOptions::reduce_gradients): the buckets of the current layout,
  // the stream their collectives run on, and the events that order it with stream_.
  // grads_reduced: this step's gradients are averaged already (step_adamw's ZeRO stage 1
  // takes its slices of them, reduce-scattered, as they are).
  std::vector<GradientBucket> buckets;
  cudaStream_t comm_stream = nullptr;
  cudaEvent_t grads_ready = nullptr, comm_done = nullptr;
  bool grads_reduced = false;

  std::vector<StepGraph> step_graphs;
  // AdamW + the layers' preparation, one graph per set of layers refreshing their
  // masks in it (`refreshing`; usually none, or all of them).
  std::map<std::vector<bool>, Graph> adam_graphs;
  uint64_t graph_uses = 0;
  int64_t graph_launches = 0;

  ~Impl() {
    if (staging) cudaFreeHost(staging);
    if (host_loss) cudaFreeHost(host_loss);
    if (host_norm) cudaFreeHost(host_norm);
    if (staged) cudaEventDestroy(staged);
    if (grads_ready) cudaEventDestroy(grads_ready);
    if (comm_done) cudaEventDestroy(comm_done);
    for (cudaEvent_t e : slot_free) cudaEventDestroy(e);
    for (cudaEvent_t e : weights_gathered) cudaEventDestroy(e);
    if (slot_released) cudaEventDestroy(slot_released);
    if (comm_stream) cudaStreamDestroy(comm_stream);
  }
};

// A storage layout's state kept while the state moves into a new one: on the device
// (GpuTransformer::move_state_from) with the layers whose stored forms it holds, or on the
// host in the flat layout (state_to_host, state_from_host).
struct GpuTransformer::RetiredState {
  std::vector<ParamInfo> stored;
  DeviceArena arena, host_arena, gathered;
  bf16* w = nullptr;
  int16_t* w_lo = nullptr;
  float *m = nullptr, *v = nullptr;
  std::map<std::string, const DeviceLinear*> layers;    // by weight name: each slot's top() then
  std::vector<std::unique_ptr<DeviceLinear>> replaced;  // the layers that went, alive until the move

  struct HostTensor {  // a layer's own tensor (an adapter's L or R), carried over by name
    std::vector<float> w, m, v;
  };
  std::vector<float> host_params, host_m, host_v;
  std::map<std::string, HostTensor> host_own;
};

namespace gpu_model {

// The gradient buckets of a storage layout `stored` (offsets packed) under options `o`:
// with reduce_gradients, those of bucket_bytes; with shard_optimizer (else none), those or
// one of the whole layout, padded into the ranks' slices (shard_gradient_buckets, which
// moves the tensors' offsets and returns each bucket's slice). Also sets `end`, the
// elements of the layout.
std::vector<GradientBucket> lay_out_buckets(const ModelConfig& c, const GpuModelOptions& o,
                                            std::vector<ParamInfo>& stored, std::vector<size_t>& slices, size_t& end);

// The parameter state of a storage layout (GpuTransformer::lay_out_state) of `end`
// elements with its buckets and slices (lay_out_buckets), in one order, for counting
// (take.arena null) and for real (then also AdamW's chunk tables, zero_grad's table and
// this rank's slices, in `im`).
// With an optimizer offload the offloaded buffers come from `host` (pinned host memory).
void lay_out_state_buffers(const ModelConfig& c, const std::vector<ParamInfo>& stored, size_t end,
                           const std::vector<GradientBucket>& buckets, const std::vector<size_t>& slices,
                           const GpuModelOptions& o, GpuTransformer::Impl& im, GpuMemoryPlan& plan, Take take,
                           Take host);

}  // namespace gpu_model

}  // namespace esplag
