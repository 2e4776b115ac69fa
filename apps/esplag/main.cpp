// esplag: the command-line front end. Parses arguments, calls the library, prints.
// Every error reaches main() as an esplag::Error and becomes one line on stderr with a
// non-zero exit code.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "args.h"
#include "commands.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "data/bpe_trainer.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "io/atomic_file.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#include "io/safetensors.h"
#include "model/linear.h"
#include "profile/profiler.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"
#include "sparse/transposable.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace esplag;
using cli::Args;

namespace {

void print_line(const std::string& s) { std::cout << s << std::endl; }

const char* kUsage = R"(esplag — sparse-aware transformer LM training

usage:
  esplag data prepare --input TEXT --out DIR [--tokenizer byte|TOKENIZER.json]
                      [--val-fraction 0.05] [--shard-tokens 100000000]
  esplag tokenizer train --input TEXT --vocab-size N --out TOKENIZER.json
  esplag train --config FILE.yaml [--set key=value]... [--out RUN_DIR] [--device cpu|cuda|auto]
  esplag train --resume RUN_OR_CHECKPOINT_DIR [--steps N] [--device cpu|cuda|auto]
  esplag eval --checkpoint DIR [--data DIR] [--split val|train] [--batches N] [--device auto|cpu|cuda] [--json]
  esplag sample --checkpoint DIR [--prompt TEXT] [--tokens 200] [--temperature 0.8]
                [--top-k 40] [--seed 1]
  esplag profile --config FILE.yaml [--set key=value]... [--warmup 1] [--steps 1] [--out DIR]
                 [--what-if 'PATTERN=FACTOR']... [--what-if-from bench.csv]...
                 [--validate [--steps 5] [--calibration-steps 3]]
  esplag sparsity --checkpoint DIR [--json] [--mask-quality]
  esplag export --checkpoint DIR --dense --out FILE.safetensors
  esplag bench train --model PRESET [--device cpu|cuda] [--batch 4] [--seq 256] [--steps N]
                     [--warmup 1] [--vocab N] [--peak-tflops 989] [--csv FILE]
                     [--semi-sparse all|REGEX [--always-sparse]] [--op-profile STEPS]
  esplag bench gemm|layer|attention|sparsify|sparse-adamw|vnm [--csv FILE] ...
                     GPU kernels against their dense baselines (esplag bench --help)
  esplag --version

Common: --threads N sets the CPU worker threads (default: all cores).
)";

std::string take_threads(std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--threads" && i + 1 < args.size()) {
      const std::string v = args[i + 1];
      args.erase(args.begin() + i, args.begin() + i + 2);
      return v;
    }
    if (args[i].rfind("--threads=", 0) == 0) {
      const std::string v = args[i].substr(10);
      args.erase(args.begin() + i);
      return v;
    }
  }
  return "";
}

int cmd_data(const std::vector<std::string>& argv) {
  ESPLAG_CHECK(!argv.empty() && argv[0] == "prepare", "usage: esplag data prepare --input TEXT --out DIR ...");
  Args a({argv.begin() + 1, argv.end()}, "data prepare", {"input", "out", "tokenizer", "val-fraction", "shard-tokens"});
  PrepareOptions opt;
  opt.input = a.required("input");
  opt.out_dir = a.required("out");
  opt.tokenizer = a.get("tokenizer", "byte");
  opt.val_fraction = a.number("val-fraction", opt.val_fraction);
  opt.shard_tokens = a.integer("shard-tokens", opt.shard_tokens);
  const PrepareResult r = prepare_dataset(opt, print_line);
  std::printf("prepared %s: %lld train tokens, %lld val tokens, vocab %d\n", opt.out_dir.c_str(),
              static_cast<long long>(r.train_tokens), static_cast<long long>(r.val_tokens), r.vocab_size);
  return 0;
}

