#include "train/gpu_memory_plan.h"

#include <cuda_runtime.h>

#include "core/device_collectives.h"
#include "core/error.h"
#include "train/stored_layout.h"

namespace esplag {

namespace {

// The ranks of a data-parallel run, as GpuTransformer::memory_plan asks them: how many, and
// this one's index (rank 0: every rank's slices are the same size). Nothing is communicated.
class PlannedRanks final : public DeviceCollectives {
 public:
  explicit PlannedRanks(int world) : world_(world) {}
  int rank() const override { return 0; }
  int size() const override { return world_; }
  void reduce_scatter_mean(const float*, float*, size_t, cudaStream_t) override { refuse(); }
  void all_gather(const void*, void*, size_t, cudaStream_t) override { refuse(); }
  void all_reduce_sum(float*, size_t, cudaStream_t) override { refuse(); }
  void all_reduce_sum_int(int32_t*, size_t, cudaStream_t) override { refuse(); }
  void all_reduce_mean(float*, size_t, cudaStream_t) override { refuse(); }
  void all_reduce_max(float*, size_t, cudaStream_t) override { refuse(); }

 private:
  [[noreturn]] static void refuse() { fail("the memory plan's ranks do not communicate"); }
  int world_;
};

}  // namespace

GpuModelOptions gpu_model_options(const TrainConfig& config) {
  GpuModelOptions o;
  o.extra_arena_bytes = 2 * DeviceArena::kDefaultAlignment;  // the step's health record
  o.checkpointing = config.checkpointing;
  o.offload_moments = config.offload != "none";
  o.offload_master = config.offload == "optimizer+master";
  o.precision = config.linear_precision();
  o.kept_values = largest_stored_layout(config).kept_values;
  o.sparse_dispatch = config.sparse_dispatch == "measure";
  return o;
}

void set_data_parallel_options(GpuModelOptions& o, const TrainConfig& config, DeviceCollectives* ranks) {
  if (!ranks) return;
  if (config.parallel.zero >= 1) o.shard_optimizer = ranks;
  o.shard_gradients = o.shard_optimizer && config.parallel.zero >= 2;
  o.shard_parameters = o.shard_optimizer && config.parallel.zero >= 3;
  if (config.linear_precision().delayed()) o.fp8_amax_ranks = ranks;
  if (config.parallel.bucket_mb > 0) {
    o.reduce_gradients = ranks;
    o.bucket_bytes = size_t(config.parallel.bucket_mb * double(1 << 20));
  }
}

GpuMemoryBytes gpu_memory_plan(const TrainConfig& config, int world) {
  GpuModelOptions options = gpu_model_options(config);
  PlannedRanks ranks(world);
  set_data_parallel_options(options, config, world > 1 ? &ranks : nullptr);  // as the GPU step does
  const GpuMemoryPlan p = GpuTransformer::memory_plan(config.model, config.batch_size, config.seq_len, options);
  return {p.params, p.grads, p.optimizer, p.activations, p.scratch, p.workspace};
}

GpuModelOptions gpu_teacher_options(const TrainConfig& config) {
  GpuModelOptions o;
  o.forward_only = true;
  o.attention = gpu_model_options(config).attention;
  return o;
}

uint64_t gpu_teacher_bytes(const ModelConfig& teacher, const TrainConfig& config) {
  return GpuTransformer::memory_plan(teacher, config.batch_size, config.seq_len, gpu_teacher_options(config)).total();
}

uint64_t gpu_free_bytes(int device) {
  int devices = 0;
  size_t free_b = 0, total_b = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || device < 0 || device >= devices ||
      cudaSetDevice(device) != cudaSuccess || cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) {
    cudaGetLastError();  // clear the error: the caller reports "unknown"
    return 0;
  }
  return free_b;
}

}  // namespace esplag
