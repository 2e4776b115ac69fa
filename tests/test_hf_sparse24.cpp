// export --hf --sparse-24: the compressed-tensors sparse-24-bitmask layout, decoded here by the
// format's rules (NAME.shape I64 [2, 1]; NAME.compressed [rows, cols / 2], the kept values in row
// order; NAME.bitmask U8 [rows, ceil(cols / 8)], bit c % 8 of byte c / 8 marks column c kept)
// from the file's raw bytes, independently of esplag's safetensors reader.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "interop/hf_export.h"
#include "interop/hf_import.h"
#include "io/atomic_file.h"
#include "model/linear_kinds.h"
#include "test_util.h"

namespace esplag {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::contains;
using testing::error_of;
using testing::TempDir;

const std::string kFixtures = std::string(ESPLAG_SOURCE_DIR) + "/tests/fixtures/hf/";

struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

// A safetensors file as the format defines it: u64 header length, JSON header, data buffer.
uint64_t header_size(const std::string& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(file[i]);
  return n;
}

json raw_header(const std::string& path) {
  const std::string file = read_file(path);
  return json::parse(file.substr(8, header_size(file)));
}

std::map<std::string, RawTensor> read_raw(const std::string& path) {
  const std::string file = read_file(path);
  const uint64_t n = header_size(file);
  const json header = json::parse(file.substr(8, n));
  std::map<std::string, RawTensor> out;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t begin = v["data_offsets"][0], end = v["data_offsets"][1];
    out[name] = {v["dtype"], v["shape"].get<std::vector<int64_t>>(), file.substr(8 + n + begin, end - begin)};
  }
  return out;
}

// The dense weight NAME.weight from NAME.{shape, compressed, bitmask}.
std::vector<float> decode(const std::map<std::string, RawTensor>& t, const std::string& name) {
  const RawTensor& shape = t.at(name + ".shape");
  EXPECT_EQ(shape.dtype, "I64");
  EXPECT_EQ(shape.shape, (std::vector<int64_t>{2, 1}));
  int64_t dims[2];
  std::memcpy(dims, shape.bytes.data(), sizeof dims);
  const int64_t rows = dims[0], cols = dims[1], mask_cols = (cols + 7) / 8;
  const RawTensor& values = t.at(name + ".compressed");
  const RawTensor& mask = t.at(name + ".bitmask");
  EXPECT_EQ(values.dtype, "F32");
  EXPECT_EQ(values.shape, (std::vector<int64_t>{rows, cols / 2}));
  EXPECT_EQ(mask.dtype, "U8");
  EXPECT_EQ(mask.shape, (std::vector<int64_t>{rows, mask_cols}));
  std::vector<float> dense(rows * cols, 0.0f);
  const float* v = reinterpret_cast<const float*>(values.bytes.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      if (c % 4 == 0) {  // exactly 2 of every 4 are kept, so the values fill [rows, cols / 2]
        int kept = 0;
        for (int k = 0; k < 4; ++k) kept += (mask.bytes[r * mask_cols + (c + k) / 8] >> ((c + k) % 8)) & 1;
        EXPECT_EQ(kept, 2) << name << " row " << r << " column " << c;
      }
      if ((mask.bytes[r * mask_cols + c / 8] >> (c % 8)) & 1) dense[r * cols + c] = *v++;
    }
  return dense;
}

std::unique_ptr<Transformer<float>> semi_sparse_llama() {
  HfModel hf = load_hf_model(kFixtures + "llama-gqa");
  LinearOptions o;
  o.kind = "semi_sparse";
  for (const auto& name : hf.model->linear_names())
    hf.model->replace_linear(name, make_linear(hf.model->linear_params(name), o, &hf.model->linear(name)));
  return std::move(hf.model);
}