int cmd_tokenizer(const std::vector<std::string>& argv) {
  ESPLAG_CHECK(!argv.empty() && argv[0] == "train",
               "usage: esplag tokenizer train --input TEXT --vocab-size N --out TOKENIZER.json");
  Args a({argv.begin() + 1, argv.end()}, "tokenizer train", {"input", "vocab-size", "out"});
  const std::string text = read_file(a.required("input"));
  const int vocab = static_cast<int>(a.integer("vocab-size", 0));
  const std::string out = a.required("out");
  const auto t0 = std::chrono::steady_clock::now();
  const BpeModel bpe = train_bpe(text, vocab, print_line);
  save_tokenizer_json(out, bpe);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: vocabulary %d (%zu merges) in %.1f s\n", out.c_str(), vocab, bpe.merges.size(), s);
  return 0;
}

int cmd_train(const std::vector<std::string>& argv) {
  Args a(argv, "train", {"config", "out", "resume", "steps", "device"}, {}, {"set"});
  std::unique_ptr<Trainer> trainer;
  if (a.has("resume")) {
    ESPLAG_CHECK(!a.has("config") && a.all("set").empty(),
                 "train --resume continues a run with its saved config; --config and --set do not apply");
    trainer = Trainer::resume(a.get("resume"), print_line, a.integer("steps", 0), a.get("device", ""));
  } else {
    const std::string config_path = a.required("config");
    TrainConfig cfg = load_train_config(config_path, a.all("set"));
    if (a.has("steps")) cfg.steps = cfg.schedule.total_steps = a.integer("steps", cfg.steps);
    if (a.has("device")) cfg.device = a.get("device");
    const std::string out = a.get("out", "runs/" + fs::path(config_path).stem().string());
    trainer = std::make_unique<Trainer>(cfg, out, print_line);
  }
  const TrainResult r = trainer->run();
  std::printf("done: %lld steps, loss %.4f -> %.4f, val loss %.4f, checkpoint %s\n",
              static_cast<long long>(r.steps), r.first_loss, r.last_loss, r.final_val_loss,
              r.last_checkpoint.c_str());
  return 0;
}

int cmd_eval(const std::vector<std::string>& argv) {
  Args a(argv, "eval", {"checkpoint", "data", "split", "batches", "batch", "seq", "device"}, {"json"});
  const std::string ck = resolve_checkpoint(a.required("checkpoint"));
  const std::string data = a.get("data", read_checkpoint_info(ck).config.data_path);
  const std::string split = a.get("split", "val");
  ESPLAG_CHECK(split == "val" || split == "train", "eval: --split must be val or train, got '", split, "'");
  const EvalResult r =
      evaluate_checkpoint(ck, data, split, static_cast<int>(a.integer("batches", 0)),
                          static_cast<int>(a.integer("batch", 0)), static_cast<int>(a.integer("seq", 0)), a.get("device", "auto"));
  if (a.has("json")) {
    std::cout << nlohmann::json{{"checkpoint", ck}, {"data", data},       {"split", split},
                                {"loss", r.loss},   {"perplexity", r.perplexity}, {"batches", r.batches},
                                {"tokens", r.tokens},  {"device", r.device}}
                     .dump()
              << std::endl;
  } else {
    std::printf("%s on %s/%s: loss %.4f | perplexity %.3f | %d batches, %lld tokens | device %s\n", ck.c_str(),
                data.c_str(), split.c_str(), r.loss, r.perplexity, r.batches, static_cast<long long>(r.tokens),
                r.device.c_str());
  }
  return 0;
}

