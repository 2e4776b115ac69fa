// Distillation on the GPU: the fused loss kernel (gpu::distill_cross_entropy) against the
// CPU's (ops/distill.h), and a student GpuTransformer taught by a forward-only teacher
// against the CPU student and teacher (model/transformer.h's DistillTarget).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "gpu_test_util.h"
#include "model/gpu_transformer.h"
#include "model/transformer.h"
#include "ops/distill.h"
#include "ops/gpu.h"

namespace {

using namespace esplag;
using namespace esplag::gpu_test;

#define REQUIRE_DEVICE() ASSERT_TRUE(has_device()) << "no CUDA device visible to the gpu tests"

// The columns [0, V) of rows of stride Vp.
template <typename T>
std::vector<T> unpadded(const std::vector<T>& a, int64_t N, int V, int Vp) {
  std::vector<T> out(size_t(N) * V);
  for (int64_t r = 0; r < N; ++r)
    for (int c = 0; c < V; ++c) out[r * V + c] = a[r * Vp + c];
  return out;
}

void run_distill_loss(int64_t N, int V, int Vp, double alpha, double temperature, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " V=" + std::to_string(V) + " Vp=" + std::to_string(Vp) +
               " alpha=" + std::to_string(alpha) + " T=" + std::to_string(temperature));
  DeviceBuffers dev(size_t(64) << 20);
  Rng rng(seed);
  std::vector<int32_t> tgt(N);
  for (auto& t : tgt) t = static_cast<int32_t>(rng.below(V));
  // The padding holds large values that must be ignored, in both models' rows.
  const Data x = random_bf16(size_t(N) * Vp, seed + 1, 3.0), t = random_bf16(size_t(N) * Vp, seed + 2, 2.0);
  Bits xb = x.bits, tb = t.bits;
  for (int64_t r = 0; r < N; ++r)
    for (int c = V; c < Vp; ++c) xb[r * Vp + c] = tb[r * Vp + c] = float_to_bf16(1e4f);
  const float dloss = 1.0f / static_cast<float>(N);
  bf16* dx = dev.put_bf16(xb, "logits");
  bf16* dt = dev.put_bf16(tb, "teacher");
  float* losses = dev.poisoned<float>(3 * N, "losses");
  gpu::distill_cross_entropy(losses, losses + N, losses + 2 * N, dx, dt, dev.put(tgt), N, V, Vp, alpha, temperature,
                             dloss, true, dev.stream());
  const VF got = dev.get(losses, 3 * N), got_d = dev.get_bf16(dx, size_t(N) * Vp);
  EXPECT_EQ(dev.get_bits(dt, tb.size()), tb) << "the teacher's logits were written";

  const VD xd = unpadded(x.d, N, V, Vp), td = unpadded(t.d, N, V, Vp);
  VD ce(N), kl(N), d(size_t(N) * V);
  cpu::distill_cross_entropy(ce.data(), kl.data(), d.data(), xd.data(), td.data(), tgt.data(), N, V, alpha,
                             temperature, double(dloss));
  VD loss(N);
  for (int64_t n = 0; n < N; ++n) loss[n] = (1 - alpha) * ce[n] + alpha * temperature * temperature * kl[n];
  const VF got_ce(got.begin() + N, got.begin() + 2 * N), got_kl(got.begin() + 2 * N, got.end());
  expect_close_to(VF(got.begin(), got.begin() + N), loss, 1e-4, 1e-5, "losses");
  expect_close_to(got_ce, ce, 1e-4, 1e-5, "ce");
  expect_close_to(got_kl, kl, 1e-4, 1e-5, "kl");
  for (int64_t r = 0; r < N; ++r)
    for (int c = V; c < Vp; ++c) ASSERT_EQ(got_d[r * Vp + c], 0.f) << "padding column " << c << " of row " << r;
  // bf16 outputs: within a bf16 rounding of each value, plus a small share of the largest.
  expect_close_to(unpadded(got_d, N, V, Vp), d, 1.0 / 128, 1e-3, "dlogits");

  // Loss only: the same losses, the logits untouched.
  bf16* dx2 = dev.put_bf16(xb, "logits2");
  float* losses2 = dev.poisoned<float>(3 * N, "losses2");
  gpu::distill_cross_entropy(losses2, losses2 + N, losses2 + 2 * N, dx2, dt, dev.put(tgt), N, V, Vp, alpha,
                             temperature, dloss, false, dev.stream());
  const VF got2 = dev.get(losses2, 3 * N);
  EXPECT_EQ(std::memcmp(got.data(), got2.data(), got.size() * sizeof(float)), 0) << "losses without the gradient";
  EXPECT_EQ(dev.get_bits(dx2, xb.size()), xb) << "the logits were written without write_dlogits";
}

TEST(GpuDistill, LossMatchesTheCpu) {
  REQUIRE_DEVICE();
  run_distill_loss(37, 1031, 1040, 0.5, 2.0, 11);
  run_distill_loss(5, 3, 3, 0.7, 0.5, 12);
  run_distill_loss(3, 32000, 32000, 0.9, 1.0, 13);  // a LLaMA vocabulary
  run_distill_loss(9, 384, 384, 0.0, 2.0, 14);      // alpha 0: the cross-entropy alone
  run_distill_loss(9, 384, 384, 1.0, 3.0, 15);      // alpha 1: the KL alone
}

