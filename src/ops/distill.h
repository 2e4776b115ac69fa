// Knowledge distillation's loss (Hinton et al.), fused like softmax_cross_entropy: per row
// of the student's logits, the cross-entropy to the targets and the KL divergence from the
// teacher's softened distribution, and the logits gradient, in one pass over a row chunk.
#pragma once
#include <cstdint>

namespace esplag::cpu {

// logits, teacher: [N, V]. With p = softmax(logits[n]), p_T = softmax(logits[n] / temperature)
// and q_T = softmax(teacher[n] / temperature):
//   ce[n] = -log p[targets[n]]                      (as softmax_cross_entropy)
//   kl[n] = KL(q_T || p_T) = sum_v q_T[v] · (log q_T[v] - log p_T[v])
// The row's loss is (1 - alpha)·ce[n] + alpha·temperature²·kl[n]. If dlogits is not null it is
// OVERWRITTEN with dloss · d(loss)/d(logits) = dloss·[(1 - alpha)(p - onehot) + alpha·temperature·(p_T - q_T)];
// the teacher gets no gradient. With alpha = 0, ce and dlogits are softmax_cross_entropy's bit
// for bit. Throws if a target is outside [0, V), alpha outside [0, 1] or temperature <= 0.
template <typename T>
void distill_cross_entropy(T* ce, T* kl, T* dlogits, const T* logits, const T* teacher, const int32_t* targets,
                           int64_t N, int V, double alpha, double temperature, T dloss);

}  // namespace esplag::cpu
