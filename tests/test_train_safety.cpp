// Nothing a user does to a run directory loses a checkpoint: inconsistent or missing
// trainer state, a hostile `latest`, two processes on one run, leftovers of killed writes,
// a stop signal, damaged tensors, a model too large for the host; and the schedule of an
// extended run, the ETA's text.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "data/prepare.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "test_util.h"
#include "train/host_memory.h"
#include "train/memory_plan.h"
#include "train/progress.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;
using esplag::testing::write_text;
namespace fs = std::filesystem;

namespace {

std::string make_dataset(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += "In the beginning God created the heaven and the earth " + std::to_string(i) + ".\n";
  write_text(dir.file("corpus.txt"), text);
  prepare_dataset(dir.file("corpus.txt"), ByteTokenizer(), dir.file("data"), 0.1, 1 << 20);
  return dir.file("data");
}

TrainConfig small_config(const std::string& data) {
  return parse_train_config(R"(
model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}
train: {batch_size: 2, seq_len: 32, steps: 6, log_every: 1, eval_every: 3, eval_batches: 1,
        checkpoint_every: 3, keep_checkpoints: 0, device: cpu}
optimizer: {lr: 1.0e-2}
schedule: {warmup_steps: 2}
)",
                            "test", {"data.path=" + data});
}

void quiet(const std::string&) {}

// Every file under `dir` with its content: what "nothing was touched" compares.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out[e.path().string()] = e.is_regular_file() ? read_file(e.path().string()) : "(dir)";
  return out;
}

// A finished 6-step run with checkpoints at steps 3 and 6.
fs::path finished_run(const TempDir& dir, const std::string& data, const std::string& name = "run") {
  const fs::path run = dir.file(name);
  Trainer(small_config(data), run.string(), quiet).run();
  return run;
}

// A PID that no process has: a child that has already been reaped.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) _exit(0);
  ::waitpid(pid, nullptr, 0);
  return pid;
}

std::vector<nlohmann::json> metrics_of(const fs::path& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

double lr_at(const fs::path& run, int64_t step) {
  for (const auto& j : metrics_of(run))
    if (j.contains("lr") && j["step"] == step) return j["lr"].get<double>();
  return -1;
}

void expect_same_weights(Transformer<float>& a, Transformer<float>& b) {
  ASSERT_EQ(a.num_params(), b.num_params());
  EXPECT_EQ(std::memcmp(a.params(), b.params(), a.num_params() * sizeof(float)), 0);
}

}  // namespace

// --- state.json -------------------------------------------------------------------------

TEST(TrainSafety, StateJsonAtAnotherStepIsRefusedAndNothingIsTouched) {
  TempDir dir;
  const fs::path run = finished_run(dir, make_dataset(dir));
  // The later checkpoint is the one `latest` names: make it claim an earlier step.
  const fs::path state = run / "step-000006" / "state.json";
  auto js = nlohmann::json::parse(read_file(state.string()));
  js["step"] = 3;
  write_text(state.string(), js.dump());
  const auto before = snapshot(run);
  const std::string e = error_of([&] { Trainer::resume(run.string(), quiet, 10); });
  EXPECT_TRUE(contains(e, state.string() + ": field 'step' is 3")) << e;
  EXPECT_TRUE(contains(e, "says step 6")) << e;
  EXPECT_EQ(snapshot(run), before);

  // The model's metadata against the directory's name.
  fs::rename(run / "step-000006", run / "step-000009");
  write_text((run / "latest").string(), "step-000009\n");
  const std::string named = error_of([&] { Trainer::resume(run.string(), quiet, 10); });
  EXPECT_TRUE(contains(named, "is named for step 9")) << named;
}

