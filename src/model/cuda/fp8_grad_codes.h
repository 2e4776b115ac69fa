// dY's fp8 codes shared by a layer's two backward products (dX takes dY [N, out], dW takes
// dYᵀ [out, N]): one amax and one pass writing both layouts (gpu::fp8_cast_both) by whichever
// product of the layer runs first; the other takes them over. Or dY's producer wrote them
// (produced()): both take them over. Part of the scratch that the fp8 layers of a model share
// (device_linear_dense.cu, device_linear_fp8_sparse.cu).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/device_arena.h"
#include "model/cuda/fp8_histories.h"
#include "ops/gpu_fp8.h"

namespace esplag {

struct Fp8GradCodes {
  uint8_t* dy = nullptr;   // [N, out], room for the largest layer's
  uint8_t* dyt = nullptr;  // [out, N]
  // The pair dY's producer writes (produced()), so that the cast pair may still serve
  // another layer meanwhile; null where none writes (DeviceLinearContext::swiglu_grad_codes).
  uint8_t* made = nullptr;
  uint8_t* made_t = nullptr;

  // Arena bytes for the codes of up to n values of dY: the cast pair, and the pair a producer
  // writes where `produced` (DeviceLinearContext::swiglu_grad_codes).
  static size_t bytes(size_t n, bool produced) {
    return (produced ? 4 : 2) * (n + DeviceArena::kDefaultAlignment);
  }
  // Takes them from `arena` (bytes(n, produced) of it).
  void allocate(DeviceArena& arena, size_t n, bool produced) {
    dy = arena.allocate_array<uint8_t>("fp8.dy", n);
    dyt = arena.allocate_array<uint8_t>("fp8.dyt", n);
    if (!produced) return;
    made = arena.allocate_array<uint8_t>("fp8.dy_made", n);
    made_t = arena.allocate_array<uint8_t>("fp8.dyt_made", n);
  }

  struct Codes {
    const uint8_t* dy;   // [N, out]
    const uint8_t* dyt;  // [out, N]
  };
  // dY's codes (scaled as `amax` says, its inverse scale into *inv; the values the cast
  // saturated added to *saturated when given) unless `owner`'s producer wrote them, or its
  // other product of this same dY (pointer and rows) cast them last: then they are taken
  // over, and a third product would cast again.
  Codes take(const void* owner, const gpu::bf16* grad, int N, int64_t out, const Fp8OperandAmax& amax, float* inv,
             Fp8Format format, uint64_t* saturated, cudaStream_t s) {
    if (made_.take(owner, grad, N)) return {made, made_t};
    if (cast_.take(owner, grad, N)) return {dy, dyt};
    gpu::fp8_cast_both(dy, dyt, inv, grad, N, out, amax.before_cast(grad, int64_t(N) * out, s), format, saturated,
                       s);
    cast_ = {owner, grad, N, 1};
    return {dy, dyt};
  }
  // Where dY's producer writes the codes of `owner`'s dY (pointer and rows, whose bf16
  // values it need not write): both products of the layer take them over.
  std::pair<uint8_t*, uint8_t*> produced(const void* owner, const gpu::bf16* grad, int N) {
    made_ = {owner, grad, N, 2};
    return {made, made_t};
  }
  // At a new backward nothing is taken over (the same pointers hold another dY).
  void forget() { cast_.takers = made_.takers = 0; }

 private:
  struct Holder {  // whose dY a pair holds, and how many products still take it over
    const void* owner = nullptr;
    const gpu::bf16* of = nullptr;
    int rows = 0, takers = 0;
    bool take(const void* o, const gpu::bf16* g, int N) {
      if (o != owner || g != of || N != rows || takers == 0) return false;
      --takers;
      return true;
    }
  };
  Holder cast_, made_;
};

}  // namespace esplag