int cmd_sample(const std::vector<std::string>& argv) {
  Args a(argv, "sample", {"checkpoint", "prompt", "tokens", "temperature", "top-k", "seed"});
  const std::string ck = resolve_checkpoint(a.required("checkpoint"));
  CheckpointContents info;
  const auto model_ptr = load_model(ck, &info);
  Transformer<float>& model = *model_ptr;
  const auto tok = load_tokenizer(info.tokenizer);
  const int n_new = static_cast<int>(a.integer("tokens", 200));
  const double temperature = a.number("temperature", 0.8);
  const int top_k = static_cast<int>(a.integer("top-k", 40));
  ESPLAG_CHECK(temperature >= 0, "sample: --temperature must not be negative");
  ESPLAG_CHECK(n_new >= 0 && top_k >= 0, "sample: --tokens and --top-k must not be negative");
  Rng rng(static_cast<uint64_t>(a.integer("seed", 1)));

  const std::string prompt = a.get("prompt", "");
  std::vector<int32_t> ids = tok->encode(prompt);
  if (ids.empty()) ids.push_back(tok->eot_token() >= 0 ? tok->eot_token() : 0);
  const int V = info.config.model.vocab_size, ctx = info.config.model.max_seq_len;
  std::vector<float> logits(V);
  std::vector<int32_t> generated;
  std::cout << prompt << std::flush;
  for (int i = 0; i < n_new; ++i) {
    const int len = std::min<int>(ids.size(), ctx);
    model.forward_last_logits(ids.data() + ids.size() - len, 1, len, logits.data());
    int next;
    if (temperature == 0) {
      next = static_cast<int>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      std::vector<int> order(V);
      for (int v = 0; v < V; ++v) order[v] = v;
      const int k = top_k > 0 ? std::min(top_k, V) : V;
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int x, int y) { return logits[x] > logits[y] || (logits[x] == logits[y] && x < y); });
      std::vector<double> p(k);
      double sum = 0;
      for (int j = 0; j < k; ++j) sum += p[j] = std::exp((logits[order[j]] - logits[order[0]]) / temperature);
      double r = rng.uniform() * sum;
      next = order[k - 1];
      for (int j = 0; j < k; ++j)
        if ((r -= p[j]) < 0) {
          next = order[j];
          break;
        }
    }
    if (next == tok->eot_token()) break;
    ids.push_back(next);
    generated.push_back(next);
    std::cout << tok->decode({next}) << std::flush;
  }
  std::cout << std::endl;
  return 0;
}

// How much weight magnitude each 2:4 mask family would keep on this checkpoint's weights
// (the effective weight of every block linear whose shape is a multiple of 4).
int mask_quality(Transformer<float>& model) {
  std::printf("kept fraction of sum|w| (density in brackets)\n%-28s %16s %16s %16s %16s\n", "layer", "row 2:4",
              "transp. greedy", "transp. exact", "SLoPe bwd copy");
  for (const auto& name : model.linear_names()) {
    const Linear<float>& l = model.linear(name);
    const int rows = l.params().out_features, cols = l.params().in_features;
    if (rows % 4 || cols % 4) continue;
    std::vector<float> w(size_t(rows) * cols);
    l.dense_weight(w.data());
    const auto q = cpu::mask_quality_report(w.data(), rows, cols);
    std::printf("%-28s %7.4f (%.3f) %7.4f (%.3f) %7.4f (%.3f) %7.4f (%.3f)\n", name.c_str(), q.row_24,
                q.density_row_24, q.transposable_greedy, q.density_transposable_greedy, q.transposable_exact,
                q.density_transposable_exact, q.double_pruned, q.density_double_pruned);
  }
  return 0;
}

