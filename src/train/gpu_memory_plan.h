// The GPU half of the memory planner (train/memory_plan.h): GpuTransformer's memory plan for
// a training config, and the free memory of the device. Host-only arithmetic and one query
// of the CUDA runtime: nothing is allocated.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "train/gpu_memory_plan.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>

#include "model/gpu_transformer.h"
#include "train/config.h"
#include "train/memory_plan.h"

namespace esplag {

// The GPU model's options for a training config: train.checkpointing, train.offload, and
// room for the step's own records.
GpuModelOptions gpu_model_options(const TrainConfig& config);

// `o` for a data-parallel run over `ranks` (null: one process, unchanged): train.parallel.zero
// 1 shards the optimizer state, 2 the gradients too, 3 the parameters too, and train.parallel.bucket_mb averages
// the gradients in buckets during the backward.
void set_data_parallel_options(GpuModelOptions& o, const TrainConfig& config, DeviceCollectives* ranks);

// The device memory GpuTransformer reserves for `config`'s micro-batch with its
// train.checkpointing (what the GPU training step builds), on each of `world` data-parallel
// ranks: with train.parallel.zero 1 and several ranks, the sharded optimizer state's.
GpuMemoryBytes gpu_memory_plan(const TrainConfig& config, int world = 1);

// The device memory of a distillation teacher of model `teacher` beside `config`'s student
// (train/gpu_step.h): a forward-only GpuTransformer sized for the same micro-batch.
GpuModelOptions gpu_teacher_options(const TrainConfig& config);
uint64_t gpu_teacher_bytes(const ModelConfig& teacher, const TrainConfig& config);

// Free memory of CUDA device `device` (cudaMemGetInfo), which becomes the current device;
// 0 when there is no such device.
uint64_t gpu_free_bytes(int device = 0);

}  // namespace esplag
