// ZeRO stage 3 inside one process (GpuModelOptions::shard_parameters over a world of one
// rank, whose collectives are copies): the per-step preparation that the update leaves to
// the next forward (Impl::prepare_in_forward) must happen whichever forward comes next, an
// evaluation or a training step, and whether that step's graph is captured or replayed.
// The two-GPU runs are tests/gpu_cli_data_parallel.cpp's.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "core/device_collectives.h"
#include "gpu_test_util.h"
#include "model/gpu_transformer.h"
#include "model/transformer.h"

namespace {

using esplag::GpuModelOptions;
using esplag::GpuTransformer;
using esplag::ModelConfig;
using esplag::Transformer;

// A world of one rank: every collective leaves its data as it is (or copies it across).
class OneRank final : public esplag::DeviceCollectives {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void reduce_scatter_mean(const float* in, float* out, size_t chunk, cudaStream_t s) override {
    copy(out, in, sizeof(float) * chunk, s);
  }
  void all_gather(const void* in, void* out, size_t chunk_bytes, cudaStream_t s) override {
    copy(out, in, chunk_bytes, s);
  }
  void all_reduce_sum(float*, size_t, cudaStream_t) override {}
  void all_reduce_sum_int(int32_t*, size_t, cudaStream_t) override {}
  void all_reduce_mean(float*, size_t, cudaStream_t) override {}
  void all_reduce_max(float*, size_t, cudaStream_t) override {}

 private:
  static void copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
    if (dst != src && bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  }
};

// Four blocks in four gradient buckets (more than the ring's two slots), the MLP's layers
// semi_sparse (pruned from the gathered weights in every step's preparation).
struct Stage3Model {
  OneRank ranks;
  GpuTransformer gm;
  Stage3Model(const ModelConfig& cfg, const Transformer<float>& cm)
      : gm(cfg, 2, 64, [&] {
          GpuModelOptions o;
          o.shard_optimizer = &ranks;
          o.reduce_gradients = &ranks;
          o.shard_gradients = true;
          o.shard_parameters = true;
          o.bucket_bytes = 1;  // a bucket per block
          o.sparse_dispatch = false;
          return o;
        }()) {
    for (const std::string& name : cm.linear_names())
      if (name.find(".mlp.") != std::string::npos) gm.set_linear_kind(name, "semi_sparse");
    gm.set_params(cm.params(), cm.num_params());
  }
};

TEST(GpuZeroStageThree, AnEvaluationBetweenStepsChangesNoBits) {
  if (!esplag::gpu_test::has_device()) GTEST_SKIP() << "no CUDA device";
  ModelConfig cfg = esplag::gpu_test::sparse_llama_config();
  cfg.n_layer = 4;
  Transformer<float> cm(cfg);
  cm.init_weights(7);
  for (size_t i = 0; i < cm.num_params(); ++i) cm.params()[i] = esplag::gpu_test::round_bf16(cm.params()[i]);
  std::vector<int32_t> x(2 * 64), y(2 * 64);
  esplag::gpu_test::random_tokens(x, cfg.vocab_size, 31);
  esplag::gpu_test::random_tokens(y, cfg.vocab_size, 32);

  // `evaluated` evaluates after its first step: that forward prepares the layers for the
  // second step, whose graph is then captured without a preparation; the third step's
  // forward must still prepare. `plain` never evaluates.
  Stage3Model evaluated(cfg, cm), plain(cfg, cm);
  for (int step = 1; step <= 5; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    double loss[2];
    int k = 0;
    for (Stage3Model* m : {&evaluated, &plain}) {
      m->gm.zero_grad();
      loss[k++] = m->gm.forward_backward(x.data(), y.data(), 2, 64, 1.0);
      m->gm.step_adamw(esplag::GpuAdamW{});
    }
    EXPECT_EQ(loss[0], loss[1]) << "the training losses";
    if (step == 1 || step == 4) evaluated.gm.forward_loss(x.data(), y.data(), 2, 64);
  }
  const std::vector<float> a = evaluated.gm.params_to_host(), b = plain.gm.params_to_host();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), sizeof(float) * a.size()), 0) << "the weights after five steps";
}

}  // namespace