// Per layer: kind, pattern, density of the effective weight, and whether the stored
// weight really satisfies the pattern. Exit code 1 if any layer breaks its pattern.
int cmd_sparsity(const std::vector<std::string>& argv) {
  Args a(argv, "sparsity", {"checkpoint"}, {"json", "mask-quality"});
  const std::string ck = resolve_checkpoint(a.required("checkpoint"));
  const auto model = load_model(ck);
  if (a.has("mask-quality")) return mask_quality(*model);
  nlohmann::json rows = nlohmann::json::array();
  int broken = 0;
  if (!a.has("json"))
    std::printf("%-28s %-24s %-14s %8s  %s\n", "layer", "kind", "pattern", "density", "check");
  for (const auto& name : model->linear_names()) {
    const Linear<float>& l = model->linear(name);
    const auto& p = l.params();
    std::vector<float> w(size_t(p.out_features) * p.in_features);
    l.sparse_weight(w.data());
    int64_t nonzeros = 0;
    for (float x : w) nonzeros += x != 0.0f;
    const double density = double(nonzeros) / double(w.size());
    // Kinds that store a pruned weight are checked; runtime kinds keep a dense master.
    std::string check = "-";
    const std::string base_kind = l.kind().substr(0, l.kind().find('+'));
    const bool stored_sparse = base_kind == "masked" || base_kind == "slope" || base_kind == "vnm";
    if (stored_sparse && l.pattern().rfind("unstructured", 0) != 0) {
      const auto r = cpu::check_pattern(w.data(), p.out_features, p.in_features, SparsityPattern::parse(l.pattern()));
      check = r.ok ? "ok" : "BROKEN: " + r.detail;
      broken += !r.ok;
    }
    if (a.has("json")) {
      rows.push_back({{"layer", name}, {"kind", l.kind()}, {"pattern", l.pattern()}, {"density", density},
                      {"check", check}});
    } else {
      std::printf("%-28s %-24s %-14s %8.4f  %s\n", name.c_str(), l.kind().c_str(), l.pattern().c_str(), density,
                  check.c_str());
    }
  }
  if (a.has("json")) std::cout << nlohmann::json{{"checkpoint", ck}, {"layers", rows}}.dump(2) << std::endl;
  if (broken) std::cerr << "esplag: error: " << broken << " layer(s) do not satisfy their sparsity pattern" << std::endl;
  return broken ? 1 : 0;
}

// A plain dense safetensors of the effective weights, for tools that know nothing of
// compressed layers.
int cmd_export(const std::vector<std::string>& argv) {
  Args a(argv, "export", {"checkpoint", "out"}, {"dense"});
  ESPLAG_CHECK(a.has("dense"), "export: only --dense export exists (a plain dense safetensors)");
  const std::string ck = resolve_checkpoint(a.required("checkpoint"));
  const std::string out = a.required("out");
  CheckpointContents info;
  const auto model = load_model(ck, &info);
  std::map<std::string, std::vector<float>> dense;
  for (const auto& name : model->linear_names()) {
    const Linear<float>& l = model->linear(name);
    auto& w = dense[name];
    w.resize(size_t(l.params().out_features) * l.params().in_features);
    l.dense_weight(w.data());
  }
  std::vector<Tensor> tensors;
  for (const auto& pi : model->param_infos()) {
    auto it = dense.find(pi.name);
    tensors.push_back(it == dense.end() ? model->param(pi.name)
                                        : Tensor::borrow(it->second.data(), pi.shape, DType::f32, Device::cpu, pi.name));
  }
  save_safetensors(out, tensors, {{"format", "esplag-dense-1"}, {"config", to_yaml(info.config)},
                                  {"tokenizer", info.tokenizer}, {"step", std::to_string(info.state.step)}});
  std::printf("wrote %s: %zu tensors, %.2fM parameters (dense)\n", out.c_str(), tensors.size(),
              model->num_params() / 1e6);
  return 0;
}

// Wall time of one profiled window: max end - min start over its records.
double window_wall_ns(const std::vector<OpRecord>& records) {
  if (records.empty()) return 0;
  int64_t t0 = records.front().start_ns, t1 = records.front().end_ns;
  for (const auto& r : records) {
    t0 = std::min(t0, r.start_ns);
    t1 = std::max(t1, r.end_ns);
  }
  return static_cast<double>(t1 - t0);
}

