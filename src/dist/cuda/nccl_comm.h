// Collectives between the GPUs of a data-parallel run, through NCCL. NCCL is opened at run
// time (dlopen of libnccl.so.2, or of the file or folder ESPLAG_NCCL_LIB names), as
// cuSPARSELt is, so the binary starts where NCCL is missing and only a run of several
// processes on the GPU needs it. The ranks meet through the host channel
// (dist/host_channel.h): rank 0 draws NCCL's unique id and the channel hands it to the
// others, so NCCL needs no rendezvous of its own.
//
// A collective that fails, or that does not finish within the timeout (a rank that died
// or hangs), aborts the communicator (ncclCommAbort) and throws an Error saying which
// wait gave up: every rank exits instead of hanging.
//
// Only for the CUDA build with nccl.h (ESPLAG_HAVE_NCCL).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "dist/cuda/nccl_comm.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <string>

#include "core/device_collectives.h"

namespace esplag {

class HostChannel;

class NcclComm final : public DeviceCollectives {
 public:
  // Joins every rank of `channel` on the current CUDA device (each rank its own device).
  // Throws Error when NCCL cannot be loaded or the communicator cannot be made.
  explicit NcclComm(HostChannel& channel);
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // In place, queued on `stream` (nothing waits). Every rank calls them in the same order.
  void all_reduce_sum(double* data, size_t n, cudaStream_t stream);
  // DeviceCollectives (core/device_collectives.h): ZeRO's collectives.
  void reduce_scatter_mean(const float* in, float* out, size_t chunk, cudaStream_t stream) override;
  void all_gather(const void* in, void* out, size_t chunk_bytes, cudaStream_t stream) override;
  void all_reduce_sum_int(int32_t* data, size_t n, cudaStream_t stream) override;
  void all_reduce_sum(float* data, size_t n, cudaStream_t stream) override;
  void all_reduce_mean(float* data, size_t n, cudaStream_t stream) override;
  void all_reduce_max(float* data, size_t n, cudaStream_t stream) override;
  void group_begin() override;
  void group_end() override;

  // Waits for `stream`, watching NCCL's asynchronous errors meanwhile. An error, or work
  // still queued after the host channel's timeout, aborts the communicator and throws
  // Error naming `what`.
  void synchronize(cudaStream_t stream, const std::string& what);

  // "2.28.3", or why NCCL cannot be loaded.
  static std::string version();

 private:
  [[noreturn]] void abort_and_fail(const std::string& what, const std::string& why);

  struct Handle;
  std::unique_ptr<Handle> handle_;
  int rank_ = 0, size_ = 1;
  double timeout_s_ = 0;
};

}  // namespace esplag
