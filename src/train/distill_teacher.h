// The teacher of a recipe's distill entry: a checkpoint's model loaded once, read-only, that
// runs forward only (no gradients, no optimizer state) beside the student it teaches.
#pragma once
#include <memory>
#include <string>

#include "model/transformer.h"
#include "train/recipe.h"

namespace esplag {

// The model of `distill.teacher` (a checkpoint or run directory), checked against the student
// it teaches: the same vocabulary size and the same tokenizer, and sequences of `seq_len`
// tokens (the run's train.seq_len) within its max_seq_len, else an Error naming the recipe
// entry's key and both values. `where` names the entry ("run.yaml: recipe[1] (distill)").
std::unique_ptr<Transformer<float>> load_teacher(const Recipe::Modifier& distill, const std::string& where,
                                                 const ModelConfig& student, const std::string& student_tokenizer,
                                                 int seq_len);

}  // namespace esplag
