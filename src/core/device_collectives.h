// The collectives a GPU model needs when data-parallel ranks shard its optimizer state
// (ZeRO stages 1 to 3: GpuModelOptions::shard_optimizer), average its gradients during the
// backward (GpuModelOptions::reduce_gradients) or reduce its delayed fp8 amaxes
// (GpuModelOptions::fp8_amax_ranks). The model only queues them; what
// carries them (NCCL: dist/cuda/nccl_comm.h) is the caller's. Every rank calls them in the
// same order with the same sizes; each is queued on `stream` and waits for nothing.
//
// Only for the CUDA build.
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/device_collectives.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace esplag {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // in [size() · chunk] fp32: out [chunk] of rank r becomes the mean over the ranks of
  // everyone's chunk r of in. In place when out is in + rank() · chunk (the rest of in is
  // then left as it was, or scratch).
  virtual void reduce_scatter_mean(const float* in, float* out, size_t chunk, cudaStream_t stream) = 0;
  // out [size() · chunk_bytes]: chunk r becomes rank r's in [chunk_bytes]. In place when in
  // is out + rank() · chunk_bytes.
  virtual void all_gather(const void* in, void* out, size_t chunk_bytes, cudaStream_t stream) = 0;
  // data [n] fp32, in place: the sum over the ranks.
  virtual void all_reduce_sum(float* data, size_t n, cudaStream_t stream) = 0;
  // data [n] int32, in place: the sum over the ranks (wrapping). Where one rank gives a
  // value's bits and the others zero, every rank gets those bits: -0.0 and NaN payloads
  // included, which a float sum would not keep.
  virtual void all_reduce_sum_int(int32_t* data, size_t n, cudaStream_t stream) = 0;
  // data [n] fp32, in place: the mean over the ranks (GpuModelOptions::reduce_gradients).
  virtual void all_reduce_mean(float* data, size_t n, cudaStream_t stream) = 0;
  // data [n] fp32, in place: the largest over the ranks (delayed fp8 scaling's amaxes).
  virtual void all_reduce_max(float* data, size_t n, cudaStream_t stream) = 0;
  // The collectives queued between group_begin and group_end may run as one launch (NCCL's
  // groups): many small ones cost less so. By default each runs as it is queued.
  virtual void group_begin() {}
  virtual void group_end() {}
};

}  // namespace esplag
