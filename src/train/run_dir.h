// What a training process does to a run directory before it writes there: it takes the
// directory's lock, so that two processes never interleave metrics or overwrite each
// other's checkpoints, and it removes what killed writers left behind.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace esplag {

// An exclusive flock on RUN/lock for the object's lifetime, with the holder's PID written
// into the file. Released when the object is destroyed or the process ends, however it
// ends (the kernel drops the lock with the descriptor), so a stale file is no obstacle.
class RunLock {
 public:
  // Throws an Error naming the PID of the process that holds the lock.
  explicit RunLock(const std::string& run_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

struct RemovedLeftovers {
  std::vector<std::string> names;  // file or directory names inside the run directory
  uint64_t bytes = 0;
};

// Removes the unfinished writes of processes that are no longer running: checkpoint
// directories `step-NNNNNN.tmp-PID/` and files `NAME.tmp.PID` (io/atomic_file.h) whose
// PID is not alive. The caller holds the run's lock, so no live writer of this run can be
// among them; a live PID (another program's, after PID reuse) is left alone.
RemovedLeftovers remove_dead_writers(const std::string& run_dir);

}  // namespace esplag
