#include "core/op_trace.h"

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

uint64_t OpRecorder::begin_op(const OpDesc& op) {
  OpRecord r;
  r.name = op.name.str();
  r.category = op.category;
  r.layer = op.layer;
  r.stream = op.stream;
  r.flops = op.flops;
  r.bytes = op.bytes;
  r.inputs.reserve(op.inputs.size());
  for (const void* p : op.inputs)
    if (p != nullptr) r.inputs.push_back(p);
  r.outputs.reserve(op.outputs.size());
  for (const void* p : op.outputs)
    if (p != nullptr) r.outputs.push_back(p);

  std::lock_guard<std::mutex> lock(mutex_);
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
  // The clock is read last so that the bookkeeping above is not charged to the op.
  OpRecord& rec = records_.back();
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
  records_[index].end_ns = t;
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
  return records_;
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
  std::vector<OpRecord> out = std::move(records_);
  records_.clear();
  stacks_.clear();
  ++generation_;
  return out;
}

void OpRecorder::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  records_.clear();
  stacks_.clear();
  open_ = 0;
  ++generation_;
}

}  // namespace esplag
