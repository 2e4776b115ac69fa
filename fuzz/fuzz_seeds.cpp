// Writes the seed corpus of every fuzz target into DIR/<target>/: small valid files made
// by the engine's own writers (so the seeds follow the formats as they are written today),
// the shipped configs and the recipes they hold.
//
//   fuzz_seeds DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

#include "data/bpe_trainer.h"
#include "fuzz_checkpoint.h"
#include "data/shard.h"
#include "io/safetensors.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/config.h"

namespace fs = std::filesystem;
using namespace esplag;

namespace {

fs::path g_out;

fs::path seed(const std::string& target, const std::string& name) {
  fs::create_directories(g_out / target);
  return g_out / target / name;
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

Tensor tensor(const std::string& name, DType dtype, const Shape& shape) {
  Tensor t = Tensor::zeros(shape, DType::f32);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = 0.25f * float(i);
  Tensor c = dtype == DType::f32 ? t : t.to(dtype);
  c.set_name(name);
  return c;
}

void safetensors_seeds() {
  save_safetensors(seed("safetensors", "f32.safetensors"), {tensor("w", DType::f32, {2, 3})}, {{"format", "seed"}});
  save_safetensors(seed("safetensors", "dtypes.safetensors"),
                   {tensor("a", DType::f64, {2}), tensor("b", DType::i32, {3}), tensor("c", DType::bf16, {2, 2}),
                    tensor("d", DType::f16, {1, 3}), tensor("e", DType::u16, {2}), tensor("f", DType::u8, {5}),
                    tensor("scalar", DType::f32, {}), tensor("empty", DType::f32, {0, 4})});
  save_safetensors(seed("safetensors", "none.safetensors"), {});
}

void shard_seeds() {
  std::vector<int32_t> tokens(100);
  std::iota(tokens.begin(), tokens.end(), 0);
  write_shard(seed("shard", "v1.bin").string(), tokens, 257);
  tokens.push_back(69999);
  write_shard(seed("shard", "v2.bin").string(), tokens, 70000);
  write_shard(seed("shard", "empty.bin").string(), {}, 257);
}

void tokenizer_seeds() {
  // GPT-2's layout, with an added token and a Split + ByteLevel pre-tokenizer.
  write_text(seed("tokenizer", "tiny.json"), R"({
  "version": "1.0",
  "added_tokens": [{"id": 15, "content": "<|endoftext|>", "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated"},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
  "decoder": {"type": "ByteLevel"},
  "model": {
    "type": "BPE", "ignore_merges": false,
    "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "he": 8, "ll": 9,
              "hell": 10, "hello": 11, "Ġw": 12, "or": 13, "Ġwor": 14, "<|endoftext|>": 15},
    "merges": ["h e", "l l", ["he", "ll"], "hell o", "Ġ w", "o r", "Ġw or"]
  }
})");
  std::string text;
  for (int i = 0; i < 40; ++i) text += "In the beginning God created the heaven and the earth. naïve café 1234\n";
  save_tokenizer_json(seed("tokenizer", "trained.json").string(), train_bpe(text, 290));
}

void config_seeds() {
  write_text(seed("config", "defaults.yaml"), to_yaml(TrainConfig{}));
  // YAML's other forms (flow collections, explicit keys, anchors, tags, quoting), which the
  // shipped configs do not use and a mutator rarely invents.
  write_text(seed("config", "yaml-forms.yaml"), R"(model: &m {preset: tiny, d_model: 64, n_head: !!int 4}
? train
: {steps: 10, device: "cpu", seed: 0x10}
data: {path: 'data/kjv'}
optimizer: {lr: .5e-3, beta1: 0.9}
recipe:
  - semi_sparse: {params: ["re:blocks\.[0-9]+\.mlp\..*"], until: 0.5}
)");
  write_text(seed("recipe", "yaml-forms.yaml"), R"([{gradual_magnitude: {params: [re:blocks\.0\..*], start: 0, end: 0.5,
  update_every: 10, mask_type: "2:4"}}, {slope: &s {params: ["blocks.1.attn.qkv.weight"], lora_rank: 4}}])");
  int n = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(ESPLAG_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".yaml") continue;
    const std::string name = e.path().parent_path().filename().string() + "-" + e.path().filename().string();
    fs::copy_file(e.path(), seed("config", name), fs::copy_options::overwrite_existing);
    const TrainConfig c = load_train_config(e.path().string());
    if (!c.recipe_yaml.empty()) write_text(seed("recipe", name), c.recipe_yaml);
    ++n;
  }
  if (n == 0) std::fprintf(stderr, "fuzz_seeds: no configs found under %s/configs\n", ESPLAG_SOURCE_DIR);
}

void state_seeds() {
  const fs::path run = g_out / "state-run";
  const fs::path dir = fuzz::save_default_checkpoint(run.string());
  fs::copy_file(dir / "state.json", seed("state", "state.json"), fs::copy_options::overwrite_existing);
  fs::remove_all(run);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seeds DIR\n");
    return 2;
  }
  g_out = argv[1];
  try {
    safetensors_seeds();
    shard_seeds();
    tokenizer_seeds();
    config_seeds();
    state_seeds();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_seeds: %s\n", e.what());
    return 1;
  }
  return 0;
}
