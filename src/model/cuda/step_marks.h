// The op marks of a GpuTransformer step, shared by the model and its DeviceLinear layers:
// per-op CUDA-event timing (GpuTransformer::set_op_timing) and the profiler's view
// (core/op_trace.h). mark(kind) ends the previous op and starts `kind` on the stream;
// nothing is built unless timing or tracing is on.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/op_trace.h"
#include "model/gpu_transformer.h"

namespace esplag {

// The CPU model's name of a GPU op of block `layer` (-1 outside the blocks), from its
// op-timing name: "blocks.3.mlp.fc.fwd", ".bwd.dx", ".bwd.dw" for a Linear's products (dense
// or 2:4: the category tells them apart), "lm_head.fwd" and so on for the head; any other op
// "blocks.3." + its timing name with '.' for ' ' ("blocks.3.attention.bwd"), without the
// prefix outside the blocks ("adamw", "embedding.fwd").
std::string op_trace_name(const std::string& kind, int layer);

class StepMarks {
 public:
  StepMarks() = default;
  StepMarks(const StepMarks&) = delete;
  StepMarks& operator=(const StepMarks&) = delete;
  ~StepMarks();

  // Starts the op `kind` (the op-timing table's name) on stream s; `trace_name` overrides
  // the derived name in the trace.
  void mark(cudaStream_t s, std::string_view kind, double flops = 0, std::string_view trace_name = {}) {
    if (!marking()) [[likely]]
      return;
    mark_slow(s, kind, flops, trace_name);
  }
  // An op traced as a part of the Linear op `op` ("gemm fc fwd" + ".lora":
  // "blocks.3.mlp.fc.fwd.lora").
  void mark_part(cudaStream_t s, std::string_view kind, double flops, const char* op, const char* suffix) {
    if (!marking()) [[likely]]
      return;
    mark_slow(s, kind, flops, tracing() ? op_trace_name(op, layer) + suffix : std::string());
  }
  // A Linear's product: `op`, or "sparse " + op for its 2:4 products.
  void mark_product(cudaStream_t s, const char* op, double flops, bool sparse) {
    if (!marking()) [[likely]]
      return;
    mark_slow(s, sparse ? std::string("sparse ") + op : std::string(op), flops, {});
  }
  // Closes the last op of a call (the timer's intervals are collected separately).
  void end_ops() { trace_op_.reset(); }
  bool tracing() const { return current_op_tracer() != nullptr; }
  bool marking() const { return !paused_ && (timing_ || tracing()); }
  // No marks while one lives (a layer timing its products outside the step).
  class Pause {
   public:
    explicit Pause(StepMarks& m) : m_(m), was_(m.paused_) { m.paused_ = true; }
    ~Pause() { m_.paused_ = was_; }
    Pause(const Pause&) = delete;
    Pause& operator=(const Pause&) = delete;

   private:
    StepMarks& m_;
    bool was_;
  };

  // Timing: on clears the sums; collect() waits for the last op and adds the intervals up.
  void set_timing(bool on);
  bool timing() const { return timing_; }
  void collect(cudaStream_t s);
  const std::vector<GpuOpTime>& totals() const { return totals_; }

  int layer = -1;  // the block the ops being marked belong to; -1 outside the blocks

 private:
  void mark_slow(cudaStream_t s, std::string_view kind, double flops, std::string_view trace_name);
  void record(cudaStream_t s);

  bool timing_ = false;
  bool paused_ = false;
  std::vector<cudaEvent_t> events_;
  std::vector<int> kinds_;  // the op kind of the interval starting at events_[i]
  std::vector<double> flops_;
  size_t used_ = 0;
  std::vector<GpuOpTime> totals_;
  std::map<std::string, int> index_;
  std::optional<ScopedOp> trace_op_;
};

}  // namespace esplag
