// DeviceArena: the one GPU allocation of a run, handed out as named sub-allocations.
//
// A training run knows its memory needs up front (parameters, optimizer state,
// activations, workspaces), so it reserves one block of device memory with cudaMalloc
// and carves it with a bump pointer. Allocation is a pointer increment, there is no
// fragmentation, and running out names the tensor that did not fit and what was free,
// before any kernel runs. Memory is released only in stack order (release_to / reset).
// Never managed (unified) memory: placement and traffic stay explicit. An arena may instead
// hold pinned host memory mapped into the device's address space (Memory::pinned_host): what
// the optimizer offload keeps off the GPU. Kernels read and write it across PCIe with the
// same pointers (the unified virtual address space makes the host pointer the device one).
//
// The header needs no CUDA headers, so code shared with the CPU build can hold an
// arena; in a build without CUDA constructing a non-empty arena throws.
// Not thread-safe: one owner allocates.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace esplag {

class DeviceArena {
 public:
  // 256 bytes: what cudaMalloc guarantees and what cuBLASLt prefers for its operands.
  static constexpr size_t kDefaultAlignment = 256;

  struct Allocation {
    std::string name;
    size_t offset = 0;  // from the arena base, aligned
    size_t bytes = 0;   // as requested
  };

  enum class Memory { device, pinned_host };

  DeviceArena() = default;  // empty: every allocation of more than 0 bytes fails
  // Reserves `capacity_bytes` of device memory on the current device (or of pinned host
  // memory mapped into it). Throws Error with the free and total memory if that is not
  // possible.
  explicit DeviceArena(size_t capacity_bytes, std::string name = "device", Memory where = Memory::device);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  DeviceArena(DeviceArena&& other) noexcept;
  DeviceArena& operator=(DeviceArena&& other) noexcept;

  // A sub-allocation of `bytes` aligned to `alignment` (a power of two). Throws Error
  // naming `tensor`, the bytes requested and the bytes still free when it does not fit.
  // The memory is uninitialised.
  void* allocate(std::string_view tensor, size_t bytes, size_t alignment = kDefaultAlignment);

  template <typename T>
  T* allocate_array(std::string_view tensor, size_t count, size_t alignment = kDefaultAlignment) {
    const size_t a = alignment < alignof(T) ? alignof(T) : alignment;
    return static_cast<T*>(allocate(tensor, checked_bytes(tensor, count, sizeof(T)), a));
  }

  // A named device Tensor (a view; the arena keeps ownership of the memory).
  Tensor tensor(const std::string& name, const Shape& shape, DType dtype, size_t alignment = kDefaultAlignment);

  // Stack-ordered release: mark() remembers the current top, release_to(mark) frees
  // everything allocated after it (e.g. per-step scratch); reset() frees everything.
  size_t mark() const { return used_; }
  void release_to(size_t mark);
  void reset() { release_to(0); }

  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }  // bytes up to the top, alignment padding included
  size_t available() const { return capacity_ - used_; }
  size_t peak() const { return peak_; }  // highest `used` since construction or reset_peak()
  void reset_peak() { peak_ = used_; }
  const std::string& name() const { return name_; }
  Memory memory() const { return memory_; }
  void* base() const { return base_; }
  // Live sub-allocations in allocation order.
  const std::vector<Allocation>& allocations() const { return allocs_; }
  // Human-readable usage: capacity, used, peak and the `top` largest live allocations.
  std::string report(size_t top = 10) const;

  // "1.50 MiB (1572864 bytes)".
  static std::string format_bytes(size_t bytes);

 private:
  static size_t checked_bytes(std::string_view tensor, size_t count, size_t elem);
  [[noreturn]] void fail_out_of_memory(std::string_view tensor, size_t bytes, size_t alignment) const;
  void free_all() noexcept;

  std::string name_ = "device";
  Memory memory_ = Memory::device;
  void* base_ = nullptr;
  size_t capacity_ = 0;
  size_t used_ = 0;
  size_t peak_ = 0;
  std::vector<Allocation> allocs_;
};

}  // namespace esplag
