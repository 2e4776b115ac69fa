// Token (+ position) embedding, forward and deterministic backward.
//
// Backward without atomics. Several positions can hold the same token, so rows of dwte
// are not owned by positions. Instead:
//   1. keys = token ids (tokens outside [0, V) get the key V, a bucket that is skipped),
//      values = positions; a stable radix sort (cub) groups the positions of each token,
//      in position order. The sorted list is cut into fixed segments of kSeg entries.
//   2. Per segment (one thread per channel) the dout rows of each maximal piece of equal
//      keys are summed in order. A piece that is a whole run of its token is added to
//      dwte directly (that row has no other writer). A piece cut by the segment start is
//      the segment's "head" partial, one that continues past the segment end (and starts
//      in it) its "tail" partial; both go to scratch.
//   3. The segment holding the start of a run that crosses segments adds its tail and
//      the following segments' heads, in segment order, into dwte.
// Every element's summation order depends on the token sequence only. A very frequent
// token costs kSeg sequential rows in step 2 and (count / kSeg) partials in step 3, so
// skewed token distributions stay parallel.
#include <cub/device/device_radix_sort.cuh>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load8;
using detail::store8;
using detail::to_bf;
using detail::to_f;

constexpr int kThreads = 256;
constexpr int kSeg = 64;           // sorted entries per segment
constexpr int kSegThreads = 128;   // channels per block in the segment kernels
constexpr size_t kAlign = 256;

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t N, int T,
                             int C, int V) {
  const int per = kVec ? kPack : 1;
  const int groups = C / per;
  const int64_t t_id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (t_id >= N * groups) return;
  const int64_t i = t_id / groups;
  const int c = static_cast<int>(t_id % groups) * per;
  const int tok = tokens[i];
  bf16* o = out + i * C + c;
  float v[kPack];
  if (tok < 0 || tok >= V) {
    for (int k = 0; k < per; ++k) v[k] = __int_as_float(0x7fffffff);  // NaN: a bad id must not pass silently
  } else {
    const bf16* e = wte + static_cast<int64_t>(tok) * C + c;
    if constexpr (kVec)
      load8(v, e);
    else
      v[0] = to_f(*e);
    if (wpe) {
      const bf16* p = wpe + (i % T) * C + c;
      float w[kPack];
      if constexpr (kVec)
        load8(w, p);
      else
        w[0] = to_f(*p);
      for (int k = 0; k < per; ++k) v[k] += w[k];
    }
  }
  if constexpr (kVec)
    store8(o, v);
  else
    *o = to_bf(v[0]);
}

__global__ void prepare_keys_kernel(uint32_t* keys, int32_t* vals, const int32_t* tokens, int64_t N, int V) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= N) return;
  const int tok = tokens[i];
  keys[i] = (tok >= 0 && tok < V) ? static_cast<uint32_t>(tok) : static_cast<uint32_t>(V);
  vals[i] = static_cast<int32_t>(i);
}

// Step 2: grid (segments, channel blocks).
__global__ void __launch_bounds__(kSegThreads)
    segment_sums_kernel(float* dwte, float* head, float* tail, const uint32_t* keys, const int32_t* pos,
                        const bf16* dout, int64_t N, int C, uint32_t skip_key) {
  __shared__ uint32_t skey[kSeg];
  __shared__ int32_t spos[kSeg];
  const int64_t s = blockIdx.x;
  const int64_t start = s * kSeg;
  const int len = static_cast<int>(min(static_cast<int64_t>(kSeg), N - start));
  for (int j = threadIdx.x; j < len; j += kSegThreads) {
    skey[j] = keys[start + j];
    spos[j] = pos[start + j];
  }
  __syncthreads();
  const int c = blockIdx.y * kSegThreads + threadIdx.x;
  if (c >= C) return;
  // Keys just outside the segment decide whether its first / last piece is a whole run.
  const bool has_prev = start > 0, has_next = start + len < N;
  const uint32_t prev_key = has_prev ? keys[start - 1] : 0u;
  const uint32_t next_key = has_next ? keys[start + len] : 0u;
  float acc = 0.f;
  int piece_start = 0;
  for (int j = 0; j < len; ++j) {
    acc += to_f(dout[static_cast<int64_t>(spos[j]) * C + c]);
    const uint32_t k = skey[j];
    if (j + 1 < len && skey[j + 1] == k) continue;
    if (k != skip_key) {
      const bool starts_here = piece_start > 0 || !has_prev || prev_key != k;
      const bool ends_here = j + 1 < len || !has_next || next_key != k;
      if (starts_here && ends_here)
        dwte[static_cast<int64_t>(k) * C + c] += acc;
      else if (!starts_here)
        head[s * C + c] = acc;
      else
        tail[s * C + c] = acc;
    }
    acc = 0.f;
    piece_start = j + 1;
  }
}

// Step 3: the segment where a segment-crossing run starts completes it.
__global__ void __launch_bounds__(kSegThreads)
    segment_finish_kernel(float* dwte, const float* head, const float* tail, const uint32_t* keys, int64_t N,
                          int64_t segments, int C, uint32_t skip_key) {
  const int64_t s = blockIdx.x;
  const int c = blockIdx.y * kSegThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t start = s * kSeg, end = min(N, start + kSeg);
  const uint32_t k = keys[end - 1];
  if (k == skip_key || end >= N || keys[end] != k) return;   // last piece ends in this segment
  if (start > 0 && keys[start - 1] == k && keys[start] == k) return;  // run started earlier: a head
  float acc = tail[s * C + c];
  for (int64_t s2 = s + 1; s2 < segments; ++s2) {
    acc += head[s2 * C + c];
    const int64_t end2 = min(N, (s2 + 1) * kSeg);
    if (end2 >= N || keys[end2] != k) break;
  }
  dwte[static_cast<int64_t>(k) * C + c] += acc;
}

