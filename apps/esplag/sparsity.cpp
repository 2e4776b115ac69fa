// esplag sparsity: per layer, the kind, pattern and density of a checkpoint's weights, and
// whether each stored weight satisfies its pattern.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "model/linear.h"
#include "model/linear_registry.h"
#include "model/transformer.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"
#include "sparse/transposable.h"
#include "train/checkpoint.h"

namespace esplag::cli {

namespace {

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

// Exit code 1 if any layer breaks its pattern.
int sparsity(const Args& a) {
  const std::string ck = resolve_checkpoint(a.get("checkpoint"));
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
    const bool stored_sparse =
        find_linear_kind(base_linear_kind(l.kind()), "linear '" + name + "'").stores_sparse_weight;
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

}  // namespace

const Command kSparsity = {
    "sparsity",
    "per layer of a checkpoint: kind, pattern, density, and whether the weight satisfies its pattern",
    "Exits with 1 when a stored sparse weight breaks its pattern.",
    {
        Option::text("checkpoint", "DIR", "", "a run directory (its latest checkpoint) or a step-NNNNNN directory")
            .mandatory(),
        Option::flag("json", "print the table as JSON"),
        Option::flag("mask-quality", "instead: the weight magnitude each 2:4 mask family would keep"),
    },
    sparsity,
};

}  // namespace esplag::cli
