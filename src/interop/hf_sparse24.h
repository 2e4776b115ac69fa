// The compressed 2:4 layout of the compressed-tensors format ("sparse-24-bitmask"), the one
// vLLM and compressed-tensors read for 2:4 models. A weight W [rows, cols] that is 2:4 along
// its rows (of every 4 consecutive entries of a row at most 2 are non-zero) is stored as
// three tensors in place of NAME.weight:
//
//   NAME.shape       I64 [2, 1]                 rows, cols
//   NAME.compressed  W's dtype [rows, cols / 2]  the 2 kept entries of each group of 4, in column order
//   NAME.bitmask     U8 [rows, ceil(cols / 8)]   bit c % 8 of byte c / 8 (little bit order) set where
//                                                column c is kept
//
// Exactly 2 entries of each group are kept (decompression puts the values back by position);
// a group with fewer non-zeros keeps its first zeros too. config.json describes the layout in
// quantization_config (hf_sparse24_config).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace esplag {

// Throws an Error naming `layer` and the first group of 4 of the row-major [rows, cols] weight
// `w` that holds more than 2 non-zeros, or cols that is not a multiple of 4.
void check_2_of_4(const std::string& layer, const float* w, int64_t rows, int64_t cols);

struct Sparse24Tensor {
  std::string name;  // NAME, the weight's name without ".weight"
  int64_t rows = 0, cols = 0;
  Tensor compressed;  // f32 [rows, cols / 2], named NAME.compressed
  Tensor bitmask;     // u8 [rows, ceil(cols / 8)], named NAME.bitmask
};

// The compressed form of `weight` (f32 [rows, cols], named NAME.weight, 2:4: check_2_of_4).
Sparse24Tensor compress_2_of_4(const Tensor& weight);

// Writes a safetensors file of `dense` and the compressed tensors (NAME.shape as I64) with
// `metadata`.
void save_sparse24_safetensors(const std::string& path, const std::vector<Tensor>& dense,
                               const std::vector<Sparse24Tensor>& compressed,
                               const std::map<std::string, std::string>& metadata);

// config.json's "quantization_config" for a model whose `Linear` modules are stored so, but
// for `ignore` (module names); global_sparsity is the fraction of zeros over all parameters.
// JSON text.
std::string hf_sparse24_config(const std::vector<std::string>& ignore, double global_sparsity);

}  // namespace esplag
