#include "interop/hf_export.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe_trainer.h"
#include "data/tokenizer.h"
#include "interop/hf_sparse24.h"
#include "interop/hf_tensors.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"

namespace esplag {

namespace fs = std::filesystem;

namespace {

// Writes DIR/tokenizer.json; returns the id of end-of-text (or -1) through `eot`, and ""
// or why no tokenizer was written.
std::string write_tokenizer(const std::string& spec, const fs::path& dir, int& eot) {
  eot = -1;
  const std::string path = (dir / "tokenizer.json").string();
  if (spec == "byte") {
    // Byte-level BPE without merges whose ids are the bytes: ByteTokenizer exactly.
    BpeModel bytes;
    for (int b = 0; b < 256; ++b) bytes.tokens.push_back(std::string(1, static_cast<char>(b)));
    bytes.tokens.push_back("<|endoftext|>");
    bytes.eot_token = ByteTokenizer::kEot;
    save_tokenizer_json(path, bytes);
    eot = ByteTokenizer::kEot;
    return "";
  }
  std::error_code ec;
  if (!fs::is_regular_file(spec, ec))
    return "the checkpoint's tokenizer '" + spec + "' is not a file here, so no tokenizer.json was written";
  write_file_atomic(path, read_file(spec));
  try {
    eot = load_tokenizer(spec)->eot_token();
  } catch (const Error&) {
    // Copied as it is: transformers reads tokenizers esplag's BPE does not.
  }
  return "";
}

// LLaMA's block linears: model.layers.L.self_attn.{q,k,v,o}_proj, model.layers.L.mlp.{gate,up,down}_proj.
bool is_block_linear_weight(const std::string& hf_name) {
  const std::string suffix = "_proj.weight";
  return hf_name.rfind("model.layers.", 0) == 0 && hf_name.size() > suffix.size() &&
         hf_name.compare(hf_name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

double zero_fraction(const std::vector<Tensor>& tensors) {
  size_t zeros = 0, total = 0;
  for (const Tensor& t : tensors) {
    const float* v = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) zeros += v[i] == 0.0f;
    total += t.numel();
  }
  return total == 0 ? 0.0 : double(zeros) / double(total);
}

}  // namespace

HfExport export_hf(Transformer<float>& model, const std::string& tokenizer, const std::string& dir, bool sparse_24) {
  HfExport out;
  out.config = hf_config_for(model.config());
  ESPLAG_CHECK(!sparse_24 || out.config.family == HfFamily::llama, "export --hf --sparse-24: a ",
               to_string(out.config.family), " model has no 2:4 layout in compressed-tensors (its Conv1D layers ",
               "store weights [in, out], whose rows are not the 2:4 groups); export it dense, without --sparse-24");
  // Every parameter as the dense effective weight (sparse kinds: their dense view).
  std::map<std::string, std::vector<float>> dense;
  std::map<std::string, Tensor> params;
  for (const auto& name : model.linear_names()) {
    const Linear<float>& l = model.linear(name);
    auto& w = dense[name];
    w.resize(size_t(l.params().out_features) * l.params().in_features);
    l.dense_weight(w.data());
    if (sparse_24) {
      try {
        check_2_of_4(l.params().module, w.data(), l.params().out_features, l.params().in_features);
      } catch (const Error& e) {
        fail("export --hf --sparse-24: ", e.what(), "; its kind is ", l.kind(),
             " (the weight as the model applies it, adapters included, must be 2:4); export it dense, without ",
             "--sparse-24");
      }
    }
  }
  for (const auto& pi : model.param_infos()) {
    auto it = dense.find(pi.name);
    params[pi.name] = it == dense.end() ? model.param(pi.name)
                                        : Tensor::borrow(it->second.data(), pi.shape, DType::f32, Device::cpu, pi.name);
  }
  const std::vector<Tensor> tensors = hf_tensors_from_esplag(out.config, params);
  out.tensors = tensors.size();
  std::vector<Tensor> dense_tensors;
  std::vector<Sparse24Tensor> compressed;
  for (const Tensor& t : tensors) {
    if (sparse_24 && is_block_linear_weight(t.name()))
      compressed.push_back(compress_2_of_4(t));
    else
      dense_tensors.push_back(t);
  }
  out.compressed = compressed.size();
  if (sparse_24) out.global_sparsity = zero_fraction(tensors);

  std::error_code ec;
  fs::create_directories(dir, ec);
  ESPLAG_CHECK(!ec, "export --hf: cannot create '", dir, "': ", ec.message());
  int eot = -1;
  out.tokenizer_note = write_tokenizer(tokenizer, dir, eot);
  const std::string weights = (fs::path(dir) / "model.safetensors").string();
  std::string config = hf_config_json(out.config, eot);
  if (sparse_24) {
    save_sparse24_safetensors(weights, dense_tensors, compressed, {{"format", "pt"}});
    nlohmann::json js = nlohmann::json::parse(config);
    js["quantization_config"] = nlohmann::json::parse(hf_sparse24_config({"lm_head"}, out.global_sparsity));
    config = js.dump(2) + "\n";
  } else {
    save_safetensors(weights, tensors, {{"format", "pt"}});
  }
  write_file_atomic((fs::path(dir) / "config.json").string(), config);
  return out;
}

}  // namespace esplag
