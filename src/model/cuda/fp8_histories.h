// Delayed fp8 scaling on the GPU (train.fp8_scaling: delayed; the rule and its CPU
// reference: model/fp8_amax_history.h). DeviceFp8Histories holds every block Linear's amax
// histories of X and dY in one device array, which the model rolls after each optimizer
// step (gpu::fp8_roll_amax_histories); the casts read their scale from it and record their
// tensor's amax into it (gpu::Fp8CastAmax), so no amax pass reads X or dY. Before the first
// roll the casts take each tensor's own amax (an amax pass, as current scaling), which the
// model's CUDA graphs capture: it drops them when the histories turn warm.
//
// Fp8OperandAmax is what a layer asks before a cast of its X or dY, with either scaling.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "core/device_collectives.h"
#include "model/fp8_amax_history.h"
#include "ops/gpu_fp8.h"

namespace esplag {

class DeviceFp8Histories {
 public:
  // Floats of device memory for the histories of `linears` layers of `length` steps.
  static size_t floats(int64_t linears, int length) { return size_t(2 * linears) * size_t(length + 2); }

  // Over `device` (floats(weight_names.size(), length) of them, the caller's), zeroed on
  // `s`; weight_names in the order of Transformer::linear_names.
  DeviceFp8Histories(float* device, std::vector<std::string> weight_names, int length, cudaStream_t s);

  struct Operand {
    const float* scale = nullptr;  // the amax the step's casts scale by
    float* current = nullptr;      // the step's amax so far, which the casts raise
  };
  Operand operand(const std::string& weight_name, ProductOperand role) const;

  // Whether a step was rolled: the casts scale by the histories.
  bool warm() const { return warm_; }
  // The step is over (after the optimizer's update, on the model's stream).
  void roll(cudaStream_t s);
  // Data parallel, before roll: every value becomes its largest over `ranks`. The past
  // amaxes are the same on every rank already, so the step's amaxes become the ranks' largest.
  void reduce_max(DeviceCollectives& ranks, cudaStream_t s);

  // While paused (an evaluation, or a timing of the products on made-up operands), casts
  // neither read nor record the histories: they take each tensor's own amax.
  bool paused() const { return paused_; }
  struct Pause {
    explicit Pause(DeviceFp8Histories* h) : h_(h), was_(h && h->paused_) {
      if (h_) h_->paused_ = true;
    }
    ~Pause() {
      if (h_) h_->paused_ = was_;
    }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    DeviceFp8Histories* h_;
    bool was_;
  };

  // To and from the host model's histories (checkpoints), in linear_names order; to_host
  // waits for `s`. from_host makes the histories warm when the host's are.
  void to_host(std::vector<Fp8AmaxHistory>& host, cudaStream_t s) const;
  void from_host(const std::vector<Fp8AmaxHistory>& host, cudaStream_t s);

 private:
  float* at(size_t linear, ProductOperand role) const;

  float* device_;
  std::vector<std::string> names_;
  int length_;
  bool warm_ = false, paused_ = false;
};

// How one of a layer's activation operands (X or dY) is scaled in its fp8 casts: current
// scaling (no histories), or the histories' operand.
class Fp8OperandAmax {
 public:
  Fp8OperandAmax() = default;  // for a layer in full precision: never asked
  // `own`: the layer's device float for the tensor's own amax (current scaling, and a
  // history's first step).
  Fp8OperandAmax(float* own, const DeviceFp8Histories* histories, const std::string& weight_name,
                 ProductOperand role);
  // Before a cast of x [n]: where the cast takes its scale and records its amax. Runs the
  // amax pass over x when the cast scales by x's own amax.
  gpu::Fp8CastAmax before_cast(const gpu::bf16* x, int64_t n, cudaStream_t s) const;
  // The amax the last before_cast's cast scaled by, for another cast of the same tensor
  // (dW's transposed cast of X after the forward's).
  const float* last() const;
  // Whether the casts scale by the history now (delayed scaling, warm, not paused): before_cast
  // then runs no pass.
  bool from_history() const { return histories_ && histories_->warm() && !histories_->paused(); }

 private:
  float* own_ = nullptr;
  const DeviceFp8Histories* histories_ = nullptr;
  DeviceFp8Histories::Operand op_;
};

}  // namespace esplag
