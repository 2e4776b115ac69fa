// train.init_from: a run that starts from the weights of an imported Hugging Face model
// (or any checkpoint), with the checkpoint's model section and fresh optimizer state; and
// eval of an imported run on data prepared with the Hugging Face directory's tokenizer.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "data/prepare.h"
#include "data/tokenizer.h"
#include "interop/hf_import.h"
#include "train/trainer.h"
#include "test_util.h"

namespace esplag {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::error_of;
using testing::TempDir;

const std::string kFixtures = std::string(ESPLAG_SOURCE_DIR) + "/tests/fixtures/hf/";

void quiet(const std::string&) {}

// Token shards of a lowercase corpus, tokenized with `tokenizer`.
std::string make_data(const TempDir& tmp, const Tokenizer& tokenizer, const std::string& name) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += i % 3 ? "the earth and the waters " : "a light in the heaven ";
  const std::string corpus = tmp.file(name + ".txt");
  std::ofstream(corpus) << text;
  prepare_dataset(corpus, tokenizer, tmp.file(name), 0.1, 1 << 20);
  return tmp.file(name);
}

TrainConfig config(const std::string& model_section, const std::string& data, const std::string& init_from) {
  return parse_train_config(model_section + R"(
train: {batch_size: 2, seq_len: 16, steps: 2, log_every: 1, eval_every: 0, eval_batches: 1,
        checkpoint_every: 0, device: cpu}
)",
                            "test", {"data.path=" + data, "train.init_from=" + init_from});
}

struct Imported {
  std::string run, data;
};

Imported import_llama(const TempDir& tmp) {
  Imported i;
  i.run = tmp.file("imported");
  import_hf(kFixtures + "llama-gqa", i.run);
  i.data = make_data(tmp, *load_tokenizer(i.run + "/tokenizer.json"), "data");
  return i;
}

TEST(HfInitFrom, RunStartsFromTheImportedWeightsAtStepZero) {
  TempDir tmp;
  const Imported im = import_llama(tmp);
  const HfModel hf = load_hf_model(kFixtures + "llama-gqa");
  // No model section: the checkpoint's, whatever the config's defaults are (tiny, 128 positions).
  Trainer t(config("", im.data, im.run), tmp.file("run"), quiet);
  EXPECT_EQ(t.config().model.n_kv_head, 1);
  EXPECT_EQ(t.config().model.max_seq_len, 32);
  ASSERT_EQ(t.model().num_params(), hf.model->num_params());
  EXPECT_EQ(0, std::memcmp(t.model().params(), hf.model->params(), hf.model->num_params() * sizeof(float)));
  const TrainResult r = t.run();
  EXPECT_EQ(r.steps, 2);
  EXPECT_TRUE(std::isfinite(r.last_loss));
  // The new run's own checkpoint resumes like any other.
  EXPECT_TRUE(fs::exists(tmp.file("run/step-000002/optimizer.safetensors")));
  const auto saved = load_model(resolve_checkpoint(tmp.file("run")));
  EXPECT_EQ(saved->config().n_kv_head, 1);
}

TEST(HfInitFrom, ModelKeysThatDisagreeWithTheCheckpointAreNamed) {
  TempDir tmp;
  const Imported im = import_llama(tmp);
  // Keys that agree are fine.
  EXPECT_NO_THROW(Trainer(config("model: {d_model: 16, n_kv_head: 1}", im.data, im.run), tmp.file("ok"), quiet));
  const std::string err =
      error_of([&] { Trainer(config("model: {d_model: 32}", im.data, im.run), tmp.file("r1"), quiet); });
  EXPECT_TRUE(contains(err, "train.init_from '" + im.run + "': model.d_model is 32 in the config (given) but 16 in "
                                                           "the checkpoint"))
      << err;
  // A preset fixes every model key.
  const std::string preset =
      error_of([&] { Trainer(config("model: {preset: llama-tiny}", im.data, im.run), tmp.file("r2"), quiet); });
  EXPECT_TRUE(contains(preset, "in the config (from model.preset) but")) << preset;
  EXPECT_FALSE(fs::exists(tmp.file("r1")) || fs::exists(tmp.file("r2")));
}

TEST(HfInitFrom, DataOfAnotherTokenizerOrAMissingCheckpointIsRefused) {
  TempDir tmp;
  const Imported im = import_llama(tmp);
  const std::string bytes = make_data(tmp, ByteTokenizer(), "bytes");
  const std::string err = error_of([&] { Trainer(config("", bytes, im.run), tmp.file("r"), quiet); });
  EXPECT_TRUE(contains(err, "was tokenized with 'byte' but the checkpoint")) << err;
  // The same tokenizer file elsewhere is the same tokenizer.
  const std::string other = make_data(tmp, *load_tokenizer(kFixtures + "llama-gqa/tokenizer.json"), "other");
  EXPECT_NO_THROW(Trainer(config("", other, im.run), tmp.file("r3"), quiet));
  const std::string missing = error_of([&] { Trainer(config("", im.data, tmp.file("nope")), tmp.file("r2"), quiet); });
  EXPECT_TRUE(contains(missing, "train.init_from '" + tmp.file("nope") + "': checkpoint")) << missing;
}

TEST(HfEval, DataOfTheSameTokenizerFileElsewhereIsAccepted) {
  TempDir tmp;
  const Imported im = import_llama(tmp);
  // The import's run records its own copy, RUN/tokenizer.json; this data records the original.
  const std::string other = make_data(tmp, *load_tokenizer(kFixtures + "llama-gqa/tokenizer.json"), "other");
  const EvalResult r = evaluate_checkpoint(im.run, other, "val", 1, 2, 16, "cpu");
  EXPECT_TRUE(std::isfinite(r.loss));
  const std::string bytes = make_data(tmp, ByteTokenizer(), "bytes");
  const std::string err = error_of([&] { evaluate_checkpoint(im.run, bytes, "val", 1, 2, 16, "cpu"); });
  EXPECT_TRUE(contains(err, "data '" + bytes + "' was tokenized with 'byte' but the checkpoint")) << err;
}

TEST(HfInitFrom, TheKeyRoundTripsThroughTheSavedConfig) {
  const TrainConfig c = parse_train_config("train: {init_from: some/run}\n", "test");
  EXPECT_EQ(parse_train_config(to_yaml(c), "saved").init_from, "some/run");
  EXPECT_EQ(parse_train_config(to_yaml(TrainConfig{}), "saved").init_from, "");
}

}  // namespace
}  // namespace esplag
