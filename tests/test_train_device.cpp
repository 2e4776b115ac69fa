// train.device: how auto / cpu / cuda resolve, and the errors a run gets when the GPU path
// cannot be used (a build without CUDA, no GPU visible, a sparse recipe), checked without
// a GPU. The GPU runs themselves are tests/gpu_train.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "train/layer_kinds.h"
#include "train/trainer.h"

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::TempDir;
namespace fs = std::filesystem;

namespace {

const DeviceProbe kCpuBuild{false, 0, ""};
const DeviceProbe kNoGpu{true, 0, "cudaErrorNoDevice: no CUDA-capable device is detected"};
const DeviceProbe kOneGpu{true, 1, ""};
const std::string kBlocker = "the run needs sparse Linear kinds (modifier slope on re:.*mlp.*)";

std::string make_dataset(const TempDir& dir) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "In the beginning God created the heaven and the earth. " + std::to_string(i) + "\n";
  esplag::testing::write_text(dir.file("corpus.txt"), text);
  prepare_dataset(dir.file("corpus.txt"), ByteTokenizer(), dir.file("data"), 0.1, 1 << 20);
  return dir.file("data");
}

TrainConfig small_config(const std::string& data, const std::string& device) {
  return parse_train_config(R"(
model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 16}
train: {batch_size: 2, seq_len: 16, steps: 2, log_every: 1, eval_every: 0, eval_batches: 1, checkpoint_every: 0}
)",
                            "test", {"data.path=" + data, "train.device=" + device});
}

const char* kRecipe = R"(
model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 16}
train: {batch_size: 2, seq_len: 16, steps: 10}
recipe:
  - gradual_magnitude: {params: ['blocks.0.mlp.fc.weight'], mask_type: "2:4", start: 2, end: 6, update_every: 2}
  - kernel_replacement: {params: ['blocks.0.mlp.fc.weight'], start: 7, lora_rank: 2, lora_start: 8}
  - semi_sparse_activation: {params: ['blocks.0.mlp.proj.weight']}
  - slope: {params: ['blocks.0.attn.qkv.weight'], lora_rank: 2, lora_start: 0.5}
)";

void quiet(const std::string&) {}

}  // namespace

TEST(TrainDevice, CpuIsAlwaysTheCpu) {
  for (const DeviceProbe& p : {kCpuBuild, kNoGpu, kOneGpu}) {
    const DeviceChoice c = choose_train_device("cpu", p, kBlocker);
    EXPECT_EQ(c.device, "cpu");
    EXPECT_EQ(c.note, "");
  }
}

TEST(TrainDevice, CudaNeedsACudaBuildAGpuAndADenseRun) {
  const std::string no_build = error_of([] { choose_train_device("cuda", kCpuBuild, ""); });
  EXPECT_TRUE(contains(no_build, "train.device=cuda")) << no_build;
  EXPECT_TRUE(contains(no_build, "built without the CUDA backend")) << no_build;
  EXPECT_TRUE(contains(no_build, "use train.device=cpu")) << no_build;

  const std::string no_gpu = error_of([] { choose_train_device("cuda", kNoGpu, ""); });
  EXPECT_TRUE(contains(no_gpu, "no CUDA device is visible")) << no_gpu;
  EXPECT_TRUE(contains(no_gpu, "cudaErrorNoDevice")) << no_gpu;  // the runtime's reason is passed on

  const std::string sparse = error_of([] { choose_train_device("cuda", kOneGpu, kBlocker); });
  EXPECT_TRUE(contains(sparse, "modifier slope on re:.*mlp.*")) << sparse;
  EXPECT_TRUE(contains(sparse, gpu_kinds_note())) << sparse;
  EXPECT_TRUE(contains(sparse, "use train.device=cpu")) << sparse;

  const DeviceChoice ok = choose_train_device("cuda", kOneGpu, "");
  EXPECT_EQ(ok.device, "cuda");
  EXPECT_EQ(ok.note, "");
}

