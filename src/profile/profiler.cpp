#include "profile/profiler.h"

#include "core/error.h"

namespace esplag {

Profiler::Profiler(std::unique_ptr<OpRecorder> recorder)
    : recorder_(recorder ? std::move(recorder) : std::make_unique<OpRecorder>()) {}

Profiler::~Profiler() {
  if (running_ && current_op_tracer() == recorder_.get()) set_op_tracer(nullptr);
}

void Profiler::start() {
  ESPLAG_CHECK(!running_, "Profiler::start: already running");
  recorder_->clear();
  OpTracer* expected = nullptr;
  if (!detail::g_op_tracer.compare_exchange_strong(expected, recorder_.get(),
                                                   std::memory_order_acq_rel))
    fail("Profiler::start: another op tracer is already installed; only one profiler can "
         "run at a time");
  running_ = true;
}

std::vector<OpRecord> Profiler::stop() {
  ESPLAG_CHECK(running_, "Profiler::stop: not running (call start() first)");
  if (current_op_tracer() == recorder_.get()) set_op_tracer(nullptr);
  running_ = false;
  // The recorder stays alive with this Profiler, so an op that is still open can close
  // on it harmlessly after the error below.
  return recorder_->take();
}

std::vector<WhatIfSpec> Profiler::what_if_specs(const std::vector<std::string>& specs,
                                                const std::vector<std::string>& csv_files) {
  std::vector<WhatIfSpec> out = parse_what_if_specs(specs);
  for (const auto& f : csv_files) {
    auto more = read_what_if_csv(f);
    for (auto& s : more) out.push_back(std::move(s));
  }
  return out;
}

ProfileResult Profiler::analyse(std::vector<OpRecord> records,
                                const std::vector<WhatIfSpec>& specs,
                                const GraphOptions& options) {
  return esplag::analyse(std::move(records), specs, options);
}

void Profiler::write_reports(const std::string& dir, const ProfileResult& result,
                             const ValidationResult* validation) {
  esplag::write_reports(dir, result, validation);
}

std::string Profiler::summary(const ProfileResult& result) { return summary_text(result); }

}  // namespace esplag
