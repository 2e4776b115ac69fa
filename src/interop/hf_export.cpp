#include "interop/hf_export.h"

#include <filesystem>

#include "core/error.h"
#include "data/bpe_trainer.h"
#include "data/tokenizer.h"
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

}  // namespace

HfExport export_hf(Transformer<float>& model, const std::string& tokenizer, const std::string& dir) {
  HfExport out;
  out.config = hf_config_for(model.config());
  // Every parameter as the dense effective weight (sparse kinds: their dense view).
  std::map<std::string, std::vector<float>> dense;
  std::map<std::string, Tensor> params;
  for (const auto& name : model.linear_names()) {
    const Linear<float>& l = model.linear(name);
    auto& w = dense[name];
    w.resize(size_t(l.params().out_features) * l.params().in_features);
    l.dense_weight(w.data());
  }
  for (const auto& pi : model.param_infos()) {
    auto it = dense.find(pi.name);
    params[pi.name] = it == dense.end() ? model.param(pi.name)
                                        : Tensor::borrow(it->second.data(), pi.shape, DType::f32, Device::cpu, pi.name);
  }
  const std::vector<Tensor> tensors = hf_tensors_from_esplag(out.config, params);
  out.tensors = tensors.size();

  std::error_code ec;
  fs::create_directories(dir, ec);
  ESPLAG_CHECK(!ec, "export --hf: cannot create '", dir, "': ", ec.message());
  int eot = -1;
  out.tokenizer_note = write_tokenizer(tokenizer, dir, eot);
  save_safetensors((fs::path(dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
  write_file_atomic((fs::path(dir) / "config.json").string(), hf_config_json(out.config, eot));
  return out;
}

}  // namespace esplag