// profile --validate: the dense version of the config (recipe removed, so every Linear is
// dense) and the config itself are stepped in alternation; calibration steps give each
// changed module's speed-up (unless --what-if specs give them), the dense steps' graphs
// give the prediction, the sparse steps the measurement (profile/validate.h).
int profile_validate(const TrainConfig& cfg, const std::vector<WhatIfSpec>& specs, int warmup, int steps,
                     int calibration, const std::string& out) {
  TrainConfig sparse = cfg, dense = cfg;
  dense.recipe_yaml.clear();
  const int64_t need = int64_t(warmup) + (specs.empty() ? calibration : 0) + steps;
  for (TrainConfig* c : {&sparse, &dense}) c->steps = c->schedule.total_steps = std::max<int64_t>(c->steps, need);
  if (cfg.recipe_yaml.empty())
    print_line("note: the config has no recipe, so the sparse run is the dense one again: the error shows the "
               "noise floor of the measurement");
  Trainer sparse_trainer(sparse, out, [](const std::string&) {});
  // Both runs on the device the sparse one got (`auto` may put only the dense one on a GPU).
  dense.device = sparse_trainer.device();
  Trainer dense_trainer(dense, (fs::path(out) / "dense").string(), [](const std::string&) {});
  Profiler profiler(sparse_trainer.device() == "cuda" ? make_cuda_op_recorder() : nullptr);
  const ValidationSteps st = run_validation_steps(
      profiler, [&] { dense_trainer.train_step(); }, [&] { sparse_trainer.train_step(); },
      ValidationPlan{warmup, specs.empty() ? calibration : 0, steps});
  // The modules the recipe changed: Linears whose kind is no longer plain dense.
  std::vector<std::string> modules;
  for (const auto& name : sparse_trainer.model().linear_names()) {
    const Linear<float>& l = sparse_trainer.model().linear(name);
    if (l.kind() != "dense") modules.push_back(l.params().module);
  }
  if (modules.empty() && !cfg.recipe_yaml.empty())
    print_line("note: every Linear was still dense in the profiled steps (does the recipe start later than step " +
               std::to_string(need) + "? --set can move it)");
  SpeedupModel model = specs.empty() ? speedups_from_calibration(st.calibration_dense, st.calibration_sparse, modules)
                                     : speedups_from_specs(specs);
  const ValidationResult v = validate_prediction(st.dense, st.sparse, std::move(model));

  // Reports: the median dense step with the prediction as its what-if, and the median
  // measured sparse step; both carry the validation section.
  const ProfileResult dense_result = Profiler::analyse(st.dense[v.dense_step], v.model.specs);
  const ProfileResult sparse_result = Profiler::analyse(st.sparse[v.sparse_step]);
  const std::string dense_dir = (fs::path(out) / "profile").string();
  const std::string sparse_dir = (fs::path(out) / "profile-sparse").string();
  Profiler::write_reports(dense_dir, dense_result, &v);
  Profiler::write_reports(sparse_dir, sparse_result, &v);
  const std::string json_path = (fs::path(out) / "validate.json").string();
  write_text_file(json_path, validation_json(v));
  std::string files = json_path;
  if (!v.model.groups.empty()) {
    const std::string csv_path = (fs::path(out) / "speedups.csv").string();
    write_text_file(csv_path, speedups_csv(v.model));
    files += ", " + csv_path;
  }
  std::cout << validation_summary(v);
  std::printf("reports: %s/report.html (dense + prediction), %s/report.html (sparse measured); %s\n",
              dense_dir.c_str(), sparse_dir.c_str(), files.c_str());
  return 0;
}

