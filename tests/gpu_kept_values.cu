// The kept values of a row-wise 2:4 mask on the GPU (sparse/cuda/kept_values.h) against
// the CPU's compressed 2:4 (sparse/compressed.h: compress_24 of the pruned weight, whose
// values are the kept ones in ascending column order), bit for bit.
//
// Fresh seeded random inputs (no zeros, so the compressed slots are exactly the mask's),
// outputs poisoned with NaN (all bytes 0xFF) first, shapes from the smallest legal one to
// non-square ones with an odd number of tiles.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "sparse/compressed.h"
#include "sparse/cuda/kept_values.h"
#include "sparse/masks.h"

#include "gpu_test_util.h"

namespace {

using esplag::gpu::bf16;
namespace cpu = esplag::cpu;
namespace gpu = esplag::gpu;
using esplag::gpu_test::DeviceBuffers;
using esplag::gpu_test::has_device;
using esplag::gpu_test::random_f32;
using esplag::gpu_test::VF;

#define REQUIRE_DEVICE() \
  if (!has_device()) GTEST_SKIP() << "no CUDA device"

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0;
}

TEST(GpuKeptValues, GatherAndScatterMatchTheCompressedForm) {
  REQUIRE_DEVICE();
  DeviceBuffers dev(size_t(64) << 20, "kept values test");
  const cudaStream_t st = dev.stream();
  const int64_t shapes[][2] = {{4, 4}, {8, 12}, {12, 36}, {64, 128}, {36, 260}};
  uint64_t seed = 1;
  for (const auto& [rows, cols] : shapes) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(cols));
    const size_t n = size_t(rows * cols), k = n / 2;
    VF w = random_f32(n, seed++);
    const cpu::Mask mask = cpu::nm_mask(w.data(), rows, cols, 2, 4);
    VF w1 = w;
    cpu::apply_mask(w1.data(), mask.data(), int64_t(n));
    const esplag::Compressed24 ref = cpu::compress_24(w1.data(), rows, cols);
    const uint16_t* tiles = dev.put(cpu::tile_bits(mask, rows, cols));

    // fp32: gather, gather onto earlier values, scatter.
    const float* dw = dev.put(w);
    float* values = dev.poisoned<float>(k);
    gpu::gather_kept_24(values, dw, tiles, rows, cols, false, st);
    EXPECT_TRUE(same_bits(dev.get(values, k), ref.values)) << "fp32 gather";
    float* odd = dev.poisoned<float>(k + 1) + 1;  // not 8-byte aligned: the scalar kernel
    gpu::gather_kept_24(odd, dw, tiles, rows, cols, false, st);
    EXPECT_TRUE(same_bits(dev.get(odd, k), ref.values)) << "fp32 gather, unaligned values";
    const VF before = random_f32(k, seed++);
    float* accumulated = dev.put(before);
    gpu::gather_kept_24(accumulated, dw, tiles, rows, cols, true, st);
    VF sum(k);
    for (size_t i = 0; i < k; ++i) sum[i] = before[i] + ref.values[i];
    EXPECT_TRUE(same_bits(dev.get(accumulated, k), sum)) << "fp32 gather with accumulate";
    float* dense = dev.poisoned<float>(n);
    gpu::scatter_kept_24(dense, dev.put(ref.values), tiles, rows, cols, st);
    EXPECT_TRUE(same_bits(dev.get(dense, n), w1)) << "fp32 scatter";

    // bf16: the same on the rounded values.
    std::vector<uint16_t> wb(n), w1b(n), vb(k);
    for (size_t i = 0; i < n; ++i) wb[i] = esplag::float_to_bf16(w[i]);
    for (size_t i = 0; i < n; ++i) w1b[i] = mask[i] ? wb[i] : 0;
    for (size_t i = 0; i < k; ++i) vb[i] = esplag::float_to_bf16(ref.values[i]);
    bf16* vbd = dev.poisoned<bf16>(k);
    gpu::gather_kept_24(vbd, reinterpret_cast<const bf16*>(dev.put(wb)), tiles, rows, cols, false, st);
    EXPECT_TRUE(same_bits(dev.get(reinterpret_cast<const uint16_t*>(vbd), k), vb)) << "bf16 gather";
    bf16* db = dev.poisoned<bf16>(n);
    gpu::scatter_kept_24(db, reinterpret_cast<const bf16*>(dev.put(vb)), tiles, rows, cols, st);
    EXPECT_TRUE(same_bits(dev.get(reinterpret_cast<const uint16_t*>(db), n), w1b)) << "bf16 scatter";
  }
}

TEST(GpuKeptValues, RefusesShapesThatAreNotMultiplesOf4) {
  REQUIRE_DEVICE();
  DeviceBuffers dev(size_t(1) << 20, "kept values test");
  float* a = dev.poisoned<float>(64);
  const uint16_t* tiles = dev.put(std::vector<uint16_t>(4, 0x3333));
  try {
    gpu::gather_kept_24(a, a + 32, tiles, 4, 6, false, dev.stream());
    FAIL() << "a 4x6 matrix was accepted";
  } catch (const esplag::Error& e) {
    EXPECT_NE(std::string(e.what()).find("gather_kept_24: shape 4x6 is not a positive multiple of 4"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
