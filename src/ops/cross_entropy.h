// Softmax cross-entropy over the vocabulary, fused: forward and the logits gradient in
// one pass, so the probabilities are never stored separately.
#pragma once
#include <cstdint>

namespace esplag::cpu {

// losses[n] = logsumexp(logits[n,:]) - logits[n, targets[n]].  logits: [N, V].
// If dlogits is not null it is OVERWRITTEN with dloss * (softmax(logits[n]) - onehot(targets[n]))
// (it is the start of backward, not an accumulation). Throws if a target is outside [0, V).
template <typename T>
void softmax_cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N, int V,
                           T dloss);

}  // namespace esplag::cpu
