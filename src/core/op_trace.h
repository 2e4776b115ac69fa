// The profiler's one hook into the engine. Model code wraps every op call in a ScopedOp:
//
//   ScopedOp op(name_, OpCategory::dense_gemm, layer_, 2.0 * M * N * K, bytes,
//               {x, w}, {y});                       // a host op (the CPU backend)
//   ScopedOp op(name_, OpCategory::dense_gemm, layer_, flops, bytes,
//               {x, w}, {y}, stream);               // a kernel on a cudaStream_t
//
// When no tracer is installed (the normal case) a ScopedOp costs one atomic load and a
// branch in its constructor and one branch in its destructor: nothing is allocated,
// copied or formatted. Names are taken as std::string_view and only copied by a tracer,
// so callers should build per-layer names once (e.g. in a layer's constructor) or pass
// them in two parts (OpName), not format them per call. inputs/outputs are buffer
// identities (any pointer into the buffer's storage; the same buffer must be named by the
// same pointer every time) from which the profiler derives data dependencies; null
// pointers are ignored, so optional gradient buffers can be passed as they are.
//
// A tracer observes ops through two virtual calls (begin_op / end_op). OpRecorder is the
// CPU implementation with host timestamps; the CUDA tracer (make_cuda_op_recorder, in the
// CUDA build) records CUDA events on the op's stream in the same two calls and resolves
// them after a synchronisation, so the same ScopedOps serve both backends.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

// The CUDA runtime's stream type (cudaStream_t is CUstream_st*), declared here so that a
// ScopedOp takes a cudaStream_t without this header including the CUDA headers.
struct CUstream_st;

namespace esplag {

enum class OpCategory : uint8_t {
  dense_gemm,
  sparse_gemm,
  attention,
  norm,
  elementwise,
  loss,
  optimizer,
  memcpy,
  comm,
  other,
};
inline constexpr int kNumOpCategories = 10;

// "dense_gemm", "sparse_gemm", ... (the enumerator's spelling).
std::string_view op_category_name(OpCategory c);
// Inverse of op_category_name, case-insensitive; nullopt for an unknown name.
std::optional<OpCategory> parse_op_category(std::string_view name);
// Every category in enum order.
std::span<const OpCategory> all_op_categories();
// "dense_gemm, sparse_gemm, ..." for error messages.
std::string op_category_list();

// A list of buffer identities, built from a braced list at the call site ({a, b}) or from
// a span when the count is only known at run time. It does not own the pointers: it is
// valid only for the duration of the call it is passed to.
class BufferList {
 public:
  BufferList() = default;
  // The array behind a braced list passed as an argument lives until the end of the full
  // expression that contains the call, which outlasts every use of a BufferList
  // parameter; GCC's lifetime warning cannot see that.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  BufferList(std::initializer_list<const void*> l) : data_(l.begin()), size_(l.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  BufferList(std::span<const void* const> s) : data_(s.data()), size_(s.size()) {}
  const void* const* begin() const { return data_; }
  const void* const* end() const { return data_ + size_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  const void* const* data_ = nullptr;
  size_t size_ = 0;
};

// An op's name, possibly in two parts joined with '.' only when a tracer records it, so
// that a layer can pass its own name and a constant suffix without building a string per
// call: ScopedOp op({name_, "fwd"}, ...) records "blocks.3.mlp.fc.fwd". Borrowed.
struct OpName {
  OpName(const char* n) : name(n) {}
  OpName(std::string_view n) : name(n) {}
  OpName(const std::string& n) : name(n) {}
  OpName(std::string_view prefix_, std::string_view name_) : prefix(prefix_), name(name_) {}
  std::string str() const;  // prefix.name, or name when prefix is empty

  std::string_view prefix;
  std::string_view name;
};

// Where an op runs. The default is the host: the calling thread runs the op synchronously
// and its stream label is 0. An int gives a host op another label (a model of overlapping
// host work, or a hand-made trace). A cudaStream_t (nullptr included: the legacy default
// stream) marks a device op: the kernel runs asynchronously on that stream; a device
// tracer times it there, and numbers device streams 1, 2, ... in order of first
// appearance unless `id` is set (>= 0).
struct OpStream {
  constexpr OpStream() = default;
  constexpr OpStream(int label) : id(label) {}
  constexpr OpStream(CUstream_st* stream) : handle(stream), device(true), id(-1) {}
  constexpr OpStream(CUstream_st* stream, int label) : handle(stream), device(true), id(label) {}
  friend constexpr bool operator==(const OpStream&, const OpStream&) = default;

