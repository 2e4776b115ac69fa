// Distillation end to end on the CPU: a dense teacher trained a few steps teaches a student
// through the recipe's distill entry; its metrics carry the loss's parts, alpha 0 is the run
// without distillation bit for bit, a slope student trains, a resumed run reloads its teacher,
// and the GPU refuses such a run with the reason.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "data/prepare.h"
#include "test_util.h"
#include "train/memory_plan.h"
#include "train/trainer.h"

using namespace esplag;
using esplag::testing::error_of;
namespace fs = std::filesystem;

namespace {

// The suite's scratch directory (TempDir names its directory after a running test).
struct SuiteDir {
  fs::path path = fs::temp_directory_path() / ("esplag_test_distill_" + std::to_string(::getpid()));
  SuiteDir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~SuiteDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::string make_dataset(const SuiteDir& dir) {
  std::string text;
  const char* words[] = {"light", "darkness", "waters", "earth", "heaven", "firmament", "evening", "morning"};
  for (int i = 0; i < 300; ++i)
    text += std::string("And God said, Let there be ") + words[i % 8] + ": and there was " + words[(i * 3) % 8] + ".\n";
  esplag::testing::write_text(dir.file("corpus.txt"), text);
  prepare_dataset(dir.file("corpus.txt"), ByteTokenizer(), dir.file("data"), 0.1, 1 << 20);
  return dir.file("data");
}

TrainConfig config(const std::string& data, const std::string& recipe = "", int steps = 4) {
  TrainConfig cfg = parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 32}
train: {batch_size: 4, seq_len: 32, steps: 4, log_every: 1, eval_every: 0, eval_batches: 2,
        checkpoint_every: 2, keep_checkpoints: 0, device: cpu}
optimizer: {lr: 1.0e-2}
schedule: {warmup_steps: 1}
)",
                                       "run.yaml", {"data.path=" + data});
  cfg.steps = steps;
  cfg.schedule.total_steps = steps;
  cfg.recipe_yaml = recipe;
  return cfg;
}

std::vector<nlohmann::json> train_lines(const std::string& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(fs::path(run) / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.push_back(j);
  }
  return out;
}

void expect_same_weights(const Transformer<float>& a, const Transformer<float>& b) {
  ASSERT_EQ(a.num_params(), b.num_params());
  EXPECT_EQ(std::memcmp(a.params(), b.params(), a.num_params() * sizeof(float)), 0);
}

// One teacher for every case of this file: a dense model trained 6 steps.
class DistillTrain : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new SuiteDir();
    data_ = make_dataset(*dir_);
    teacher_ = dir_->file("teacher");
    Trainer(config(data_, "", 6), teacher_, [](const std::string&) {}).run();
  }
  static void TearDownTestSuite() { delete dir_; }
  static std::string distill(double alpha, const std::string& teacher = teacher_) {
    return "- distill: {teacher: '" + teacher + "', alpha: " + std::to_string(alpha) + ", temperature: 2.0}\n";
  }
  static inline SuiteDir* dir_ = nullptr;
  static inline std::string data_, teacher_;
};

}  // namespace

TEST_F(DistillTrain, StudentLogsTheLossPartsAndAlphaZeroIsThePlainRun) {
  std::vector<std::string> log;
  Trainer student(config(data_, distill(0.5)), dir_->file("student"), [&](const std::string& l) { log.push_back(l); });
  student.run();
  const auto lines = train_lines(dir_->file("student"));
  ASSERT_EQ(lines.size(), 4u);
  for (const auto& j : lines) {
    ASSERT_TRUE(j.contains("distill_kl") && j.contains("distill_ce")) << j.dump();
    const double ce = j["distill_ce"], kl = j["distill_kl"], loss = j["loss"];
    EXPECT_GT(kl, 0.0);
    EXPECT_NEAR(loss, 0.5 * ce + 0.5 * 4.0 * kl, 1e-9 * std::abs(loss));
  }
  bool progress = false, loaded = false;
  for (const auto& l : log) {
    progress |= l.find("step      1/4 | loss ") != std::string::npos && l.find(" (ce ") != std::string::npos &&
                l.find(", kl ") != std::string::npos;
    loaded |= l.find("distilling from " + teacher_) != std::string::npos;
  }
  EXPECT_TRUE(progress && loaded);

  // alpha = 0: the teacher runs and the KL is measured, but the run is the plain one bit for bit.
  Trainer plain(config(data_), dir_->file("plain"), [](const std::string&) {});
  plain.run();
  Trainer zero(config(data_, distill(0.0)), dir_->file("alpha0"), [](const std::string&) {});
  zero.run();
  expect_same_weights(plain.model(), zero.model());
  const auto a = train_lines(dir_->file("plain")), b = train_lines(dir_->file("alpha0"));
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["loss"].get<double>(), b[i]["loss"].get<double>());
    EXPECT_EQ(a[i]["grad_norm"].get<double>(), b[i]["grad_norm"].get<double>());
    EXPECT_FALSE(a[i].contains("distill_kl"));
    EXPECT_GT(b[i]["distill_kl"].get<double>(), 0.0);
  }
}

