#include "interop/hf_import.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "data/tokenizer.h"
#include "interop/hf_tensors.h"
#include "io/atomic_file.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

// Every tensor of the model: model.safetensors, or the shards of the index.
std::map<std::string, Tensor> read_weights(const fs::path& dir, std::string& where) {
  const fs::path single = dir / "model.safetensors", index = dir / "model.safetensors.index.json";
  if (fs::exists(single)) {
    where = single.string();
    return load_safetensors(where).tensors;
  }
  if (!fs::exists(index)) {
    const bool bin = fs::exists(dir / "pytorch_model.bin") || fs::exists(dir / "pytorch_model.bin.index.json");
    fail("'", dir.string(), "' holds neither model.safetensors nor model.safetensors.index.json",
         bin ? " (only PyTorch .bin weights, which esplag does not read: save them with safe_serialization=True)" : "");
  }
  where = index.string();
  const nlohmann::json js = parse_json(read_file(where), where);
  ESPLAG_CHECK(js.is_object() && js.contains("weight_map") && js["weight_map"].is_object(), where,
               ": field 'weight_map' (an object of tensor name -> shard file) is missing");
  std::map<std::string, std::string> shard_of;
  for (const auto& [name, file] : js["weight_map"].items()) {
    ESPLAG_CHECK(file.is_string(), where, ": weight_map entry '", name, "' must be a file name, got ", file.dump());
    const std::string f = file.get<std::string>();
    ESPLAG_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "..", where, ": weight_map entry '", name,
                 "' names '", f, "', which is not a file of the directory");
    shard_of[name] = f;
  }
  std::set<std::string> files;
  for (const auto& [name, f] : shard_of) files.insert(f);
  std::map<std::string, Tensor> all;
  for (const std::string& f : files) {
    const std::string path = (dir / f).string();
    ESPLAG_CHECK(fs::exists(path), where, " names the shard '", f, "', which is missing");
    for (auto& [name, t] : load_safetensors(path).tensors) {
      auto it = shard_of.find(name);
      ESPLAG_CHECK(it != shard_of.end() && it->second == f, path, ": tensor '", name, "' is ",
                   it == shard_of.end() ? "not in " + where : "listed under '" + it->second + "' in " + where);
      all.emplace(name, std::move(t));
    }
  }
  for (const auto& [name, f] : shard_of)
    ESPLAG_CHECK(all.count(name), where, " lists tensor '", name, "' in '", f, "', which does not hold it");
  return all;
}

// An empty or absent directory: an import never mixes with an existing run.
void check_run_dir(const std::string& run_dir) {
  std::error_code ec;
  if (!fs::exists(run_dir, ec)) return;
  ESPLAG_CHECK(fs::is_directory(run_dir, ec), "import: --out '", run_dir, "' exists and is not a directory");
  ESPLAG_CHECK(fs::is_empty(run_dir, ec), "import: --out '", run_dir,
               "' is not empty; give a new directory (an import never mixes with an existing run)");
}

}  // namespace

HfModel load_hf_model(const std::string& dir) {
  ESPLAG_CHECK(fs::is_directory(dir), "import: '", dir, "' is not a directory");
  const std::string config_path = (fs::path(dir) / "config.json").string();
  ESPLAG_CHECK(fs::exists(config_path), "import: '", dir, "' has no config.json (not a Hugging Face model directory?)");
  HfModel out;
  out.config = parse_hf_config(read_file(config_path), config_path);
  std::string where;
  const auto tensors = read_weights(dir, where);
  const auto params = esplag_params_from_hf(out.config, tensors, where);
  out.model = std::make_unique<Transformer<float>>(out.config.model);
  for (const auto& [name, t] : params) {
    Tensor dst = out.model->param(name);
    std::copy_n(t.data<float>(), t.numel(), dst.data<float>());
  }
  return out;
}

HfImport import_hf(const std::string& dir, const std::string& run_dir) {
  check_run_dir(run_dir);
  HfModel hf = load_hf_model(dir);
  const fs::path tokenizer_src = fs::path(dir) / "tokenizer.json";
  ESPLAG_CHECK(fs::exists(tokenizer_src), "import: '", dir,
               "' has no tokenizer.json (the run records its tokenizer; vocab.json/merges.txt alone are not read: "
               "save the tokenizer with a recent transformers)");
  HfImport out;
  out.config = hf.config;
  // Whether esplag's tokenizer reads it: the import goes on either way (eval and training
  // take token shards), but sample and data prepare need it.
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = load_tokenizer(tokenizer_src.string());
  } catch (const Error& e) {
    out.tokenizer_note = e.what();
  }
  if (tok)
    ESPLAG_CHECK(tok->vocab_size() <= hf.config.model.vocab_size, tokenizer_src.string(), ": the tokenizer has ",
                 tok->vocab_size(), " tokens, more than the model's vocab_size ", hf.config.model.vocab_size);

  TrainConfig config;
  config.model = hf.config.model;
  config.seq_len = std::min(config.seq_len, config.model.max_seq_len);
  config.source = "import of " + dir;
  config.validate();

  std::error_code ec;
  fs::create_directories(run_dir, ec);
  ESPLAG_CHECK(!ec, "import: cannot create '", run_dir, "': ", ec.message());
  const fs::path tokenizer_dst = fs::absolute(fs::path(run_dir) / "tokenizer.json").lexically_normal();
  write_file_atomic(tokenizer_dst.string(), read_file(tokenizer_src.string()));
  out.tokenizer = tokenizer_dst.string();
  write_file_atomic((fs::path(run_dir) / "config.yaml").string(), to_yaml(config));
  out.checkpoint = save_weights_checkpoint(run_dir, *hf.model, config, out.tokenizer, TrainerState{});
  return out;
}

}  // namespace esplag
