// The memory planner (`esplag plan`, train/gpu_memory_plan.h) against what a GPU training
// step really takes: the device memory in use after the step backend is built and has run
// two steps (cuBLASLt, cuDNN and graph allocations included), measured with
// cudaMemGetInfo against the free memory once the CUDA context exists, must be within 5%
// of the plan. llama-1b at its micro-batch (4 x 2048) with and without full activation
// checkpointing, and in fp8: large enough that the libraries' fixed costs are a few hundred
// MB of ~20 GiB.
//
// Host code only (the GPU work is the library's), as tests/gpu_train.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <filesystem>
#include <tuple>
#include <vector>

#include "core/rng.h"
#include "data/loader.h"
#include "data/shard.h"
#include "train/config.h"
#include "train/gpu_memory_plan.h"
#include "train/gpu_step.h"
#include "train/memory_plan.h"

namespace {

using namespace esplag;
namespace fs = std::filesystem;

// One shard of random ids, enough windows for the two steps.
std::string random_shard(int vocab, int64_t tokens) {
  const fs::path dir = fs::temp_directory_path() / ("esplag_gpu_memory_plan_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  Rng rng(7);
  std::vector<int32_t> ids(tokens);
  for (auto& t : ids) t = static_cast<int32_t>(rng.below(vocab));
  write_shard((dir / "train_000000.bin").string(), ids, vocab);
  return dir.string();
}

uint64_t used_since(size_t free_before) {
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return free_before - free;
}

// `train` options beyond the micro-batch and device, as YAML flow mapping entries.
void expect_plan_within_5_percent(const std::string& train) {
  TrainConfig cfg = parse_train_config(
      "model: {preset: llama-1b, vocab_size: 32000}\n"
      "train: {batch_size: 4, seq_len: 2048, device: cuda, " + train + "}\n", "test");
  const std::string data = random_shard(256, 4 * 2049 * 3);
  cfg.data_path = data;
  const uint64_t planned = gpu_memory_plan(cfg).total();

  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the context first: it is not the run's
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  uint64_t used = 0;
  {
    Transformer<float> host(cfg.model);
    host.init_weights(1);
    auto step = make_gpu_step(cfg, host, {}, {}, 0);
    DataLoader loader(data, "train", cfg.batch_size, cfg.seq_len, 1, 256);
    for (int s = 0; s < 2; ++s) step->step(s, 1e-4, loader);
    step->last_stats();
    used = used_since(free_before);
  }
  const double ratio = double(used) / double(planned);
  std::printf("%s: planned %.2f GiB, in use after two steps %.2f GiB (%.3f)\n", train.c_str(),
              planned / 1073741824.0, used / 1073741824.0, ratio);
  EXPECT_NEAR(ratio, 1.0, 0.05) << "planned " << planned << " bytes, in use " << used;
  fs::remove_all(data);
}

}  // namespace

// `esplag plan`'s model state per GPU (gpu_model_state, what a CPU build reports) is what
// GpuTransformer::memory_plan lays out for ZeRO stages 0 to 3 over 1 to 8 ranks: the same
// bytes but for the arenas' alignment and the tables of the zeroing and the AdamW update.
TEST(GpuMemoryPlan, TheModelStatePerGpuIsTheLayoutsForEachZeroStageAndWorld) {
  TrainConfig cfg = parse_train_config(
      "model: {preset: llama-1b, vocab_size: 32000}\n"
      "train: {batch_size: 4, seq_len: 2048, device: cuda}\n", "test");
  for (int zero : {0, 1, 2, 3})
    for (int world : {1, 2, 3, 8}) {
      cfg.parallel.zero = zero;
      const GpuMemoryBytes plan = gpu_memory_plan(cfg, world);
      const GpuModelState state = gpu_model_state(cfg, world);
      for (const auto& [name, planned, analytic] : {std::tuple{"params", plan.params, state.params},
                                                    std::tuple{"grads", plan.grads, state.grads},
                                                    std::tuple{"optimizer", plan.optimizer, state.optimizer}}) {
        EXPECT_GE(planned, analytic) << name << ", zero " << zero << ", world " << world;
        EXPECT_LE(planned - analytic, analytic / 1000 + 65536) << name << ", zero " << zero << ", world " << world;
      }
    }
}

TEST(GpuMemoryPlan, Llama1bPlanIsWithinFivePercentOfWhatTheStepUses) {
  expect_plan_within_5_percent("checkpointing: none");
}

TEST(GpuMemoryPlan, Llama1bWithFullCheckpointingToo) { expect_plan_within_5_percent("checkpointing: full"); }

// fp8 with delayed scaling: the layers' weight codes and the products' shared scratch
// (with SwiGLU's second pair of dY codes) live outside the step arena.
TEST(GpuMemoryPlan, Llama1bInFp8Too) { expect_plan_within_5_percent("precision: fp8, fp8_scaling: delayed"); }
