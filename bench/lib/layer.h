// `esplag bench layer`: one Linear layer's training step on the GPU (sparse/cuda/
// sparse_linear.h) for each kind against dense, in the same process on the same inputs:
// the per-step weight preparation, the forward, and the backward (dX and the fp32 dW).
//
// Per shape and kind: random non-zero bf16 inputs (|x| in [0.1, 1), W scaled by 1/√in),
// one untimed step that tunes the cuSPARSELt products (a search once per problem, or the
// tuning cache's entry), then `warmup` untimed steps and `iters` timed ones. prep, fwd and
// bwd are medians of CUDA-event times of each part alone; total is the median of whole
// steps (prepare + forward + backward between one pair of events), so it includes the
// weight preparation that the sparse kinds pay at every step. The speed-up is dense's
// total over the kind's total.
//
// With sparse_dw, each sparse kind is timed a second time with SparseLinearOptions::
// sparse_dw (dW from the 2:4 MVUE of dYᵀ: its fused compression, the 2:4 product and the
// widening into fp32 count in bwd and total), as an extra row labelled
// "<kind>+sparse_dw" right after the kind's own row, against the same dense baseline.
//
// semi_sparse_activation (sparse/cuda/sparse_activation_linear.h: X pruned 2:4 at every
// forward, the forward a 2:4 product of the pruned X, dX and dW dense) is timed once per
// pattern in `activation`, rows labelled "activation:row_24" / "activation:tile_24"; it has
// no weight preparation (prep 0: the pruning of X is part of fwd and, again for dW, of bwd).
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "bench/lib/layer.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cstdint>
#include <string>
#include <vector>

#include "sparse/cuda/sparse_activation_linear.h"
#include "sparse/cuda/sparse_linear.h"

namespace esplag {

struct LayerBenchShape {
  int64_t out = 0, in = 0, tokens = 0;  // W [out, in], N = tokens
  friend bool operator==(const LayerBenchShape&, const LayerBenchShape&) = default;
};

// The MLP projections of llama-1b (5632×2048, 2048×5632) and llama-7b (11008×4096,
// 4096×11008), each over 8192 tokens (out × in × tokens).
std::vector<LayerBenchShape> default_layer_bench_shapes();

struct LayerBenchOptions {
  std::vector<LayerBenchShape> shapes = default_layer_bench_shapes();
  // Dense is always timed first (the baseline), whether listed or not.
  std::vector<gpu::SparseLinearKind> kinds = {gpu::SparseLinearKind::dense, gpu::SparseLinearKind::semi_sparse,
                                              gpu::SparseLinearKind::slope};
  // semi_sparse_activation's patterns to time (empty: none), after the kinds.
  std::vector<ActivationSparsity> activation = {ActivationSparsity::row_24, ActivationSparsity::tile_24};
  // Also time every sparse kind with sparse dW (rows "<kind>+sparse_dw"); shapes whose out
  // or tokens are not multiples of 64 give those rows with the reason instead.
  bool sparse_dw = false;
  int warmup = 5;
  int iters = 20;
};

struct LayerBenchRow {
  LayerBenchShape shape;
  gpu::SparseLinearKind kind = gpu::SparseLinearKind::dense;
  bool sparse_dw = false;  // the layer was built with sparse_dw (label "<kind>+sparse_dw")
  // A semi_sparse_activation row (kind unused), with its pattern.
  bool activation = false;
  ActivationSparsity pattern = ActivationSparsity::row_24;
  bool ran = false;
  bool sparse = false;  // 2:4 products ran (false: dense, or the fallback without cuSPARSELt)
  std::string note;     // why it did not run
  double prep_ms = 0, fwd_ms = 0, bwd_ms = 0, total_ms = 0;
  double speedup = 0;  // dense total / this total (0 when either did not run)
};

struct LayerBenchResult {
  std::string gpu;
  int cusparselt_version = 0;          // 0: not available
  std::string cusparselt_unavailable;  // the reason, when not available
  int warmup = 0, iters = 0;
  std::vector<LayerBenchRow> rows;
};

// Throws Error on bad options or when the dense baseline fails; a kind that cannot run a
// shape gives a row with the reason.
LayerBenchResult run_layer_bench(const LayerBenchOptions& options);

// A row's kind as the table and the CSV write it: the kind's name, "+sparse_dw" appended
// for the rows timed with sparse dW; "activation:<pattern>" for semi_sparse_activation.
std::string layer_bench_kind_label(const LayerBenchRow& row);

// The human table (kind, shape, prep / fwd / bwd / total ms, speed-up); it ends with the
// rows at >= 1.3x dense.
std::string layer_bench_table(const LayerBenchResult& r);
// CSV with a leading `commit` column; the kind column holds layer_bench_kind_label.
std::string layer_bench_csv_header();
std::string layer_bench_csv_rows(const LayerBenchResult& r, const std::string& commit);

}  // namespace esplag