TEST(TrainSafety, BadStateJsonIsOneSentenceAndDoesNotStopEval) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = finished_run(dir, data);
  const std::string state = (run / "step-000006" / "state.json").string();
  const nlohmann::json good = nlohmann::json::parse(read_file(state));
  auto with = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json js = good;
    js[key] = value;
    return js.dump();
  };
  const struct {
    std::string text, expected;
  } cases[] = {
      {"{\"step\": 6, ", "is not valid JSON"},
      {"[1, 2]", "must hold a JSON object"},
      {with("step", -1), "field 'step' must be a non-negative integer, got -1"},
      {with("tokens_seen", "many"), "field 'tokens_seen' must be a non-negative integer, got \"many\""},
      {with("rng", {1, 2}), "field 'rng' must be a list of 4"},
  };
  for (const auto& c : cases) {
    write_text(state, c.text);
    const auto before = snapshot(run);
    const std::string e = error_of([&] { Trainer::resume(run.string(), quiet, 10); });
    EXPECT_TRUE(contains(e, state)) << e;
    EXPECT_TRUE(contains(e, c.expected)) << e;
    EXPECT_FALSE(contains(e, "json.exception")) << e;
    EXPECT_EQ(snapshot(run), before);
    // Inference and export read the weights and the metadata's step alone.
    CheckpointContents info;
    auto model = load_model(resolve_checkpoint(run.string()), &info);
    EXPECT_EQ(info.state.step, 6);
    EXPECT_EQ(info.state_file, CheckpointContents::StateFile::invalid);
    EXPECT_TRUE(std::isfinite(evaluate_checkpoint(run.string(), data, "val", 1).loss));
  }
}

TEST(TrainSafety, MissingStateJsonResumesOnlyWhenAllowedAndSaysWhatIsLost) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = finished_run(dir, data);
  fs::remove(run / "step-000006" / "state.json");
  const auto before = snapshot(run);
  const std::string e = error_of([&] { Trainer::resume(run.string(), quiet, 8); });
  EXPECT_TRUE(contains(e, "state.json is missing")) << e;
  EXPECT_TRUE(contains(e, "--allow-inexact")) << e;
  EXPECT_EQ(snapshot(run), before);

  std::vector<std::string> log;
  ResumeOptions options;
  options.steps = 8;
  options.allow_inexact = true;
  auto t = Trainer::resume(run.string(), [&](const std::string& s) { log.push_back(s); }, options);
  const TrainResult r = t->run();
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.steps_run, 2);
  ASSERT_FALSE(log.empty());
  EXPECT_TRUE(contains(log.front(), "inexact resume")) << log.front();
  EXPECT_TRUE(contains(log.front(), "the data restarts from its first batch")) << log.front();
  EXPECT_TRUE(contains(log.front(), "RNG state")) << log.front();
}

TEST(TrainSafety, ResumeWithNothingToDoSaysSoAndWritesNothing) {
  TempDir dir;
  const fs::path run = finished_run(dir, make_dataset(dir));
  const auto before = snapshot(run);
  for (const int64_t steps : {int64_t(0), int64_t(6), int64_t(4)}) {
    std::vector<std::string> log;
    auto t = Trainer::resume(run.string(), [&](const std::string& s) { log.push_back(s); }, steps);
    const TrainResult r = t->run();
    EXPECT_EQ(r.steps_run, 0);
    EXPECT_EQ(r.steps, 6);
    EXPECT_TRUE(std::isnan(r.first_loss) && std::isnan(r.last_loss) && std::isnan(r.final_val_loss));
    ASSERT_EQ(log.size(), 1u);
    EXPECT_TRUE(contains(log[0], "nothing to do")) << log[0];
    EXPECT_TRUE(contains(log[0], "is at step 6")) << log[0];
    EXPECT_EQ(snapshot(run), before) << "--steps " << steps;
  }
}

// --- latest -----------------------------------------------------------------------------

TEST(TrainSafety, LatestNamesOnlyAStepDirectoryOfItsRun) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = finished_run(dir, data);
  const fs::path other = finished_run(dir, data, "other");
  const auto before = snapshot(other);
  for (const std::string name : {(other / "step-000003").string(), std::string("../other/step-000003"),
                                  std::string("config.yaml"), std::string("step-000003/..")}) {
    write_text((run / "latest").string(), name + "\n");
    const std::string e = error_of([&] { Trainer::resume(run.string(), quiet, 10); });
    EXPECT_TRUE(contains(e, "must hold the name of a step directory of its run")) << e;
    EXPECT_TRUE(contains(e, "'" + name + "'")) << e;
  }
  EXPECT_EQ(snapshot(other), before);
  write_text((run / "latest").string(), "step-000003\n");
  EXPECT_EQ(resolve_checkpoint(run.string()), (run / "step-000003").string());
}

// --- one process per run directory, leftovers of killed writers ------------------------