TEST(TrainDevice, AutoTakesTheGpuOnlyWhenCudaWould) {
  DeviceChoice c = choose_train_device("auto", kCpuBuild, "");
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.note, "");  // nothing to explain: a CPU build has one device

  c = choose_train_device("auto", kNoGpu, "");
  EXPECT_EQ(c.device, "cpu");
  EXPECT_TRUE(contains(c.note, "no CUDA device is visible")) << c.note;

  c = choose_train_device("auto", kOneGpu, kBlocker);
  EXPECT_EQ(c.device, "cpu");  // said in the run's first log line, not silent
  EXPECT_TRUE(contains(c.note, "modifier slope")) << c.note;
  EXPECT_TRUE(contains(c.note, gpu_kinds_note())) << c.note;

  c = choose_train_device("auto", kOneGpu, "");
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.note, "");

  EXPECT_TRUE(contains(error_of([] { choose_train_device("gpu", kOneGpu, ""); }), "must be auto, cpu or cuda"));
}

TEST(TrainDevice, BlockerNamesEveryModifierAndSparseKind) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  EXPECT_EQ(gpu_training_blocker(small_config(data, "auto")), "");

  const TrainConfig cfg = parse_train_config(kRecipe, "recipe.yaml", {"data.path=" + data});
  const std::string b = gpu_training_blocker(cfg);
  EXPECT_TRUE(contains(b, "modifier kernel_replacement with LoRA adapters on blocks.0.mlp.fc.weight")) << b;
  EXPECT_FALSE(contains(b, "modifier gradual_magnitude")) << "gradual magnitude pruning trains on the GPU: " << b;
  EXPECT_FALSE(contains(b, "modifier semi_sparse_activation")) << "semi_sparse_activation trains on the GPU: " << b;
  EXPECT_FALSE(contains(b, "modifier slope")) << "slope with its adapters trains on the GPU: " << b;

  // semi_sparse trains on the GPU: neither its modifier nor its layers block.
  const TrainConfig semi = parse_train_config(R"(
model: {preset: tiny, n_layer: 1, d_model: 32, n_head: 2, n_kv_head: 2, d_ff: 64, max_seq_len: 16}
train: {batch_size: 2, seq_len: 16, steps: 10}
recipe:
  - semi_sparse: {params: ['blocks.0.mlp.fc.weight'], until: 5}
)",
                                              "semi.yaml", {"data.path=" + data});
  EXPECT_EQ(gpu_training_blocker(semi), "");
  // ... unless cuSPARSELt cannot take a layer it claims, or the micro-batch (multiples of 16).
  TrainConfig odd = semi;
  odd.model.d_ff = 72;  // mlp.fc 72x32, mlp.proj 32x72
  std::string why = gpu_training_blocker(odd);
  EXPECT_TRUE(contains(why, "modifier semi_sparse on blocks.0.mlp.fc.weight: blocks.0.mlp.fc.weight is 72x32, not "
                            "multiples of 16")) << why;
  odd.recipe_yaml = "- semi_sparse: {params: ['re:blocks\\.0\\.attn\\..*'], until: 5}\n";
  EXPECT_EQ(gpu_training_blocker(odd), "") << "the layers it claims are fine";
  // slope trains on the GPU too, with the same shape rule.
  TrainConfig slope = semi;
  slope.recipe_yaml = "- slope: {params: ['blocks.0.mlp.fc.weight'], mask_change_freq: 10}\n";
  EXPECT_EQ(gpu_training_blocker(slope), "");
  slope.model.d_ff = 72;
  why = gpu_training_blocker(slope);
  EXPECT_TRUE(contains(why, "modifier slope on blocks.0.mlp.fc.weight: blocks.0.mlp.fc.weight is 72x32")) << why;
  TrainConfig few = semi;
  few.batch_size = 3;
  few.seq_len = 5;
  why = gpu_training_blocker(few);
  EXPECT_TRUE(contains(why, "15 tokens, not a multiple of 16")) << why;

  // A model whose layer has another kind (as a checkpoint of a sparse run is rebuilt).
  TrainConfig dense = small_config(data, "auto");
  dense.model.vocab_size = 257;
  Transformer<float> model(dense.model);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "");
  LayerPlan plan;
  plan.kind = "masked";
  plan.pattern = SparsityPattern::nm(2, 4);
  plan.sparsity = 0.5;
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "");
  plan.kind = "semi_sparse_activation";
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "");
  plan.kind = "semi_sparse";
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "");
  plan.kind = "slope";
  plan.mask_change_freq = 10;
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "");
  plan.lora_rank = 4;
  plan.lora_enabled = true;
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  EXPECT_EQ(gpu_training_blocker(dense, &model), "") << "slope's own adapter trains on the GPU";
  // Any other kind with an adapter is wrapped in LoRA, which the GPU does not train.
  plan.kind = "semi_sparse";
  apply_layer_plan(model, "blocks.0.mlp.proj.weight", plan, 1);
  const std::string lora = gpu_training_blocker(dense, &model);
  EXPECT_TRUE(contains(lora, "blocks.0.mlp.proj.weight of kind semi_sparse+lora")) << lora;
}

