// A sparsity method added from this file alone (docs/architecture.md, "Adding a sparsity
// method"): kind "token_halves", dense with each product run as two, one per half of the
// micro-batch's tokens. Its CPU class, its GPU class, one registry entry and one GPU kind
// table entry; the trainer then runs it through a recipe (its own modifier) on the CPU and
// on the GPU, and the two curves agree (each is dense's, up to the GPU's bf16).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/prepare.h"
#include "model/cuda/step_marks.h"
#include "model/device_linear.h"
#include "model/linear_registry.h"
#include "ops/matmul.h"
#include "train/gpu_step.h"
#include "train/trainer.h"

using namespace esplag;
namespace fs = std::filesystem;

namespace {

// The rows [first, first + count) of the micro-batch (its tokens) as one product.
int half_rows(int N, int part, int* first) {
  *first = part == 0 ? 0 : N / 2;
  return part == 0 ? N / 2 : N - N / 2;
}

template <typename T>
class TokenHalvesLinear final : public Linear<T> {
 public:
  using Linear<T>::Linear;
  void forward(T* out, const T* inp, int N) override {
    const auto& p = this->params();
    for (int part = 0; part < 2; ++part) {
      int first = 0;
      const int rows = half_rows(N, part, &first);
      cpu::linear_forward(out + size_t(first) * p.out_features, inp + size_t(first) * p.in_features, p.weight, p.bias,
                          rows, p.in_features, p.out_features);
    }
  }
  void backward(T* dinp, const T* dout, const T* inp, int N) override { this->dense_backward(dinp, dout, inp, N); }
  std::string kind() const override { return "token_halves"; }
};

class DeviceTokenHalvesLinear final : public DeviceLinear {
 public:
  explicit DeviceTokenHalvesLinear(const DeviceLinearSetup& s) : DeviceLinear("token_halves", s) {}
  void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) override {
    const int K = int(in_), OC = int(out_);
    ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
    for (int part = 0; part < 2; ++part) {
      int first = 0;
      const int rows = half_rows(N, part, &first);
      const size_t o = size_t(first) * size_t(OC);
      ctx_.gemm->forward(out + o, in + size_t(first) * size_t(K), p_.weight.w, p_.bias.w, rows, K, OC, ctx_.stream,
                         act, pre_act ? pre_act + o : nullptr);
    }
  }
  void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) override {
    const int K = int(in_), OC = int(out_);
    ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
    ctx_.gemm->backward_input(dinp, dout, p_.weight.w, N, K, OC, false, ctx_.stream, pre_act);
  }
  void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                   const char* op) override {
    const int K = int(in_), OC = int(out_);
    ctx_.marks->mark(ctx_.stream, op, 2.0 * N * K * OC);
    ctx_.gemm->backward_weight(p_.weight.grad, bias_grad ? p_.bias.grad : nullptr, dout, inp, N, K, OC, accumulate,
                               ctx_.stream);
  }
};

void register_token_halves() {
  if (lookup_linear_kind("token_halves")) return;
  LinearKindInfo k;
  k.name = "token_halves";
  k.description = "dense, each forward product in two halves of the micro-batch's tokens";
  k.recipe_modifier = true;
  k.gpu = true;
  k.set_make_cpu([]<typename T>(LinearBuild<T>& b) -> std::unique_ptr<Linear<T>> {
    return std::make_unique<TokenHalvesLinear<T>>(b.params);
  });
  register_linear_kind(std::move(k));
  DeviceLinearKind d;
  d.name = "token_halves";
  d.make = [](const DeviceLinearSetup& s) -> std::unique_ptr<DeviceLinear> {
    return std::make_unique<DeviceTokenHalvesLinear>(s);
  };
  register_device_linear_kind(std::move(d));
}

std::string make_dataset(const fs::path& dir) {
  std::string text;
  const char* words[] = {"light", "darkness", "waters", "earth", "heaven", "firmament", "evening", "morning"};
  for (int i = 0; i < 1000; ++i)
    text += std::string("And God said, Let there be ") + words[i % 8] + ": and there was " + words[(i * 3) % 8] +
            ".\n";
  std::ofstream(dir / "corpus.txt") << text;
  prepare_dataset((dir / "corpus.txt").string(), ByteTokenizer(), (dir / "data").string(), 0.1, 1 << 20);
  return (dir / "data").string();
}

struct RunLog {
  std::map<int64_t, double> loss;
  std::vector<std::string> log;
};

RunLog train(const fs::path& dir, const std::string& data, const std::string& device) {
  const TrainConfig cfg = parse_train_config(R"(
model: {preset: tiny, n_layer: 2, d_model: 64, n_head: 2, n_kv_head: 2, d_ff: 128, max_seq_len: 64}
train: {batch_size: 4, seq_len: 64, steps: 8, log_every: 1, eval_every: 0, checkpoint_every: 0}
optimizer: {lr: 3.0e-3}
recipe:
  - token_halves: {params: ['re:blocks\.\d+\.mlp\..*'], start: 2, until: 6}
)",
                                             "test", {"data.path=" + data, "train.device=" + device});
  RunLog r;
  Trainer(cfg, (dir / device).string(), [&](const std::string& l) { r.log.push_back(l); }).run();
  std::ifstream in(dir / device / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) r.loss[j["step"].get<int64_t>()] = j["loss"].get<double>();
  }
  return r;
}

}  // namespace

TEST(GpuKindPlugin, AKindOfThisFileTrainsThroughARecipeOnTheCpuAndTheGpu) {
  ASSERT_GT(cuda_device_count(), 0) << "no CUDA device visible to the gpu tests";
  register_token_halves();
  const fs::path dir = fs::temp_directory_path() / ("esplag_gpu_kind_plugin_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string data = make_dataset(dir);
  const RunLog cpu = train(dir, data, "cpu"), gpu = train(dir, data, "cuda");
  ASSERT_EQ(cpu.loss.size(), 8u);
  ASSERT_EQ(gpu.loss.size(), 8u);
  for (const auto& [step, loss] : cpu.loss)
    EXPECT_NEAR(gpu.loss.at(step), loss, 2e-2 * loss) << "step " << step << " (bf16 on the GPU)";
  for (const RunLog* r : {&cpu, &gpu}) {
    EXPECT_EQ(std::count_if(r->log.begin(), r->log.end(),
                            [](const std::string& l) { return l.find("-> token_halves") != std::string::npos; }),
              4)
        << "the 4 MLP layers become token_halves at step 2";
    EXPECT_EQ(std::count_if(r->log.begin(), r->log.end(),
                            [](const std::string& l) { return l.find("step 6: blocks.0.mlp.fc.weight -> dense") != std::string::npos; }),
              1);
  }
  fs::remove_all(dir);
}
