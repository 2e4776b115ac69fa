// esplag bench: benchmarks of the engine (training steps; on the GPU also the GEMMs of a
// Linear, one sparse Linear's training step, the 2:4 sparsification kernels, attention,
// the V:N:M GEMM, SLoPe's sparse AdamW and generation), printed as a table and optionally appended to
// a CSV. Every subcommand parses and checks its options first, so a CPU build reports bad
// options the same way before saying that the benchmark needs the GPU.
#include <algorithm>
#include <array>
#include <cctype>
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
#include "model/linear_registry.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#ifdef ESPLAG_HAVE_CUDA
#include "bench/lib/attention.h"
#include "bench/lib/gemm.h"
#include "bench/lib/generate.h"
#include "bench/lib/layer.h"
#include "bench/lib/slope_merged.h"
#include "bench/lib/sparse_adamw.h"
#include "bench/lib/sparsify.h"
#include "bench/lib/train.h"
#include "bench/lib/vnm.h"
#endif

namespace fs = std::filesystem;

namespace esplag::cli {

namespace {

[[maybe_unused]] std::string commit_id() {
  const char* c = std::getenv("ESPLAG_COMMIT");
  return c && *c ? c : "unknown";
}

// Appends rows to a CSV, writing the header first when the file is new (atomic rewrite).
[[maybe_unused]] void append_csv(const std::string& path, const std::string& header, const std::string& rows) {
  const bool fresh = !fs::exists(path);
  write_file_atomic(path, (fresh ? header : read_file(path)) + rows);
}

// The same for a CSV text whose first line is its header.
[[maybe_unused]] void append_csv(const std::string& path, const std::string& csv) {
  const size_t eol = csv.find('\n');
  if (eol == std::string::npos) return append_csv(path, csv + "\n", "");
  append_csv(path, csv.substr(0, eol + 1), csv.substr(eol + 1));
}

[[noreturn]] [[maybe_unused]] void needs_cuda(const std::string& what) {
  fail("bench ", what, ": needs a build configured with the cuda preset (it runs on the GPU)");
}

// A comma-separated list of OUTxINxTOKENS (x, X or the multiplication sign; spaces
// ignored), for bench gemm and bench layer. Throws Error naming the bad item.
std::vector<std::array<int64_t, 3>> parse_shapes(const std::string& cmd, const std::string& spec) {
  std::vector<std::array<int64_t, 3>> shapes;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    for (size_t i; (i = item.find("\xC3\x97")) != std::string::npos;) item.replace(i, 2, "x");
    std::vector<int64_t> dims;
    std::string cur;
    bool ok = !item.empty();
    for (size_t i = 0; i <= item.size() && ok; ++i) {
      const char c = i < item.size() ? item[i] : 'x';
      if (c == 'x' || c == 'X') {
        ok = !cur.empty() && cur.size() <= 9;
        if (ok) dims.push_back(std::stoll(cur));
        cur.clear();
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        cur += c;
      } else if (c != ' ') {
        ok = false;
      }
    }
    ESPLAG_CHECK(ok && dims.size() == 3 && dims[0] > 0 && dims[1] > 0 && dims[2] > 0, "bench ", cmd,
                 ": --shapes item '", item, "' is not OUTxINxTOKENS (three positive integers, e.g. 4096x4096x8192) ",
                 "or 'default'");
    shapes.push_back({dims[0], dims[1], dims[2]});
  }
  return shapes;
}

// A comma-separated list for bench layer's `option`, each item one of `allowed` at most once.
std::vector<std::string> parse_choices(const std::string& spec, const char* option,
                                       const std::vector<std::string>& allowed) {
  std::string names;
  for (const std::string& a : allowed) names += (names.empty() ? "" : ", ") + a;
  std::vector<std::string> items;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string k = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    ESPLAG_CHECK(std::find(allowed.begin(), allowed.end(), k) != allowed.end(), "bench layer: --", option, " item '",
                 k, "' is not one of ", names);
    ESPLAG_CHECK(std::find(items.begin(), items.end(), k) == items.end(), "bench layer: --", option, " lists '", k,
                 "' twice");
    items.push_back(k);
  }
  return items;
}