// sparse_dw trains on the GPU where the fused MVUE kernel's 64×64 tiles fit: the claimed
// layers' outputs and the micro-batch's tokens multiples of 64. Otherwise `auto` stays on
// the CPU and `cuda` is an error naming the rule; the layers it built never keep a
// checkpoint off the GPU.
TEST(TrainDevice, SparseDwNeedsMultiplesOf64OnTheGpu) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  for (const char* type : {"semi_sparse", "slope"}) {
    SCOPED_TRACE(type);
    TrainConfig cfg = small_config(data, "auto");  // 2 x 16 = 32 tokens
    cfg.recipe_yaml = std::string("- ") + type + ": {params: ['blocks.0.mlp.fc.weight'], sparse_dw: true}\n";
    const std::string b = gpu_training_blocker(cfg);
    EXPECT_TRUE(contains(b, std::string("modifier ") + type +
                                " with sparse_dw on blocks.0.mlp.fc.weight: train.batch_size x train.seq_len = 32 "
                                "tokens, not a multiple of 64 (sparse_dw)")) << b;
    const DeviceChoice c = choose_train_device("auto", kOneGpu, b);
    EXPECT_EQ(c.device, "cpu");
    EXPECT_TRUE(contains(c.note, "not a multiple of 64 (sparse_dw)")) << c.note;
    const std::string e = error_of([&] { choose_train_device("cuda", kOneGpu, b); });
    EXPECT_TRUE(contains(e, "train.device=cuda")) << e;
    EXPECT_TRUE(contains(e, "use train.device=cpu")) << e;
    // 64 tokens: the GPU trains it (fc has 64 outputs); attn.qkv has 96, which it refuses.
    cfg.batch_size = 4;
    EXPECT_EQ(gpu_training_blocker(cfg), "");
    cfg.recipe_yaml = std::string("- ") + type + ": {params: ['blocks.0.attn.qkv.weight'], sparse_dw: true}\n";
    const std::string q = gpu_training_blocker(cfg);
    EXPECT_TRUE(contains(q, "blocks.0.attn.qkv.weight has 96 outputs, not a multiple of 64 (sparse_dw)")) << q;
    cfg.recipe_yaml = std::string("- ") + type + ": {params: ['blocks.0.attn.qkv.weight'], sparse_dw: false}\n";
    EXPECT_EQ(gpu_training_blocker(cfg), "");
    cfg.batch_size = 2;

    cfg.model.vocab_size = 257;
    Transformer<float> model(cfg.model);
    LayerPlan plan;
    plan.kind = type;
    plan.pattern = SparsityPattern::nm(2, 4);
    plan.mask_change_freq = 10;
    plan.sparse_dw = true;
    apply_layer_plan(model, "blocks.0.mlp.fc.weight", plan, 1);
    ASSERT_TRUE(model.linear("blocks.0.mlp.fc.weight").state().count("blocks.0.mlp.fc.weight.sparse_dw_draws"));
    TrainConfig kinds_only = cfg;
    kinds_only.recipe_yaml.clear();
    EXPECT_EQ(gpu_training_blocker(kinds_only, &model), "");
  }
}

