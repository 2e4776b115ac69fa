// The parameter layout a GPU run stores (docs/memory.md): a block Linear weight whose kind
// trains another form of it (LinearKindInfo::stored_fraction: slope's kept values, half)
// takes that share of its elements in the weights, gradients and moments. The layout
// changes at the recipe's updates; the memory plan counts the largest one the run holds.
#pragma once

#include <cstdint>
#include <set>
#include <string>

#include "train/config.h"

namespace esplag {

struct StoredLayout {
  uint64_t elements = 0;                // stored elements of the largest layout
  std::set<std::string> kept_values;    // the weights stored in their kind's form in it
};

// The largest layout over `config`'s run (train.steps, its recipe), ties going to the
// earliest; without a recipe, or with one that does not fit the model, every weight is
// dense (config.model.num_params() elements).
// Adapters (a few elements per weight) are not counted.
StoredLayout largest_stored_layout(const TrainConfig& config);

}  // namespace esplag
