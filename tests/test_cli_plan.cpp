// `esplag plan` end to end: the report's categories, the settings it suggests for a run
// that does not fit, and one-line errors for bad options.
#include <cstdio>

#include "cli_util.h"
#include "train/memory_plan.h"
#include "train/progress.h"
#ifdef ESPLAG_HAVE_CUDA
#include "train/gpu_step.h"
#endif

using namespace esplag;
using namespace esplag::testing;

namespace {

const std::string kTinyFile = std::string(ESPLAG_SOURCE_DIR) + "/configs/tiny.yaml";
// The byte-level vocabulary of the dataset tiny.yaml trains on, given so that no dataset is read.
const std::string kTiny = kTinyFile + " --set model.vocab_size=257";

const cli_fs::path& scratch() { return scratch_root("cli_plan"); }

std::string gib(uint64_t bytes) {
  char s[64];
  std::snprintf(s, sizeof s, "%.12g", double(bytes) / double(uint64_t(1) << 30));
  return s;
}

uint64_t host_bytes(CheckpointMode mode) {
  TrainConfig c = load_train_config(kTinyFile, {"train.device=cpu", "model.vocab_size=257"});
  c.checkpointing = {mode, 1};
  return host_bytes_for_training(c, "cpu");
}

}  // namespace

TEST(CliPlan, PrintsEachCategoryAndFits) {
  const auto r = run_esplag("plan --config " + kTiny + " --set train.device=cpu --host-memory 1000", scratch());
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* line : {"model tiny", "micro-batch 16 x 128", "weights", "gradients", "moments", "activations",
                           "total", "fits in 1000.0 GiB (--host-memory)", "GPU memory: none (train.device cpu)"})
    EXPECT_TRUE(contains(r.out, line)) << line << " in\n" << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(CliPlan, AHostLimitSuggestsSettingsThatFit) {
  const uint64_t budget = (host_bytes(CheckpointMode::full) + host_bytes(CheckpointMode::selective)) / 2;
  const auto r =
      run_esplag("plan --config " + kTiny + " --set train.device=cpu --host-memory " + gib(budget), scratch());
  expect_one_line_error(r, "the run does not fit");
  EXPECT_TRUE(contains(r.out, "does NOT fit")) << r.out;
  EXPECT_TRUE(contains(r.out, "cheapest settings that fit: --set train.checkpointing=full\n")) << r.out;
  // The suggestion, applied, fits.
  const auto fixed = run_esplag("plan --config " + kTiny + " --set train.device=cpu --set train.checkpointing=full "
                                "--host-memory " + gib(budget), scratch());
  EXPECT_EQ(fixed.code, 0) << fixed.out << fixed.err;
  // Below the weights and moments nothing helps, and the error says so.
  expect_one_line_error(run_esplag("plan --config " + kTiny + " --set train.device=cpu --host-memory 0.001", scratch()),
                        "nor with train.checkpointing full and train.batch_size 1");
}

// The ranks of --gpus N run on this host and share its memory: it must hold them all (on the
// CPU at stage 0 each holds what one process would).
TEST(CliPlan, RanksOnOneHostShareItsMemory) {
  const uint64_t need = host_bytes(CheckpointMode::none);
  const std::string config = "plan --config " + kTiny + " --set train.device=cpu --set parallel.zero=0 --host-memory ";
  const auto one = run_esplag(config + gib(need * 3 / 2), scratch());
  EXPECT_EQ(one.code, 0) << one.out << one.err;
  const auto two = run_esplag(config + gib(need * 3 / 2) + " --gpus 2", scratch());
  expect_one_line_error(two, "the run does not fit");
  EXPECT_TRUE(contains(two.out, "2 ranks on this host: ")) << two.out;
  const auto enough = run_esplag(config + gib(need * 5 / 2) + " --gpus 2", scratch());
  EXPECT_EQ(enough.code, 0) << enough.out << enough.err;
}

