// Tensor: a named, shaped view of memory with an element type and a device.
// Storage is either owned (shared, freed with the last copy) or borrowed (a view into
// memory someone else owns, e.g. one slice of a model's flat parameter buffer).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace esplag {

enum class Device : uint8_t { cpu, cuda };
std::string device_name(Device d);

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& s);

class Tensor {
 public:
  Tensor() = default;

  // Zero-filled host tensor that owns its memory.
  static Tensor zeros(const Shape& shape, DType dtype, std::string name = "");
  // A view of memory owned elsewhere; the caller keeps it alive.
  static Tensor borrow(void* data, const Shape& shape, DType dtype, Device device = Device::cpu,
                       std::string name = "");

  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool owns_storage() const { return static_cast<bool>(storage_); }
  bool defined() const { return data_ != nullptr || numel() == 0; }
  const std::string& name() const { return name_; }
  void set_name(std::string n) { name_ = std::move(n); }

  void* raw() const { return data_; }
  // Typed access; throws if T does not match the dtype (by size and kind).
  template <typename T>
  T* data() const {
    check_type(sizeof(T), type_tag<T>());
    return static_cast<T*>(data_);
  }

  // Same memory, new shape with the same element count.
  Tensor reshape(const Shape& shape) const;
  // Deep copy into new host memory, converting the element type (f32/f64/bf16/f16).
  Tensor to(DType dtype) const;
  // Throws Error naming this tensor if its shape differs from `expected`.
  void expect_shape(const Shape& expected) const;

 private:
  enum class Kind : uint8_t { floating, integer, raw16 };
  template <typename T>
  static constexpr Kind type_tag() {
    if constexpr (std::is_floating_point_v<T>) return Kind::floating;
    else if constexpr (std::is_same_v<T, uint16_t>) return Kind::raw16;
    else return Kind::integer;
  }
  void check_type(size_t size, Kind kind) const;

  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  std::string name_;
};

}  // namespace esplag