// The real probe of this process: where no GPU can be used (a CPU build, or a CUDA build
// on a machine without a GPU) `cuda` fails before the run directory is created, and
// `auto` trains on the CPU.
TEST(TrainDevice, TrainerRefusesCudaWhereThereIsNone) {
  const DeviceProbe probe = probe_devices();
  if (probe.cuda_build && probe.gpus > 0) GTEST_SKIP() << "a GPU is visible: tests/gpu_train.cu covers this machine";
  TempDir dir;
  const std::string data = make_dataset(dir);
  const std::string run = dir.file("run_cuda");
  const std::string e = error_of([&] { Trainer(small_config(data, "cuda"), run, quiet); });
  EXPECT_TRUE(contains(e, "train.device=cuda")) << e;
  EXPECT_TRUE(contains(e, probe.cuda_build ? "no CUDA device is visible" : "built without the CUDA backend")) << e;
  EXPECT_FALSE(fs::exists(run)) << "nothing is written before the device is resolved";

  std::vector<std::string> log;
  Trainer t(small_config(data, "auto"), dir.file("run_auto"), [&](const std::string& s) { log.push_back(s); });
  EXPECT_EQ(t.device(), "cpu");
  const TrainResult r = t.run();
  EXPECT_EQ(r.steps, 2);
  EXPECT_TRUE(std::isfinite(r.last_loss));
  ASSERT_FALSE(log.empty());
  EXPECT_TRUE(contains(log.front(), "| device cpu")) << log.front();

  // --resume with another device: cuda is refused the same way, cpu continues.
  const std::string re = error_of([&] { Trainer::resume(dir.file("run_auto"), quiet, 3, "cuda"); });
  EXPECT_TRUE(contains(re, "train.device=cuda")) << re;
  auto resumed = Trainer::resume(dir.file("run_auto"), quiet, 3, "cpu");
  EXPECT_EQ(resumed->device(), "cpu");
  EXPECT_EQ(resumed->run().steps, 3);
  EXPECT_TRUE(contains(error_of([&] { Trainer::resume(dir.file("run_auto"), quiet, 4, "tpu"); }),
                       "must be auto, cpu or cuda"));

  // Evaluation the same way: cuda is refused with the reason, auto evaluates on the CPU.
  const std::string ev = error_of([&] { evaluate_checkpoint(dir.file("run_auto"), data, "val", 1, 0, 0, "cuda"); });
  EXPECT_TRUE(contains(ev, "eval --device cuda")) << ev;
  EXPECT_TRUE(contains(ev, probe.cuda_build ? "no CUDA device is visible" : "built without the CUDA backend")) << ev;
  const EvalResult on_auto = evaluate_checkpoint(dir.file("run_auto"), data, "val", 1, 0, 0, "auto");
  EXPECT_EQ(on_auto.device, "cpu");
  EXPECT_EQ(on_auto.loss, evaluate_checkpoint(dir.file("run_auto"), data, "val", 1).loss);
}

// A sparse recipe asks for the GPU: one error naming the modifiers, whatever the machine
// (without a GPU the missing device is named instead).
TEST(TrainDevice, SparseRecipeOnCudaIsAnError) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  const TrainConfig cfg = parse_train_config(kRecipe, "recipe.yaml", {"data.path=" + data, "train.device=cuda"});
  const std::string e = error_of([&] { Trainer(cfg, dir.file("run"), quiet); });
  const DeviceProbe probe = probe_devices();
  if (probe.cuda_build && probe.gpus > 0) {
    EXPECT_TRUE(contains(e, "modifier kernel_replacement with LoRA adapters")) << e;
    EXPECT_TRUE(contains(e, gpu_kinds_note())) << e;
  } else {
    EXPECT_TRUE(contains(e, "train.device=cuda")) << e;
  }
  EXPECT_FALSE(fs::exists(dir.file("run")));
}

// The optimizer offload moves GPU training's state to the host: a run on the CPU (asked
// for, or chosen by auto) with it is one error naming the key, and writes nothing.
TEST(TrainDevice, OptimizerOffloadIsRefusedOnTheCpu) {
  TempDir dir;
  const std::string data = make_dataset(dir);
  for (const std::string offload : {"optimizer", "optimizer+master"}) {
    TrainConfig cfg = small_config(data, "cpu");
    cfg.offload = offload;
    const std::string run = dir.file("run_" + offload);
    const std::string e = error_of([&] { Trainer(cfg, run, quiet); });
    EXPECT_TRUE(contains(e, "train.offload is " + offload)) << e;
    EXPECT_TRUE(contains(e, "set train.offload none")) << e;
    EXPECT_FALSE(fs::exists(run));
  }
  // The key takes its three values only.
  const std::string bad = error_of([&] {
    parse_train_config("model: {preset: tiny}\n", "test", {"data.path=" + data, "train.offload=gpu"});
  });
  EXPECT_TRUE(contains(bad, "train.offload")) << bad;
}
