// Pointwise activations (GELU-tanh, SwiGLU, ReLU²) and the residual add, bf16 in and
// out, fp32 arithmetic. Each thread owns eight consecutive elements, moved as one 16-byte
// access when the pointers are aligned (scalar accesses otherwise and for the tail).
// Same expressions and constants as the CPU reference (ops/cpu/activation.cpp).
#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/swiglu_math.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load8;
using detail::store8;
using detail::to_bf;
using detail::to_f;

constexpr int kThreads = 256;
constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

struct Gelu {
  __device__ static float fwd(float x) {
    const float cube = kGeluC * x * x * x;
    return 0.5f * x * (1.f + tanhf(kGeluS * (x + cube)));
  }
  __device__ static float bwd(float x, float d) {
    const float cube = kGeluC * x * x * x;
    const float arg = kGeluS * (x + cube);
    const float t = tanhf(arg);
    const float ch = coshf(arg);  // overflows to inf for |arg| > ~89: sech² = 0, the limit
    const float sech2 = 1.f / (ch * ch);
    const float local = 0.5f * (1.f + t) + x * 0.5f * sech2 * kGeluS * (1.f + 3.f * kGeluC * x * x);
    return local * d;
  }
};

struct Relu2 {
  __device__ static float fwd(float x) {
    const float r = x > 0.f ? x : 0.f;
    return r * r;
  }
  __device__ static float bwd(float x, float d) {
    const float r = x > 0.f ? x : 0.f;
    return 2.f * r * d;
  }
};

// One thread per eight elements [i, i+8). Pointers are deliberately not __restrict__:
// out may alias inp (in-place activation), which is safe because every element is read
// and written by the same thread.
template <typename Op, bool kVec>
__global__ void __launch_bounds__(kThreads) unary_forward_kernel(bf16* out, const bf16* inp, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPack;
  if (i >= n) return;
  if (kVec && i + kPack <= n) {
    float v[kPack];
    load8(v, inp + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) v[k] = Op::fwd(v[k]);
    store8(out + i, v);
  } else {
    const int64_t e = min(n, i + kPack);
    for (int64_t j = i; j < e; ++j) out[j] = to_bf(Op::fwd(to_f(inp[j])));
  }
}

template <typename Op, bool kVec, bool kAcc>
__global__ void __launch_bounds__(kThreads)
    unary_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPack;
  if (i >= n) return;
  if (kVec && i + kPack <= n) {
    float x[kPack], d[kPack], o[kPack];
    load8(x, inp + i);
    load8(d, dout + i);
    if (kAcc) load8(o, dinp + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) o[k] = (kAcc ? o[k] : 0.f) + Op::bwd(x[k], d[k]);
    store8(dinp + i, o);
  } else {
    const int64_t e = min(n, i + kPack);
    for (int64_t j = i; j < e; ++j) {
      const float g = Op::bwd(to_f(inp[j]), to_f(dout[j]));
      dinp[j] = to_bf(kAcc ? to_f(dinp[j]) + g : g);
    }
  }
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) residual_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * kPack;
  if (i >= n) return;
  if (kVec && i + kPack <= n) {
    float va[kPack], vb[kPack];
    load8(va, a + i);
    load8(vb, b + i);
#pragma unroll
    for (int k = 0; k < kPack; ++k) va[k] += vb[k];
    store8(out + i, va);
  } else {
    const int64_t e = min(n, i + kPack);
    for (int64_t j = i; j < e; ++j) out[j] = to_bf(to_f(a[j]) + to_f(b[j]));
  }
}

// SwiGLU, one thread per eight outputs of one row (kVec: H % 8 == 0) or per output.
template <bool kVec>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per = kVec ? kPack : 1;
  const int64_t groups = static_cast<int64_t>(H / per);
  if (t >= N * groups) return;
  const int64_t n = t / groups;
  const int h = static_cast<int>(t % groups) * per;
  const bf16* g = inp + n * 2 * H + h;
  const bf16* u = g + H;
  bf16* o = out + n * H + h;
  if constexpr (kVec) {
    float vg[kPack], vu[kPack];
    load8(vg, g);
    load8(vu, u);
#pragma unroll
    for (int k = 0; k < kPack; ++k) vg[k] = detail::swiglu_value(vg[k], vu[k]);
    store8(o, vg);
  } else {
    *o = to_bf(detail::swiglu_value(to_f(*g), to_f(*u)));
  }
}

template <bool kVec, bool kAcc>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, int H) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per = kVec ? kPack : 1;
  const int64_t groups = static_cast<int64_t>(H / per);
  if (t >= N * groups) return;
  const int64_t n = t / groups;
  const int h = static_cast<int>(t % groups) * per;
  const bf16* g = inp + n * 2 * H + h;
  const bf16* u = g + H;
  const bf16* d = dout + n * H + h;
  bf16* dg = dinp + n * 2 * H + h;
  bf16* du = dg + H;
  float vg[kPack], vu[kPack], vd[kPack], og[kPack], ou[kPack];
  if constexpr (kVec) {
    load8(vg, g);
    load8(vu, u);
    load8(vd, d);
    if (kAcc) {
      load8(og, dg);
      load8(ou, du);
    }
  } else {
    vg[0] = to_f(*g);
    vu[0] = to_f(*u);
    vd[0] = to_f(*d);
    if (kAcc) {
      og[0] = to_f(*dg);
      ou[0] = to_f(*du);
    }
  }