TEST(TrainSafety, SecondTrainerOnARunDirectoryIsRefusedNamingTheFirstsPid) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = dir.file("run");
  Trainer first(small_config(data), run.string(), quiet);
  EXPECT_EQ(read_file((run / "lock").string()), std::to_string(::getpid()) + "\n");
  const auto before = snapshot(run);
  const std::string pid = "PID " + std::to_string(::getpid());
  const std::string e = error_of([&] { Trainer(small_config(data), run.string(), quiet); });
  EXPECT_TRUE(contains(e, "is in use by another esplag process (" + pid)) << e;
  EXPECT_EQ(snapshot(run), before);
  first.run();
  // The lock ends with the run: the run directory can be continued.
  EXPECT_EQ(Trainer::resume(run.string(), quiet, 7)->run().steps, 7);

  // A resume holds the lock from its construction.
  auto resumed = Trainer::resume(run.string(), quiet, 8);
  const std::string re = error_of([&] { Trainer::resume(run.string(), quiet, 9); });
  EXPECT_TRUE(contains(re, pid)) << re;
}

TEST(TrainSafety, UnfinishedWritesOfDeadProcessesAreRemovedAndReported) {
  TempDir dir;
  const fs::path run = finished_run(dir, make_dataset(dir));
  const pid_t dead = dead_pid();
  const std::string tmp_dir = "step-000009.tmp-" + std::to_string(dead);
  const std::string tmp_file = "latest.tmp." + std::to_string(dead);
  const std::string live_dir = "step-000012.tmp-" + std::to_string(::getppid());  // a process that is running
  fs::create_directories(run / tmp_dir);
  fs::create_directories(run / live_dir);
  write_text((run / tmp_dir / "model.safetensors").string(), std::string(3000, 'x'));
  write_text((run / tmp_file).string(), "step-000009\n");

  std::vector<std::string> log;
  auto t = Trainer::resume(run.string(), [&](const std::string& s) { log.push_back(s); }, 7);
  EXPECT_FALSE(fs::exists(run / tmp_dir));
  EXPECT_FALSE(fs::exists(run / tmp_file));
  EXPECT_TRUE(fs::exists(run / live_dir));
  EXPECT_TRUE(fs::exists(run / "step-000006" / "model.safetensors"));
  ASSERT_FALSE(log.empty());
  EXPECT_TRUE(contains(log[0], "removed unfinished writes of processes no longer running")) << log[0];
  EXPECT_TRUE(contains(log[0], tmp_dir)) << log[0];
  EXPECT_TRUE(contains(log[0], tmp_file)) << log[0];
  EXPECT_TRUE(contains(log[0], "(3012 bytes)")) << log[0];
}

// --- stop signals -----------------------------------------------------------------------

// The first SIGINT lets the step finish and saves it; resuming from there reproduces the
// uninterrupted run bit for bit.
TEST(TrainSafety, FirstSignalSavesTheStepReachedAndTheRunResumesExactly) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  TrainConfig cfg = small_config(data);
  cfg.checkpoint_every = 0;  // only the end (or a stop) saves
  cfg.eval_every = 0;
  Trainer full(cfg, dir.file("full"), quiet);
  full.run();

  install_stop_handlers();
  clear_stop_request();
  const fs::path run = dir.file("run");
  std::vector<std::string> log;
  Trainer t(cfg, run.string(), [&](const std::string& s) {
    log.push_back(s);
    if (s.rfind("step      2/", 0) == 0) std::raise(SIGINT);
  });
  const TrainResult r = t.run();
  EXPECT_TRUE(stop_requested());
  clear_stop_request();
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps, 3);  // the step under way when the signal was seen
  EXPECT_EQ(r.last_checkpoint, (run / "step-000003").string());
  EXPECT_EQ(read_file((run / "latest").string()), "step-000003\n");
  EXPECT_TRUE(contains(log.back(), "stopped by SIGINT after step 3 of 6")) << log.back();

  auto resumed = Trainer::resume(run.string(), quiet);
  const TrainResult rest = resumed->run();
  EXPECT_FALSE(rest.interrupted);
  EXPECT_EQ(rest.steps, 6);
  expect_same_weights(full.model(), resumed->model());
}

