#include "core/cuda_timing.h"

#include <algorithm>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"

namespace esplag {

std::vector<double> event_times_ms(const std::function<void(int)>& call, int warmup, int iters, cudaStream_t stream) {
  ESPLAG_CHECK(iters > 0 && warmup >= 0, "event_times_ms: iters must be positive and warmup not negative");
  for (int i = 0; i < warmup; ++i) call(i);
  CudaEvents ev(2 * size_t(iters));
  for (int i = 0; i < iters; ++i) {
    CUDA_CHECK(cudaEventRecord(ev.e[2 * i], stream));
    call(warmup + i);
    CUDA_CHECK(cudaEventRecord(ev.e[2 * i + 1], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, ev.e[2 * i], ev.e[2 * i + 1]));
    ms[i] = t;
  }
  return ms;
}

double median_of(std::vector<double> v) {
  ESPLAG_CHECK(!v.empty(), "median_of: no values");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double median_event_ms(const std::function<void(int)>& call, int warmup, int iters, cudaStream_t stream) {
  return median_of(event_times_ms(call, warmup, iters, stream));
}

std::string current_gpu_name() {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  return prop.name;
}

}  // namespace esplag
