// Training steps on the GPU: the StepBackend of train.device=cuda (train/trainer.h) over
// GpuTransformer (model/gpu_transformer.h). Before every step the GPU model's block
// linears take the kinds of the host model's (the recipe's plan for the step: dense,
// masked, semi_sparse or slope with its adapter); the per-layer dispatch decisions this makes are
// returned by take_notes for the run log.
//
// The trainer keeps the host model, the data, the schedule and the checkpoints; this
// backend holds the device copy of the weights, the gradients and the AdamW moments.
// It starts from the host model's weights (so a GPU run starts where the CPU run of the
// same config starts, and a CPU checkpoint continues on the GPU) and writes weights and
// moments back in the CPU layout when the trainer saves.
//
// A step queues its work and returns: the micro-batches' tokens go up through the
// model's pinned staging buffer, each micro-batch adds its mean loss into a device
// accumulator, and a one-thread kernel keeps the first step whose loss is not finite.
// The host waits only in last_stats() (when the trainer logs, evaluates or saves), which
// reports that step as the CPU would have at once.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "train/gpu_step.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "train/recipe.h"
#include "train/trainer.h"

namespace esplag {

// CUDA devices this process sees. 0 when there are none, with the runtime's reason in
// *why (no driver, no device) when why is given.
int cuda_device_count(std::string* why = nullptr);

// The mean loss of one batch ([B·T] tokens and targets, host memory) on CUDA device 0:
// a GPU model sized for B x T holding `host_model`'s weights and Linear kinds (dense,
// masked, semi_sparse, slope with its adapter; others throw), kept alive by the returned function.
std::function<double(const int32_t* tokens, const int32_t* targets, int B, int T)> gpu_batch_loss(
    const ModelConfig& config, Transformer<float>& host_model, int B, int T);

// Makes CUDA device `index` this process's device (a data-parallel rank's LOCAL_RANK):
// an Error naming the count when there are not that many.
void use_cuda_device(int index);

// The GPU step for `config` on the current CUDA device, starting from `host_model`'s
// weights (every Linear of a kind gpu_trains_kind accepts) and the moments m, v by tensor
// name (empty: zero, for a fresh run) after `steps_done` optimizer steps. Sized for
// micro-batches of train.batch_size x train.seq_len; throws with the memory plan when that
// does not fit. With `ranks` (data parallel), the ranks' gradients are averaged through
// NCCL (dist/cuda/nccl_comm.h) before each optimizer step, and the loss too. With a
// `teacher` (the recipe's distill entry, loaded by the trainer; `recipe` says when it
// teaches), a forward-only GPU copy of it (dense, bf16) teaches the steps that distill,
// as CpuStep does; the host copy is not kept.
std::unique_ptr<StepBackend> make_gpu_step(const TrainConfig& config, Transformer<float>& host_model, Moments m,
                                           Moments v, int64_t steps_done, HostChannel* ranks = nullptr,
                                           std::unique_ptr<Transformer<float>> teacher = nullptr,
                                           const Recipe* recipe = nullptr);

}  // namespace esplag
