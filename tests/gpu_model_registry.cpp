// The GPU's kind table (model/cuda/device_linear_kinds.cu) against the kind registry
// (model/linear_registry.h): the table has an entry exactly for the kinds whose `gpu` flag
// is set, and a kind registered with the flag but without an entry is an Error.
//
// Host code only: the table is read, no layer is built.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/device_linear.h"
#include "model/linear_registry.h"
#include "train/trainer.h"

using namespace esplag;

// One test: the registration below stays in the registry for the rest of the process.
TEST(GpuKindRegistry, TheTableHasAnEntryExactlyForTheKindsTheRegistryPutsOnTheGpu) {
  std::vector<std::string> table, registry;
  for (const auto& k : device_linear_kinds()) table.push_back(k.name);
  for (const auto& k : linear_kinds())
    if (k.gpu) registry.push_back(k.name);
  std::sort(table.begin(), table.end());
  std::sort(registry.begin(), registry.end());
  EXPECT_EQ(table, registry);
  for (const auto& name : table) EXPECT_TRUE(gpu_trains_kind(name)) << name;

  LinearKindInfo k;
  k.name = "gpu_without_entry";
  k.gpu = true;
  k.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<DenseLinear<T>>(b.params);
  });
  register_linear_kind(std::move(k));
  try {
    device_linear_kinds();
    FAIL() << "a kind the registry puts on the GPU without a table entry was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gpu_without_entry' says the GPU trains it"), std::string::npos)
        << e.what();
  }
}