TEST(GpuDistill, AlphaZeroGivesTheCrossEntropyKernelsGradient) {
  REQUIRE_DEVICE();
  DeviceBuffers dev(size_t(16) << 20);
  const int64_t N = 17;
  const int V = 500;
  std::vector<int32_t> tgt(N);
  random_tokens(tgt, V, 21);
  const Data x = random_bf16(size_t(N) * V, 22, 3.0), t = random_bf16(size_t(N) * V, 23);
  bf16* a = dev.put_bf16(x.bits, "a");
  bf16* b = dev.put_bf16(x.bits, "b");
  float* la = dev.poisoned<float>(3 * N, "la");
  float* lb = dev.poisoned<float>(N, "lb");
  const int32_t* dt = dev.put(tgt);
  gpu::distill_cross_entropy(la, la + N, la + 2 * N, a, dev.put_bf16(t.bits, "t"), dt, N, V, V, 0.0, 2.0, 0.25f,
                             true, dev.stream());
  gpu::softmax_cross_entropy(lb, b, dt, N, V, V, 0.25f, true, dev.stream());
  const VF ga = dev.get_bf16(a, x.bits.size()), gb = dev.get_bf16(b, x.bits.size());
  EXPECT_LT(rel_l2(ga.data(), gb.data(), ga.size()), 1e-2);
  const VF ca = dev.get(la + N, N), cb = dev.get(lb, N);
  EXPECT_LT(rel_l2(ca.data(), cb.data(), size_t(N)), 1e-5);
}

TEST(GpuDistill, BadTargetGivesNaNAndBadSettingsThrow) {
  REQUIRE_DEVICE();
  DeviceBuffers dev(size_t(1) << 20);
  const int N = 2, V = 16;
  const Data x = random_bf16(N * V, 31), t = random_bf16(N * V, 32);
  float* losses = dev.poisoned<float>(3 * N);
  bf16* dx = dev.put_bf16(x.bits, "x");
  bf16* dt = dev.put_bf16(t.bits, "t");
  const int32_t* tgt = dev.put(std::vector<int32_t>{4, 16});
  gpu::distill_cross_entropy(losses, losses + N, losses + 2 * N, dx, dt, tgt, N, V, V, 0.5, 2.0, 1.f, true,
                             dev.stream());
  const VF l = dev.get(losses, 3 * N);
  EXPECT_TRUE(std::isfinite(l[0]) && std::isfinite(l[N]) && std::isfinite(l[2 * N]));
  EXPECT_TRUE(std::isnan(l[1]) && std::isnan(l[N + 1]));
  EXPECT_THROW(gpu::distill_cross_entropy(losses, losses + N, losses + 2 * N, dx, dt, tgt, N, V, V, 1.5, 2.0, 1.f,
                                          true, dev.stream()),
               Error);
  EXPECT_THROW(gpu::distill_cross_entropy(losses, losses + N, losses + 2 * N, dx, dt, tgt, N, V, V, 0.5, 0.0, 1.f,
                                          true, dev.stream()),
               Error);
}

// ---------------------------------------------------------------------------------------
// A student taught by a forward-only teacher

// The student: the sparse tests' LLaMA; the teacher: wider and deeper, same vocabulary.
ModelConfig teacher_config() {
  ModelConfig c = sparse_llama_config();
  c.n_layer = 3;
  c.d_model = 192;
  c.n_head = 6;
  c.n_kv_head = 3;
  c.d_ff = 512;
  return c;
}

GpuModelOptions teacher_options(GpuTransformer& student) {
  GpuModelOptions o;
  o.forward_only = true;
  o.stream = student.stream();
  o.head_chunk_rows = student.head_chunk_rows();
  return o;
}

