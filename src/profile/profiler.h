// The profiler in four calls, for the CLI and the trainer:
//
//   Profiler p;
//   p.start();                         // installs a recorder as the op tracer
//   ... run one training step ...
//   auto records = p.stop();           // uninstalls it, returns the recorded ops
//   auto specs = Profiler::what_if_specs({"re:.*mlp.*=1.5x"}, {"bench.csv"});
//   ProfileResult r = Profiler::analyse(std::move(records), specs);
//   Profiler::write_reports("runs/x/profile", r);
//   std::cout << Profiler::summary(r);
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/op_trace.h"
#include "profile/analysis.h"
#include "profile/report.h"
#include "profile/validate.h"
#include "profile/what_if.h"

namespace esplag {

class Profiler {
 public:
  // A CPU recorder (host timestamps) by default; a device recorder can be passed in.
  explicit Profiler(std::unique_ptr<OpRecorder> recorder = nullptr);
  // Uninstalls the recorder if still running (records are dropped).
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Clears earlier records and installs the recorder. Throws Error if this profiler is
  // running or another tracer is installed.
  void start();
  // Uninstalls the recorder and returns the records. Throws Error if not running, or if
  // an op is still open (stop must be called outside every ScopedOp).
  std::vector<OpRecord> stop();
  bool running() const { return running_; }

  // Specs from the command line first, then the rows of each CSV file, in order (so with
  // first-match-wins, command-line specs take precedence).
  static std::vector<WhatIfSpec> what_if_specs(const std::vector<std::string>& specs,
                                               const std::vector<std::string>& csv_files = {});
  static ProfileResult analyse(std::vector<OpRecord> records,
                               const std::vector<WhatIfSpec>& specs = {},
                               const GraphOptions& options = {});
  static void write_reports(const std::string& dir, const ProfileResult& result,
                            const ValidationResult* validation = nullptr);
  static std::string summary(const ProfileResult& result);

 private:
  std::unique_ptr<OpRecorder> recorder_;
  bool running_ = false;
};

}  // namespace esplag
