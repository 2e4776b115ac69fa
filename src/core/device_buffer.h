// DeviceBuffer: one cudaMalloc'ed block owned by an object, freed with it.
//
// For GPU code whose buffers change size after construction or must be given back out of
// stack order (a cuSPARSELt workspace that grows after the first tuning, a benchmark that
// sizes buffers shape by shape), where a DeviceArena's bump allocation does not fit.
// A failed allocation throws esplag::Error naming the owner, the purpose, the size and
// CUDA's reason. Only for the CUDA build.
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/device_buffer.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string_view>

#include "core/device_arena.h"
#include "core/error.h"

namespace esplag {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `owner` and `what` only name the buffer in the error message.
  DeviceBuffer(size_t bytes, std::string_view owner, std::string_view what) { allocate(bytes, owner, what); }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) {
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_;
      bytes_ = o.bytes_;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }

  // Replaces the block by a new one of `bytes` (uninitialised; none for 0).
  void allocate(size_t bytes, std::string_view owner, std::string_view what) {
    reset();
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error state of the failed call
      p_ = nullptr;
      fail(owner, ": cannot allocate ", DeviceArena::format_bytes(bytes), " for ", what, " (", cudaGetErrorString(err),
           ")");
    }
    bytes_ = bytes;
  }
  void reset() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    bytes_ = 0;
  }

  void* get() const { return p_; }
  __nv_bfloat16* bf() const { return static_cast<__nv_bfloat16*>(p_); }
  float* f32() const { return static_cast<float*>(p_); }
  uint16_t* u16() const { return static_cast<uint16_t*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace esplag
