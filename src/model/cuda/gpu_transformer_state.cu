// GpuTransformer's parameter state: its storage layout (the flat layout's tensors, each
// Linear weight in its layer's stored form, then the layers' extra tensors) and its host
// copies in the flat layout (see model/gpu_transformer.h).
#include <algorithm>
#include <cmath>
#include <functional>

#include "core/cuda_check.h"
#include "model/cuda/gpu_transformer_impl.h"

namespace esplag {

using namespace gpu_model;

namespace {

// Zeroes the gradient ranges of a table (what zero_grad writes), one block per entry.
__global__ void zero_chunks_kernel(const ZeroChunk* table) {
  const ZeroChunk c = table[blockIdx.x];
  for (int64_t i = threadIdx.x; i < c.n; i += kThreads) c.at[i] = 0.f;
}

// The segments AdamW updates: the tensors' parts within [begin, begin + size) of the storage
// layout (one of this rank's slices), at offsets from begin; tensor k's amax into slot k
// where takes_amax[k].
std::vector<gpu::ParamSegment> segments_of(const std::vector<ParamInfo>& infos, size_t begin, size_t size,
                                           const std::vector<bool>& takes_amax) {
  std::vector<gpu::ParamSegment> segs;
  for (size_t k = 0; k < infos.size(); ++k) {
    const ParamInfo& i = infos[k];
    const size_t lo = std::max(i.offset, begin), hi = std::min(i.offset + i.numel, begin + size);
    if (lo < hi) segs.push_back({int64_t(lo - begin), int64_t(hi - lo), i.decay, takes_amax[k] ? int(k) : -1});
  }
  return segs;
}

// zero_grad's table of chunks of at most kZeroChunk (gradient_zero_ranges' zero_grad), then
// each ring bucket's (ring: per bucket, [first, first + count) of the table).
struct ZeroTable {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // storage offset, count
  int64_t zero_grad = 0;
  std::vector<std::pair<int64_t, int64_t>> ring;
};
ZeroTable zero_table(const ModelConfig& c, const std::vector<ParamInfo>& infos,
                     const std::vector<GradientBucket>& buckets, const GradientStorage& g) {
  const GradientZeroRanges z =
      gradient_zero_ranges(infos, buckets, g, c.tie_embeddings ? "embed.tokens.weight" : "lm_head.weight");
  ZeroTable table;
  auto chunk = [&](const std::vector<std::pair<size_t, size_t>>& ranges) {
    const int64_t first = int64_t(table.chunks.size());
    for (const auto& [o, n] : ranges)
      for (int64_t k = 0; k < int64_t(n); k += kZeroChunk)
        table.chunks.push_back({int64_t(o) + k, std::min(kZeroChunk, int64_t(n) - k)});
    return std::pair{first, int64_t(table.chunks.size()) - first};
  };
  table.zero_grad = chunk(z.zero_grad).second;
  for (const auto& ranges : z.ring) table.ring.push_back(chunk(ranges));
  return table;
}

int head_segment(const ModelConfig& c, const std::vector<ParamInfo>& infos) {
  const ParamInfo& head = info_named(infos, c.tie_embeddings ? "embed.tokens.weight" : "lm_head.weight");
  return static_cast<int>(&head - infos.data());
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

}  // namespace

std::vector<GradientBucket> gpu_model::lay_out_buckets(const ModelConfig& c, const GpuModelOptions& o,
                                                       std::vector<ParamInfo>& stored, std::vector<size_t>& slices,
                                                       size_t& end) {
  end = stored.empty() ? 0 : stored.back().offset + stored.back().numel;
  slices.clear();
  if (!o.reduce_gradients && !o.shard_optimizer) return {};
  const size_t elements = o.reduce_gradients ? o.bucket_bytes / sizeof(float) : 0;
  std::vector<GradientBucket> buckets = plan_gradient_buckets(stored, c.n_layer, end, elements);
  if (o.shard_optimizer) {
    const ShardedBuckets sharded = shard_gradient_buckets(stored, buckets, o.shard_optimizer->size());
    slices = sharded.slice;
    end = sharded.padded;
  }
  return buckets;
}

void gpu_model::lay_out_state_buffers(const ModelConfig& c, const std::vector<ParamInfo>& stored, size_t end,
                                      const std::vector<GradientBucket>& buckets, const std::vector<size_t>& slices,
                                      const GpuModelOptions& o, GpuTransformer::Impl& im, GpuMemoryPlan& plan,
                                      Take take, Take host) {
  const DeviceCollectives* shards = o.shard_optimizer;
  im.slices.clear();
  if (shards) {
    size_t shard_at = 0;
    for (size_t i = 0; i < buckets.size(); ++i) {
      const size_t mine = buckets[i].begin + size_t(shards->rank()) * slices[i];
      im.slices.push_back({buckets[i].begin, mine, slices[i], shard_at});
      shard_at += slices[i];
    }
  } else {
    im.slices.push_back({0, 0, end, 0});
  }
  im.shard_size = 0;
  for (const GpuTransformer::Impl::Slice& sl : im.slices) im.shard_size += sl.size;
  im.padded = end;
  // Unsharded, AdamW takes the amax of the weights whose layers cast them next
  // (DeviceLinear::takes_weight_amax; a rank's update sees a slice of a weight only).
  std::vector<bool> takes_amax(stored.size(), false);
  im.weight_amax_takers.clear();
  for (size_t k = 0; k < stored.size() && !shards; ++k)
    if (GpuTransformer::Impl::Slot* slot = im.find_linear(stored[k].name); slot && slot->top().takes_weight_amax()) {
      takes_amax[k] = true;
      im.weight_amax_takers.push_back({k, slot});
    }
  std::vector<std::vector<gpu::ParamSegment>> segments;
  for (const GpuTransformer::Impl::Slice& sl : im.slices)
    segments.push_back(segments_of(stored, sl.at, sl.size, takes_amax));
  // ZeRO stage 2 writes the blocks' gradients into a ring of slots, if there are block buckets.
  im.grad_storage = plan_gradient_storage(buckets, shards && o.shard_gradients);
  const bool ring = im.grad_storage.slots > 0;
  im.grad_elements = ring ? im.grad_storage.elements : im.padded;
  const ZeroTable zeros = zero_table(c, stored, buckets, im.grad_storage);
  host.bucket = &plan.host;
  take.bucket = &plan.params;
  // ZeRO stage 3 keeps the bf16 weights where stage 2 keeps the gradients, and the master of its slices.
  const bool sharded_params = ring && o.shard_parameters;
  im.w = take.arr<bf16>("params.bf16", sharded_params ? im.grad_storage.elements : im.padded);
  im.w_own = sharded_params ? take.arr<bf16>("params.master_high", im.shard_size) : nullptr;
  im.w_lo = (o.offload_master ? host : take)
                .arr<int16_t>("params.master_low", sharded_params ? im.shard_size : im.padded);
  im.ring_order.clear();
  im.ring_lowest.assign(size_t(c.n_layer), -1);
  im.ring_highest.assign(size_t(c.n_layer), -1);
  if (sharded_params) {
    for (size_t i = buckets.size(); i-- > 0;)  // launch order is the highest blocks' first
      if (im.grad_storage.slot[i] >= 0) im.ring_order.push_back(i);
    for (size_t p = 0; p < im.ring_order.size(); ++p) {
      const bool top = p + 1 == im.ring_order.size();
      im.ring_lowest[size_t(buckets[im.ring_order[p]].after_block)] = int(p);
      im.ring_highest[size_t(top ? c.n_layer - 1 : buckets[im.ring_order[p + 1]].after_block - 1)] = int(p);
    }
  }
  if (o.forward_only) return;  // no gradients, no optimizer
  take.bucket = &plan.grads;
  im.grad = take.arr<float>("params.grad", im.grad_elements);
  im.grad_shard = ring ? take.arr<float>("grad.shard", im.shard_size) : nullptr;
  im.zero_chunks = take.arr<ZeroChunk>("grad.zero_table", zeros.chunks.size());
  take.bucket = &plan.optimizer;
  Take& moments = o.offload_moments ? host : take;
  im.m_shard = moments.arr<float>("adamw.m", im.shard_size);
  im.v_shard = moments.arr<float>("adamw.v", im.shard_size);
  im.m = shards ? nullptr : im.m_shard;
  im.v = shards ? nullptr : im.v_shard;
  im.norm_parts = shards ? take.arr<float>("grad.norm_parts", im.slices.size()) : nullptr;
  // A slot per stored tensor (the plan's size without the layers: memory_plan's).
  im.weight_amax = o.precision.fp8 && !shards ? take.arr<float>("adamw.weight_amax", stored.size()) : nullptr;
  for (const auto& segs : segments) plan.optimizer += gpu::SplitAdamWPlan::table_bytes_bound(segs);
  if (!take.arena) return;
  // Sharded, the padded head copy is refreshed from the gathered weights instead.
  im.adamw.clear();
  for (const auto& segs : segments)
    im.adamw.push_back(std::make_unique<gpu::SplitAdamWPlan>(segs, *take.arena,
                                                             im.head_pad && !shards ? head_segment(c, stored) : -1));
  im.num_zero_chunks = zeros.zero_grad;
  im.bucket_zeros = zeros.ring;
  std::vector<ZeroChunk> table;
  for (const auto& [o, n] : zeros.chunks) table.push_back({im.grad + o, n});
  if (!table.empty())
    CUDA_CHECK(cudaMemcpy(im.zero_chunks, table.data(), table.size() * sizeof(ZeroChunk), cudaMemcpyHostToDevice));
}

void GpuTransformer::lay_out_state(RetiredState* keep) {
  Impl& im = *impl_;
  gather_master_low();  // the old state moves whole
  synchronize();        // nothing queued may still use the old state
  if (keep) {
    keep->stored = std::move(im.stored);
    keep->arena = std::move(im.state);
    keep->host_arena = std::move(im.state_host);
    keep->w = im.w;
    keep->w_lo = im.w_lo;
    keep->gathered = std::move(im.gathered);  // sharded: the whole moments, gathered by the caller
    keep->m = im.m;
    keep->v = im.v;
  }
  im.stored = infos_;
  size_t offset = 0;
  for (auto& i : im.stored) {
    if (const Impl::Slot* slot = im.find_linear(i.name)) {  // the layer's form of its weight
      i.shape = slot->top().stored_weight_shape();
      i.numel = size_t(shape_numel(i.shape));
    }
    i.offset = offset;
    offset += i.numel;
  }
  // The layers' own tensors after every flat tensor, so that the flat tensors keep their
  // indices.
  for (const auto& [weight, slot] : im.linears)
    for (const DeviceLinearTensor& t : slot.top().extra_tensors()) {
      ParamInfo a;
      a.name = module_of(weight) + t.suffix;
      a.shape = t.shape;
      a.numel = size_t(shape_numel(t.shape));
      a.decay = true;
      a.offset = offset;
      offset += a.numel;
      im.stored.push_back(std::move(a));
    }
  std::vector<size_t> slices;
  im.buckets = lay_out_buckets(cfg_, opt_, im.stored, slices, nstored_);
  // The old state goes first (unless kept), so that the device never holds both.
  im.adamw.clear();
  im.state = DeviceArena();
  im.state_host = DeviceArena();
  im.gathered = DeviceArena();
  im.gathered_root = -1;
  GpuMemoryPlan state;
  lay_out_state_buffers(cfg_, im.stored, nstored_, im.buckets, slices, opt_, im, state, Take{}, Take{});
  im.state = DeviceArena(state.total(), "parameter state");
  im.state_host = DeviceArena(state.host, "offloaded optimizer state", DeviceArena::Memory::pinned_host);
  GpuMemoryPlan counted;
  lay_out_state_buffers(cfg_, im.stored, nstored_, im.buckets, slices, opt_, im, counted, Take{&im.state, nullptr},
                        Take{&im.state_host, nullptr});
  plan_ = im.step_plan + im.fp8_plan + state;

  // Parameter views, fixed until the next layout.
  auto wp = [&](const std::string& n) { return view(n).w; };
  auto gp = [&](const std::string& n) { return view(n).grad; };
  auto norm = [&](const std::string& n) {
    return Impl::Norm{wp(n + ".weight"), wp(n + ".bias"), gp(n + ".weight"), gp(n + ".bias")};
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
    im.blocks[l].n1 = norm(b + "norm1");
    im.blocks[l].n2 = norm(b + "norm2");
  }
  im.ring_position.clear();
  for (auto& [weight, slot] : im.linears) {
    slot.db = gp(module_of(weight) + ".bias");
    const auto at = std::find(im.ring_order.begin(), im.ring_order.end(),
                              size_t(bucket_of(im.buckets, info_named(im.stored, weight).offset)));
    im.ring_position.push_back(at == im.ring_order.end() ? -1 : int(at - im.ring_order.begin()));
  }
  bind_layers();  // each keeps its kind

  im.lo_stale = false;
  // A defined start: zero parameters, gradients and moments (and the padding, for good).
  const size_t weights = im.w_own ? im.grad_storage.elements : im.padded, master = im.w_own ? im.shard_size : im.padded;
  CUDA_CHECK(cudaMemsetAsync(im.w, 0, sizeof(bf16) * weights, stream_));
  if (im.w_own) CUDA_CHECK(cudaMemsetAsync(im.w_own, 0, sizeof(bf16) * master, stream_));
  // Offloaded buffers too: the device writes the mapped host memory.
  CUDA_CHECK(cudaMemsetAsync(im.w_lo, 0, sizeof(int16_t) * master, stream_));
  if (!opt_.forward_only) {
    CUDA_CHECK(cudaMemsetAsync(im.grad, 0, sizeof(float) * im.grad_elements, stream_));
    if (im.grad_shard) CUDA_CHECK(cudaMemsetAsync(im.grad_shard, 0, sizeof(float) * im.shard_size, stream_));
    CUDA_CHECK(cudaMemsetAsync(im.m_shard, 0, sizeof(float) * im.shard_size, stream_));
    CUDA_CHECK(cudaMemsetAsync(im.v_shard, 0, sizeof(float) * im.shard_size, stream_));
  }
  // Sharded, a state that moves in is written whole: into a whole copy of zeros.
  if (opt_.shard_optimizer && state_written_) fresh_whole_moments();
  im.zero_pending = false;
  // The captured graphs baked the old buffers in.
  im.step_graphs.clear();
  im.adam_graphs.clear();
  synchronize();
}

DeviceTensorView GpuTransformer::view(const std::string& name) const {
  const Impl& im = *impl_;
  const auto it = std::find_if(im.stored.begin(), im.stored.end(), [&](const ParamInfo& i) { return i.name == name; });
  if (it == im.stored.end()) return {};
  const size_t o = it->offset, stored = im.grad_storage.of(im.buckets, o);
  if (im.w_own)  // ZeRO stage 3: the bf16 weights where they are gathered, no whole master
    return {im.w + stored, nullptr, im.grad + stored, nullptr, nullptr};
  return {im.w + o, im.w_lo + o, im.grad ? im.grad + stored : nullptr, im.m ? im.m + o : nullptr,
          im.v ? im.v + o : nullptr};
}

void GpuTransformer::bind_layers() {
  for (auto& [weight, slot] : impl_->linears) slot.top().bind(linear_views(weight, &slot.top()));
}

void GpuTransformer::extras_from_twin(const std::string& weight_name, Linear<float>& twin, const NamedMoments* m,
                                      const NamedMoments* v) {
  DeviceLinear& layer = linear(weight_name);
  if (!layer.extra_tensors().empty()) whole_moments_for_write();  // they write their moments through their views
  layer.extras_from_twin(twin, m, v);
}

DeviceLinearParams GpuTransformer::linear_views(const std::string& weight_name, const DeviceLinear* layer) const {
  const std::string module = module_of(weight_name);
  DeviceLinearParams p{view(weight_name), view(module + ".bias"), {}};
  if (layer)
    for (const DeviceLinearTensor& t : layer->extra_tensors()) p.extra.push_back(view(module + t.suffix));
  return p;
}

void GpuTransformer::synchronize() { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

// --- parameters ---------------------------------------------------------------------------
//
// Host copies of the parameter state go through the shared scratch region in fp32 chunks
// (it is idle between steps, and stream order keeps it so), tensor by tensor: a Linear
// weight stored in another form (slope's kept values) moves in chunks of whole row groups,
// mapped to (or from) its form by its layer in the second part of the region.

struct GpuTransformer::Transfer {
  // Elements [o, o + n) of flat tensor k, dense fp32 in `stage` (device): written there
  // (into the storage layout) or handed over (out of it).
  std::function<void(size_t k, size_t o, size_t n, float* stage)> dense;
  // n values of the storage layout at offset `at`: written from `buf` (into the storage
  // layout) or read into `buf` (out of it), device fp32.
  std::function<void(size_t at, float* buf, size_t n)> stored;
};

namespace {

// The rows of a weight one transfer moves when it is stored in another form: `cols` dense
// values and `stored_cols` stored ones per row, in whole groups of `group` rows.
size_t transfer_rows(const ParamInfo& info, int64_t stored_cols, int64_t group, size_t stage_floats) {
  const size_t cols = size_t(info.shape.at(1));
  const size_t rows = stage_floats / (cols + size_t(stored_cols)) / size_t(group) * size_t(group);
  ESPLAG_CHECK(rows > 0, "GpuTransformer: rows of ", info.name, " (", cols,
               " columns) do not fit the shared scratch region for host copies");
  return rows;
}

}  // namespace

void GpuTransformer::transfer(const Transfer& t, bool to_store, size_t first, size_t last) const {
  const Impl& im = *impl_;
  float* stage = reinterpret_cast<float*>(im.shared);
  const size_t floats = im.sizes.total / sizeof(float);
  for (size_t k = first; k < std::min(last, infos_.size()); ++k) {
    const ParamInfo& info = infos_[k];
    const ParamInfo& st = im.stored[k];
    if (st.numel == info.numel) {  // stored as it is
      for (size_t o = 0; o < info.numel; o += floats) {
        const size_t n = std::min(floats, info.numel - o);
        if (to_store) t.dense(k, o, n, stage);
        t.stored(st.offset + o, stage, n);
        if (!to_store) t.dense(k, o, n, stage);
      }
      continue;
    }
    // A Linear weight in its layer's form, after the dense chunk in the stage.
    const DeviceLinear& layer = im.find_linear(info.name)->top();
    const int64_t cols = info.shape.at(1), scols = st.shape.at(1);
    const size_t chunk = transfer_rows(info, scols, layer.stored_row_group(), floats) * size_t(cols);
    for (size_t o = 0; o < info.numel; o += chunk) {
      const size_t n = std::min(chunk, info.numel - o);
      const int64_t row0 = int64_t(o) / cols, rows = int64_t(n) / cols;
      if (to_store) t.dense(k, o, n, stage);
      if (to_store) layer.weight_to_stored(stage + n, stage, row0, rows);
      t.stored(st.offset + size_t(row0 * scols), stage + n, size_t(rows * scols));
      if (!to_store) layer.weight_from_stored(stage, stage + n, row0, rows);
      if (!to_store) t.dense(k, o, n, stage);
    }
  }
}

namespace {

// A Transfer::dense that copies the chunk into host memory at h + offset(k) (and waits: the
// stage is reused by the next chunk). offset(k) is tensor k's flat offset, or 0 for a host
// copy of one tensor.
std::function<void(size_t, size_t, size_t, float*)> to_host(float* h, const std::vector<ParamInfo>* infos,
                                                            cudaStream_t s) {
  return [h, infos, s](size_t k, size_t o, size_t n, float* stage) {
    const size_t at = infos ? (*infos)[k].offset : 0;
    CUDA_CHECK(cudaMemcpyAsync(h + at + o, stage, sizeof(float) * n, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
  };
}

// A Transfer::stored that copies device fp32 values between buf and base.
std::function<void(size_t, float*, size_t)> copy_stored(float* base, bool into_base, cudaStream_t s) {
  return [base, into_base, s](size_t at, float* buf, size_t n) {
    CUDA_CHECK(cudaMemcpyAsync(into_base ? base + at : buf, into_base ? buf : base + at, sizeof(float) * n,
                               cudaMemcpyDefault, s));  // base may be offloaded (pinned host) memory
  };
}

std::function<void(size_t, size_t, size_t, float*)> from_host(const float* h, const std::vector<ParamInfo>& infos,
                                                              cudaStream_t s) {
  return [h, &infos, s](size_t k, size_t o, size_t n, float* stage) {
    CUDA_CHECK(cudaMemcpyAsync(stage, h + infos[k].offset + o, sizeof(float) * n, cudaMemcpyHostToDevice, s));
  };
}

}  // namespace

void GpuTransformer::set_params(const float* host, size_t n) {
  if (impl_->stored.empty()) lay_out_state();  // deferred (GpuModelOptions::defer_state), no kinds set
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_params: got ", n, " values, the model has ", nparams_,
               " parameters");
  transfer({from_host(host, infos_, stream_), [this](size_t at, float* buf, size_t k) { split_master(at, buf, k); }},
           true);
  gather_rest_weights();
  refresh_head_copy();
  prepare_layers();
  state_written_ = true;
  synchronize();
}

std::vector<float> GpuTransformer::params_to_host() const {
  std::vector<float> h(nparams_);
  params_to_host(h.data());
  return h;
}

void GpuTransformer::params_to_host(float* out) const {
  transfer({to_host(out, &infos_, stream_), [this](size_t at, float* buf, size_t n) { join_master(at, buf, n); }},
           false);
}

std::vector<float> GpuTransformer::grads_to_host() const {
  check_whole_gradients("grads_to_host");
  settle_zero_grad();
  std::vector<float> h(nparams_);
  transfer({to_host(h.data(), &infos_, stream_), copy_stored(impl_->grad, false, stream_)}, false);
  return h;
}

void GpuTransformer::set_optimizer_state(const float* m, const float* v, size_t n, int64_t steps) {
  check_trains("set_optimizer_state");
  ESPLAG_CHECK(n == nparams_, "GpuTransformer::set_optimizer_state: got ", n, " moments, the model has ", nparams_,
               " parameters");
  ESPLAG_CHECK(steps >= 0, "GpuTransformer::set_optimizer_state: negative step count ", steps);
  whole_moments_for_write();
  transfer({from_host(m, infos_, stream_), copy_stored(impl_->m, true, stream_)}, true);
  transfer({from_host(v, infos_, stream_), copy_stored(impl_->v, true, stream_)}, true);
  synchronize();
  step_ = steps;
  state_written_ = true;
}

void GpuTransformer::optimizer_state_to_host(std::vector<float>& m, std::vector<float>& v) const {
  check_whole_moments("optimizer_state_to_host");
  m.assign(nparams_, 0.f);
  v.assign(nparams_, 0.f);
  transfer({to_host(m.data(), &infos_, stream_), copy_stored(impl_->m, false, stream_)}, false);
  transfer({to_host(v.data(), &infos_, stream_), copy_stored(impl_->v, false, stream_)}, false);
}

void GpuTransformer::tensor_moments_to_host(size_t k, float* m, float* v) const {
  ESPLAG_CHECK(k < infos_.size(), "GpuTransformer::tensor_moments_to_host: no flat tensor ", k);
  check_whole_moments("tensor_moments_to_host");
  transfer({to_host(m, nullptr, stream_), copy_stored(impl_->m, false, stream_)}, false, k, k + 1);
  transfer({to_host(v, nullptr, stream_), copy_stored(impl_->v, false, stream_)}, false, k, k + 1);
}

std::pair<const float*, const float*> GpuTransformer::offloaded_moments(size_t k) const {
  const Impl& im = *impl_;
  const bool whole_on_host = opt_.shard_optimizer ? im.m != nullptr : opt_.offload_moments;
  if (!whole_on_host || k >= infos_.size() || im.stored[k].numel != infos_[k].numel) return {nullptr, nullptr};
  const size_t at = im.stored[k].offset;
  return {im.m + at, im.v + at};
}

void GpuTransformer::init_weights(uint64_t seed) {
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
  transfer({draw, [this](size_t at, float* buf, size_t k) { split_master(at, buf, k); }}, true);
  gather_rest_weights();
  refresh_head_copy();
  prepare_layers();
  state_written_ = true;
  synchronize();
}

void GpuTransformer::refresh_head_copy() {
  const Impl& im = *impl_;
  if (!im.head_pad) return;
  CUDA_CHECK(cudaMemcpyAsync(im.head_pad, im.head_w, sizeof(bf16) * size_t(cfg_.vocab_size) * cfg_.d_model,
                             cudaMemcpyDeviceToDevice, stream_));
}

void GpuTransformer::stored_to_host(StateField f, size_t at, size_t n, float* host) const {
  const Impl& im = *impl_;
  if (f == StateField::weight) {  // joined in the shared region, chunk by chunk
    float* stage = reinterpret_cast<float*>(im.shared);
    const size_t chunk = im.sizes.total / sizeof(float);
    for (size_t o = 0; o < n; o += chunk) {
      const size_t k = std::min(chunk, n - o);
      join_master(at + o, stage, k);
      CUDA_CHECK(cudaMemcpyAsync(host + o, stage, sizeof(float) * k, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    return;
  }
  if (f == StateField::grad) {
    check_whole_gradients("stored_to_host");
    settle_zero_grad();
  } else {
    check_whole_moments("stored_to_host");
  }
  const float* base = f == StateField::grad ? im.grad : f == StateField::m ? im.m : im.v;
  CUDA_CHECK(cudaMemcpyAsync(host, base + at, sizeof(float) * n, cudaMemcpyDefault, stream_));
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
      split_master(at + o, stage, k);
    }
    gather_rest_weights();
  } else {
    if (f == StateField::grad) check_whole_gradients("stored_from_host");
    if (f != StateField::grad) whole_moments_for_write();
    float* base = f == StateField::grad ? im.grad : f == StateField::m ? im.m : im.v;
    CUDA_CHECK(cudaMemcpyAsync(base + at, host, sizeof(float) * n, cudaMemcpyDefault, stream_));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuTransformer::zero_grad() {
  check_trains("zero_grad");
  Impl& im = *impl_;
  if (im.zero_pending) return;
  im.grads_reduced = false;
  if (im.num_zero_chunks > 0) {
    zero_chunks_kernel<<<static_cast<unsigned>(im.num_zero_chunks), kThreads, 0, stream_>>>(im.zero_chunks);
    CUDA_CHECK_LAUNCH("GpuTransformer::zero_grad");
  }
  im.zero_pending = true;
}

void GpuTransformer::ready_ring_slot_below(int l) {
  Impl& im = *impl_;
  if (!im.grad_shard) return;
  size_t bucket = 0;  // the ring's first, below the final norm
  if (l < cfg_.n_layer) {
    const auto due = std::find_if(im.buckets.begin(), im.buckets.end(),
                                  [&](const GradientBucket& b) { return b.after_block == l; });
    if (due == im.buckets.end()) return;
    bucket = size_t(due - im.buckets.begin()) + 1;
  }
  if (bucket >= im.buckets.size() || im.grad_storage.slot[bucket] < 0) return;
  im.marks.mark(stream_, "gradient ring slot");
  // The bucket that used the slot last in this micro-batch (the micro-batch before ended
  // with its collectives).
  if (bucket >= size_t(im.grad_storage.slots))
    CUDA_CHECK(cudaStreamWaitEvent(stream_, im.slot_free[size_t(im.grad_storage.slot[bucket])]));
  const auto [first, count] = im.bucket_zeros[bucket];
  if (count == 0) return;
  zero_chunks_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream_>>>(im.zero_chunks + first);
  CUDA_CHECK_LAUNCH("GpuTransformer (gradient ring slot)");
}

float* GpuTransformer::device_gradients() {
  check_whole_gradients("device_gradients");
  settle_zero_grad();
  return impl_->grad;
}

void GpuTransformer::settle_zero_grad() const {
  Impl& im = *impl_;
  if (!im.zero_pending) return;
  CUDA_CHECK(cudaMemsetAsync(im.grad, 0, sizeof(float) * im.grad_elements, stream_));
  if (im.grad_shard) CUDA_CHECK(cudaMemsetAsync(im.grad_shard, 0, sizeof(float) * im.shard_size, stream_));
  im.zero_pending = false;
}

void GpuTransformer::check_whole_gradients(const char* who) const {
  check_trains(who);
  ESPLAG_CHECK(!impl_->grad_shard, "GpuTransformer::", who, ": the gradients are sharded over the ranks (ZeRO stage "
               "2): no rank holds them whole");
}

// --- sharded state (GpuModelOptions::shard_optimizer) -------------------------------------

void GpuTransformer::gather_master_low() const {
  Impl& im = *impl_;
  if (!im.lo_stale) return;
  DeviceCollectives* ranks = opt_.shard_optimizer;
  ranks->group_begin();
  for (size_t k = 0; k < im.slices.size(); ++k)
    ranks->all_gather(im.master_lo(k), im.w_lo + im.slices[k].bucket, sizeof(int16_t) * im.slices[k].size, stream_);
  ranks->group_end();
  im.lo_stale = false;
}

namespace {

// Calls f(from, shard_at, count) for each part [at + from, at + from + count) of
// [at, at + n) in this rank's slices, shard_at being its offset in the rank's shard.
template <typename F>
void for_own_parts(const std::vector<GpuTransformer::Impl::Slice>& slices, size_t at, size_t n, F f) {
  for (const GpuTransformer::Impl::Slice& sl : slices) {
    const size_t lo = std::max(at, sl.at), hi = std::min(at + n, sl.at + sl.size);
    if (lo < hi) f(lo - at, sl.shard_at + (lo - sl.at), hi - lo);
  }
}

}  // namespace

void GpuTransformer::join_master(size_t at, float* buf, size_t n) const {
  const Impl& im = *impl_;
  if (!im.w_own) {
    gather_master_low();
    gpu::master_join(buf, im.w + at, im.w_lo + at, int64_t(n), stream_);
    return;
  }
  CUDA_CHECK(cudaMemsetAsync(buf, 0, sizeof(float) * n, stream_));
  for_own_parts(im.slices, at, n, [&](size_t from, size_t shard, size_t k) {
    gpu::master_join(buf + from, im.w_own + shard, im.w_lo + shard, int64_t(k), stream_);
  });
  // Summed as bits: one rank gives each value, the others zero.
  opt_.shard_optimizer->all_reduce_sum_int(reinterpret_cast<int32_t*>(buf), n, stream_);
}

void GpuTransformer::split_master(size_t at, const float* buf, size_t n) {
  Impl& im = *impl_;
  if (!im.w_own) {
    gather_master_low();  // the rest of the layout stays whole
    gpu::master_split(im.w + at, im.w_lo + at, buf, int64_t(n), stream_);
    return;
  }
  for_own_parts(im.slices, at, n, [&](size_t from, size_t shard, size_t k) {
    gpu::master_split(im.w_own + shard, im.w_lo + shard, buf + from, int64_t(k), stream_);
  });
}

void GpuTransformer::gather_rest_weights() {
  Impl& im = *impl_;
  if (!im.w_own) return;
  DeviceCollectives* ranks = opt_.shard_optimizer;
  ranks->group_begin();
  for (size_t k = 0; k < im.slices.size(); ++k)
    if (im.grad_storage.slot[k] < 0) gather_bucket_weights(k, stream_);
  ranks->group_end();
}

void GpuTransformer::gather_bucket_weights(size_t k, cudaStream_t s) {
  const Impl& im = *impl_;
  opt_.shard_optimizer->all_gather(im.master_hi(k), im.bucket_weights(k), sizeof(bf16) * im.slices[k].size, s);
}

void GpuTransformer::check_whole_moments(const char* who) const {
  check_trains(who);
  ESPLAG_CHECK(impl_->m, "GpuTransformer::", who, ": the moments are sharded over the ranks; call "
               "gather_optimizer_state first");
}

void GpuTransformer::gather_optimizer_state(int root) {
  Impl& im = *impl_;
  DeviceCollectives* ranks = opt_.shard_optimizer;
  // Whether every rank holds the copy already: the same answer on every rank.
  if (!ranks || (im.m && im.gathered_root < 0)) return;
  ESPLAG_CHECK(root < ranks->size(), "GpuTransformer::gather_optimizer_state: no rank ", root, " of ", ranks->size());
  // A copy gathered to another rank before would be stale here (the root is the same rank every time).
  ESPLAG_CHECK(im.gathered_root < 0 || root < 0 || root == im.gathered_root,
               "GpuTransformer::gather_optimizer_state: gathered to rank ", im.gathered_root, ", then to rank ", root);
  const bool keep = root < 0 || root == ranks->rank();
  if (keep && !im.m) allocate_whole_moments();  // else the copy of an earlier gather to this rank, gathered again
  // Through the shared scratch region, a piece of every rank's slice of a bucket at a time.
  float* stage = reinterpret_cast<float*>(im.shared);
  const size_t n = size_t(ranks->size());
  const size_t room = im.sizes.total / sizeof(float) / n;
  ESPLAG_CHECK(room > 0, "GpuTransformer: no room to gather the optimizer state");
  for (auto [shard, whole] : {std::pair{im.m_shard, im.m}, std::pair{im.v_shard, im.v}})
    for (const Impl::Slice& sl : im.slices)
      for (size_t o = 0; o < sl.size; o += room) {
        const size_t len = std::min(room, sl.size - o);
        CUDA_CHECK(cudaMemcpyAsync(stage + size_t(ranks->rank()) * len, shard + sl.shard_at + o, sizeof(float) * len,
                                   cudaMemcpyDefault, stream_));
        ranks->all_gather(stage + size_t(ranks->rank()) * len, stage, sizeof(float) * len, stream_);
        for (size_t r = 0; keep && r < n; ++r)
          CUDA_CHECK(cudaMemcpyAsync(whole + sl.bucket + r * sl.size + o, stage + r * len, sizeof(float) * len,
                                     cudaMemcpyDefault, stream_));
      }
  im.gathered_root = root;
  synchronize();
}

void GpuTransformer::whole_moments_for_write() {
  Impl& im = *impl_;
  if (!opt_.shard_optimizer) return;
  if (!im.m || im.gathered_root >= 0) {  // not on every rank
    if (state_written_)
      gather_optimizer_state();
    else  // all zero everywhere: nothing to gather
      fresh_whole_moments();
  }
  im.gathered_written = true;
}

void GpuTransformer::fresh_whole_moments() {
  Impl& im = *impl_;
  allocate_whole_moments();
  CUDA_CHECK(cudaMemsetAsync(im.m, 0, sizeof(float) * im.padded, stream_));
  CUDA_CHECK(cudaMemsetAsync(im.v, 0, sizeof(float) * im.padded, stream_));
  im.gathered_written = true;
  im.gathered_root = -1;
}

void GpuTransformer::allocate_whole_moments() {
  Impl& im = *impl_;
  im.gathered = DeviceArena(2 * sizeof(float) * im.padded + 2 * DeviceArena::kDefaultAlignment,
                            "the whole optimizer state (sharded over the ranks)", DeviceArena::Memory::pinned_host);
  im.m = im.gathered.allocate_array<float>("adamw.m (whole)", im.padded);
  im.v = im.gathered.allocate_array<float>("adamw.v (whole)", im.padded);
  im.gathered_written = false;
  bind_layers();  // the layers' own tensors reach their moments through their views
}

void GpuTransformer::settle_moments() {
  Impl& im = *impl_;
  im.gathered_root = -1;  // the ranks that held no copy hold none still
  if (!opt_.shard_optimizer || !im.m) return;
  if (im.gathered_written)
    for (const Impl::Slice& sl : im.slices) {
      CUDA_CHECK(cudaMemcpyAsync(im.m_shard + sl.shard_at, im.m + sl.at, sizeof(float) * sl.size, cudaMemcpyDefault,
                                 stream_));
      CUDA_CHECK(cudaMemcpyAsync(im.v_shard + sl.shard_at, im.v + sl.at, sizeof(float) * sl.size, cudaMemcpyDefault,
                                 stream_));
    }
  synchronize();  // before the pinned memory goes
  im.gathered = DeviceArena();
  im.m = im.v = nullptr;
  im.gathered_written = false;
  bind_layers();
}

void GpuTransformer::zero_moments(size_t at, size_t n) {
  Impl& im = *impl_;
  if (im.m) {
    CUDA_CHECK(cudaMemsetAsync(im.m + at, 0, sizeof(float) * n, stream_));
    CUDA_CHECK(cudaMemsetAsync(im.v + at, 0, sizeof(float) * n, stream_));
  }
  if (im.m_shard == im.m) return;  // not sharded
  for (const Impl::Slice& sl : im.slices) {
    const size_t lo = std::max(at, sl.at), hi = std::min(at + n, sl.at + sl.size);
    if (lo >= hi) continue;
    CUDA_CHECK(cudaMemsetAsync(im.m_shard + sl.shard_at + (lo - sl.at), 0, sizeof(float) * (hi - lo), stream_));
    CUDA_CHECK(cudaMemsetAsync(im.v_shard + sl.shard_at + (lo - sl.at), 0, sizeof(float) * (hi - lo), stream_));
  }
}

}  // namespace esplag
