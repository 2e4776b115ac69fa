// Linear layer on the CPU: one blocked GEMM driver serves all three products
// (out = inp·Wᵀ, dinp += dout·W, dweight += doutᵀ·inp).
//
// The GEMM follows the usual packed-panel scheme: a KC×NC block of the right operand is
// packed into NR-wide column panels, an MC×KC block of the left operand into MR-tall row
// panels, and an MR×NR register tile is updated by outer products, one k at a time.
// Vectorising across the NR columns of the tile (not along k) means every output element
// is accumulated sequentially in k, starting from its current value: the result of an
// element depends neither on the blocking, nor on which thread computes it, nor on how
// the output is split between threads, so it is bit-identical for any thread count.
//
// The register tile is written with GCC/Clang vector extensions, so the same source gives
// SSE2 code in the portable build and, on x86-64 CPUs that have them, an AVX2+FMA copy
// selected once at run time (the build uses no -march flags, so the binary still runs on
// any x86-64). The two kernels round differently (FMA), the choice never changes within
// a process.
#include "ops/matmul.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ESPLAG_GEMM_X86_DISPATCH 1
#endif

namespace esplag::cpu {

namespace detail {
// Forces the portable kernel even where the AVX2+FMA one is available, so that tests can
// exercise both on one machine. Returns the previous setting. Not for concurrent use
// with running GEMMs.
bool gemm_force_portable(bool on);
// "avx2+fma" or "portable": the kernel the next GEMM will use.
const char* gemm_kernel_name();
}  // namespace detail

namespace {

std::atomic<bool> g_force_portable{false};

bool use_wide_kernel() {
#ifdef ESPLAG_GEMM_X86_DISPATCH
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has && !g_force_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Element (i, k) of an operand lives at p[i * rs + k * cs].
template <typename T>
struct View {
  const T* p;
  int64_t rs, cs;
  T at(int64_t i, int64_t k) const { return p[i * rs + k * cs]; }
};

// C (M×N, row stride ldc) += A (M×K) · B (K×N).
template <typename T>
struct Gemm {
  int64_t M, N, K;
  View<T> A, B;
  T* C;
  int64_t ldc;
};

template <typename T, int W>
struct VecType;
template <>
struct VecType<float, 4> {
  typedef float type __attribute__((vector_size(16)));
};
template <>
struct VecType<float, 8> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecType<double, 2> {
  typedef double type __attribute__((vector_size(16)));
};
template <>
struct VecType<double, 4> {
  typedef double type __attribute__((vector_size(32)));
};

// Blocking: MR×NR register tile (2·MR accumulators + 2 B vectors + 1 broadcast fit the
// 16 vector registers of SSE2/AVX2), a KC×NR B panel (16 KiB in float with AVX2) stays in
// L1, an MC×KC A block in L2, a KC×NC B block in L3.
template <typename T, int W>
struct Tile {
  static constexpr int MR = 6, NV = 2, NR = W * NV;
  static constexpr int KC = 256, MC = 20 * MR, NC = 2048;
};

// Packs A rows [i0, i0+mc) × cols [k0, k0+kc) into MR-row panels laid out [panel][k][MR],
// zero-filling the rows past mc so the kernel always runs a full tile.
template <typename T, int MR>
void pack_a(T* dst, const View<T>& A, int64_t i0, int mc, int64_t k0, int kc) {
  for (int ip = 0; ip < mc; ip += MR) {
    const int rows = std::min(MR, mc - ip);
    T* d = dst + static_cast<int64_t>(ip) * kc;
    if (A.cs == 1) {
      for (int r = 0; r < rows; ++r) {
        const T* s = A.p + (i0 + ip + r) * A.rs + k0;
        for (int k = 0; k < kc; ++k) d[k * MR + r] = s[k];
      }
    } else {
      for (int k = 0; k < kc; ++k) {
        const T* s = A.p + (i0 + ip) * A.rs + (k0 + k) * A.cs;
        for (int r = 0; r < rows; ++r) d[k * MR + r] = s[r * A.rs];
      }
    }
    if (rows < MR)
      for (int k = 0; k < kc; ++k)
        for (int r = rows; r < MR; ++r) d[k * MR + r] = T(0);
  }
}

// Packs B rows [k0, k0+kc) × cols [j0, j0+nc) into NR-column panels laid out [panel][k][NR],
// zero-filling the columns past nc.
template <typename T, int NR>
void pack_b(T* dst, const View<T>& B, int64_t k0, int kc, int64_t j0, int nc) {
  for (int jp = 0; jp < nc; jp += NR) {
    const int cols = std::min(NR, nc - jp);
    T* d = dst + static_cast<int64_t>(jp) * kc;
    if (B.cs == 1) {
      for (int k = 0; k < kc; ++k) {
        const T* s = B.p + (k0 + k) * B.rs + j0 + jp;
        std::memcpy(d + k * NR, s, sizeof(T) * cols);
        for (int j = cols; j < NR; ++j) d[k * NR + j] = T(0);
      }
    } else {
      // Transposing: read NR source rows side by side so every written line is filled at once.
      const T* s = B.p + k0 * B.rs + (j0 + jp) * B.cs;
      for (int k = 0; k < kc; ++k) {
        for (int j = 0; j < cols; ++j) d[k * NR + j] = s[k * B.rs + j * B.cs];
        for (int j = cols; j < NR; ++j) d[k * NR + j] = T(0);
      }
    }
  }
}

// c[MR×NR] (row stride ldc) += a_panel · b_panel over kc steps, k in order.
template <typename T, int W>
[[gnu::always_inline]] inline void micro_kernel(int kc, const T* __restrict a, const T* __restrict b, T* c,
                                                int64_t ldc) {
  using V = typename VecType<T, W>::type;
  constexpr int MR = Tile<T, W>::MR, NV = Tile<T, W>::NV, NR = Tile<T, W>::NR;
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&acc[r][v], c + r * ldc + v * W, sizeof(V));
  for (int k = 0; k < kc; ++k) {
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(&bv[v], b + k * NR + v * W, sizeof(V));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const T av = a[k * MR + r];  // broadcast by the vector-scalar product
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += av * bv[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) std::memcpy(c + r * ldc + v * W, &acc[r][v], sizeof(V));
}

// Per-thread packing buffers, reused across calls (the pool's workers are persistent).
template <typename T>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The C block rows [m0, m1) × cols [n0, n1), computed by the calling thread alone.
template <typename T, int W>
[[gnu::always_inline]] inline void gemm_block_impl(const Gemm<T>& g, int64_t m0, int64_t m1, int64_t n0,
                                                   int64_t n1) {
  using Tl = Tile<T, W>;
  constexpr int MR = Tl::MR, NR = Tl::NR, KC = Tl::KC, MC = Tl::MC, NC = Tl::NC;
  T* bpack = scratch<T>(static_cast<size_t>(KC) * NC + static_cast<size_t>(KC) * MC);
  T* apack = bpack + static_cast<size_t>(KC) * NC;
  T edge[MR * NR];
  for (int64_t jc = n0; jc < n1; jc += NC) {
    const int nc = static_cast<int>(std::min<int64_t>(NC, n1 - jc));
    for (int64_t pc = 0; pc < g.K; pc += KC) {
      const int kc = static_cast<int>(std::min<int64_t>(KC, g.K - pc));
      pack_b<T, NR>(bpack, g.B, pc, kc, jc, nc);
      for (int64_t ic = m0; ic < m1; ic += MC) {
        const int mc = static_cast<int>(std::min<int64_t>(MC, m1 - ic));
        pack_a<T, MR>(apack, g.A, ic, mc, pc, kc);
        for (int jr = 0; jr < nc; jr += NR) {
          const int nr = std::min(NR, nc - jr);
          const T* bp = bpack + static_cast<int64_t>(jr) * kc;
          for (int ir = 0; ir < mc; ir += MR) {
            const int mr = std::min(MR, mc - ir);
            const T* ap = apack + static_cast<int64_t>(ir) * kc;
            T* c = g.C + (ic + ir) * g.ldc + jc + jr;
            if (mr == MR && nr == NR) {
              micro_kernel<T, W>(kc, ap, bp, c, g.ldc);
            } else {
              // Edge tile: run the full tile on a copy, write back only the valid part.
              for (int r = 0; r < MR; ++r)
                for (int j = 0; j < NR; ++j) edge[r * NR + j] = (r < mr && j < nr) ? c[r * g.ldc + j] : T(0);
              micro_kernel<T, W>(kc, ap, bp, edge, NR);
              for (int r = 0; r < mr; ++r)
                for (int j = 0; j < nr; ++j) c[r * g.ldc + j] = edge[r * NR + j];
            }
          }
        }
      }
    }
  }
}

template <typename T>
void gemm_block_portable(const Gemm<T>& g, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  gemm_block_impl<T, 16 / sizeof(T)>(g, m0, m1, n0, n1);
}

#ifdef ESPLAG_GEMM_X86_DISPATCH
template <typename T>
__attribute__((target("avx2,fma"))) void gemm_block_avx2(const Gemm<T>& g, int64_t m0, int64_t m1, int64_t n0,
                                                          int64_t n1) {
  gemm_block_impl<T, 32 / sizeof(T)>(g, m0, m1, n0, n1);
}
#endif

// Runs C += A·B, with `init(m0, m1, n0, n1)` called first on each thread's own block.
// The output is split between threads along rows or columns, whichever makes the
// operand every thread must pack in full (B for a row split, A for a column split) the
// smaller one, as long as that dimension gives every thread some tiles.
template <typename T, typename Init>
void gemm(const Gemm<T>& g, const Init& init) {
  if (g.M <= 0 || g.N <= 0) return;
  const bool wide = use_wide_kernel();
  auto block = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    init(m0, m1, n0, n1);
#ifdef ESPLAG_GEMM_X86_DISPATCH
    if (wide) return gemm_block_avx2<T>(g, m0, m1, n0, n1);
#endif
    gemm_block_portable<T>(g, m0, m1, n0, n1);
  };
  const int threads = num_threads();
  const double flops = 2.0 * static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K);
  if (threads == 1 || flops < 2e6) {
    block(0, g.M, 0, g.N);
    return;
  }
  // Split units: MR rows or 16 columns (a multiple of every kernel's NR), so that only
  // the last thread's block has edge tiles.
  constexpr int64_t kRowUnit = 6, kColUnit = 16;
  const int64_t row_units = (g.M + kRowUnit - 1) / kRowUnit, col_units = (g.N + kColUnit - 1) / kColUnit;
  const bool rows_ok = row_units >= 2 * threads, cols_ok = col_units >= 2 * threads;
  const bool split_rows = rows_ok && (!cols_ok || g.N <= g.M);
  if (split_rows) {
    parallel_for(row_units, [&](int64_t u0, int64_t u1) {
      block(u0 * kRowUnit, std::min(g.M, u1 * kRowUnit), 0, g.N);
    });
  } else {
    parallel_for(col_units, [&](int64_t u0, int64_t u1) {
      block(0, g.M, u0 * kColUnit, std::min(g.N, u1 * kColUnit));
    });
  }
}

}  // namespace