TEST(TrainSafetyDeathTest, SecondSignalExitsAtOnce) {
  EXPECT_EXIT(
      {
        install_stop_handlers();
        std::raise(SIGTERM);
        std::raise(SIGTERM);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(128 + SIGTERM), "stop requested");
  EXPECT_EXIT(
      {
        install_stop_handlers();
        std::raise(SIGINT);
        std::raise(SIGINT);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(130), "");
}

// --- tensors on load ----------------------------------------------------------------------

namespace {

// Rewrites tensor `name` of a checkpoint's model.safetensors with `edit`.
void edit_tensor(const fs::path& checkpoint, const std::string& name, const std::function<Tensor(const Tensor&)>& edit) {
  const std::string path = (checkpoint / "model.safetensors").string();
  SafetensorsFile file = load_safetensors(path);
  std::vector<Tensor> tensors;
  for (auto& [n, t] : file.tensors) {
    Tensor out = n == name ? edit(t) : t;
    out.set_name(n);
    tensors.push_back(out);
  }
  save_safetensors(path, tensors, file.metadata);
}

}  // namespace

TEST(TrainSafety, ATrainedTensorOfAnIntegerDtypeIsAnError) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = finished_run(dir, data);
  const std::string name = "blocks.0.mlp.fc.weight";
  edit_tensor(run / "step-000006", name, [](const Tensor& t) { return Tensor::zeros(t.shape(), DType::i32); });
  const std::string e = error_of([&] { load_model((run / "step-000006").string()); });
  EXPECT_TRUE(contains(e, "tensor '" + name + "' is stored as I32")) << e;
  EXPECT_TRUE(contains(e, "expected F32")) << e;
  EXPECT_TRUE(contains(error_of([&] { Trainer::resume(run.string(), quiet, 8); }), "is stored as I32"));
}

TEST(TrainSafety, NonFiniteWeightsAreAnErrorOnEveryLoad) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const fs::path run = finished_run(dir, data);
  const std::string name = "blocks.0.attn.proj.weight";
  edit_tensor(run / "step-000006", name, [](const Tensor& t) {
    Tensor out = Tensor::zeros(t.shape(), DType::f32);
    std::memcpy(out.data<float>(), t.data<float>(), t.nbytes());
    out.data<float>()[5] = std::nanf("");
    return out;
  });
  for (const auto& load : std::vector<std::function<void()>>{
           [&] { load_model(resolve_checkpoint(run.string())); },  // sample, export
           [&] { evaluate_checkpoint(run.string(), data, "val", 1); },
           [&] { Trainer::resume(run.string(), quiet, 8); }}) {
    const std::string e = error_of(load);
    EXPECT_TRUE(contains(e, "tensor '" + name + "' holds a non-finite value (nan at element 5)")) << e;
  }
}

// --- host memory, validation before anything is written ---------------------------------

TEST(TrainSafety, AModelTooLargeForTheHostIsRefusedBeforeAnythingIsCreated) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  TrainConfig huge = small_config(data);
  huge.model.n_layer = 400;
  huge.model.d_model = 16384;
  huge.model.n_head = huge.model.n_kv_head = 128;
  huge.model.d_ff = 65536;  // about 1.7e12 parameters: terabytes
  const fs::path run = dir.file("huge");
  const std::string e = error_of([&] { Trainer(huge, run.string(), quiet); });
  EXPECT_TRUE(contains(e, "of host memory to train on cpu")) << e;
  EXPECT_TRUE(contains(e, "is available")) << e;
  EXPECT_TRUE(contains(e, "would fit")) << e;
  EXPECT_FALSE(fs::exists(run));

  // The weights fit and the activations of 16 sequences do not: the largest batch that does.
  TrainConfig cfg = small_config(data);
  cfg.model.vocab_size = 256;
  cfg.batch_size = 16;
  TrainConfig five = cfg;
  five.batch_size = 5;
  const uint64_t available = host_bytes_for_training(five, "cpu");
  EXPECT_NO_THROW(check_host_memory(cfg, "cpu", host_bytes_for_training(cfg, "cpu")));
  EXPECT_NO_THROW(check_host_memory(cfg, "cpu", 0));  // unknown: no check
  const std::string small = error_of([&] { check_host_memory(cfg, "cpu", available); });
  EXPECT_TRUE(contains(small, "train.batch_size 5 would fit")) << small;
  // Two ranks on this host: it must hold both, and the message says so.
  const uint64_t need = host_bytes_for_training(cfg, "cpu");
  EXPECT_NO_THROW(check_host_memory(cfg, "cpu", 2 * need, 2, 2));
  const std::string shared = error_of([&] { check_host_memory(cfg, "cpu", 2 * need - 1, 2, 2); });
  EXPECT_TRUE(contains(shared, "its 2 ranks on this host")) << shared;
  // Under ZeRO each rank keeps the moments of its range only: the plan's numbers, which fit
  // where two whole states would not.
  TrainConfig zero = cfg;
  zero.parallel.zero = 1;
  const uint64_t sharded = plan_memory(zero, "cpu", 2, 2).host_of_local_ranks();
  ASSERT_LT(sharded, 2 * need);
  EXPECT_NO_THROW(check_host_memory(zero, "cpu", sharded, 2, 2));
  EXPECT_TRUE(contains(error_of([&] { check_host_memory(zero, "cpu", sharded - 1, 2, 2); }), "its 2 ranks"));
  // On the GPU (no offload) only rank 0 makes the host copy of the moments a checkpoint writes.
  const HostMemoryPlan gpu = host_memory_plan(cfg, "cuda");
  EXPECT_EQ(host_bytes_of_local_ranks(gpu, cfg, "cuda", 3), gpu.total() + 2 * (gpu.total() - gpu.moments));
  TrainConfig offloaded = cfg;
  offloaded.offload = "optimizer";
  EXPECT_EQ(host_bytes_of_local_ranks(gpu, offloaded, "cuda", 3), 3 * gpu.total());
  // The GPU keeps weights and moments on the host, not gradients nor activations.
  EXPECT_EQ(host_bytes_for_training(cfg, "cuda"), uint64_t(cfg.model.num_params()) * 12);
}