// --batch of bench generate: a comma-separated list of positive integers.
std::vector<int> parse_batches(const std::string& spec) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    const bool digits = !item.empty() && item.size() <= 7 &&
                        std::all_of(item.begin(), item.end(), [](unsigned char c) { return std::isdigit(c); });
    ESPLAG_CHECK(digits && std::stoi(item) > 0, "bench generate: --batch item '", item,
                 "' is not a positive integer (e.g. --batch 1,32)");
    out.push_back(std::stoi(item));
  }
  return out;
}

int bench_generate(const Args& a) {
  const std::vector<int> batches = parse_batches(a.get("batch"));
  const std::string preset = a.get("model");
  model_preset(preset);  // an unknown preset is an Error before anything else
#ifdef ESPLAG_HAVE_CUDA
  gpu::GenerateBenchOptions o;
  o.model = preset;
  o.batches = batches;
  o.prompt_len = a.int32("prompt-len");
  o.new_tokens = a.int32("new-tokens");
  o.chunk_rows = a.int32("chunk-rows");
  o.prune_24 = a.has("prune-24");
  o.op_times = a.has("op-times");
  if (a.has("vocab")) o.vocab = a.int32("vocab");
  const auto rows = gpu::bench_generate(o);
  std::cout << gpu::format_generate_bench(rows);
  if (a.has("csv")) append_csv(a.get("csv"), gpu::generate_bench_csv(rows));
  return 0;
#else
  needs_cuda("generate");
#endif
}

int bench_gemm(const Args& a) {
  const std::string dtype = a.get("dtype");
  ESPLAG_CHECK(dtype == "bf16" || dtype == "e4m3", "bench gemm: --dtype must be bf16 or e4m3, got '", dtype, "'");
  const bool fp8_dense = a.has("fp8-dense");
  ESPLAG_CHECK(!fp8_dense || dtype == "bf16",
               "bench gemm: --fp8-dense times the dense GEMMs only; --dtype is the 2:4 product's type");
  const std::string products = a.get("products", dtype == "e4m3" ? "fwd" : "fwd,bwd");
  ESPLAG_CHECK(dtype == "bf16" || products == "fwd",
               "bench gemm: --dtype e4m3 runs the forward product only (--products fwd)");
  ESPLAG_CHECK(products == "fwd" || products == "bwd" || products == "fwd,bwd" || products == "bwd,fwd",
               "bench gemm: --products must be fwd, bwd or fwd,bwd, got '", products, "'");
  const std::string operand = a.get("operand");
  ESPLAG_CHECK(operand == "A" || operand == "B" || operand == "a" || operand == "b",
               "bench gemm: --operand must be A or B (the cuSPARSELt operand that holds W), got '", operand, "'");
  const int warmup = a.int32("warmup"), iters = a.int32("iters");
  const std::string shape_spec = a.get("shapes");
  const auto shapes = shape_spec == "default" ? std::vector<std::array<int64_t, 3>>{} : parse_shapes("gemm", shape_spec);
#ifdef ESPLAG_HAVE_CUDA
  GemmBenchOptions o;
  if (!shapes.empty()) {
    o.shapes.clear();
    for (const auto& s : shapes) o.shapes.push_back({s[0], s[1], s[2]});
  }
  o.forward = products.find("fwd") != std::string::npos;
  o.backward_data = products.find("bwd") != std::string::npos;
  o.weight_operand = (operand == "A" || operand == "a") ? gpu::SparseOperand::a : gpu::SparseOperand::b;
  o.search = !a.has("no-search");
  o.dtype = dtype == "e4m3" ? gpu::SparseDtype::e4m3 : gpu::SparseDtype::bf16;
  o.warmup = warmup;
  o.iters = iters;
  if (fp8_dense) {
    const GemmFp8Result r = run_gemm_fp8_bench(o);
    std::cout << gemm_fp8_bench_table(r);
    if (a.has("csv")) append_csv(a.get("csv"), gemm_fp8_bench_csv_header(), gemm_fp8_bench_csv_rows(r, commit_id()));
    // The table lists the failed calls; scripts see them in the exit status too.
    const bool failed = std::any_of(r.rows.begin(), r.rows.end(), [](const auto& row) { return !row.failures.empty(); });
    return failed ? 1 : 0;
  }
  if (a.has("tuning-cache")) gpu::set_cusparselt_tuning_path(a.get("tuning-cache"));
  const GemmBenchResult r = run_gemm_bench(o);
  std::cout << gemm_bench_table(r);
  if (r.cusparselt_version > 0) std::cout << "tuning cache: " << gpu::cusparselt_tuning_path() << "\n";
  if (a.has("csv")) append_csv(a.get("csv"), gemm_bench_csv_header(), gemm_bench_csv_rows(r, commit_id()));
  return 0;
#else
  needs_cuda("gemm");
#endif
}

