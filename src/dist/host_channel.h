// The ranks' control and data channel over TCP, a star through rank 0: barriers, the
// agreement to stop, small broadcasts, and the sums, maxima, reduce-scatters and gathers of
// the CPU reference of data parallel training. Every collective is blocking and called by
// every rank in the same order; rank 0 checks that they agree (each message carries its
// collective and size), computes the result and sends it back, so every rank gets identical
// bits.
//
// Failure: a rank that leaves (its process ends, its connection closes) or stays away longer
// than the timeout makes the next collective throw an Error naming it on every rank: rank 0
// sends the others an abort message and closes their connections, and after a failure every
// later call throws the same Error. Nothing hangs.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dist/world.h"

namespace esplag {

class HostChannel {
 public:
  // Rank 0 listens on world.master_addr:world.master_port (on all interfaces unless the
  // address is a loopback one), the others connect, retrying until timeout_s; when it
  // returns, every rank knows every rank is there. Errors name the address and what failed.
  static std::unique_ptr<HostChannel> connect(const World& world, double timeout_s = 300);
  ~HostChannel();
  HostChannel(const HostChannel&) = delete;
  HostChannel& operator=(const HostChannel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Elementwise sum over the ranks, added in rank order (((r0 + r1) + r2) ...) on rank 0 and
  // sent back, so every rank gets identical bits. Every rank passes the same n.
  void all_reduce_sum(float* data, size_t n);
  void all_reduce_sum(double* data, size_t n);
  // Elementwise maximum over the ranks (of values that are not NaN), the same on every rank.
  void all_reduce_max(float* data, size_t n);
  // The pieces of ZeRO (train/zero_partition.h). `counts` (the same on every rank) splits
  // sum(counts) elements into consecutive ranges, counts[r] elements for rank r.
  // Reduce-scatter: `data` holds sum(counts) elements on every rank; `out` gets this rank's
  // range of their sum over the ranks, added in rank order as all_reduce_sum adds (the same bits).
  void reduce_scatter_sum(const float* data, const std::vector<size_t>& counts, float* out);
  // All-gather: `mine` holds counts[rank] elements; `out` gets sum(counts) on every rank, the
  // ranks' elements in rank order.
  void all_gather(const float* mine, const std::vector<size_t>& counts, float* out);
  // The same to rank 0 alone: `out` (sum(counts) elements) is written on rank 0 and unused elsewhere.
  void gather(const float* mine, const std::vector<size_t>& counts, float* out);
  // Root's bytes to every rank; the receivers' strings are resized.
  void broadcast(std::string& bytes, int root = 0);
  void barrier();
  // True on every rank when any rank passed true.
  bool any(bool flag);

  // Seconds a collective waits for a peer before failing (default 1800; the environment
  // variable ESPLAG_COLLECTIVE_TIMEOUT_S overrides it).
  void set_timeout(double seconds);
  double timeout() const { return timeout_s_; }

 private:
  HostChannel(int rank, int size, std::vector<int> sockets, double timeout_s);
  // Runs one collective's exchange with the peers; a failed peer becomes the run's Error.
  template <typename Exchange>
  void guarded(const char* name, const Exchange& exchange);
  template <typename T>
  void reduce(T* data, size_t n, bool max, const char* name);
  void gather_to(const float* mine, const std::vector<size_t>& counts, float* out, bool to_all);
  // Records the failure, tells the other ranks (rank 0) and throws it.
  [[noreturn]] void abort_run(const std::string& message);

  int rank_ = 0, size_ = 1;
  std::vector<int> sockets_;  // rank 0: one per rank (index 0 unused); others: one, to rank 0
  double timeout_s_ = 1800;
  std::string failure_;  // the Error of an earlier failure; every later call throws it again
};

}  // namespace esplag
