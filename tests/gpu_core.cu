// DeviceArena and the CUDA check macros, on a real device.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_arena.h"

namespace {

using esplag::DeviceArena;
using esplag::Error;

bool has_device() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// The gpu label runs only where a GPU is expected; a missing one is a failure, not a skip.
#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

TEST(GpuCore, ArenaAlignsNamesAndCountsAllocations) {
  REQUIRE_DEVICE();
  DeviceArena arena(1 << 20, "unit");
  EXPECT_EQ(arena.capacity(), size_t(1) << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.base()) % 256, 0u);
  void* a = arena.allocate("a", 10);
  void* b = arena.allocate("b", 3, 64);
  void* c = arena.allocate("c", 100);  // default 256 alignment
  EXPECT_EQ(a, arena.base());
  EXPECT_EQ(static_cast<char*>(b) - static_cast<char*>(a), 64);
  EXPECT_EQ(static_cast<char*>(c) - static_cast<char*>(a), 256);
  EXPECT_EQ(arena.used(), 356u);
  ASSERT_EQ(arena.allocations().size(), 3u);
  EXPECT_EQ(arena.allocations()[1].name, "b");
  EXPECT_EQ(arena.allocations()[1].offset, 64u);
  EXPECT_EQ(arena.allocations()[1].bytes, 3u);
  float* f = arena.allocate_array<float>("f", 7, 4);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f) % 4, 0u);
  EXPECT_EQ(static_cast<char*>(static_cast<void*>(f)) - static_cast<char*>(a), 356);
  EXPECT_NE(arena.report().find("'unit'"), std::string::npos);
}

TEST(GpuCore, ArenaMemoryIsUsableDeviceMemory) {
  REQUIRE_DEVICE();
  DeviceArena arena(1 << 16, "io");
  esplag::Tensor t = arena.tensor("x", {3, 5}, esplag::DType::f32);
  EXPECT_EQ(t.device(), esplag::Device::cuda);
  EXPECT_EQ(t.name(), "x");
  std::vector<float> h(15), back(15, 0.f);
  for (int i = 0; i < 15; ++i) h[i] = 0.5f * i - 3.f;
  CUDA_CHECK(cudaMemcpy(t.raw(), h.data(), 15 * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(back.data(), t.raw(), 15 * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(h, back);
  cudaPointerAttributes attr{};
  CUDA_CHECK(cudaPointerGetAttributes(&attr, t.raw()));
  EXPECT_EQ(attr.type, cudaMemoryTypeDevice);  // never managed memory
}

TEST(GpuCore, ArenaOutOfMemoryNamesTensorAndBytes) {
  REQUIRE_DEVICE();
  DeviceArena arena(4096, "small");
  arena.allocate("weights", 3000);
  try {
    arena.allocate("blocks.3.mlp.fc_out", 2000);
    FAIL() << "expected an out-of-memory error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("blocks.3.mlp.fc_out"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2000"), std::string::npos) << msg;  // requested
    EXPECT_NE(msg.find("1096 bytes"), std::string::npos) << msg;  // free: 4096 - 3000
    EXPECT_NE(msg.find("'weights'"), std::string::npos) << msg;
  }
  // The failed request changed nothing.
  EXPECT_EQ(arena.used(), 3000u);
  EXPECT_EQ(arena.allocations().size(), 1u);
}

TEST(GpuCore, ArenaReleaseToMarkAndPeak) {
  REQUIRE_DEVICE();
  DeviceArena arena(1 << 20, "stack");
  arena.allocate("params", 1000);
  const size_t m = arena.mark();
  void* s1 = arena.allocate("scratch1", 50000);
  arena.allocate("scratch2", 70000);
  const size_t peak = arena.peak();
  EXPECT_GE(peak, 121000u);
  arena.release_to(m);
  EXPECT_EQ(arena.used(), m);
  EXPECT_EQ(arena.allocations().size(), 1u);
  EXPECT_EQ(arena.peak(), peak);  // peak is kept
  EXPECT_EQ(arena.allocate("again", 10), s1);  // memory is reused
  EXPECT_THROW(arena.release_to(arena.used() + 1), Error);
  arena.reset();
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_TRUE(arena.allocations().empty());
  EXPECT_THROW(arena.allocate("bad", 8, 3), Error);  // alignment not a power of two
}

TEST(GpuCore, ArenaTooLargeForDeviceThrowsWithDeviceMemory) {
  REQUIRE_DEVICE();
  try {
    DeviceArena huge(size_t(1) << 50, "huge");
    FAIL() << "a 1 PiB arena cannot exist";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'huge'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("free of"), std::string::npos) << msg;
  }
  // The failure left no sticky error behind.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  DeviceArena ok(1 << 20, "after");
  EXPECT_NE(ok.base(), nullptr);
}

TEST(GpuCore, ArenaMoveTransfersOwnership) {
  REQUIRE_DEVICE();
  DeviceArena a(1 << 16, "a");
  a.allocate("x", 100);
  void* base = a.base();
  DeviceArena b(std::move(a));
  EXPECT_EQ(b.base(), base);
  EXPECT_EQ(b.used(), 100u);
  EXPECT_EQ(a.base(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  EXPECT_EQ(a.capacity(), 0u);
}

TEST(GpuCore, CudaCheckThrowsWithCallFileAndError) {
  REQUIRE_DEVICE();
  try {
    CUDA_CHECK(cudaSetDevice(-1));  // rejected on the host; leaves the context intact
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaSetDevice(-1)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorInvalidDevice"), std::string::npos) << msg;
    EXPECT_NE(msg.find("gpu_core.cu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaError"), std::string::npos) << msg;
  }
  cudaGetLastError();
}

TEST(GpuCore, CublasCheckThrowsWithStatusName) {
  REQUIRE_DEVICE();
  cublasLtMatmulDesc_t desc = nullptr;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const char wrong_size = 0;  // the attribute is an int32: a 1-byte buffer is rejected
  try {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &wrong_size, 1));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cublasLtMatmulDescSetAttribute"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CUBLAS_STATUS_"), std::string::npos) << msg;
  }
  cublasLtMatmulDescDestroy(desc);
}

}  // namespace