int bench_layer(const Args& a) {
  const std::vector<std::string> kinds =
      parse_choices(a.get("kinds"), "kinds", {"dense", "semi_sparse", "slope", "semi_sparse_activation"});
  const std::vector<std::string> patterns = parse_choices(a.get("activation"), "activation", {"row_24", "tile_24"});
  const std::string shape_spec = a.get("shapes");
  const auto shapes = shape_spec == "default" ? std::vector<std::array<int64_t, 3>>{} : parse_shapes("layer", shape_spec);
  const int warmup = a.int32("warmup"), iters = a.int32("iters");
#ifdef ESPLAG_HAVE_CUDA
  LayerBenchOptions o;
  if (!shapes.empty()) {
    o.shapes.clear();
    for (const auto& s : shapes) o.shapes.push_back({s[0], s[1], s[2]});
  }
  o.kinds.clear();
  o.activation.clear();
  for (const std::string& k : kinds) {
    if (!find_linear_kind(k, "bench layer").takes_activation)
      o.kinds.push_back(gpu::parse_sparse_linear_kind(k));
    else
      for (const std::string& p : patterns) o.activation.push_back(parse_activation_sparsity(p));
  }
  o.warmup = warmup;
  o.iters = iters;
  o.sparse_dw = a.has("sparse-dw");
  if (a.has("tuning-cache")) gpu::set_cusparselt_tuning_path(a.get("tuning-cache"));
  const LayerBenchResult r = run_layer_bench(o);
  std::cout << layer_bench_table(r);
  if (r.cusparselt_version > 0) std::cout << "tuning cache: " << gpu::cusparselt_tuning_path() << "\n";
  if (a.has("csv")) append_csv(a.get("csv"), layer_bench_csv_header(), layer_bench_csv_rows(r, commit_id()));
  return 0;
#else
  needs_cuda("layer");
#endif
}

int bench_sparsify([[maybe_unused]] const Args& a) {
#ifdef ESPLAG_HAVE_CUDA
  const std::vector<SparsifyTiming> t = esplag::bench_sparsify(default_sparsify_shapes(), 50, 10);
  std::cout << sparsify_timing_table(t);
  if (a.has("csv")) append_csv(a.get("csv"), sparsify_timing_csv(t, commit_id()));
  return 0;
#else
  needs_cuda("sparsify");
#endif
}

int bench_attention([[maybe_unused]] const Args& a) {
#ifdef ESPLAG_HAVE_CUDA
  const auto rows = gpu::bench_attention(gpu::attention_bench_shapes(), gpu::AttentionBenchOptions{});
  std::cout << gpu::format_attention_bench(rows);
  if (a.has("csv")) append_csv(a.get("csv"), gpu::attention_bench_csv(rows));
  return 0;
#else
  needs_cuda("attention");
#endif
}

int bench_vnm([[maybe_unused]] const Args& a) {
#ifdef ESPLAG_HAVE_CUDA
  const auto results = gpu::vnm_bench(gpu::vnm_bench_default_shapes(), gpu::vnm_bench_default_patterns(), 5, 20);
  std::cout << gpu::vnm_bench_table(results);
  if (a.has("csv")) append_csv(a.get("csv"), gpu::vnm_bench_csv(results));
  return 0;
#else
  needs_cuda("vnm");
#endif
}

int bench_sparse_adamw([[maybe_unused]] const Args& a) {
#ifdef ESPLAG_HAVE_CUDA
  const gpu::SparseAdamWBenchResult r = gpu::bench_sparse_adamw({{4096, 11008}, {2048, 5632}}, 5, 50);
  std::cout << gpu::sparse_adamw_bench_table(r);
  if (a.has("csv")) {
    std::string rows;
    for (const auto& row : r.rows) rows += gpu::sparse_adamw_bench_csv_row(r, row);
    append_csv(a.get("csv"), gpu::sparse_adamw_bench_csv_header(), rows);
  }
  return 0;
#else
  needs_cuda("sparse-adamw");
#endif
}

