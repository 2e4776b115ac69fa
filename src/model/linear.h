// The one seam every sparsity method plugs into (docs/architecture.md, "Seam 2"): a linear layer
// y = x·Wᵀ + b with an explicit forward and backward. The dense weight and bias (and their
// gradients) live in the model's flat parameter buffers; a Linear holds views into them
// plus whatever extra state its kind needs (masks, compressed copies, adapters).
//
// How a kind talks to the trainer (all hooks have do-nothing defaults, so `dense` only
// implements forward/backward):
//   - on_step_begin(step)       before the step's first forward (refresh masks, ...)
//   - trains_dense_weight()     false when the kind stores and trains its weight in
//                               another form (compressed kept values): the trainer then
//                               skips the flat-buffer weight in AdamW and in the grad norm
//   - owned_params()            parameters the kind stores itself (compressed values,
//                               adapters): the trainer zeroes their gradients, includes
//                               them in the global grad norm, runs AdamW on them (its
//                               moments exist only for these values: that is "sparse
//                               AdamW" for compressed kinds) and checkpoints them
//   - after_optimizer_step()    after AdamW (re-apply a mask, refresh a compressed copy)
//   - state() / load_state()    non-trained state (masks, indices, metadata) for checkpoints
//   - dense_weight(out)         the effective dense weight (for export)
//   - sparse_weight(out)        the stored weight without adapters (for `esplag sparsity`)
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/linear_precision.h"

namespace esplag {

template <typename T>
struct LinearParams {
  std::string name;    // weight parameter name, e.g. "blocks.0.mlp.fc.weight"
  std::string module;  // the layer's name without ".weight": how profiled ops are named
  int layer = -1;      // transformer block index
  int in_features = 0;
  int out_features = 0;
  T* weight = nullptr;   // [out, in]
  T* bias = nullptr;     // [out] or null
  T* dweight = nullptr;  // gradient buffers, same shapes
  T* dbias = nullptr;
  LinearPrecision precision;  // of the products (the model's, Transformer::set_linear_precision)
  // The model's amax history of this layer's X and dY (delayed fp8 scaling); it outlives the
  // layer's kind.
  Fp8AmaxHistory* fp8_history = nullptr;
};

// A trained tensor owned by a Linear kind: value and gradient of the same shape.
template <typename T>
struct OwnedParam {
  std::string name;  // e.g. "blocks.0.mlp.fc.weight.values", "blocks.0.mlp.fc.lora_a"
  Shape shape;
  T* value = nullptr;
  T* grad = nullptr;
  bool decay = true;
};

template <typename T>
class Linear {
 public:
  explicit Linear(const LinearParams<T>& p) : p_(p) {}
  virtual ~Linear() = default;

  // out[N, out] = inp[N, in] · Wᵀ + b.
  virtual void forward(T* out, const T* inp, int N) = 0;
  // dinp += dout · W (dinp may be null); weight/bias gradients += their gradients.
  virtual void backward(T* dinp, const T* dout, const T* inp, int N) = 0;
  // "dense", "masked", "slope", ... as written in recipes.
  virtual std::string kind() const = 0;
  // Human-readable pattern ("dense", "2:4", "64:2:8", "unstructured 50%").
  virtual std::string pattern() const { return "dense"; }

  virtual void on_step_begin(int64_t step) {}
  virtual bool trains_dense_weight() const { return true; }
  virtual std::vector<OwnedParam<T>> owned_params() { return {}; }
  virtual void after_optimizer_step() {}
  // Tensors named "<weight name>.<what>" plus string metadata describing the kind.
  virtual std::map<std::string, Tensor> state() const { return {}; }
  virtual void load_state(const std::map<std::string, Tensor>& tensors) {}
  // Writes the effective dense weight [out, in] (what forward multiplies by, adapters
  // included).
  virtual void dense_weight(T* out) const;
  // Writes the stored weight without low-rank adapters: what the sparsity pattern holds for.
  virtual void sparse_weight(T* out) const { dense_weight(out); }

  const LinearParams<T>& params() const { return p_; }
  // From the next product on (a LoRA wrapper passes it to its inner kind).
  virtual void set_precision(const LinearPrecision& precision) { p_.precision = precision; }
  // Operand values the fp8 casts saturated so far (0 in full precision).
  virtual int64_t fp8_saturated() const { return fp8_.saturated(); }

 protected:
  // What a product multiplies for operand `x` of n values (model/linear_precision.h): x
  // itself, or in fp8 its quantised copy, valid until the next call for the same role.
  const T* operand(ProductOperand role, const T* x, int64_t n) const {
    return fp8_(p_.precision, role, x, n, p_.fp8_history);
  }
  // dbias += the column sums of dout [N, out] (when there is a bias): exact sums of dY in
  // every precision, apart from the products' operands.
  void bias_backward(const T* dout, int N) const;

  // The dense GEMMs on the flat-buffer weight (profiled as dense_gemm ops), for kinds
  // whose products are dense.
  void dense_forward(T* out, const T* inp, int N) const;
  void dense_backward(T* dinp, const T* dout, const T* inp, int N) const;

  LinearParams<T> p_;
  mutable Fp8Operands<T> fp8_;
};

// The baseline kind: dense GEMMs for forward, dX and dW.
template <typename T>
class DenseLinear final : public Linear<T> {
 public:
  using Linear<T>::Linear;
  void forward(T* out, const T* inp, int N) override { this->dense_forward(out, inp, N); }
  void backward(T* dinp, const T* dout, const T* inp, int N) override { this->dense_backward(dinp, dout, inp, N); }
  std::string kind() const override { return "dense"; }
};

}  // namespace esplag
