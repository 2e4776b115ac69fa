// Choosing the next token from a row of logits: greedy at temperature 0, otherwise a draw
// from softmax(logits / temperature) restricted to the top_k most likely ids and then to the
// smallest set of them whose probability reaches top_p (nucleus sampling). Deterministic in
// the generator's state: one uniform draw per sampled token, none for a greedy one.
#pragma once
#include <cstdint>

#include "core/rng.h"

namespace esplag {

struct SamplingOptions {
  double temperature = 0.8;  // >= 0; 0 picks the most likely id
  int top_k = 40;            // >= 0; 0: no limit
  double top_p = 1.0;        // in (0, 1]; 1: no limit
};

// Throws Error naming the option (temperature, top_k, top_p) that is out of range.
void validate(const SamplingOptions& options);

// An id in [0, n_ids) from logits[0, n_ids) (the ids a tokenizer decodes may be fewer than
// the logits). Ties go to the lowest id, in the greedy pick and in the top-k and top-p sets.
int32_t sample_token(const float* logits, int n_ids, const SamplingOptions& options, Rng& rng);

}  // namespace esplag