namespace detail {
bool gemm_force_portable(bool on) { return g_force_portable.exchange(on); }
const char* gemm_kernel_name() { return use_wide_kernel() ? "avx2+fma" : "portable"; }
}  // namespace detail

template <typename T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int N, int C, int OC) {
  ESPLAG_CHECK(N >= 0 && C >= 0 && OC >= 0, "linear_forward: negative size (N=", N, ", C=", C, ", OC=", OC, ")");
  // out[n, o] = bias[o] + Σ_c inp[n, c] · W[o, c]:  A = inp (N×C), B = Wᵀ (C×OC).
  const Gemm<T> g{N, OC, C, {inp, C, 1}, {weight, 1, C}, out, OC};
  gemm(g, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t i = m0; i < m1; ++i) {
      T* row = out + i * OC;
      if (bias)
        std::copy(bias + n0, bias + n1, row + n0);
      else
        std::fill(row + n0, row + n1, T(0));
    }
  });
}

template <typename T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int N, int C,
                     int OC) {
  ESPLAG_CHECK(N >= 0 && C >= 0 && OC >= 0, "linear_backward: negative size (N=", N, ", C=", C, ", OC=", OC,
               ")");
  auto no_init = [](int64_t, int64_t, int64_t, int64_t) {};
  if (dinp) {
    // dinp[n, c] += Σ_o dout[n, o] · W[o, c]:  A = dout (N×OC), B = W (OC×C).
    gemm(Gemm<T>{N, C, OC, {dout, OC, 1}, {weight, C, 1}, dinp, C}, no_init);
  }
  if (dweight) {
    // dW[o, c] += Σ_n dout[n, o] · inp[n, c]:  A = doutᵀ (OC×N), B = inp (N×C).
    gemm(Gemm<T>{OC, C, N, {dout, 1, OC}, {inp, C, 1}, dweight, C}, no_init);
  }
  if (dbias) {
    // Each thread owns a range of outputs and sums over n in order.
    parallel_for(
        OC,
        [&](int64_t o0, int64_t o1) {
          for (int64_t n = 0; n < N; ++n) {
            const T* d = dout + n * OC;
            for (int64_t o = o0; o < o1; ++o) dbias[o] += d[o];
          }
        },
        256);
  }
}

template void linear_forward<float>(float*, const float*, const float*, const float*, int, int, int);
template void linear_forward<double>(double*, const double*, const double*, const double*, int, int, int);
template void linear_backward<float>(float*, float*, float*, const float*, const float*, const float*, int, int,
                                     int);
template void linear_backward<double>(double*, double*, double*, const double*, const double*, const double*, int,
                                      int, int);

}  // namespace esplag::cpu
