// The CUDA op tracer: OpRecorder with device timing. An op issued on a device stream
// (ScopedOp(..., stream) with a cudaStream_t) gets two CUDA events recorded on its stream,
// one when the ScopedOp opens and one when it closes, so its interval is when the stream
// reached and passed the op's work, not when the host launched it. Host ops keep host
// timestamps. The events are resolved when the records are read (records() / take()),
// which waits for them: read the records between steps, not inside the hot loop.
//
// Clocks. cudaEventElapsedTime gives the time between two events of one device. The first
// device op of a window records a base event on its stream and waits for it, then reads
// the host clock: every later event completes after the base (it is recorded after the
// wait returned), so its offset from the base is never negative, and base + offset puts
// device ops on the host timeline within the wake-up latency of one synchronisation.
// Each device has its own base. The wait drains that stream once per window, which only
// delays the first op.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/cuda_check.h"
#include "core/op_trace.h"

namespace esplag {

namespace {

class CudaOpRecorder final : public OpRecorder {
 public:
  CudaOpRecorder() = default;
  ~CudaOpRecorder() override {
    clear();
    // Destruction must not throw; a failing destroy at exit leaves nothing to recover.
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }

 protected:
  bool begin_device_op(const OpDesc& op, size_t index) override {
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaStream_t stream = op.stream.handle;
    ensure_base(device, stream);
    Pending p;
    p.index = index;
    p.device = device;
    p.stream = stream;
    p.start = acquire();
    p.end = acquire();
    CUDA_CHECK(cudaEventRecord(p.start, stream));
    if (pending_.size() <= index) pending_.resize(index + 1);
    pending_[index] = p;
    return true;
  }

  void end_device_op(size_t index) override {
    if (index >= pending_.size() || pending_[index].start == nullptr) return;
    Pending& p = pending_[index];
    // The op may close on another device than it opened on (a ScopedOp around a
    // cudaSetDevice); the event must be recorded on the stream's device.
    int current = 0;
    CUDA_CHECK(cudaGetDevice(&current));
    if (current != p.device) CUDA_CHECK(cudaSetDevice(p.device));
    CUDA_CHECK(cudaEventRecord(p.end, p.stream));
    if (current != p.device) CUDA_CHECK(cudaSetDevice(current));
    p.ended = true;
  }

  void resolve_device_ops(std::vector<OpRecord>& records) const override {
    for (const Pending& p : pending_) {
      if (p.start == nullptr || !p.ended || p.index >= records.size()) continue;
      const Base* base = find_base(p.device);
      if (base == nullptr) continue;
      CUDA_CHECK(cudaEventSynchronize(p.end));
      float start_ms = 0, end_ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&start_ms, base->event, p.start));
      CUDA_CHECK(cudaEventElapsedTime(&end_ms, base->event, p.end));
      OpRecord& r = records[p.index];
      r.start_ns = base->host_ns + static_cast<int64_t>(std::llround(double(start_ms) * 1e6));
      r.end_ns = std::max<int64_t>(r.start_ns, base->host_ns + static_cast<int64_t>(std::llround(double(end_ms) * 1e6)));
    }
  }

  void reset_device_ops() override {
    for (Pending& p : pending_) {
      if (p.start != nullptr) free_.push_back(p.start);
      if (p.end != nullptr) free_.push_back(p.end);
    }
    pending_.clear();
    for (const Base& b : bases_) free_.push_back(b.event);
    bases_.clear();
  }

 private:
  struct Pending {
    size_t index = 0;
    int device = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr;
    cudaEvent_t end = nullptr;
    bool ended = false;
  };
  struct Base {
    int device = 0;
    cudaEvent_t event = nullptr;
    int64_t host_ns = 0;
  };

  cudaEvent_t acquire() {
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
    return e;
  }

  const Base* find_base(int device) const {
    for (const Base& b : bases_)
      if (b.device == device) return &b;
    return nullptr;
  }

  void ensure_base(int device, cudaStream_t stream) {
    if (find_base(device) != nullptr) return;
    Base b;
    b.device = device;
    b.event = acquire();
    CUDA_CHECK(cudaEventRecord(b.event, stream));
    CUDA_CHECK(cudaEventSynchronize(b.event));
    b.host_ns = now_ns();
    bases_.push_back(b);
  }

  // Indexed by record index (sparse: host ops leave empty slots).
  std::vector<Pending> pending_;
  std::vector<Base> bases_;
  std::vector<cudaEvent_t> free_;  // created events, reused across windows
};

}  // namespace

std::unique_ptr<OpRecorder> make_cuda_op_recorder() { return std::make_unique<CudaOpRecorder>(); }

bool have_cuda_op_recorder() { return true; }

}  // namespace esplag
