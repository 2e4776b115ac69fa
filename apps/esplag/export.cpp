// esplag export: a plain dense safetensors of a checkpoint's effective weights, for tools
// that know nothing of compressed layers.
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <map>

#include "commands.h"
#include "core/error.h"
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

// The export never replaces a file of a checkpoint or of a run (which would stop it from
// loading or resuming), nor, without --force, any existing file.
void check_out_path(const std::string& out, bool force) {
  const fs::path p = fs::weakly_canonical(fs::absolute(out));
  ESPLAG_CHECK(!fs::is_directory(p), "export: --out '", out, "' is a directory; give the file to write");
  for (fs::path d = p.parent_path();; d = d.parent_path()) {
    ESPLAG_CHECK(!is_checkpoint_dir(d), "export: --out '", out, "' is inside the checkpoint directory '", d.string(),
                 "'; write the export outside of it");
    ESPLAG_CHECK(!is_run_dir(d), "export: --out '", out, "' is inside the run directory '", d.string(),
                 "'; write the export outside of it");
    if (d == d.parent_path()) break;
  }
  ESPLAG_CHECK(force || !fs::exists(p), "export: --out '", out, "' already exists; give --force to replace it");
}

int export_dense(const Args& a) {
  ESPLAG_CHECK(a.has("dense"), "export: only --dense export exists (a plain dense safetensors)");
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

}  // namespace

const Command kExport = {
    "export",
    "write a checkpoint's weights as a plain dense safetensors",
    "Pruned entries are zeros; the metadata holds the config, the tokenizer and the step. The file may not be\n"
    "inside a checkpoint or run directory, and an existing file is replaced only with --force.",
    {
        Option::text("checkpoint", "DIR", "", "a run directory (its latest checkpoint) or a step-NNNNNN directory")
            .mandatory(),
        Option::flag("dense", "dense export (the only kind; required)"),
        Option::text("out", "FILE.safetensors", "", "the file to write").mandatory(),
        Option::flag("force", "replace --out if it exists"),
    },
    export_dense,
};

}  // namespace esplag::cli
