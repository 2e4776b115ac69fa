// Timing device work with CUDA events, the one way every benchmark and measured choice
// of the engine does it (benchmarks, per-layer dispatch): owned events and streams, the
// median of timed calls, and the name of the GPU the results belong to.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/cuda_timing.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <functional>
#include <string>
#include <vector>

#include "core/cuda_check.h"

namespace esplag {

// n CUDA events (timing enabled), destroyed with the object.
struct CudaEvents {
  std::vector<cudaEvent_t> e;
  explicit CudaEvents(size_t n) : e(n, nullptr) {
    for (auto& x : e) CUDA_CHECK(cudaEventCreate(&x));
  }
  ~CudaEvents() {
    for (auto x : e)
      if (x) cudaEventDestroy(x);
  }
  CudaEvents(const CudaEvents&) = delete;
  CudaEvents& operator=(const CudaEvents&) = delete;
};

// A non-blocking stream of its own (benchmarks keep off the legacy default stream),
// destroyed with the object.
struct CudaStream {
  cudaStream_t s = nullptr;
  CudaStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~CudaStream() {
    if (s) cudaStreamDestroy(s);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
};

// The CUDA-event time in ms of each of `iters` calls of call(i), i = warmup .. warmup +
// iters - 1 (in call order), each between its own pair of events on `stream`, after
// `warmup` untimed calls call(0 .. warmup - 1); the index lets a caller rotate input sets.
// Synchronises the stream; iters must be positive.
std::vector<double> event_times_ms(const std::function<void(int i)>& call, int warmup, int iters,
                                   cudaStream_t stream);
// The median (of an even count: the mean of the middle two); v must not be empty.
double median_of(std::vector<double> v);

// median_of(event_times_ms(...)).
double median_event_ms(const std::function<void(int i)>& call, int warmup, int iters, cudaStream_t stream);

// The current device's name ("NVIDIA H100 80GB HBM3"), as results and tuning caches record it.
std::string current_gpu_name();

}  // namespace esplag
