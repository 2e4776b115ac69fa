#include "interop/hf_sparse24.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"

namespace esplag {

using nlohmann::json;

namespace {

// The compressed-tensors version whose sparse-24-bitmask compressor this layout follows (the
// format is read by compressed-tensors up to 0.14 and by vLLM).
constexpr const char* kCompressedTensorsVersion = "0.12.2";

std::string strip_weight(const std::string& name) {
  const std::string suffix = ".weight";
  ESPLAG_CHECK(name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0,
               "sparse-24 layout: tensor '", name, "' is not a weight");
  return name.substr(0, name.size() - suffix.size());
}

}  // namespace

void check_2_of_4(const std::string& layer, const float* w, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(cols % 4 == 0, "layer '", layer, "' is not 2:4: its ", cols,
               " input features are not a multiple of 4");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; c += 4) {
      int nonzeros = 0;
      for (int k = 0; k < 4; ++k) nonzeros += w[r * cols + c + k] != 0.0f;
      ESPLAG_CHECK(nonzeros <= 2, "layer '", layer, "' is not 2:4: row ", r, ", columns ", c, "..", c + 3, " hold ",
                   nonzeros, " non-zeros (at most 2 of every 4 consecutive weights of a row may be)");
    }
}

Sparse24Tensor compress_2_of_4(const Tensor& weight) {
  ESPLAG_CHECK(weight.dtype() == DType::f32 && weight.shape().size() == 2, "sparse-24 layout: tensor '",
               weight.name(), "' is not a 2-d f32 weight");
  Sparse24Tensor s;
  s.name = strip_weight(weight.name());
  s.rows = weight.shape()[0];
  s.cols = weight.shape()[1];
  const float* w = weight.data<float>();
  check_2_of_4(s.name, w, s.rows, s.cols);
  const int64_t mask_cols = (s.cols + 7) / 8;
  s.compressed = Tensor::zeros({s.rows, s.cols / 2}, DType::f32, s.name + ".compressed");
  s.bitmask = Tensor::zeros({s.rows, mask_cols}, DType::u8, s.name + ".bitmask");
  float* values = s.compressed.data<float>();
  uint8_t* bits = s.bitmask.data<uint8_t>();
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; c += 4) {
      const float* g = w + r * s.cols + c;
      bool keep[4] = {};
      int kept = 0;
      for (int k = 0; k < 4; ++k)
        if (g[k] != 0.0f) keep[k] = true, ++kept;
      for (int k = 0; k < 4 && kept < 2; ++k)
        if (!keep[k]) keep[k] = true, ++kept;
      for (int k = 0; k < 4; ++k) {
        if (!keep[k]) continue;
        *values++ = g[k];
        bits[r * mask_cols + (c + k) / 8] |= static_cast<uint8_t>(1u << ((c + k) % 8));
      }
    }
  return s;
}

void save_sparse24_safetensors(const std::string& path, const std::vector<Tensor>& dense,
                               const std::vector<Sparse24Tensor>& compressed,
                               const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> tensors = dense;
  for (const auto& s : compressed) {
    ESPLAG_CHECK(s.compressed.dtype() == DType::f32, "sparse-24 layout: '", s.name, "' is not f32");
    Tensor shape = Tensor::zeros({2, 1}, DType::i64, s.name + ".shape");
    shape.data<int64_t>()[0] = s.rows;
    shape.data<int64_t>()[1] = s.cols;
    tensors.push_back(std::move(shape));
    tensors.push_back(s.compressed);
    tensors.push_back(s.bitmask);
  }
  save_safetensors(path, tensors, metadata);
}

std::string hf_sparse24_config(const std::vector<std::string>& ignore, double global_sparsity) {
  const json sparsity = {{"format", "sparse-24-bitmask"},
                         {"global_sparsity", global_sparsity},
                         {"ignore", ignore},
                         {"sparsity_structure", "2:4"},
                         {"targets", {"Linear"}}};
  const json config = {{"quant_method", "compressed-tensors"},
                       {"sparsity_config", sparsity},
                       {"version", kCompressedTensorsVersion}};
  return config.dump();
}

}  // namespace esplag
