// The trainer state (state.json of a checkpoint, read by train/checkpoint.h's
// read_checkpoint_info, which --resume, eval, sample and export call) on arbitrary files,
// inside a real checkpoint written once by save_checkpoint.
#include <filesystem>

#include "fuzz_checkpoint.h"
#include "fuzz_input.h"
#include "train/checkpoint.h"

using namespace esplag;

namespace {

// A checkpoint of the default model, step 100; each input replaces its state.json.
const std::string& checkpoint_dir() {
  static const std::string dir = fuzz::save_default_checkpoint((fuzz::scratch_dir() / "run").string());
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& dir = checkpoint_dir();
  fuzz::write_bytes((std::filesystem::path(dir) / "state.json").string(), data, size);
  fuzz::accepts([&] { (void)read_checkpoint_info(dir); });
  return 0;
}