// dwpe[t, c] += Σ_b dout[b, t, c], b in order.
__global__ void __launch_bounds__(kThreads)
    position_grad_kernel(float* dwpe, const bf16* dout, int B, int T, int C) {
  const int64_t id = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (id >= static_cast<int64_t>(T) * C) return;
  float acc = 0.f;
  for (int b = 0; b < B; ++b) acc += to_f(dout[static_cast<int64_t>(b) * T * C + id]);
  dwpe[id] += acc;
}

int key_bits(int V) {
  int bits = 1;
  while (bits < 31 && (int64_t(1) << bits) <= V) ++bits;  // keys span [0, V]
  return bits;
}

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t keys_in = 0, keys_out = 0, vals_in = 0, vals_out = 0, head = 0, tail = 0, temp = 0, temp_bytes = 0,
         total = 0;
};

Layout layout(int64_t N, int C, int V) {
  Layout l;
  size_t temp = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp, static_cast<const uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(N), 0, key_bits(V)));
  const int64_t segments = (N + kSeg - 1) / kSeg;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  l.keys_in = take(N * sizeof(uint32_t));
  l.keys_out = take(N * sizeof(uint32_t));
  l.vals_in = take(N * sizeof(int32_t));
  l.vals_out = take(N * sizeof(int32_t));
  l.head = take(static_cast<size_t>(segments) * C * sizeof(float));
  l.tail = take(static_cast<size_t>(segments) * C * sizeof(float));
  l.temp_bytes = temp;
  l.temp = take(temp);
  l.total = off;
  return l;
}

void check_shape(const char* name, int B, int T, int C, int V) {
  ESPLAG_CHECK(B >= 0 && T > 0 && C > 0 && V > 0, name, ": bad shape B=", B, ", T=", T, ", C=", C, ", V=", V);
  ESPLAG_CHECK(int64_t(B) * T <= INT32_MAX, name, ": B*T=", int64_t(B) * T, " positions exceed the 32-bit index");
}

}  // namespace

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int B, int T, int C,
                       int V, cudaStream_t stream) {
  check_shape("embedding_forward", B, T, C, V);
  const int64_t N = int64_t(B) * T;
  if (N == 0) return;
  const bool vec =
      C % kPack == 0 && detail::aligned16(out) && detail::aligned16(wte) && (!wpe || detail::aligned16(wpe));
  const int64_t threads = N * (vec ? C / kPack : C);
  const unsigned grid = detail::blocks_for(threads, kThreads);
  if (vec)
    embedding_forward_kernel<true><<<grid, kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C, V);
  else
    embedding_forward_kernel<false><<<grid, kThreads, 0, stream>>>(out, tokens, wte, wpe, N, T, C, V);
  CUDA_CHECK_LAUNCH("embedding_forward");
}

size_t embedding_backward_workspace_bytes(int B, int T, int C, int V) {
  check_shape("embedding_backward_workspace_bytes", B, T, C, V);
  return layout(int64_t(B) * T, C, V).total;
}

void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int B, int T, int C,
                        int V, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_shape("embedding_backward", B, T, C, V);
  const int64_t N = int64_t(B) * T;
  if (N == 0) return;
  if (dwpe) {
    position_grad_kernel<<<detail::blocks_for(int64_t(T) * C, kThreads), kThreads, 0, stream>>>(dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH("embedding_backward (positions)");
  }
  if (!dwte) return;
  const Layout l = layout(N, C, V);
  ESPLAG_CHECK(workspace && workspace_bytes >= l.total, "embedding_backward: workspace of ", workspace_bytes,
               " bytes is smaller than embedding_backward_workspace_bytes(", B, ", ", T, ", ", C, ", ", V, ") = ",
               l.total);
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<uint32_t*>(ws + l.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(ws + l.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);
  auto* head = reinterpret_cast<float*>(ws + l.head);
  auto* tail = reinterpret_cast<float*>(ws + l.tail);
  prepare_keys_kernel<<<detail::blocks_for(N, kThreads), kThreads, 0, stream>>>(keys_in, vals_in, tokens, N, V);
  CUDA_CHECK_LAUNCH("embedding_backward (keys)");
  size_t temp_bytes = l.temp_bytes;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, vals_in, vals_out,
                                             static_cast<int>(N), 0, key_bits(V), stream));
  const int64_t segments = (N + kSeg - 1) / kSeg;
  const dim3 grid(static_cast<unsigned>(segments), detail::blocks_for(C, kSegThreads));
  ESPLAG_CHECK(grid.y <= 65535, "embedding_backward: C=", C, " is too large");
  const uint32_t skip = static_cast<uint32_t>(V);
  segment_sums_kernel<<<grid, kSegThreads, 0, stream>>>(dwte, head, tail, keys_out, vals_out, dout, N, C, skip);
  CUDA_CHECK_LAUNCH("embedding_backward (segments)");
  segment_finish_kernel<<<grid, kSegThreads, 0, stream>>>(dwte, head, tail, keys_out, N, segments, C, skip);
  CUDA_CHECK_LAUNCH("embedding_backward (crossing runs)");
}

}  // namespace esplag::gpu
