// The one seam every sparsity method plugs into (DESIGN.md, "Linear"): a linear layer
// y = x·Wᵀ + b with an explicit forward and backward. The weight and bias (and their
// gradients) live in the model's flat parameter buffers; a Linear holds views into them
// plus whatever extra state its kind needs (masks, compressed copies, adapters).
#pragma once
#include <memory>
#include <string>

namespace esplag {

template <typename T>
struct LinearParams {
  std::string name;  // weight parameter name, e.g. "blocks.0.mlp.fc.weight"
  int in_features = 0;
  int out_features = 0;
  T* weight = nullptr;   // [out, in]
  T* bias = nullptr;     // [out] or null
  T* dweight = nullptr;  // gradient buffers, same shapes
  T* dbias = nullptr;
};

template <typename T>
class Linear {
 public:
  explicit Linear(const LinearParams<T>& p) : p_(p) {}
  virtual ~Linear() = default;

  // out[N, out] = inp[N, in] · Wᵀ + b.
  virtual void forward(T* out, const T* inp, int N) = 0;
  // dinp += dout · W (dinp may be null); dweight/dbias += their gradients.
  virtual void backward(T* dinp, const T* dout, const T* inp, int N) = 0;
  // "dense", "masked", "slope", ... as written in recipes.
  virtual std::string kind() const = 0;

  const LinearParams<T>& params() const { return p_; }

 protected:
  LinearParams<T> p_;
};

// The baseline kind: dense GEMMs for forward, dX and dW.
template <typename T>
class DenseLinear final : public Linear<T> {
 public:
  using Linear<T>::Linear;
  void forward(T* out, const T* inp, int N) override;
  void backward(T* dinp, const T* dout, const T* inp, int N) override;
  std::string kind() const override { return "dense"; }
};

}  // namespace esplag
