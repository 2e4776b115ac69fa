// A fixed-size array that starts as zeros, for gradient buffers. It is calloc'd: a large
// block comes as fresh zero pages that the OS backs only when they are first written, so
// the gradients of a model that never runs backward on the host (GPU training keeps its
// own) cost neither memory nor the time to zero them. The storage never moves, so
// pointers into it stay valid for the array's life.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>

namespace esplag {

template <typename T>
class ZeroedArray {
 public:
  ZeroedArray() = default;
  explicit ZeroedArray(size_t n) : p_(static_cast<T*>(std::calloc(n > 0 ? n : 1, sizeof(T)))), n_(n) {
    if (!p_) throw std::bad_alloc();
  }

  T* data() { return p_.get(); }
  const T* data() const { return p_.get(); }
  size_t size() const { return n_; }
  T* begin() { return p_.get(); }
  T* end() { return p_.get() + n_; }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T[], Free> p_;
  size_t n_ = 0;
};

}  // namespace esplag