// A comma-separated list of adapter ranks for bench slope-merged.
std::vector<int> parse_ranks(const std::string& spec) {
  std::vector<int> ranks;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string item = spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    pos = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    const bool digits = !item.empty() && item.size() <= 6 &&
                        std::all_of(item.begin(), item.end(), [](unsigned char c) { return std::isdigit(c); });
    ESPLAG_CHECK(digits && std::stoi(item) > 0, "bench slope-merged: --ranks item '", item,
                 "' is not a positive integer (e.g. --ranks 16,64)");
    ranks.push_back(std::stoi(item));
  }
  return ranks;
}

int bench_slope_merged(const Args& a) {
  const std::string shape_spec = a.get("shapes");
  const auto shapes =
      shape_spec == "default" ? std::vector<std::array<int64_t, 3>>{} : parse_shapes("slope-merged", shape_spec);
  const std::vector<int> ranks = parse_ranks(a.get("ranks"));
  const int warmup = a.int32("warmup"), iters = a.int32("iters");
#ifdef ESPLAG_HAVE_CUDA
  const gpu::SlopeMergedBenchResult r =
      gpu::bench_slope_merged(shapes.empty() ? gpu::slope_merged_bench_default_shapes() : shapes,
                              ranks, warmup, iters);
  std::cout << gpu::slope_merged_bench_table(r);
  if (a.has("csv"))
    append_csv(a.get("csv"), gpu::slope_merged_bench_csv_header(), gpu::slope_merged_bench_csv_rows(r, commit_id()));
  return 0;
#else
  needs_cuda("slope-merged");
#endif
}

// bench train's options that make block linears sparse, each with the Linear kind it gives
// (model/linear_registry.h says what the kind takes).
const std::pair<const char*, const char*> kTrainKindOptions[] = {
    {"semi-sparse", "semi_sparse"}, {"slope", "slope"}, {"masked", "masked"}, {"activation", "semi_sparse_activation"}};

// "--semi-sparse or --slope": the kind options whose kind `pick` accepts.
std::string train_kind_options(const std::function<bool(const LinearKindInfo&)>& pick) {
  std::vector<std::string> options;
  for (const auto& [option, kind] : kTrainKindOptions)
    if (pick(find_linear_kind(kind, "bench train"))) options.push_back(std::string("--") + option);
  std::string out;
  for (size_t i = 0; i < options.size(); ++i)
    out += (i == 0 ? "" : i + 1 == options.size() ? " or " : ", ") + options[i];
  return out;
}

