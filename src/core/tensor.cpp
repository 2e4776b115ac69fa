#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace esplag {

std::string device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    ESPLAG_CHECK(d >= 0, "negative dimension in shape ", shape_str(s));
    n *= d;
  }
  return n;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, std::string name) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.name_ = std::move(name);
  const size_t bytes = t.nbytes();
  // 64-byte alignment: cache lines, and what vectorised loops like.
  void* p = std::aligned_alloc(64, ((bytes + 63) / 64) * 64 + 64);
  if (!p) fail("out of host memory allocating ", bytes, " bytes for tensor '", t.name_, "' ", shape_str(shape));
  std::memset(p, 0, bytes);
  t.storage_ = std::shared_ptr<void>(p, std::free);
  t.data_ = p;
  return t;
}

Tensor Tensor::borrow(void* data, const Shape& shape, DType dtype, Device device, std::string name) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  t.data_ = data;
  t.name_ = std::move(name);
  return t;
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  if (i < 0) i += n;
  ESPLAG_CHECK(i >= 0 && i < n, "dimension ", i, " out of range for tensor '", name_, "' of shape ",
               shape_str(shape_));
  return shape_[i];
}

Tensor Tensor::reshape(const Shape& shape) const {
  ESPLAG_CHECK(shape_numel(shape) == numel(), "cannot reshape tensor '", name_, "' from ", shape_str(shape_),
               " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

namespace {
double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::i32: return static_cast<const int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DType::u16: return static_cast<const uint16_t*>(p)[i];
    case DType::u8: return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}
void store(void* p, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::f16: static_cast<uint16_t*>(p)[i] = float_to_f16(static_cast<float>(v)); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::i64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    case DType::u16: static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(v); break;
    case DType::u8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}
}  // namespace

Tensor Tensor::to(DType dtype) const {
  ESPLAG_CHECK(device_ == Device::cpu, "Tensor::to converts host tensors only; '", name_, "' is on ",
               device_name(device_));
  Tensor out = zeros(shape_, dtype, name_);
  const int64_t n = numel();
  if (dtype == dtype_) {
    std::memcpy(out.data_, data_, nbytes());
    return out;
  }
  for (int64_t i = 0; i < n; ++i) store(out.data_, dtype, i, load(data_, dtype_, i));
  return out;
}

void Tensor::expect_shape(const Shape& expected) const {
  if (shape_ != expected)
    fail("shape mismatch for tensor '", name_, "': expected ", shape_str(expected), ", got ", shape_str(shape_));
}

void Tensor::check_type(size_t size, Kind kind) const {
  const bool fp = dtype_ == DType::f32 || dtype_ == DType::f64;
  const bool raw16 = dtype_ == DType::bf16 || dtype_ == DType::f16 || dtype_ == DType::u16;
  const bool ok = dtype_size(dtype_) == size &&
                  ((kind == Kind::floating && fp) || (kind == Kind::raw16 && raw16) ||
                   (kind == Kind::integer && (dtype_ == DType::i32 || dtype_ == DType::i64 || dtype_ == DType::u8)));
  ESPLAG_CHECK(ok, "tensor '", name_, "' holds ", dtype_name(dtype_), ", accessed as a ", size,
               "-byte element type");
}

}  // namespace esplag
