// The safetensors file format (https://huggingface.co/docs/safetensors), the format of
// esplag checkpoints and the one other tools read:
//
//   u64 little-endian N | N bytes of JSON header, padded with spaces | data buffer
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (byte offsets into the data buffer) and may hold "__metadata__": {string: string}.
// Files are written like the reference implementation writes them: tensors ordered by
// descending dtype alignment, then by name, packed without gaps, so every tensor starts
// at an offset aligned to its element size; "__metadata__" comes first in the header.
// Reading is as strict as the reference: the tensors must cover the buffer exactly.
//
// Supported dtypes: F64, I64, F32, I32, BF16, F16, U16, U8 (core/dtype.h). Other valid
// safetensors dtypes (BOOL, U64, F8_*, ...) are reported as unsupported.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace esplag {

// One tensor as described by the header, without its data.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data buffer, [begin, end)
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::map<std::string, std::string> metadata;
  std::vector<SafetensorsEntry> tensors;  // in data-buffer order
  uint64_t header_size = 0;               // N, the JSON header's length in bytes
  uint64_t data_start = 0;                // 8 + N, where the data buffer begins in the file
  uint64_t file_size = 0;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, Tensor> tensors;  // host tensors that own their memory, named
};

// Writes `tensors` (names from Tensor::name(); host tensors of a supported dtype) and
// `metadata` to `path` through write_file_atomic. Throws esplag::Error on an empty,
// duplicate or reserved ("__metadata__") name, a tensor not on the host, or metadata
// that is not valid UTF-8 (JSON strings must be).
void save_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads and validates the whole file. Every problem with the file is an esplag::Error
// that names it: too short, header length beyond the file, header not JSON or not of
// the expected structure, unknown or unsupported dtype, shape inconsistent with the
// offsets, offsets beyond the buffer, overlapping or leaving gaps, metadata values
// that are not strings.
SafetensorsFile load_safetensors(const std::string& path);

// Reads and validates only the header (the same checks, the data is not read), for
// tools that list tensors or need the metadata of a large file.
SafetensorsHeader read_safetensors_header(const std::string& path);
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

}  // namespace esplag
