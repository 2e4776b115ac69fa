#include "train/gpu_memory_plan.h"

#include <cuda_runtime.h>


namespace esplag {

GpuModelOptions gpu_model_options(const TrainConfig& config) {
  GpuModelOptions o;
  o.extra_arena_bytes = 2 * DeviceArena::kDefaultAlignment;  // the step's health record
  o.checkpointing = config.checkpointing;
  o.offload_moments = config.offload != "none";
  o.offload_master = config.offload == "optimizer+master";
  o.precision = config.linear_precision();
  return o;
}

GpuMemoryBytes gpu_memory_plan(const TrainConfig& config) {
  const GpuMemoryPlan p =
      GpuTransformer::memory_plan(config.model, config.batch_size, config.seq_len, gpu_model_options(config));
  return {p.params, p.grads, p.optimizer, p.activations, p.scratch, p.workspace};
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
