// esplag export: a checkpoint's effective weights, for tools that know nothing of compressed
// layers: a plain dense safetensors (--dense), or a Hugging Face model directory (--hf).
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>

#include "commands.h"
#include "core/error.h"
#include "interop/hf_export.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/linear.h"
#include "model/transformer.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace esplag::cli {

namespace {

bool is_checkpoint_dir(const fs::path& d) {
  const std::string name = d.filename().string();
  const bool step_name =
      name.rfind("step-", 0) == 0 && name.size() > 5 && std::isdigit(static_cast<unsigned char>(name[5]));
  return step_name || fs::exists(d / "model.safetensors") || fs::exists(d / "state.json");
}

// A run directory names its newest checkpoint in `latest`.
bool is_run_dir(const fs::path& d) {
  return fs::is_regular_file(d / "latest") && read_file((d / "latest").string()).rfind("step-", 0) == 0;
}

// The export never writes into a checkpoint or a run (which would stop it from loading or
// resuming).
void check_not_inside_run(const fs::path& p, const std::string& option, const std::string& out) {
  for (fs::path d = p.parent_path();; d = d.parent_path()) {
    ESPLAG_CHECK(!is_checkpoint_dir(d), "export: ", option, " '", out, "' is inside the checkpoint directory '",
                 d.string(), "'; write the export outside of it");
    ESPLAG_CHECK(!is_run_dir(d), "export: ", option, " '", out, "' is inside the run directory '", d.string(),
                 "'; write the export outside of it");
    if (d == d.parent_path()) break;
  }
}

// Nor, without --force, does it replace any existing file.
void check_out_path(const std::string& out, bool force) {
  const fs::path p = fs::weakly_canonical(fs::absolute(out));
  ESPLAG_CHECK(!fs::is_directory(p), "export: --out '", out, "' is a directory; give the file to write");
  check_not_inside_run(p, "--out", out);
  ESPLAG_CHECK(force || !fs::exists(p), "export: --out '", out, "' already exists; give --force to replace it");
}

// --hf DIR: a new or empty directory, or with --force any directory but a checkpoint's or a run's.
void check_hf_dir(const std::string& dir, bool force) {
  const fs::path p = fs::weakly_canonical(fs::absolute(dir));
  check_not_inside_run(p, "--hf", dir);
  if (!fs::exists(p)) return;
  ESPLAG_CHECK(fs::is_directory(p), "export: --hf '", dir, "' exists and is not a directory");
  ESPLAG_CHECK(!is_run_dir(p) && !fs::exists(p / "state.json") && !fs::exists(p / "latest"), "export: --hf '", dir,
               "' is an esplag checkpoint or run directory; write the export elsewhere");
  ESPLAG_CHECK(force || fs::is_empty(p), "export: --hf '", dir,
               "' is not empty; give --force to replace its config.json, model.safetensors and tokenizer.json");
}

int export_hf_dir(const Args& a) {
  ESPLAG_CHECK(!a.has("out") && !a.has("dense"), "export: --hf DIR writes a directory; --dense and --out ",
               "are for the single-file export");
  const std::string dir = a.get("hf");
  check_hf_dir(dir, a.has("force"));
  const std::string ck = resolve_checkpoint(a.get("checkpoint"));
  CheckpointContents info;
  const auto model = load_model(ck, &info);
  const HfExport e = export_hf(*model, info.tokenizer, dir, a.has("sparse-24"));
  std::printf("wrote %s: %s (%s), %zu tensors, %.2fM parameters (%s)\n", dir.c_str(), e.config.model_type.c_str(),
              e.config.family == HfFamily::gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM", e.tensors,
              model->num_params() / 1e6, a.has("sparse-24") ? "f32, block linears 2:4 compressed" : "dense f32");
  if (a.has("sparse-24"))
    std::printf("compressed-tensors sparse-24-bitmask: %zu weights compressed, global sparsity %.3f\n", e.compressed,
                e.global_sparsity);
  if (!e.tokenizer_note.empty()) std::printf("note: %s\n", e.tokenizer_note.c_str());
  return 0;
}

int export_dense(const Args& a) {
  ESPLAG_CHECK(!a.has("sparse-24"), "export: --sparse-24 is a layout of the --hf DIR export");
  ESPLAG_CHECK(a.has("dense"), "export: give --dense (a plain dense safetensors) or --hf DIR (a Hugging Face model ",
               "directory)");
  ESPLAG_CHECK(a.has("out"), "export: --out is required with --dense (the FILE.safetensors to write)");
  const std::string out = a.get("out");
  check_out_path(out, a.has("force"));
  const std::string ck = resolve_checkpoint(a.get("checkpoint"));
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

int run_export(const Args& a) { return a.has("hf") ? export_hf_dir(a) : export_dense(a); }

}  // namespace

const Command kExport = {
    "export",
    "write a checkpoint's weights as a dense safetensors or a Hugging Face model directory",
    "--dense --out FILE: one safetensors of every parameter (pruned entries are zeros); the metadata holds the\n"
    "config, the tokenizer and the step. --hf DIR: config.json, model.safetensors and tokenizer.json that\n"
    "transformers' AutoModelForCausalLM.from_pretrained loads (GPT-2- or LLaMA-shaped models; see\n"
    "docs/interop.md); with --sparse-24, LLaMA-shaped models whose block linears are 2:4 are written in the\n"
    "compressed 2:4 layout of the compressed-tensors format (sparse-24-bitmask) that vLLM reads. Neither may\n"
    "be inside a checkpoint or run directory; an existing file, or a non-empty --hf directory, is replaced only\n"
    "with --force.",
    {
        Option::text("checkpoint", "DIR", "", "a run directory (its latest checkpoint) or a step-NNNNNN directory")
            .mandatory(),
        Option::flag("dense", "a single dense safetensors file (with --out)"),
        Option::text("out", "FILE.safetensors", "", "the file --dense writes"),
        Option::text("hf", "DIR", "", "write a Hugging Face model directory instead"),
        Option::flag("sparse-24", "with --hf: block linears in compressed-tensors' sparse-24-bitmask layout"),
        Option::flag("force", "replace --out if it exists, or the files of a non-empty --hf directory"),
    },
    run_export,
};

}  // namespace esplag::cli