TEST_F(DistillTrain, SlopeStudentTrainsOnTheCpu) {
  const std::string recipe = "- slope: {params: ['re:blocks\\..*\\.mlp\\..*']}\n" + distill(0.7);
  Trainer student(config(data_, recipe), dir_->file("slope"), [](const std::string&) {});
  const TrainResult r = student.run();
  EXPECT_EQ(r.steps, 4);
  EXPECT_EQ(student.model().linear("blocks.0.mlp.fc.weight").kind(), "slope");
  for (const auto& j : train_lines(dir_->file("slope"))) {
    EXPECT_TRUE(std::isfinite(j["loss"].get<double>()));
    EXPECT_GT(j["distill_kl"].get<double>(), 0.0);
  }
}

// The distillation window: steps outside [start, until) train on the plain loss.
TEST_F(DistillTrain, DistillsOnlyFromStartUntil) {
  const std::string recipe = "- distill: {teacher: '" + teacher_ + "', start: 1, until: 3}\n";
  Trainer(config(data_, recipe), dir_->file("window"), [](const std::string&) {}).run();
  const auto lines = train_lines(dir_->file("window"));
  ASSERT_EQ(lines.size(), 4u);
  for (const auto& j : lines) {
    const int64_t step = j["step"];  // the step done: step index + 1
    EXPECT_EQ(j.contains("distill_kl"), step == 2 || step == 3) << j.dump();
  }
}

TEST_F(DistillTrain, ResumeReloadsTheTeacherOrSaysItIsGone) {
  const std::string moved = dir_->file("teacher_copy");
  fs::copy(teacher_, moved, fs::copy_options::recursive);
  Trainer full(config(data_, distill(0.5, moved)), dir_->file("full"), [](const std::string&) {});
  full.run();

  // A run stopped after its step-2 checkpoint, resumed: the teacher is reloaded and the run
  // ends where the uninterrupted one did.
  const fs::path part = dir_->file("part");
  fs::create_directories(part);
  fs::copy(fs::path(dir_->file("full")) / "step-000002", part / "step-000002", fs::copy_options::recursive);
  std::ofstream(part / "latest") << "step-000002\n";
  auto resumed = Trainer::resume(part.string(), [](const std::string&) {});
  resumed->run();
  expect_same_weights(full.model(), resumed->model());

  fs::remove_all(part / "step-000004");
  std::ofstream(part / "latest") << "step-000002\n";
  fs::remove_all(moved);
  const std::string e = error_of([&] { Trainer::resume(part.string(), [](const std::string&) {}); });
  EXPECT_NE(e.find("recipe[0] (distill): key 'teacher': '" + moved + "' is not a directory"), std::string::npos) << e;
  EXPECT_TRUE(fs::exists(part / "step-000002" / "model.safetensors"));
}

