#include "model/cuda/step_marks.h"

#include <algorithm>

#include "core/cuda_check.h"

namespace esplag {

namespace {

// The block Linear behind a GEMM's short name.
const char* linear_module(std::string_view short_name) {
  if (short_name == "qkv") return "attn.qkv";
  if (short_name == "proj") return "attn.proj";
  if (short_name == "fc") return "mlp.fc";
  if (short_name == "mproj") return "mlp.proj";
  return nullptr;
}

OpCategory op_trace_category(const std::string& kind) {
  auto starts = [&](const char* p) { return kind.rfind(p, 0) == 0; };
  if (starts("sparse gemm")) return OpCategory::sparse_gemm;
  if (kind.find("gemm") != std::string::npos) return OpCategory::dense_gemm;
  if (starts("attention")) return OpCategory::attention;
  if (starts("norm")) return OpCategory::norm;
  if (starts("cross-entropy") || starts("distillation loss") || starts("mean loss")) return OpCategory::loss;
  if (starts("teacher fwd")) return OpCategory::other;  // a distillation teacher's whole forward
  if (starts("adamw") || starts("grad norm")) return OpCategory::optimizer;
  if (starts("memset")) return OpCategory::memcpy;
  if (starts("all-reduce") || starts("reduce-scatter") || starts("all-gather")) return OpCategory::comm;
  if (starts("sparse prepare")) return OpCategory::other;
  return OpCategory::elementwise;
}

}  // namespace

std::string op_trace_name(const std::string& kind, int layer) {
  std::string_view k = kind;
  if (k.rfind("sparse ", 0) == 0) k.remove_prefix(7);
  const std::string block = layer >= 0 ? "blocks." + std::to_string(layer) + "." : "";
  auto phase = [](std::string_view p) -> std::string {
    if (p.rfind("fwd", 0) == 0) return "fwd";
    if (p.rfind("dX", 0) == 0) return "bwd.dx";
    if (p.rfind("dW", 0) == 0) return "bwd.dw";
    return std::string(p);
  };
  if (k.rfind("gemm ", 0) == 0) {
    const std::string_view rest = k.substr(5);
    const size_t sp = rest.find(' ');
    if (const char* module = linear_module(rest.substr(0, sp)); module && sp != std::string_view::npos)
      return block + module + "." + phase(rest.substr(sp + 1));
  }
  if (k.rfind("head gemm ", 0) == 0) return "lm_head." + phase(k.substr(10));
  std::string name(k.substr(0, k.find(" (")));
  std::replace(name.begin(), name.end(), ' ', '.');
  return block + name;
}

StepMarks::~StepMarks() {
  for (auto e : events_) cudaEventDestroy(e);
}

void StepMarks::mark_slow(cudaStream_t s, std::string_view kind, double flops, std::string_view trace_name) {
  const std::string k(kind);
  if (timing_) {
    auto it = index_.find(k);
    if (it == index_.end()) {
      it = index_.emplace(k, static_cast<int>(totals_.size())).first;
      totals_.push_back(GpuOpTime{k, 0, 0, 0});
    }
    record(s);
    kinds_.push_back(it->second);
    flops_.push_back(flops);
  }
  trace_op_.reset();
  if (tracing())
    trace_op_.emplace(trace_name.empty() ? op_trace_name(k, layer) : std::string(trace_name), op_trace_category(k),
                      layer, flops, 0, BufferList{}, BufferList{}, OpStream(s));
}

void StepMarks::record(cudaStream_t s) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  CUDA_CHECK(cudaEventRecord(events_[used_++], s));
}

void StepMarks::set_timing(bool on) {
  if (on && !timing_) {
    totals_.clear();
    index_.clear();
  }
  timing_ = on;
}

void StepMarks::collect(cudaStream_t s) {
  if (!timing_ || kinds_.empty()) return;
  record(s);
  CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
  for (size_t i = 0; i < kinds_.size(); ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    GpuOpTime& t = totals_[static_cast<size_t>(kinds_[i])];
    ++t.calls;
    t.ms += ms;
    t.flops += flops_[i];
  }
  kinds_.clear();
  flops_.clear();
  used_ = 0;
}

}  // namespace esplag
