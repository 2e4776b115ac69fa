// The safetensors reader (io/safetensors.h) on arbitrary files: the header-only read and
// the full load must agree on what they accept, and a loaded file writes back and reloads
// to the same tensors.
#include <cstring>

#include "fuzz_input.h"
#include "io/safetensors.h"

using namespace esplag;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.safetensors");
  SafetensorsHeader header;
  const bool header_ok = fuzz::accepts([&] { header = read_safetensors_header(path); });
  SafetensorsFile file;
  const bool load_ok = fuzz::accepts([&] { file = load_safetensors(path); });
  fuzz::require(header_ok == load_ok, "read_safetensors_header and load_safetensors disagree");
  if (!load_ok) return 0;
  fuzz::require(file.tensors.size() == header.tensors.size(), "the load holds another number of tensors");
  fuzz::require(file.metadata == header.metadata, "the load holds other metadata than the header");

  // What was read must write back and read again to the same bytes.
  std::vector<Tensor> tensors;
  for (const auto& [name, t] : file.tensors) {
    Tensor named = t;
    named.set_name(name);
    tensors.push_back(named);
  }
  const std::string copy = (fuzz::scratch_dir() / "copy.safetensors").string();
  save_safetensors(copy, tensors, file.metadata);  // an Error here is a bug: it escapes
  const SafetensorsFile again = load_safetensors(copy);
  fuzz::require(again.metadata == file.metadata, "metadata changed through save and load");
  fuzz::require(again.tensors.size() == file.tensors.size(), "tensor count changed through save and load");
  for (const auto& [name, t] : file.tensors) {
    const Tensor& u = again.tensors.at(name);
    fuzz::require(u.dtype() == t.dtype() && u.shape() == t.shape() && u.nbytes() == t.nbytes() &&
                      (t.nbytes() == 0 || std::memcmp(u.raw(), t.raw(), t.nbytes()) == 0),
                  "a tensor changed through save and load");
  }
  return 0;
}