TEST(HfSparse24, CompressedWeightsDecodeToTheModelsWeightsExactly) {
  TempDir tmp;
  auto model = semi_sparse_llama();
  const HfExport e = export_hf(*model, "byte", tmp.file("sparse"), true);
  export_hf(*model, "byte", tmp.file("dense"));
  EXPECT_EQ(e.compressed, 2u * 7u);  // q, k, v, o, gate, up, down of 2 layers

  const auto sparse = read_raw(tmp.file("sparse/model.safetensors"));
  const auto dense = read_raw(tmp.file("dense/model.safetensors"));
  size_t decoded = 0;
  for (const auto& [name, t] : dense) {
    SCOPED_TRACE(name);
    const bool block_linear = name.rfind("model.layers.", 0) == 0 && name.find("_proj.weight") != std::string::npos;
    if (!block_linear) {  // embeddings, norms, lm_head: unchanged
      ASSERT_TRUE(sparse.count(name));
      EXPECT_EQ(sparse.at(name).dtype, t.dtype);
      EXPECT_EQ(sparse.at(name).bytes, t.bytes);
      continue;
    }
    EXPECT_FALSE(sparse.count(name));
    const std::string stem = name.substr(0, name.size() - std::string(".weight").size());
    const std::vector<float> got = decode(sparse, stem);
    ASSERT_EQ(got.size() * sizeof(float), t.bytes.size());
    EXPECT_EQ(0, std::memcmp(got.data(), t.bytes.data(), t.bytes.size()));
    ++decoded;
  }
  EXPECT_EQ(decoded, e.compressed);
  EXPECT_EQ(sparse.size(), dense.size() + 2 * decoded);  // each weight became 3 tensors
  EXPECT_EQ(raw_header(tmp.file("sparse/model.safetensors"))["__metadata__"]["format"], "pt");
}

TEST(HfSparse24, ConfigJsonDescribesTheLayout) {
  TempDir tmp;
  auto model = semi_sparse_llama();
  const HfExport e = export_hf(*model, "byte", tmp.file("out"), true);
  const json cfg = json::parse(read_file(tmp.file("out/config.json")));
  EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
  const json& q = cfg["quantization_config"];
  EXPECT_EQ(q["quant_method"], "compressed-tensors");
  EXPECT_TRUE(q["version"].is_string());
  const json& s = q["sparsity_config"];
  EXPECT_EQ(s["format"], "sparse-24-bitmask");
  EXPECT_EQ(s["sparsity_structure"], "2:4");
  EXPECT_EQ(s["targets"], json::array({"Linear"}));
  EXPECT_EQ(s["ignore"], json::array({"lm_head"}));
  // Half of every block linear is zero, the embeddings, head and norms are dense.
  EXPECT_DOUBLE_EQ(s["global_sparsity"].get<double>(), e.global_sparsity);
  EXPECT_GT(e.global_sparsity, 0.2);
  EXPECT_LT(e.global_sparsity, 0.5);
}

TEST(HfSparse24, WeightsThatAreNot2of4AreRefusedByLayer) {
  TempDir tmp;
  HfModel dense = load_hf_model(kFixtures + "llama-gqa");
  std::string err = error_of([&] { export_hf(*dense.model, "byte", tmp.file("a"), true); });
  EXPECT_TRUE(contains(err, "export --hf --sparse-24: layer 'blocks.0.attn.qkv' is not 2:4: row 0, columns 0..3 hold"))
      << err;
  EXPECT_TRUE(contains(err, "its kind is dense")) << err;
  EXPECT_FALSE(fs::exists(tmp.file("a")));

  // One dense layer among 2:4 ones is named.
  auto model = semi_sparse_llama();
  const std::string last = "blocks.1.mlp.proj.weight";
  float* w = model->param(last).data<float>();
  model->linear(last).dense_weight(w);  // the 2:4 weight, now in a dense layer
  model->replace_linear(last, make_linear(model->linear_params(last), LinearOptions{}, &model->linear(last)));
  w[4] = w[5] = w[6] = 1.0f;  // row 0's second group: 3 non-zeros
  err = error_of([&] { export_hf(*model, "byte", tmp.file("b"), true); });
  EXPECT_TRUE(contains(err, "layer 'blocks.1.mlp.proj' is not 2:4: row 0, columns 4..7")) << err;
  EXPECT_FALSE(fs::exists(tmp.file("b")));

  HfModel gpt2 = load_hf_model(kFixtures + "gpt2");
  err = error_of([&] { export_hf(*gpt2.model, "byte", tmp.file("c"), true); });
  EXPECT_TRUE(contains(err, "a gpt2 model has no 2:4 layout in compressed-tensors")) << err;
}

}  // namespace
}  // namespace esplag