TEST_F(DistillTrain, RefusesATeacherOfAnotherVocabularyOrShorterSequencesOrNone) {
  // The error of a student run `run` taught by `teacher`; a teacher of this shape trained first when given.
  const auto refusal = [&](const std::string& teacher, const std::string& run) {
    return error_of(
        [&] { Trainer(config(data_, distill(0.5, teacher)), dir_->file(run), [](const std::string&) {}); });
  };
  const auto trained = [&](const std::string& name, const std::function<void(TrainConfig&)>& shape) {
    TrainConfig t = config(data_, "", 1);
    shape(t);
    Trainer(t, dir_->file(name), [](const std::string&) {}).run();
    return dir_->file(name);
  };
  const std::string e = refusal(trained("wide", [](TrainConfig& t) { t.model.vocab_size = 300; }), "s1");
  EXPECT_NE(e.find("run.yaml: recipe[0] (distill): key 'teacher': the teacher '" + dir_->file("wide") +
                   "' has a vocabulary of 300 tokens, the student (model.vocab_size) "),
            std::string::npos)
      << e;
  EXPECT_FALSE(fs::exists(dir_->file("s1")));

  const std::string s =
      refusal(trained("short", [](TrainConfig& t) { t.model.max_seq_len = t.seq_len = 16; }), "s4");
  EXPECT_NE(s.find("key 'teacher': the teacher '" + dir_->file("short") +
                   "' takes sequences of at most 16 tokens (its model.max_seq_len), the run's train.seq_len is 32"),
            std::string::npos)
      << s;
  EXPECT_FALSE(fs::exists(dir_->file("s4")));

  const std::string none = refusal(dir_->file("nope"), "s2");
  EXPECT_NE(none.find("key 'teacher': '" + dir_->file("nope") + "' is not a directory"), std::string::npos) << none;
  const std::string empty_dir = dir_->file("empty");
  fs::create_directories(empty_dir);
  const std::string empty = refusal(empty_dir, "s3");
  EXPECT_NE(empty.find("recipe[0] (distill): key 'teacher': '" + empty_dir + "' holds neither model.safetensors"),
            std::string::npos)
      << empty;
}

// The memory plan counts the teacher: on the host its fp32 weights and, on the CPU, its
// forward's activations; on the GPU its forward-only model. A teacher that cannot be read is
// a note (the trainer refuses the run when it loads it).
TEST_F(DistillTrain, ThePlanCountsTheTeacher) {
  TrainConfig c = config(data_, distill(0.5));
  c.model.vocab_size = 257;  // the byte tokenizer's, as the trainer resolves it
  const MemoryPlan cpu = plan_memory(c, "cpu");
  ASSERT_TRUE(cpu.teacher);
  EXPECT_EQ(cpu.teacher->num_params(), c.model.num_params()) << "the suite's teacher is the student's shape";
  TrainConfig forward = c;
  forward.checkpointing = {};
  EXPECT_EQ(cpu.host.teacher,
            uint64_t(c.model.num_params()) * sizeof(float) + host_memory_plan(forward, "cpu").activations);
  EXPECT_EQ(cpu.host.total(), host_memory_plan(c, "cpu").total() + cpu.host.teacher);
  EXPECT_NE(describe(c, cpu, {}).find("  teacher "), std::string::npos) << describe(c, cpu, {});

  const MemoryPlan gpu = plan_memory(c, "cuda");
  EXPECT_EQ(gpu.host.teacher, uint64_t(c.model.num_params()) * sizeof(float)) << "loaded on the host, then moved";
  const std::string text = describe(c, gpu, {});
  if (gpu.gpu)
    EXPECT_GT(gpu.gpu->teacher, 0u);
  else
    EXPECT_NE(text.find("note: the distillation teacher (" + std::to_string(c.model.num_params()) +
                        " parameters, forward only)"),
              std::string::npos)
        << text;

  TrainConfig missing = config(data_, distill(0.5, dir_->file("nope")));
  missing.model.vocab_size = 257;
  const MemoryPlan none = plan_memory(missing, "cpu");
  EXPECT_FALSE(none.teacher);
  EXPECT_EQ(none.host.teacher, 0u);
  EXPECT_NE(none.teacher_problem.find("the distillation teacher '" + dir_->file("nope") + "' cannot be read"),
            std::string::npos)
      << none.teacher_problem;
}

// GPU training distills too (a forward-only GPU copy of the teacher): nothing blocks the
// GPU, and `auto` takes it.
TEST(DistillDevice, GpuDistillsAndAutoTakesIt) {
  TrainConfig cfg = config("unused", "- distill: {teacher: runs/dense}\n");
  const std::string blocker = gpu_training_blocker(cfg, nullptr);
  EXPECT_EQ(blocker, "");
  DeviceProbe gpu;
  gpu.cuda_build = true;
  gpu.gpus = 1;
  EXPECT_EQ(choose_train_device("auto", gpu, blocker).device, "cuda");
}
