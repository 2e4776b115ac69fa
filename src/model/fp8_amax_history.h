// Delayed fp8 scaling (train.fp8_scaling: delayed, docs/fp8.md "Delayed scaling"): the amax
// history of one block Linear's activation operands, X (ProductOperand::input) and dY
// (ProductOperand::grad). A step's casts of an operand take their scale from the largest
// amax of the last `length` optimizer steps, and record their own tensor's amax for the
// steps after; a value above the history's amax saturates (and is counted). Until the first
// roll (a run's first step) there is no history and each cast takes its own amax (current
// scaling). Weights keep current scaling: they are cast once per update, not per product.
//
// The model owns one per block Linear, so a history outlives kind changes; the trainer rolls
// them all once per optimizer step. The GPU keeps the same numbers on the device
// (model/cuda/fp8_histories.h) and checkpoints carry them (train/checkpoint.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/linear_precision.h"

namespace esplag {

class Fp8AmaxHistory {
 public:
  // Values per operand in `values()`: this step's amax so far, then the past steps' amaxes,
  // newest first.
  static int64_t values_per_operand(int length) { return 1 + int64_t(length); }

  explicit Fp8AmaxHistory(int length = 1) { resize(length); }
  // `length` past steps kept (>= 1); a change forgets the history.
  void resize(int length);
  int length() const { return length_; }

  // Whether a step has been rolled since the history began: the casts then scale by scale_amax.
  bool warm() const { return warm_; }
  // The largest amax of `role`'s past steps (input or grad).
  float scale_amax(ProductOperand role) const;
  // A cast of `role` saw amax `a` this step.
  void record(ProductOperand role, float a);
  // The largest amax `role`'s casts recorded this step (0 before the first).
  float step_amax(ProductOperand role) const { return current_[size_t(operand_index(role))]; }
  // The step is over: its amaxes become the newest past ones.
  void roll();

  // While paused (forward-only passes: evaluation, sampling, a teacher), casts take their
  // tensor's own amax and record nothing.
  bool paused() const { return paused_; }
  void set_paused(bool paused) { paused_ = paused; }

  // Which of X (0) and dY (1) a role is; weights have no history (an Error).
  static int operand_index(ProductOperand role);

  // X's and then dY's values_per_operand(length()) floats, for checkpoints and the GPU.
  std::vector<float> values() const;
  // Back from values() (of the same length), warm: an Error naming `what` when the count is
  // wrong or a value is negative or not finite.
  void set_values(const std::vector<float>& v, const std::string& what);

 private:
  int length_ = 1;
  bool warm_ = false, paused_ = false;
  std::vector<float> current_, past_;  // [2] and [2, length]: X's, then dY's
};

}  // namespace esplag