int bench_train(const Args& a) {
  const std::string device = a.get("device");
  ESPLAG_CHECK(device == "cpu" || device == "cuda", "bench train: --device must be cpu or cuda, got '", device, "'");
  ModelConfig mc = model_preset(a.get("model"));
  mc.vocab_size = a.int32("vocab", mc.vocab_size ? mc.vocab_size : 257);
  const int B = a.int32("batch"), T = a.int32("seq");
  const int steps = a.int32("steps", device == "cuda" ? 10 : 2);
  const int warmup = a.int32("warmup", device == "cuda" ? 3 : 1);
  int kinds = 0;
  // The kind option given and its kind (without one: the first, with no layers to change).
  std::string option = kTrainKindOptions[0].first, kind = kTrainKindOptions[0].second;
  for (const auto& [o, k] : kTrainKindOptions)
    if (a.has(o)) {
      ++kinds;
      option = o;
      kind = k;
    }
  const LinearKindInfo* info = kinds == 1 ? &find_linear_kind(kind, "bench train") : nullptr;
  ESPLAG_CHECK(device == "cuda" || (kinds == 0 && !a.has("op-profile") && !a.has("always-sparse") &&
                                    !a.has("no-baseline")),
               "bench train: --semi-sparse, --slope, --masked, --activation, --always-sparse, --no-baseline and "
               "--op-profile are for --device cuda");
  ESPLAG_CHECK(!a.has("no-baseline") || kinds > 0, "bench train: --no-baseline is for --semi-sparse, --slope, "
                                                   "--masked or --activation (the baseline is the dense model)");
  const std::string pattern = a.get("pattern");
  ESPLAG_CHECK(!a.has("pattern") || a.has("activation"), "bench train: --pattern is for the layers of --activation");
  ESPLAG_CHECK(pattern == "row_24" || pattern == "tile_24", "bench train: --pattern must be row_24 or tile_24, got '",
               pattern, "'");
  auto takes_sparse_dw = [](const LinearKindInfo& k) { return k.takes_sparse_dw; };
  ESPLAG_CHECK(!a.has("sparse-dw") || kinds > 1 || (info && info->takes_sparse_dw),
               "bench train: --sparse-dw is for the layers of ", train_kind_options(takes_sparse_dw));
  ESPLAG_CHECK(kinds <= 1, "bench train: give one of --semi-sparse, --slope, --masked and --activation");
  const int lora_rank = a.int32("lora-rank");
  auto own_adapter = [](const LinearKindInfo& k) { return k.adapter == AdapterStyle::own; };
  ESPLAG_CHECK(lora_rank == 0 || (info && own_adapter(*info)),
               "bench train: --lora-rank is a positive rank for the adapters of ", train_kind_options(own_adapter),
               " layers");
  if (device == "cuda") {
#ifdef ESPLAG_HAVE_CUDA
    std::string regex = a.has(option) ? a.get(option) : "";
    if (regex == "all") regex = R"(blocks\.\d+\..*\.weight)";
    const int op_steps = a.int32("op-profile");
    GpuModelOptions options;
    options.sparse_dispatch = !a.has("always-sparse");
    const double peak = a.number("peak-tflops");
    std::vector<GpuBenchResult> runs;
    // The dense baseline first, in this process (its model is gone before the sparse one).
    if (!regex.empty() && !a.has("no-baseline"))
      runs.push_back(bench_train_gpu(mc, B, T, steps, warmup, peak, options));
    runs.push_back(
        bench_train_gpu(mc, B, T, steps, warmup, peak, options, op_steps, regex, kind, a.has("sparse-dw"), lora_rank,
                        parse_activation_sparsity(pattern)));
    std::cout << gpu_bench_table_header();
    for (const auto& r : runs) std::cout << gpu_bench_table_row(r);
    if (runs.size() == 2) std::cout << gpu_bench_comparison(runs[0], runs[1]);
    std::cout << gpu_op_profile_table(runs.back());
    if (a.has("csv"))  // its own columns: a CUDA CSV is not the CPU one
      for (const auto& r : runs) append_csv(a.get("csv"), gpu_bench_csv_header(), gpu_bench_csv_row(r));
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


Option csv_option() {
  return Option::text("csv", "FILE", "", "append the rows to FILE (the header first when it is new)");
}
Option shapes_option(const std::string& fallback_help) {
  return Option::text("shapes", "default|OUTxINxTOKENS,...", "default",
                      "Linear shapes W [OUT, IN] over TOKENS rows, or 'default': " + fallback_help);
}
Option tuning_cache_option() {
  return Option::text("tuning-cache", "FILE", "", "the cuSPARSELt tuning cache (default: see docs/sparse-gpu.md)");
}

const Command kBenchTrain = {
    "bench train",
    "training steps of a model preset: step time, tokens/s (CPU, or the GPU model with sparse kinds)",
    "On cuda, --semi-sparse makes the block linears whose weight names match semi_sparse (runtime transposable\n"
    "2:4 on cuSPARSELt), --slope makes them slope (static row-wise 2:4, double-pruned backward refreshed every\n"
    "100 steps, AdamW on the kept values), --masked makes them masked (dense products, a fixed 2:4 mask on the\n"
    "weight gradients and weights), --activation makes them semi_sparse_activation (inputs pruned 2:4 by\n"
    "--pattern at every step, the forward a 2:4 product). Each layer shape takes the 2:4 or the dense products,\n"
    "whichever it measured faster, unless --always-sparse. The dense model is timed first in the same process\n"
    "and the ratios printed (step time, tokens/s, device memory), unless --no-baseline.",
    {
        Option::text("model", "PRESET", "tiny", "the model preset"),
        Option::text("device", "cpu|cuda", "cpu", "where the steps run"),
        Option::integer("batch", "4", 1, kIntMax, "sequences per step"),
        Option::integer("seq", "256", 1, kIntMax, "tokens per sequence"),
        Option::integer("steps", "", 1, kIntMax, "timed steps (default: 2 on cpu, 10 on cuda)"),
        Option::integer("warmup", "", 0, kIntMax, "untimed steps first (default: 1 on cpu, 3 on cuda)"),
        Option::integer("vocab", "", 1, kIntMax, "vocabulary size (default: the preset's, else 257)"),
        Option::number("peak-tflops", "989", 0.001, 1e6, "the GPU's dense peak, for the MFU column (cuda)"),
        csv_option(),
        Option::text("semi-sparse", "all|REGEX", "", "cuda: these block linears semi_sparse"),
        Option::text("slope", "all|REGEX", "", "cuda: these block linears slope"),
        Option::text("masked", "all|REGEX", "", "cuda: these block linears masked"),
        Option::text("activation", "all|REGEX", "", "cuda: these block linears semi_sparse_activation"),
        Option::text("pattern", "row_24|tile_24", "row_24", "the activation pattern of --activation"),
        Option::flag("always-sparse", "cuda: the 2:4 products even where dense measured faster"),
        Option::flag("no-baseline", "cuda: skip the dense baseline"),
        Option::flag("sparse-dw", "weight gradient from the MVUE 2:4 of dY^T (--semi-sparse, --slope)"),
        Option::integer("lora-rank", "0", 0, kIntMax, "rank-R low-rank adapters on the --slope layers"),
        Option::integer("op-profile", "0", 0, kIntMax, "cuda: time every op over this many eager steps"),
    },
    bench_train,
};

const Command kBenchGemm = {
    "bench gemm",
    "dense cuBLASLt against 2:4 cuSPARSELt for the GEMMs of a Linear (cuda)",
    "fwd Y = X.W^T, bwd dX = dY.W, with the default and the searched cuSPARSELt algorithm; --dtype e4m3 times\n"
    "the 2:4 forward product on fp8 W and X (bf16 out) against the bf16 dense one; --fp8-dense times cuBLASLt's\n"
    "fp8 dense GEMM against its bf16 one instead (docs/fp8.md). The CSV's commit column comes from $ESPLAG_COMMIT.",
    {
        shapes_option("LLM layer shapes (docs/sparse-gpu.md)"),
        Option::text("products", "fwd,bwd", "", "the products to time (default: fwd,bwd; fwd with --dtype e4m3)"),
        Option::text("operand", "A|B", "A", "the cuSPARSELt operand that holds W"),
        Option::text("dtype", "bf16|e4m3", "bf16", "the data type of the 2:4 product"),
        Option::flag("no-search", "skip the algorithm search"),
        Option::flag("fp8-dense", "instead: cuBLASLt fp8 (e4m3) dense against bf16 dense, and the fp8 casts"),
        tuning_cache_option(),
        Option::integer("warmup", "10", 0, kIntMax, "untimed calls first"),
        Option::integer("iters", "50", 1, kIntMax, "timed calls (the median is reported)"),
        csv_option(),
    },
    bench_gemm,
};

const Command kBenchLayer = {
    "bench layer",
    "one Linear's training step of each kind against dense (cuda)",
    "Weight preparation, forward, backward dX and dW. semi_sparse_activation is timed with each --activation\n"
    "pattern (rows activation:P); --sparse-dw also times each sparse kind with its dW GEMM 2:4 (MVUE of dY).\n"
    "The CSV's commit column comes from $ESPLAG_COMMIT.",
    {
        Option::text("kinds", "KIND,...", "dense,semi_sparse,slope,semi_sparse_activation", "the kinds to time"),
        Option::text("activation", "PATTERN,...", "row_24,tile_24", "the patterns of semi_sparse_activation"),
        shapes_option("the llama-1b and llama-7b MLP at 8192 tokens"),
        Option::flag("sparse-dw", "also time each sparse kind with a 2:4 dW GEMM"),
        tuning_cache_option(),
        Option::integer("warmup", "5", 0, kIntMax, "untimed steps first"),
        Option::integer("iters", "20", 1, kIntMax, "timed steps (the median is reported)"),
        csv_option(),
    },
    bench_layer,
};

const Command kBenchSparsify = {
    "bench sparsify",
    "2:4 sparsification kernels against a copy (cuda)",
    "Each kernel that prunes a bf16 matrix to 2:4 (transposable, into cuSPARSELt's layout, SLoPe's double\n"
    "prune, the activations' rows and tiles, MVUE) with each set of outputs it writes, on 4096x11008,\n"
    "11008x4096 and 2048x8192: the median of 50 launches alternating between two inputs (none stays in L2),\n"
    "GB/s of the bytes it must move, and the same bytes copied device to device for scale\n"
    "(docs/sparse-gpu.md). The CSV's commit column comes from $ESPLAG_COMMIT.",
    {csv_option()},
    bench_sparsify};
const Command kBenchAttention = {
    "bench attention",
    "attention paths, forward and backward (cuda)",
    "The native kernels, cuDNN's and cuDNN's non-deterministic backward on the training shapes of gpt2-124m\n"
    "(16 x 1024), gpt2-350m (8 x 1024) and llama-1b (4 x 2048): median forward and backward times of 20 pairs\n"
    "after 3 warm-up pairs; a path that cannot run on a shape says why.",
    {csv_option()},
    bench_attention};
const Command kBenchVnm = {
    "bench vnm",
    "V:2:M sparse GEMM against dense cuBLASLt (cuda)",
    "Y = X.W^T with W pruned V:2:M, for 64:2:8, 128:2:8, 64:2:16 and 64:2:5 at llama-1b, llama-7b and one\n"
    "llama-13b shape (a pattern that does not divide a shape skips it: 64:2:5 runs on the llama-13b one only):\n"
    "our wgmma.sp and mma.sp kernels (on X and on X^T), and\n"
    "the same weight as a dense W on cuSPARSELt's 2:4 product where M is a multiple of 4, each timed against\n"
    "cuBLASLt's dense GEMM in the same process; kept-product TFLOP/s and the fraction of the wgmma.sp peak.\n"
    "The table's legend says what each column is (docs/sparse-gpu.md).",
    {csv_option()},
    bench_vnm};
const Command kBenchSparseAdamw = {
    "bench sparse-adamw",
    "SLoPe's sparse AdamW against dense AdamW (cuda)",
    "On 4096x11008 and 2048x5632: dense AdamW and its gradient norm against the sparse AdamW over the kept\n"
    "values (from an fp32 or a bf16 dW, with or without writing the pruned bf16 W), the sparse gradient norm,\n"
    "and SLoPe's backward-mask refresh and refill; median times and the ratio to dense AdamW.",
    {csv_option()},
    bench_sparse_adamw};

const Command kBenchGenerate = {
    "bench generate",
    "GPU generation with a KV cache: prefill and decode tokens/s (cuda)",
    "A model preset with random weights on GpuGenerator (docs/cli.md, GPU generation): per batch size, the\n"
    "median prefill of --prompt-len random tokens per sequence and the median decode step (one token per\n"
    "sequence, CUDA graphs) over --new-tokens steps, after warm-up. --prune-24 prunes every block Linear 2:4\n"
    "by magnitude and runs each batch twice on those weights: dense products, then the prefill's block products\n"
    "through cuSPARSELt (decode stays dense), with the 2:4 run's speedups and its prefill logits' difference.",
    {
        Option::text("model", "PRESET", "llama-1b", "the model preset"),
        Option::text("batch", "B,...", "1,32", "batch sizes"),
        Option::integer("prompt-len", "128", 1, kIntMax, "prompt tokens per sequence"),
        Option::integer("new-tokens", "128", 1, kIntMax, "timed decode steps"),
        Option::integer("vocab", "", 1, kIntMax, "vocabulary size (default: the preset's, else 257)"),
        Option::integer("chunk-rows", "0", 0, 65535,
                        "positions per prefill forward pass (0: the generator's, max(batch, max_len within "
                        "[1024, 4096], batch x max_len up to 8192))"),
        Option::flag("prune-24", "prune the weights 2:4 and compare dense with 2:4 (cuSPARSELt) prefill"),
        Option::flag("op-times", "one more prefill per row with CUDA events around every op: its time by op kind"),
        csv_option(),
    },
    bench_generate,
};

const Command kBenchSlopeMerged = {
    "bench slope-merged",
    "SLoPe's inference product with its adapter as one 2:4 GEMM (cuda)",
    "Y = X.W1^T + b + (X.R^T).L^T as one 2:4 GEMM over [W1 | L], against dense cuBLASLt and against the adapter\n"
    "added in separate passes.",
    {
        shapes_option("the llama-1b and llama-7b MLP at 8192 tokens"),
        Option::text("ranks", "R,...", "16,64", "adapter ranks"),
        Option::integer("warmup", "5", 1, kIntMax, "untimed calls first (at least 1: the first call tunes)"),
        Option::integer("iters", "20", 1, kIntMax, "timed calls"),
        csv_option(),
    },
    bench_slope_merged,
};

}  // namespace

const std::vector<const Command*>& bench_commands() {
  static const std::vector<const Command*> commands = {&kBenchTrain,    &kBenchGemm,      &kBenchLayer,
                                                       &kBenchSparsify, &kBenchAttention, &kBenchVnm,
                                                       &kBenchSparseAdamw, &kBenchSlopeMerged, &kBenchGenerate};
  return commands;
}

}  // namespace esplag::cli
