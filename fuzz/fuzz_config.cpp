// The run-config reader (train/config.h) on arbitrary YAML files, as `--config` reads
// them: an accepted config written back by to_yaml reads again to the same config.
#include "fuzz_input.h"
#include "train/config.h"

using namespace esplag;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "run.yaml");
  TrainConfig c;
  if (!fuzz::accepts([&] { c = load_train_config(path); })) return 0;
  // What the checkpoint saves of a config must load back (an Error here is a bug: it escapes).
  const TrainConfig back = parse_train_config(to_yaml(c), "to_yaml");
  fuzz::require(flatten(back) == flatten(c), "to_yaml then parse_train_config changed a value");
  fuzz::require(back.recipe_yaml == c.recipe_yaml, "to_yaml then parse_train_config changed the recipe");
  return 0;
}