TEST(GpuDistill, StudentMatchesTheCpu) {
  REQUIRE_DEVICE();
  const ModelConfig sc = sparse_llama_config(), tc = teacher_config();
  const int B = 2, T = 96;  // 192 rows in three head chunks of 64
  Transformer<float> cpu_student(sc), cpu_teacher(tc);
  cpu_student.init_weights(7);
  cpu_teacher.init_weights(8);
  GpuModelOptions so;
  so.head_chunk_rows = 64;
  GpuTransformer student(sc, B, T, so);
  GpuTransformer teacher(tc, B, T, teacher_options(student));
  ASSERT_EQ(teacher.head_chunk_rows(), 64);
  student.set_params(cpu_student.params(), cpu_student.num_params());
  teacher.set_params(cpu_teacher.params(), cpu_teacher.num_params());

  std::vector<int32_t> x(size_t(B) * T), y(x.size());
  random_tokens(x, sc.vocab_size, 41);
  random_tokens(y, sc.vocab_size, 42);
  const double alpha = 0.6, temperature = 2.0, scale = 0.5;
  cpu_teacher.forward_hidden(x.data(), B, T);
  const DistillTarget<float> target{alpha, temperature,
                                    [&](int r0, int rows, float* out) { cpu_teacher.head_logits(r0, rows, out); }};
  cpu_student.zero_grad();
  const LossParts ref = cpu_student.forward_backward(x.data(), y.data(), B, T, scale, target);

  const GpuTransformer::Distillation d{&teacher, alpha, temperature};
  // Eager, then captured, then replayed: the same bits each time.
  std::vector<float> first;
  double parts[3] = {0, 0, 0};
  for (int run = 0; run < 3; ++run) {
    student.zero_grad();
    student.upload_batch(x.data(), y.data(), B, T);
    student.forward_backward_device(student.device_tokens(), student.device_targets(), B, T, scale, &d);
    student.synchronize();
    double got[3];
    CUDA_CHECK(cudaMemcpy(got, student.device_loss(), sizeof got, cudaMemcpyDeviceToHost));
    const std::vector<float> g = student.grads_to_host();
    if (run == 0) {
      std::memcpy(parts, got, sizeof got);
      first = g;
      continue;
    }
    EXPECT_EQ(std::memcmp(got, parts, sizeof got), 0) << "run " << run << ": the loss parts changed";
    EXPECT_EQ(std::memcmp(g.data(), first.data(), g.size() * sizeof(float)), 0) << "run " << run;
  }
  std::printf("loss cpu %.6f (ce %.6f kl %.6f) gpu %.6f (ce %.6f kl %.6f)\n", ref.loss, ref.ce, ref.kl, parts[0],
              parts[1], parts[2]);
  EXPECT_NEAR(parts[0], ref.loss, 1e-2 * ref.loss);
  EXPECT_NEAR(parts[1], ref.ce, 1e-2 * ref.ce);
  EXPECT_NEAR(parts[2], ref.kl, 3e-2 * ref.kl);
  EXPECT_NEAR(parts[0], (1 - alpha) * parts[1] + alpha * temperature * temperature * parts[2], 1e-5 * parts[0]);
  for (const auto& info : cpu_student.param_infos())
    EXPECT_LT(rel_l2(first.data() + info.offset, cpu_student.grads() + info.offset, info.numel), 3e-2)
        << "gradient of " << info.name;

  // Without the teacher the next step is the plain one (another graph), as a model
  // that never distilled computes it.
  GpuTransformer plain(sc, B, T, so);
  plain.set_params(cpu_student.params(), cpu_student.num_params());
  student.zero_grad();
  plain.zero_grad();
  EXPECT_EQ(student.forward_backward(x.data(), y.data(), B, T, scale),
            plain.forward_backward(x.data(), y.data(), B, T, scale));
}

TEST(GpuDistill, ForwardOnlyModelsTeachAndDoNothingElse) {
  REQUIRE_DEVICE();
  const ModelConfig sc = sparse_llama_config(), tc = teacher_config();
  const int B = 2, T = 64;
  GpuTransformer student(sc, B, T);
  GpuModelOptions o = teacher_options(student);
  const GpuMemoryPlan train = GpuTransformer::memory_plan(tc, B, T), teach = GpuTransformer::memory_plan(tc, B, T, o);
  EXPECT_EQ(teach.grads, 0u);
  EXPECT_LT(teach.optimizer, train.optimizer / 100);  // the AdamW step's hyper-parameters only
  EXPECT_LT(teach.activations, train.activations / 2);
  EXPECT_EQ(teach.params, train.params);
  GpuTransformer teacher(tc, B, T, o);
  std::vector<int32_t> x(size_t(B) * T);
  random_tokens(x, tc.vocab_size, 51);
  const auto refuses = [](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << " did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("runs forward only"), std::string::npos) << e.what();
    }
  };
  refuses([&] { teacher.forward_backward(x.data(), x.data(), B, T, 1.0); }, "forward_backward");
  refuses([&] { teacher.step_adamw({}); }, "step_adamw");
  refuses([&] { teacher.zero_grad(); }, "zero_grad");
  refuses([&] { teacher.set_linear_kind("blocks.0.mlp.fc.weight", "masked"); }, "set_linear_kind");
  std::vector<float> m, v;
  refuses([&] { teacher.optimizer_state_to_host(m, v); }, "optimizer_state_to_host");
  // Its loss is still there (an evaluation).
  EXPECT_TRUE(std::isfinite(teacher.forward_loss(x.data(), x.data(), B, T)));

  // Teachers the student cannot use.
  const auto bad = [&](GpuTransformer& t, const char* needle) {
    const GpuTransformer::Distillation d{&t, 0.5, 2.0};
    student.upload_batch(x.data(), x.data(), B, T);
    try {
      student.forward_backward_device(student.device_tokens(), student.device_targets(), B, T, 1.0, &d);
      ADD_FAILURE() << needle << ": no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GpuTransformer trains(tc, B, T);
  bad(trains, "must be a forward_only model");
  o.stream = nullptr;
  GpuTransformer own_stream(tc, B, T, o);
  bad(own_stream, "must run on its student's stream");
  o = teacher_options(student);
  GpuTransformer shorter(tc, B, T / 2, o);
  bad(shorter, "was sized for 2 x 32");
}

}  // namespace