int cmd_profile(const std::vector<std::string>& argv) {
  Args a(argv, "profile", {"config", "out", "warmup", "steps", "calibration-steps"}, {"validate"},
         {"set", "what-if", "what-if-from"});
  const std::string config_path = a.required("config");
  TrainConfig cfg = load_train_config(config_path, a.all("set"));
  const bool validate = a.has("validate");
  const int warmup = static_cast<int>(a.integer("warmup", 1));
  const int steps = static_cast<int>(a.integer("steps", validate ? 5 : 1));
  const int calibration = static_cast<int>(a.integer("calibration-steps", 3));
  ESPLAG_CHECK(warmup >= 0, "profile: --warmup must not be negative");
  ESPLAG_CHECK(steps >= 1, "profile: --steps must be at least 1, got ", steps);
  ESPLAG_CHECK(validate || !a.has("calibration-steps"), "profile: --calibration-steps only applies with --validate");
  ESPLAG_CHECK(calibration >= 1, "profile: --calibration-steps must be at least 1, got ", calibration);
  // Parse the what-if specs before spending time on the run, so a typo fails at once.
  const auto specs = Profiler::what_if_specs(a.all("what-if"), a.all("what-if-from"));
  ESPLAG_CHECK(specs.empty() || !a.has("calibration-steps"),
               "profile: --calibration-steps does not apply with --what-if/--what-if-from (the given speed-ups are used)");
  const std::string out = a.get("out", "runs/" + fs::path(config_path).stem().string() + "-profile");
  if (validate) return profile_validate(cfg, specs, warmup, steps, calibration, out);

  cfg.steps = cfg.schedule.total_steps = std::max<int64_t>(cfg.steps, int64_t(warmup) + steps);
  Trainer trainer(cfg, out, [](const std::string&) {});
  for (int i = 0; i < warmup; ++i) trainer.train_step();
  Profiler profiler(trainer.device() == "cuda" ? make_cuda_op_recorder() : nullptr);
  std::vector<std::vector<OpRecord>> windows;
  std::vector<double> walls, step_ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    profiler.start();
    trainer.train_step();
    windows.push_back(profiler.stop());
    step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    walls.push_back(window_wall_ns(windows.back()));
  }
  // The step with the median wall time stands for the run.
  std::vector<int> order(steps);
  for (int i = 0; i < steps; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return walls[x] < walls[y]; });
  const int chosen = order[(steps - 1) / 2];
  const ProfileResult result = Profiler::analyse(std::move(windows[chosen]), specs);
  const std::string dir = (fs::path(out) / "profile").string();
  Profiler::write_reports(dir, result);
  std::cout << Profiler::summary(result);
  if (steps > 1)
    std::printf("profiled %d steps: wall %.3f ms median (min %.3f, max %.3f); the reports show step %d\n", steps,
                walls[chosen] / 1e6, walls[order.front()] / 1e6, walls[order.back()] / 1e6, chosen);
  std::printf("step measured outside the profiler: %.2f ms\nreports: %s/{report.html,trace.json,ops.csv}\n",
              step_ms[chosen], dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    const std::string threads = take_threads(args);
    if (!threads.empty()) set_num_threads(std::max(1, std::atoi(threads.c_str())));
    if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
      std::cout << kUsage;
      return args.empty() ? 2 : 0;
    }
    if (args[0] == "--version") {
      std::cout << "esplag " << ESPLAG_VERSION << std::endl;
      return 0;
    }
    const std::string cmd = args[0];
    const std::vector<std::string> rest(args.begin() + 1, args.end());
    if (cmd == "data") return cmd_data(rest);
    if (cmd == "tokenizer") return cmd_tokenizer(rest);
    if (cmd == "train") return cmd_train(rest);
    if (cmd == "eval") return cmd_eval(rest);
    if (cmd == "sample") return cmd_sample(rest);
    if (cmd == "bench") return cli::cmd_bench(rest);
    if (cmd == "profile") return cmd_profile(rest);
    if (cmd == "sparsity") return cmd_sparsity(rest);
    if (cmd == "export") return cmd_export(rest);
    std::cerr << "esplag: unknown command '" << cmd << "' (see esplag --help)" << std::endl;
    return 2;
  } catch (const Error& e) {
    std::cerr << "esplag: error: " << e.what() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "esplag: unexpected error: " << e.what() << std::endl;
    return 1;
  }
}
