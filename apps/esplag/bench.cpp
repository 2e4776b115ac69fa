// esplag bench: benchmarks of the engine (training steps; on the GPU also the GEMMs of a
// Linear, dense against 2:4 sparse), printed as a table and optionally appended to a CSV.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "args.h"
#include "commands.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "io/atomic_file.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#ifdef ESPLAG_HAVE_CUDA
#include "model/gpu_bench.h"
#include "sparse/cuda/gemm_bench.h"
#endif

namespace fs = std::filesystem;

namespace esplag::cli {

namespace {

const char* kBenchUsage = R"(usage:
  esplag bench train --model PRESET [--device cpu|cuda] [--batch 4] [--seq 256] [--steps N]
                     [--warmup 1] [--vocab N] [--peak-tflops 989] [--csv FILE]
  esplag bench gemm [--shapes default|OUTxINxTOKENS,...] [--products fwd,bwd] [--operand A|B]
                    [--no-search] [--tuning-cache FILE] [--warmup 10] [--iters 50] [--csv FILE]
      dense cuBLASLt vs 2:4 cuSPARSELt (default and searched algorithm) for the GEMMs of a
      Linear W [OUT, IN] over TOKENS rows: fwd Y = X.W^T, bwd dX = dY.W (CUDA build only;
      the CSV's commit column comes from $ESPLAG_COMMIT))";

// Appends rows to a CSV, writing the header first when the file is new (atomic rewrite).
void append_csv(const std::string& path, const std::string& header, const std::string& rows) {
  const bool fresh = !fs::exists(path);
  write_file_atomic(path, (fresh ? header : read_file(path)) + rows);
}

int bench_gemm(const std::vector<std::string>& argv) {
  Args a(argv, "bench gemm", {"shapes", "products", "operand", "tuning-cache", "warmup", "iters", "csv"},
         {"no-search"});
#ifdef ESPLAG_HAVE_CUDA
  GemmBenchOptions o;
  o.shapes = parse_gemm_bench_shapes(a.get("shapes", "default"));
  const std::string products = a.get("products", "fwd,bwd");
  ESPLAG_CHECK(products == "fwd" || products == "bwd" || products == "fwd,bwd" || products == "bwd,fwd",
               "bench gemm: --products must be fwd, bwd or fwd,bwd, got '", products, "'");
  o.forward = products.find("fwd") != std::string::npos;
  o.backward_data = products.find("bwd") != std::string::npos;
  const std::string operand = a.get("operand", "A");
  ESPLAG_CHECK(operand == "A" || operand == "B" || operand == "a" || operand == "b",
               "bench gemm: --operand must be A or B (the cuSPARSELt operand that holds W), got '", operand, "'");
  o.weight_operand = (operand == "A" || operand == "a") ? gpu::SparseOperand::a : gpu::SparseOperand::b;
  o.search = !a.has("no-search");
  o.warmup = static_cast<int>(a.integer("warmup", 10));
  o.iters = static_cast<int>(a.integer("iters", 50));
  ESPLAG_CHECK(o.warmup >= 0 && o.iters > 0, "bench gemm: --iters must be positive and --warmup not negative");
  if (a.has("tuning-cache")) gpu::set_cusparselt_tuning_path(a.get("tuning-cache"));
  const GemmBenchResult r = run_gemm_bench(o);
  std::cout << gemm_bench_table(r);
  if (r.cusparselt_version > 0) std::cout << "tuning cache: " << gpu::cusparselt_tuning_path() << "\n";
  if (a.has("csv")) {
    const char* commit = std::getenv("ESPLAG_COMMIT");
    append_csv(a.get("csv"), gemm_bench_csv_header(), gemm_bench_csv_rows(r, commit && *commit ? commit : "unknown"));
  }
  return 0;
#else
  (void)a;  // options are checked even where they cannot run
  fail("bench gemm: needs a build configured with the cuda preset (cuBLASLt and cuSPARSELt run on the GPU)");
#endif
}

}  // namespace

int cmd_bench(const std::vector<std::string>& argv) {
  ESPLAG_CHECK(!argv.empty() && (argv[0] == "train" || argv[0] == "gemm"), "esplag bench: ",
               argv.empty() ? "missing subcommand" : "unknown subcommand '" + argv[0] + "'", "\n", kBenchUsage);
  if (argv[0] == "gemm") return bench_gemm({argv.begin() + 1, argv.end()});
  Args a({argv.begin() + 1, argv.end()}, "bench train",
         {"model", "device", "batch", "seq", "steps", "warmup", "vocab", "peak-tflops", "csv"});
  const std::string device = a.get("device", "cpu");
  ESPLAG_CHECK(device == "cpu" || device == "cuda", "bench train: --device must be cpu or cuda, got '", device, "'");
  ModelConfig mc = model_preset(a.get("model", "tiny"));
  mc.vocab_size = static_cast<int>(a.integer("vocab", mc.vocab_size ? mc.vocab_size : 257));
  const int B = static_cast<int>(a.integer("batch", 4)), T = static_cast<int>(a.integer("seq", 256));
  const int steps = static_cast<int>(a.integer("steps", device == "cuda" ? 10 : 2));
  const int warmup = static_cast<int>(a.integer("warmup", device == "cuda" ? 3 : 1));
  ESPLAG_CHECK(steps > 0 && warmup >= 0, "bench train: --steps must be positive and --warmup not negative");
  if (device == "cuda") {
#ifdef ESPLAG_HAVE_CUDA
    const GpuBenchResult r = bench_train_gpu(mc, B, T, steps, warmup, a.number("peak-tflops", kH100DenseBf16Tflops));
    std::cout << gpu_bench_table_header() << gpu_bench_table_row(r);
    if (a.has("csv"))  // its own columns: a CUDA CSV is not the CPU one
      append_csv(a.get("csv"), gpu_bench_csv_header(), gpu_bench_csv_row(r));
    return 0;
#else
    fail("bench train: --device cuda needs a build configured with the cuda preset");
#endif
  }
  Transformer<float> model(mc);
  model.init_weights(1);
  std::vector<float> m(model.num_params()), v(model.num_params());
  Rng rng(1);
  std::vector<int32_t> x(size_t(B) * T), y(size_t(B) * T);
  for (auto& t : x) t = static_cast<int32_t>(rng.below(mc.vocab_size));
  for (auto& t : y) t = static_cast<int32_t>(rng.below(mc.vocab_size));
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    model.zero_grad();
    model.forward_backward(x.data(), y.data(), B, T, 1.0);
    for (const auto& info : model.param_infos())
      cpu::adamw_step(model.params() + info.offset, model.grads() + info.offset, m.data() + info.offset,
                      v.data() + info.offset, int64_t(info.numel), 1e-4, 0.9, 0.95, 1e-8, 0.1, s + 1, 1.0);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) times.push_back(dt);
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  const double tok_s = B * T / med;
  const double gflops = mc.train_flops_per_token(T) * B * T / med / 1e9;
  std::printf("%-10s %-8s %8s %8s %12s %10s %10s\n", "model", "device", "batch", "seq", "params(M)", "step_ms", "tok/s");
  std::printf("%-10s %-8s %8d %8d %12.2f %10.1f %10.0f   (%.1f GFLOP/s, %d threads)\n", mc.preset.c_str(), "cpu", B, T,
              model.num_params() / 1e6, med * 1e3, tok_s, gflops, num_threads());
  if (a.has("csv")) {
    const std::string header = "model,device,batch,seq,params,step_ms,tokens_per_s,gflops,threads\n";
    char row[256];
    std::snprintf(row, sizeof row, "%s,cpu,%d,%d,%lld,%.3f,%.1f,%.2f,%d\n", mc.preset.c_str(), B, T,
                  static_cast<long long>(model.num_params()), med * 1e3, tok_s, gflops, num_threads());
    append_csv(a.get("csv"), header, row);
  }
  return 0;
}

}  // namespace esplag::cli