TEST(CliPlan, WithMemoryAutoSaysWhatTheTrainerWouldChoose) {
  const uint64_t budget = host_bytes(CheckpointMode::selective);
  const auto r = run_esplag(
      "plan --config " + kTiny + " --set train.device=cpu --set train.memory=auto --host-memory " + gib(budget),
      scratch());
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  // The line of the function the trainer calls, on the same config and budget.
  TrainConfig c = load_train_config(kTinyFile, {"train.device=cpu", "model.vocab_size=257", "train.memory=auto"});
  const auto cpu_plan = [](const TrainConfig& t) { return plan_memory(t, "cpu"); };
  const std::string line = apply_train_memory(c, {0, budget, "", "--host-memory"}, cpu_plan);
  EXPECT_TRUE(contains(line, "memory auto: train.checkpointing=selective (none needs ")) << line;
  EXPECT_EQ(r.out.substr(0, r.out.find('\n') + 1), line + "\n") << r.out;
  // The plan that follows is the choice's.
  EXPECT_TRUE(contains(r.out, "train.checkpointing selective every 1, on cpu")) << r.out;
  EXPECT_TRUE(contains(r.out, "fits in ")) << r.out;
  // Nothing fits: the trainer's error, with the plan of full checkpointing by category.
  const auto none = run_esplag("plan --config " + kTiny + " --set train.device=cpu --set train.memory=auto "
                               "--host-memory 0.001", scratch());
  EXPECT_EQ(none.code, 1) << none.out;
  EXPECT_TRUE(none.out.empty()) << none.out;
  EXPECT_EQ(none.err.rfind("esplag: error: train.memory auto: the run does not fit, not even with "
                           "train.checkpointing full in every block: it needs ", 0), 0u) << none.err;
  for (const char* line : {"train.checkpointing full every 1, on cpu\n", "  activations", "does NOT fit in 1.0 MiB "
                           "(--host-memory)\n", "nothing smaller fits either"})
    EXPECT_TRUE(contains(none.err, line)) << line << " in\n" << none.err;
}

TEST(CliPlan, BatchSizeOverridesTheConfigs) {
  const auto r = run_esplag("plan --config " + kTiny + " --set train.device=cpu --batch-size 3", scratch());
  EXPECT_TRUE(contains(r.out, "micro-batch 3 x 128")) << r.out << r.err;
}

TEST(CliPlan, BadOptionsGiveOneError) {
  expect_one_line_error(run_esplag("plan", scratch()), "plan: --config is required");
  expect_one_line_error(run_esplag("plan --config " + kTiny + " --gpu-memory 0", scratch()),
                        "plan: --gpu-memory must be a number >= 0.001, got '0'");
  expect_one_line_error(run_esplag("plan --config " + kTiny + " --host-memory lots", scratch()),
                        "plan: --host-memory must be a number >= 0.001, got 'lots'");
  expect_one_line_error(run_esplag("plan --config " + kTiny + " --batch-size 0", scratch()),
                        "plan: --batch-size must be an integer in [1, 2147483647], got '0'");
  expect_one_line_error(run_esplag("plan --config " + kTiny + " --set train.checkpointing=half", scratch()),
                        "train.checkpointing must be none, full or selective, got 'half'");
  expect_one_line_error(run_esplag("plan --config " + (scratch() / "none.yaml").string(), scratch()),
                        "cannot read config file");
  expect_one_line_error(
      run_esplag("plan --config " + kTiny + " --set model.vocab_size=0 --set data.path=" + (scratch() / "no").string(),
                 scratch()),
      "model.vocab_size 0 is the dataset's vocabulary");
}

