#include "core/device_arena.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <utility>

#include "core/error.h"

#ifdef ESPLAG_HAVE_CUDA
#include "core/cuda_check.h"
#endif

namespace esplag {

std::string DeviceArena::format_bytes(size_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.2f %s (%zu bytes)", v, units[u], bytes);
  return buf;
}

DeviceArena::DeviceArena(size_t capacity_bytes, std::string name, Memory where)
    : name_(std::move(name)), memory_(where) {
  if (capacity_bytes == 0) return;
#ifdef ESPLAG_HAVE_CUDA
  void* p = nullptr;
  const bool host = where == Memory::pinned_host;
  const cudaError_t err =
      host ? cudaHostAlloc(&p, capacity_bytes, cudaHostAllocMapped | cudaHostAllocPortable) : cudaMalloc(&p, capacity_bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();  // allocation failures are not sticky; clear it so later calls do not report it
    size_t free_b = 0, total_b = 0;
    std::string mem = host ? "the host may not have that much memory to pin" : "device memory unknown";
    if (!host && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
      mem = "the device has " + format_bytes(free_b) + " free of " + format_bytes(total_b);
    else if (!host)
      cudaGetLastError();
    fail("device arena '", name_, "': cannot reserve ", format_bytes(capacity_bytes),
         host ? " of pinned host memory with cudaHostAlloc (" : " with cudaMalloc (", cudaGetErrorName(err), ": ",
         cudaGetErrorString(err), "); ", mem);
  }
  if (host) {  // kernels use the host pointer as it is: it must be the device's address too
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, p, 0) != cudaSuccess || dev != p) {
      cudaGetLastError();
      cudaFreeHost(p);
      fail("device arena '", name_, "': pinned host memory is not mapped at the same address on the device ",
           "(no unified virtual addressing)");
    }
  }
  base_ = p;
  capacity_ = capacity_bytes;
#else
  fail("device arena '", name_, "': cannot reserve ", format_bytes(capacity_bytes),
       ": esplag was built without CUDA (configure with -DESPLAG_CUDA=ON)");
#endif
}

void DeviceArena::free_all() noexcept {
#ifdef ESPLAG_HAVE_CUDA
  // No throwing from destructors; a failure here has no remedy.
  if (base_) memory_ == Memory::pinned_host ? cudaFreeHost(base_) : cudaFree(base_);
#endif
  base_ = nullptr;
  capacity_ = used_ = peak_ = 0;
  allocs_.clear();
}

DeviceArena::~DeviceArena() { free_all(); }

DeviceArena::DeviceArena(DeviceArena&& other) noexcept
    : name_(std::move(other.name_)),
      memory_(other.memory_),
      base_(std::exchange(other.base_, nullptr)),
      capacity_(std::exchange(other.capacity_, 0)),
      used_(std::exchange(other.used_, 0)),
      peak_(std::exchange(other.peak_, 0)),
      allocs_(std::move(other.allocs_)) {
  other.allocs_.clear();
}

DeviceArena& DeviceArena::operator=(DeviceArena&& other) noexcept {
  if (this != &other) {
    free_all();
    name_ = std::move(other.name_);
    memory_ = other.memory_;
    base_ = std::exchange(other.base_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
    used_ = std::exchange(other.used_, 0);
    peak_ = std::exchange(other.peak_, 0);
    allocs_ = std::move(other.allocs_);
    other.allocs_.clear();
  }
  return *this;
}

size_t DeviceArena::checked_bytes(std::string_view tensor, size_t count, size_t elem) {
  if (elem != 0 && count > SIZE_MAX / elem)
    fail("device arena: size of tensor '", tensor, "' overflows (", count, " elements of ", elem, " bytes)");
  return count * elem;
}

void DeviceArena::fail_out_of_memory(std::string_view tensor, size_t bytes, size_t alignment) const {
  std::ostringstream os;
  os << "device arena '" << name_ << "': out of memory for tensor '" << tensor << "': requested "
     << format_bytes(bytes) << " (alignment " << alignment << "), " << format_bytes(available()) << " free of "
     << format_bytes(capacity_) << " (" << allocs_.size() << " live allocations, peak " << format_bytes(peak_)
     << ")";
  // The largest holders are what a reader can act on (batch size, sequence length, ...).
  std::vector<const Allocation*> big;
  for (const auto& a : allocs_) big.push_back(&a);
  std::sort(big.begin(), big.end(), [](const Allocation* x, const Allocation* y) { return x->bytes > y->bytes; });
  if (!big.empty()) {
    os << "; largest:";
    for (size_t i = 0; i < big.size() && i < 3; ++i)
      os << (i ? "," : "") << " '" << big[i]->name << "' " << format_bytes(big[i]->bytes);
  }
  throw Error(os.str());
}

void* DeviceArena::allocate(std::string_view tensor, size_t bytes, size_t alignment) {
  ESPLAG_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "device arena '", name_,
               "': alignment for tensor '", tensor, "' must be a power of two, got ", alignment);
  // Offsets are aligned relative to the base, which cudaMalloc aligns to at least 256.
  const size_t start = (used_ + alignment - 1) & ~(alignment - 1);
  if (start < used_ || start > capacity_ || bytes > capacity_ - start) fail_out_of_memory(tensor, bytes, alignment);
  used_ = start + bytes;
  peak_ = std::max(peak_, used_);
  allocs_.push_back(Allocation{std::string(tensor), start, bytes});
  return static_cast<char*>(base_) + start;
}

Tensor DeviceArena::tensor(const std::string& name, const Shape& shape, DType dtype, size_t alignment) {
  const size_t bytes = checked_bytes(name, static_cast<size_t>(shape_numel(shape)), dtype_size(dtype));
  void* p = allocate(name, bytes, alignment);
  return Tensor::borrow(p, shape, dtype, Device::cuda, name);
}

void DeviceArena::release_to(size_t mark) {
  ESPLAG_CHECK(mark <= used_, "device arena '", name_, "': release_to(", mark, ") is above the current top ",
               used_, " (marks must be released in stack order)");
  while (!allocs_.empty() && allocs_.back().offset >= mark) allocs_.pop_back();
  ESPLAG_CHECK(allocs_.empty() || allocs_.back().offset + allocs_.back().bytes <= mark, "device arena '", name_,
               "': release_to(", mark, ") would cut tensor '", allocs_.back().name, "' in half");
  used_ = mark;
}

std::string DeviceArena::report(size_t top) const {
  std::ostringstream os;
  os << "device arena '" << name_ << "': capacity " << format_bytes(capacity_) << ", used " << format_bytes(used_)
     << ", peak " << format_bytes(peak_) << ", " << allocs_.size() << " allocations\n";
  std::vector<const Allocation*> big;
  for (const auto& a : allocs_) big.push_back(&a);
  std::stable_sort(big.begin(), big.end(),
                   [](const Allocation* x, const Allocation* y) { return x->bytes > y->bytes; });
  for (size_t i = 0; i < big.size() && i < top; ++i) {
    char line[64];
    std::snprintf(line, sizeof line, "  %12zu  %6.2f%%  ", big[i]->bytes,
                  capacity_ ? 100.0 * static_cast<double>(big[i]->bytes) / static_cast<double>(capacity_) : 0.0);
    os << line << big[i]->name << "\n";
  }
  return os.str();
}

}  // namespace esplag