TEST(TrainSafety, ARecipeThatCannotApplyLeavesNoRunDirectory) {
  TempDir dir;
  TrainConfig cfg = small_config(make_dataset(dir));
  cfg.recipe_yaml = "- semi_sparse: {params: ['blocks.7.mlp.fc.weight']}\n";
  const fs::path run = dir.file("run");
  EXPECT_NE(error_of([&] { Trainer(cfg, run.string(), quiet); }), "(no error)");
  EXPECT_FALSE(fs::exists(run));
}

// --- the progress line, the schedule of an extended run ---------------------------------

TEST(TrainSafety, DurationTextNeverOverflows) {
  EXPECT_EQ(format_duration(59.9), "0m59s");
  EXPECT_EQ(format_duration(3725), "1h02m");
  EXPECT_EQ(format_duration(1.5e11), "41666666h40m");  // beyond an int's hours
  EXPECT_EQ(format_duration(std::numeric_limits<double>::infinity()), "?");
  EXPECT_EQ(format_duration(std::nan("")), "?");
  EXPECT_EQ(format_duration(-1), "?");
  EXPECT_EQ(format_bytes(3012), "3012 bytes");
  EXPECT_EQ(format_bytes(uint64_t(5) << 29), "2.5 GiB");
}

TEST(TrainSafety, ExtendingARunKeepsItsScheduleUnlessAskedToStretch) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const TrainConfig cfg = small_config(data);
  const fs::path run = finished_run(dir, data);
  const double final_lr = cfg.schedule.at(5);
  EXPECT_DOUBLE_EQ(cfg.schedule.at(9), final_lr);  // past the end: the final rate

  fs::copy(run, dir.file("stretch"), fs::copy_options::recursive);
  EXPECT_EQ(Trainer::resume(run.string(), quiet, 10)->run().steps, 10);  // keep is the default
  for (int64_t step = 7; step <= 10; ++step) EXPECT_DOUBLE_EQ(lr_at(run, step), final_lr) << step;
  // A second extension still keeps the schedule the run started with.
  EXPECT_EQ(Trainer::resume(run.string(), quiet, 12)->run().steps, 12);
  EXPECT_DOUBLE_EQ(lr_at(run, 12), final_lr);

  ResumeOptions stretch;
  stretch.steps = 10;
  stretch.schedule = ScheduleOnResume::stretch;
  EXPECT_EQ(Trainer::resume(dir.file("stretch"), quiet, stretch)->run().steps, 10);
  LrSchedule longer = cfg.schedule;
  longer.total_steps = 10;
  EXPECT_DOUBLE_EQ(lr_at(dir.file("stretch"), 7), longer.at(6));
  EXPECT_GT(lr_at(dir.file("stretch"), 7), final_lr);
  EXPECT_EQ(schedule_on_resume_from("stretch"), ScheduleOnResume::stretch);
  EXPECT_TRUE(contains(error_of([] { schedule_on_resume_from("restart"); }), "keep or stretch"));
}
