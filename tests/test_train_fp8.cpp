// train.precision, train.fp8_grad and delayed scaling's settings: parsing, errors, what the layers get, and the GPU's
// refusal of fp8 (emulated on the CPU only so far).
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "train/config.h"
#include "train/trainer.h"

using namespace esplag;

namespace {

std::string error_of(const std::string& yaml) {
  try {
    parse_train_config(yaml, "run.yaml", {});
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(TrainPrecision, DefaultsAndFp8Settings) {
  const TrainConfig plain = parse_train_config("", "run.yaml", {});
  EXPECT_EQ(plain.precision, "bf16");
  EXPECT_EQ(plain.linear_precision(), LinearPrecision{});
  const TrainConfig c = parse_train_config("train:\n  precision: fp8\n", "run.yaml", {});
  EXPECT_EQ(c.linear_precision(), (LinearPrecision{true, Fp8Format::e4m3}));
  const TrainConfig g = parse_train_config("train:\n  precision: fp8\n", "run.yaml", {"train.fp8_grad=e5m2"});
  EXPECT_EQ(g.linear_precision(), (LinearPrecision{true, Fp8Format::e5m2}));
  // Saved and read back.
  const TrainConfig back = parse_train_config(to_yaml(g), "config.yaml", {});
  EXPECT_EQ(back.linear_precision(), g.linear_precision());
}

TEST(TrainPrecision, DelayedScalingSettings) {
  const TrainConfig c = parse_train_config("train:\n  precision: fp8\n", "run.yaml",
                                           {"train.fp8_scaling=delayed", "train.fp8_amax_history=4"});
  const LinearPrecision p = c.linear_precision();
  EXPECT_TRUE(p.delayed());
  EXPECT_EQ(p.amax_history, 4);
  EXPECT_EQ(parse_train_config(to_yaml(c), "config.yaml", {}).linear_precision(), p);
  EXPECT_FALSE(TrainConfig{}.linear_precision().delayed());
  const std::string bad = error_of("train:\n  fp8_scaling: lazy\n");
  EXPECT_NE(bad.find("train.fp8_scaling"), std::string::npos) << bad;
  const std::string zero = error_of("train:\n  fp8_amax_history: 0\n");
  EXPECT_NE(zero.find("train.fp8_amax_history"), std::string::npos) << zero;
}

TEST(TrainPrecision, UnknownValuesAreKeyErrors) {
  const std::string fp16 = error_of("train:\n  precision: fp16\n");
  EXPECT_NE(fp16.find("train.precision"), std::string::npos) << fp16;
  EXPECT_NE(fp16.find("fp16"), std::string::npos) << fp16;
  EXPECT_NE(fp16.find("bf16"), std::string::npos) << fp16;
  const std::string grad = error_of("train:\n  fp8_grad: e3m4\n");
  EXPECT_NE(grad.find("train.fp8_grad"), std::string::npos) << grad;
}

// The GPU trains fp8 for dense, masked, vnm, slope and semi_sparse layers (the 2:4 kinds with
// e4m3 gradients only); with another sparse kind, or sparse_dw, it refuses, and auto stays on
// the CPU.
TEST(TrainPrecision, GpuTrainingRefusesFp8WithOtherSparseKindsAndAutoStaysOnTheCpu) {
  TrainConfig c;
  EXPECT_EQ(gpu_training_blocker(c), "");
  c.precision = "fp8";
  EXPECT_EQ(gpu_training_blocker(c), "") << "dense fp8 trains on the GPU";
  c.recipe_yaml = "- slope: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight']}\n";
  c.fp8_grad = "e5m2";
  const std::string e5m2 = gpu_training_blocker(c);
  EXPECT_NE(e5m2.find("train.precision is fp8 with slope layers and train.fp8_grad is e5m2"), std::string::npos)
      << e5m2;
  c.fp8_grad = "e4m3";
  EXPECT_EQ(gpu_training_blocker(c), "") << "fp8 slope with e4m3 gradients trains on the GPU";
  c.recipe_yaml = "- semi_sparse: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight']}\n";
  EXPECT_EQ(gpu_training_blocker(c), "") << "fp8 semi_sparse with e4m3 gradients trains on the GPU";
  c.fp8_grad = "e5m2";
  const std::string semi_e5m2 = gpu_training_blocker(c);
  EXPECT_NE(semi_e5m2.find("train.precision is fp8 with semi_sparse layers and train.fp8_grad is e5m2"),
            std::string::npos)
      << semi_e5m2;
  c.fp8_grad = "e4m3";
  c.recipe_yaml = "- semi_sparse: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], sparse_dw: true}\n";
  const std::string semi = gpu_training_blocker(c);
  EXPECT_EQ(semi.find("sparse Linear kinds"), std::string::npos) << semi;
  EXPECT_NE(semi.find("train.precision is fp8 with sparse_dw"), std::string::npos) << semi;
  c.recipe_yaml = "- gradual_magnitude: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], mask_type: '64:2:8', "
                  "start: 0, end: 4, update_every: 1}\n"
                  "- kernel_replacement: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight'], start: 5}\n";
  c.fp8_grad = "e5m2";
  EXPECT_EQ(gpu_training_blocker(c), "") << "fp8 masked and vnm layers (the dense products) train on the GPU";
  c.fp8_grad = "e4m3";
  c.recipe_yaml = "- semi_sparse_activation: {params: ['re:blocks\\..*\\.mlp\\.fc\\.weight']}\n";
  const std::string why = gpu_training_blocker(c);
  EXPECT_NE(why.find("train.precision is fp8 with sparse Linear kinds (semi_sparse_activation)"), std::string::npos)
      << why;
  const DeviceProbe gpu{true, 1, ""};
  const DeviceChoice choice = choose_train_device("auto", gpu, why);
  EXPECT_EQ(choice.device, "cpu");
  EXPECT_NE(choice.note.find("train.precision is fp8"), std::string::npos) << choice.note;
  try {
    choose_train_device("cuda", gpu, why);
    FAIL() << "train.device=cuda with fp8 and a semi_sparse_activation layer must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.precision is fp8"), std::string::npos) << e.what();
  }
}