// --gpus N (default: the launcher's world size) and train.parallel.zero: one GPU's numbers.
TEST(CliPlan, PlansOneGpuOfTheWorldWithItsZeroStage) {
  const std::string cuda = "plan --config " + kTiny + " --set train.device=cuda --host-memory 1000 ";
  const auto r = run_esplag(cuda + "--gpus 4 --set parallel.zero=1", scratch());
  EXPECT_EQ(r.code, 0) << r.err;
  TrainConfig c = load_train_config(kTinyFile, {"train.device=cuda", "model.vocab_size=257", "parallel.zero=1"});
  const GpuModelState s = gpu_model_state(c, 4);
  for (const std::string line : {"per GPU of 4, ZeRO stage 1: each GPU keeps the AdamW moments of " +
                                     std::to_string(s.chunk) + " of the " + std::to_string(s.elements),
                                 "a checkpoint gathers the whole moments into " + format_bytes(s.checkpoint_moments)})
    EXPECT_TRUE(contains(r.out, line)) << line << " in\n" << r.out;
  // Without --gpus, the world of the launcher's variables; with neither, one GPU.
  const auto launched = run_command("RANK=0 WORLD_SIZE=4 " + std::string(ESPLAG_BINARY) + " " + cuda +
                                        "--set parallel.zero=1", scratch() / "out.txt", scratch() / "err.txt");
  EXPECT_EQ(launched.code, 0) << launched.err;
  EXPECT_TRUE(contains(launched.out, "per GPU of 4, ZeRO stage 1")) << launched.out;
  const auto alone = run_esplag(cuda + "--set parallel.zero=1", scratch());
  EXPECT_TRUE(contains(alone.out, "per GPU of 1, ZeRO stage 1: one GPU keeps the whole state")) << alone.out;
  // On the CPU, one rank's range of the moments.
  const auto cpu = run_esplag("plan --config " + kTiny + " --set train.device=cpu --set parallel.zero=2 --gpus 2",
                              scratch());
  EXPECT_TRUE(contains(cpu.out, "per rank of 2, ZeRO stage 2: each rank keeps the AdamW moments and the mean "
                                "gradient of at most 186336 of the 372672 trained elements")) << cpu.out;
}

TEST(CliPlan, ABadWorldOrStageIsOneError) {
  const std::string cuda = "plan --config " + kTiny + " --set train.device=cuda ";
  expect_one_line_error(run_esplag(cuda + "--gpus 0", scratch()), "plan: --gpus must be an integer in [1, 1024], got '0'");
  expect_one_line_error(run_command("RANK=0 WORLD_SIZE=0 " + std::string(ESPLAG_BINARY) + " " + cuda, scratch() / "o.txt",
                                    scratch() / "e.txt"),
                        "WORLD_SIZE");
  expect_one_line_error(run_esplag(cuda + "--set parallel.zero=4", scratch()), "parallel.zero");
  // Stages 2 and 3 run on the GPU too.
  const auto two = run_esplag(cuda + "--gpus 2 --set parallel.zero=2", scratch());
  EXPECT_EQ(two.code, 0) << two.err;
  EXPECT_TRUE(contains(two.out, "per GPU of 2, ZeRO stage 2: each GPU keeps the AdamW moments and the mean gradient"))
      << two.out;
  const auto three = run_esplag(cuda + "--gpus 2 --set parallel.zero=3", scratch());
  EXPECT_EQ(three.code, 0) << three.err;
  EXPECT_TRUE(contains(three.out, "per GPU of 2, ZeRO stage 3: each GPU keeps the master weights, the AdamW moments "
                                  "and the mean gradient of"))
      << three.out;
}

#ifdef ESPLAG_HAVE_CUDA
TEST(CliPlan, ATinyGpuMemorySuggestsSettingsThatFit) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  TrainConfig c = load_train_config(kTinyFile, {"train.device=cuda", "model.vocab_size=257"});
  c.checkpointing = {CheckpointMode::full, 1};
  const uint64_t full = plan_memory(c, "cuda").gpu->total();
  const auto r = run_esplag("plan --config " + kTiny + " --set train.device=cuda --host-memory 1000 --gpu-memory " +
                                gib(full),
                            scratch());
  expect_one_line_error(r, "the run does not fit");
  EXPECT_TRUE(contains(r.out, "cheapest settings that fit: --set train.")) << r.out;
}
#else
TEST(CliPlan, ACpuBuildSaysItHasNoGpuPlan) {
  const auto r = run_esplag("plan --config " + kTiny + " --set train.device=cuda --host-memory 1000", scratch());
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "GPU memory: unknown: this esplag was built without the CUDA backend")) << r.out;
}
#endif