  CUstream_st* handle = nullptr;  // the cudaStream_t of a device op
  bool device = false;
  int id = 0;  // label; -1 for a device stream the tracer numbers
};

// What a ScopedOp tells its tracer when it opens. Everything is borrowed for the call.
struct OpDesc {
  OpName name{std::string_view()};
  OpCategory category = OpCategory::other;
  int layer = -1;  // -1: not part of a numbered layer
  OpStream stream;
  double flops = 0;
  double bytes = 0;
  BufferList inputs;
  BufferList outputs;
};

// One completed op as recorded by a tracer. Timestamps are nanoseconds on the tracer's
// clock (only differences are meaningful).
struct OpRecord {
  std::string name;
  OpCategory category = OpCategory::other;
  int layer = -1;
  int stream = 0;       // the stream's label (OpStream::id, or the number a tracer gave it)
  bool device = false;  // the op was issued on a device stream
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  double flops = 0;
  double bytes = 0;
  std::vector<const void*> inputs;   // nulls removed
  std::vector<const void*> outputs;  // nulls removed
  // Host thread that ran the op synchronously (numbered from 0 in order of appearance),
  // or -1 when the op ran asynchronously to its host thread (a device kernel). Ops of
  // one thread >= 0 are ordered like ops of one stream.
  int thread = -1;
  int depth = 0;        // 0 for a top-level op, parent's depth + 1 for a nested one
  int64_t parent = -1;  // index of the enclosing op in the same record list, -1 if none
  bool leaf = true;     // no op was opened inside this one
};

// The tracer interface (the seam between the hook and a clock). begin_op returns a token
// that is handed back to the matching end_op. Both may be called from several threads.
class OpTracer {
 public:
  virtual ~OpTracer() = default;
  virtual uint64_t begin_op(const OpDesc& op) = 0;
  virtual void end_op(uint64_t token) = 0;
};

namespace detail {
extern std::atomic<OpTracer*> g_op_tracer;
}

// Installs `tracer` (null uninstalls) and returns the previous one. Uninstall a tracer
// and keep it alive until every op it saw has closed: an open ScopedOp ends on the tracer
// it started with.
OpTracer* set_op_tracer(OpTracer* tracer);

// The installed tracer or null. An acquire load: on x86-64 and most targets it compiles to
// the same plain load as a relaxed one, and it makes the tracer's construction visible to
// threads that did not install it.
inline OpTracer* current_op_tracer() noexcept {
  return detail::g_op_tracer.load(std::memory_order_acquire);
}

// RAII op scope; see the top of this file.
class ScopedOp {
 public:
  ScopedOp(OpName name, OpCategory category, int layer = -1, double flops = 0,
           double bytes = 0, BufferList inputs = {}, BufferList outputs = {},
           OpStream stream = {})
      : tracer_(current_op_tracer()) {
    if (tracer_ != nullptr) [[unlikely]]
      token_ = tracer_->begin_op(
          OpDesc{name, category, layer, stream, flops, bytes, inputs, outputs});
  }
  ~ScopedOp() {
    if (tracer_ != nullptr) [[unlikely]]
      tracer_->end_op(token_);
  }
  ScopedOp(const ScopedOp&) = delete;
  ScopedOp& operator=(const ScopedOp&) = delete;

  bool tracing() const { return tracer_ != nullptr; }

 private:
  OpTracer* tracer_;
  uint64_t token_ = 0;
};

// CPU tracer: records every op with std::chrono::steady_clock timestamps, tracks nesting
// per thread, and marks each op with its thread since CPU ops run synchronously on it.
// Thread-safe (one mutex; the cost is only paid while tracing).
//
// A device tracer derives from it and overrides the four device hooks: the recorder keeps
// the records, nesting and stream numbering, the hooks time the device ops.
class OpRecorder : public OpTracer {
 public:
  uint64_t begin_op(const OpDesc& op) override;
  void end_op(uint64_t token) override;

  // Number of ops opened and not yet closed (over all threads).
  int open_ops() const;
  // Ops recorded so far, in the order they were opened, device timestamps resolved (which
  // waits for the device ops that have closed). An op still open has end_ns < start_ns.
  std::vector<OpRecord> records() const;
  // Moves the records out and starts afresh. Throws Error if an op is still open, naming
  // the innermost one, since its record would be incomplete.
  std::vector<OpRecord> take();
  // Drops everything, open ops included (their later end_op calls are ignored).
  void clear();

 protected:
  // The host clock; a tracer with another time source for host ops overrides it.
  virtual int64_t now_ns() const;

  // Device hooks, called with the recorder's lock held.
  // An op on a device stream opens as record `index` (its stream label already set).
  // Return true to time it on the device: the record is then marked asynchronous
  // (thread -1) and resolve_device_ops must fill in its timestamps. The default returns
  // false: the op is timed with now_ns() like a host op (what a host clock can see of it).
  virtual bool begin_device_op(const OpDesc& op, size_t index);
  // The device op at `index` (one begin_device_op accepted) closes.
  virtual void end_device_op(size_t index);
  // Writes start_ns/end_ns of the closed device ops into `records` (the recorder's list or
  // a copy of it, indexed alike); ops still open are left alone.
  virtual void resolve_device_ops(std::vector<OpRecord>& records) const;
  // The records are being dropped (take or clear): forget every device op.
  virtual void reset_device_ops();

 private:
  struct ThreadStack {
    std::thread::id thread;
    std::vector<uint64_t> open;  // indices into records_, innermost last
  };
  // The calling thread's stack and its index in stacks_ (its thread number).
  ThreadStack& stack_for_this_thread(int* index = nullptr);
  // The label of a device stream: its explicit id, or 1 + its order of first appearance.
  int device_stream_label(const OpStream& s);

  mutable std::mutex mutex_;
  std::vector<OpRecord> records_;
  std::vector<ThreadStack> stacks_;
  std::vector<CUstream_st*> device_streams_;  // in order of first appearance
  int open_ = 0;
  uint64_t generation_ = 0;
};

// The CUDA tracer (src/core/op_trace_cuda.cu): host ops are timed as by OpRecorder, ops
// on a device stream with two CUDA events recorded on their stream, resolved when the
// records are read. The first device op of a window synchronises its stream once to tie
// the device clock to the host clock. Throws Error in a build without CUDA.
std::unique_ptr<OpRecorder> make_cuda_op_recorder();
// Whether this build has the CUDA tracer.
bool have_cuda_op_recorder();

}  // namespace esplag
