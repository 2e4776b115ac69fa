#include "core/op_trace.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>

#include "core/error.h"

namespace esplag {

namespace detail {
std::atomic<OpTracer*> g_op_tracer{nullptr};
}

namespace {
constexpr std::array<OpCategory, kNumOpCategories> kCategories = {
    OpCategory::dense_gemm, OpCategory::sparse_gemm, OpCategory::attention, OpCategory::norm,
    OpCategory::elementwise, OpCategory::loss, OpCategory::optimizer, OpCategory::memcpy,
    OpCategory::comm, OpCategory::other};
constexpr std::array<std::string_view, kNumOpCategories> kCategoryNames = {
    "dense_gemm", "sparse_gemm", "attention", "norm", "elementwise",
    "loss", "optimizer", "memcpy", "comm", "other"};

// Tokens carry the recorder's generation in their high bits so that an op that closes
// after clear() cannot touch a record of the next generation.
constexpr int kIndexBits = 40;
constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
}  // namespace

std::string_view op_category_name(OpCategory c) {
  const auto i = static_cast<size_t>(c);
  ESPLAG_CHECK(i < kCategoryNames.size(), "op_category_name: invalid OpCategory value ", i);
  return kCategoryNames[i];
}

std::optional<OpCategory> parse_op_category(std::string_view name) {
  for (size_t i = 0; i < kCategoryNames.size(); ++i) {
    const std::string_view n = kCategoryNames[i];
    if (n.size() != name.size()) continue;
    bool same = true;
    for (size_t k = 0; k < n.size() && same; ++k)
      same = std::tolower(static_cast<unsigned char>(name[k])) == n[k];
    if (same) return kCategories[i];
  }
  return std::nullopt;
}

std::span<const OpCategory> all_op_categories() { return kCategories; }

std::string op_category_list() {
  std::string s;
  for (const auto n : kCategoryNames) {
    if (!s.empty()) s += ", ";
    s += n;
  }
  return s;
}

std::string OpName::str() const {
  std::string s;
  if (!prefix.empty()) {
    s.reserve(prefix.size() + 1 + name.size());
    s.append(prefix);
    s += '.';
  }
  s.append(name);
  return s;
}

OpTracer* set_op_tracer(OpTracer* tracer) {
  return detail::g_op_tracer.exchange(tracer, std::memory_order_acq_rel);
}

int64_t OpRecorder::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

OpRecorder::ThreadStack& OpRecorder::stack_for_this_thread(int* index) {
  const auto id = std::this_thread::get_id();
  for (size_t k = 0; k < stacks_.size(); ++k) {
    if (stacks_[k].thread == id) {
      if (index) *index = static_cast<int>(k);
      return stacks_[k];
    }
  }
  if (index) *index = static_cast<int>(stacks_.size());
  stacks_.push_back(ThreadStack{id, {}});
  return stacks_.back();
}

int OpRecorder::device_stream_label(const OpStream& s) {
  if (s.id >= 0) return s.id;
  for (size_t k = 0; k < device_streams_.size(); ++k)
    if (device_streams_[k] == s.handle) return static_cast<int>(k) + 1;
  device_streams_.push_back(s.handle);
  return static_cast<int>(device_streams_.size());
}

bool OpRecorder::begin_device_op(const OpDesc&, size_t) { return false; }
void OpRecorder::end_device_op(size_t) {}
void OpRecorder::resolve_device_ops(std::vector<OpRecord>&) const {}
void OpRecorder::reset_device_ops() {}

uint64_t OpRecorder::begin_op(const OpDesc& op) {
  OpRecord r;
  r.name = op.name.str();
  r.category = op.category;
  r.layer = op.layer;
  r.device = op.stream.device;
  r.flops = op.flops;
  r.bytes = op.bytes;
  r.inputs.reserve(op.inputs.size());
  for (const void* p : op.inputs)
    if (p != nullptr) r.inputs.push_back(p);
  r.outputs.reserve(op.outputs.size());
  for (const void* p : op.outputs)
    if (p != nullptr) r.outputs.push_back(p);

  std::lock_guard<std::mutex> lock(mutex_);
  r.stream = op.stream.device ? device_stream_label(op.stream) : op.stream.id;
  ThreadStack& stack = stack_for_this_thread(&r.thread);
  const uint64_t index = records_.size();
  if (!stack.open.empty()) {
    OpRecord& parent = records_[stack.open.back()];
    parent.leaf = false;
    r.parent = static_cast<int64_t>(stack.open.back());
    r.depth = parent.depth + 1;
  }
  stack.open.push_back(index);
  ++open_;
  records_.push_back(std::move(r));
  OpRecord& rec = records_.back();
  if (rec.device && begin_device_op(op, index)) rec.thread = -1;
  // The clock is read last so that the bookkeeping above is not charged to the op. A
  // device op keeps this host time until its device timestamps are resolved.
  rec.start_ns = now_ns();
  rec.end_ns = rec.start_ns - 1;
  return (generation_ << kIndexBits) | index;
}

void OpRecorder::end_op(uint64_t token) {
  const int64_t t = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if ((token >> kIndexBits) != generation_) return;  // opened before clear()
  const uint64_t index = token & kIndexMask;
  if (index >= records_.size()) return;
  OpRecord& rec = records_[index];
  if (rec.end_ns >= rec.start_ns) return;  // already closed
  rec.end_ns = std::max(t, rec.start_ns);
  if (rec.device && rec.thread < 0) end_device_op(index);
  ThreadStack& stack = stack_for_this_thread();
  // RAII closes scopes innermost first, so the op is normally on top of the stack; the
  // search only matters if a tracer is shared with code that closes out of order.
  for (size_t k = stack.open.size(); k-- > 0;) {
    if (stack.open[k] == index) {
      stack.open.erase(stack.open.begin() + static_cast<std::ptrdiff_t>(k));
      --open_;
      break;
    }
  }
}

int OpRecorder::open_ops() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_;
}

std::vector<OpRecord> OpRecorder::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<OpRecord> out = records_;
  resolve_device_ops(out);
  return out;
}

std::vector<OpRecord> OpRecorder::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_ > 0) {
    std::string innermost;
    for (const auto& s : stacks_)
      if (!s.open.empty()) innermost = records_[s.open.back()].name;
    fail("OpRecorder: cannot take the records while ", open_,
         " op(s) are still open (innermost: '", innermost,
         "'); stop profiling outside every ScopedOp");
  }
  resolve_device_ops(records_);
  std::vector<OpRecord> out = std::move(records_);
  records_.clear();
  stacks_.clear();
  device_streams_.clear();
  reset_device_ops();
  ++generation_;
  return out;
}

void OpRecorder::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
  stacks_.clear();
  device_streams_.clear();
  reset_device_ops();
  open_ = 0;
  ++generation_;
}

#ifndef ESPLAG_HAVE_CUDA
std::unique_ptr<OpRecorder> make_cuda_op_recorder() {
  fail("the CUDA op tracer is not available: this build has no CUDA (configure with "
       "-DESPLAG_CUDA=ON)");
}
bool have_cuda_op_recorder() { return false; }
#endif

}  // namespace esplag