#pragma unroll
  for (int k = 0; k < per; ++k) {
    const detail::SwigluBackward b = detail::swiglu_backward_at(vg[k], vu[k], vd[k]);
    og[k] = kAcc ? og[k] + b.gate : b.gate;
    ou[k] = kAcc ? ou[k] + b.up : b.up;
  }
  if constexpr (kVec) {
    store8(dg, og);
    store8(du, ou);
  } else {
    *dg = to_bf(og[0]);
    *du = to_bf(ou[0]);
  }
}

template <typename Op>
void launch_unary_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(n >= 0, name, ": negative element count ", n);
  if (n == 0) return;
  const unsigned grid = detail::blocks_for(n, int64_t(kThreads) * kPack);
  if (detail::aligned16(out) && detail::aligned16(inp))
    unary_forward_kernel<Op, true><<<grid, kThreads, 0, stream>>>(out, inp, n);
  else
    unary_forward_kernel<Op, false><<<grid, kThreads, 0, stream>>>(out, inp, n);
  CUDA_CHECK_LAUNCH(name);
}

template <typename Op>
void launch_unary_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, bool accumulate,
                           cudaStream_t stream, const char* name) {
  ESPLAG_CHECK(n >= 0, name, ": negative element count ", n);
  if (n == 0) return;
  const unsigned grid = detail::blocks_for(n, int64_t(kThreads) * kPack);
  const bool vec = detail::aligned16(dinp) && detail::aligned16(inp) && detail::aligned16(dout);
  if (vec && accumulate)
    unary_backward_kernel<Op, true, true><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, n);
  else if (vec)
    unary_backward_kernel<Op, true, false><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, n);
  else if (accumulate)
    unary_backward_kernel<Op, false, true><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, n);
  else
    unary_backward_kernel<Op, false, false><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, n);
  CUDA_CHECK_LAUNCH(name);
}

}  // namespace

void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  launch_unary_forward<Gelu>(out, inp, n, stream, "gelu_forward");
}
void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, bool accumulate, cudaStream_t stream) {
  launch_unary_backward<Gelu>(dinp, inp, dout, n, accumulate, stream, "gelu_backward");
}
void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  launch_unary_forward<Relu2>(out, inp, n, stream, "relu2_forward");
}
void relu2_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, bool accumulate,
                    cudaStream_t stream) {
  launch_unary_backward<Relu2>(dinp, inp, dout, n, accumulate, stream, "relu2_backward");
}

void residual_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  ESPLAG_CHECK(n >= 0, "residual_forward: negative element count ", n);
  if (n == 0) return;
  const unsigned grid = detail::blocks_for(n, int64_t(kThreads) * kPack);
  if (detail::aligned16(out) && detail::aligned16(a) && detail::aligned16(b))
    residual_kernel<true><<<grid, kThreads, 0, stream>>>(out, a, b, n);
  else
    residual_kernel<false><<<grid, kThreads, 0, stream>>>(out, a, b, n);
  CUDA_CHECK_LAUNCH("residual_forward");
}

void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int H, cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && H > 0, "swiglu_forward: bad size N=", N, ", H=", H);
  if (N == 0) return;
  const bool vec = H % kPack == 0 && detail::aligned16(out) && detail::aligned16(inp);
  const int64_t threads = N * (vec ? H / kPack : H);
  const unsigned grid = detail::blocks_for(threads, kThreads);
  if (vec)
    swiglu_forward_kernel<true><<<grid, kThreads, 0, stream>>>(out, inp, N, H);
  else
    swiglu_forward_kernel<false><<<grid, kThreads, 0, stream>>>(out, inp, N, H);
  CUDA_CHECK_LAUNCH("swiglu_forward");
}

void swiglu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t N, int H, bool accumulate,
                     cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && H > 0, "swiglu_backward: bad size N=", N, ", H=", H);
  if (N == 0) return;
  const bool vec = H % kPack == 0 && detail::aligned16(dinp) && detail::aligned16(inp) && detail::aligned16(dout);
  const int64_t threads = N * (vec ? H / kPack : H);
  const unsigned grid = detail::blocks_for(threads, kThreads);
  if (vec && accumulate)
    swiglu_backward_kernel<true, true><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, N, H);
  else if (vec)
    swiglu_backward_kernel<true, false><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, N, H);
  else if (accumulate)
    swiglu_backward_kernel<false, true><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, N, H);
  else
    swiglu_backward_kernel<false, false><<<grid, kThreads, 0, stream>>>(dinp, inp, dout, N, H);
  CUDA_CHECK_LAUNCH("swiglu_backward");
}

}  // namespace esplag::gpu
