// Incremental generation on the GPU: the CUDA counterpart of Generator (model/generate.h),
// with the same semantics (per-sequence lengths without padding, prefill then decode_step,
// logits [batch, vocab] of each sequence's last new position, a negative id leaving a
// finished sequence alone with a zero row, positions that do not slide).
//
//   GpuGenerator gen(model, /*max_batch=*/8);
//   std::vector<float> logits = gen.prefill({{1, 2, 3}, {4, 5}});  // [2, vocab], fp32 on the host
//   logits = gen.decode_step({7, 8});
//
// Weights: a snapshot of the host model's at construction, in bf16 on the device (rounded
// as the GPU training model rounds its master weights, ops/gpu_fused.h's master_hi_bits).
// Every block Linear contributes its effective dense weight (Linear::dense_weight: a 2:4
// kind's pruned weight, a slope adapter folded in). Products run in bf16 whatever the
// model's linear precision.
//
// 2:4 prefill (GpuGeneratorOptions::sparse): a block Linear whose effective weight is 2:4
// along its input dimension (at most 2 non-zeros in every 4 consecutive inputs: semi_sparse
// and slope layers without an adapter, or any weight pruned so), with both dimensions
// multiples of 16, is compressed once at construction for cuSPARSELt (sparse/cuda/
// cusparselt.h), and the forward passes of at least sparse_min_rows rows (a prefill of
// batch × prompt positions) run its product as a 2:4 GEMM over the rows rounded up to a
// multiple of 16 (the extra rows' outputs are never read). Decode steps and short
// prefills keep the dense cuBLASLt product of the same weight, kept on the device too: a
// 2:4 product of a few rows does not pay. Each row count gets its own cuSPARSELt plan
// (tuned on first use, sparse/cuda/cusparselt_tuning_cache.h), so the first prefill of a
// new length is slower. The bias is cuSPARSELt's epilogue; GELU runs after the product.
//
// Device state, in one DeviceArena reserved up front (apart from the 2:4 layers' compressed
// weights and the cuSPARSELt workspace): the weights; the KV cache in bf16,
// [layer][max_batch][max_len][n_kv_head · head_dim] for keys and for values (keys after
// RoPE at each sequence's own positions); and the buffers of one forward pass over up to
// chunk_rows positions. Each layer: norm (the residual add fused in), qkv GEMM, RoPE and
// the cache writes, attention, projection, norm, MLP; then the final norm, and the LM head
// on each sequence's last new row only, with fp32 logits.
//
// Passes: the rows of a call, sequence after sequence, run in passes of at most chunk_rows
// rows, each pass's keys and values in the cache before the next. A pass ends early before
// a sequence whose new rows do not fit whole in what is left of it, so that equal prompts
// no longer than chunk_rows each run whole; a prompt longer than chunk_rows is cut into
// passes of chunk_rows rows.
//
// Attention (GpuGeneratorOptions::flash_prefill): a prefill pass whose rows are positions
// 0..T-1 of each of its sequences, the same T for all (a fresh batch of equal prompts, or
// the first chunk_rows positions of a longer prompt), runs the training model's causal
// flash attention over the pass's own q, k and v (ops/gpu_attention.h: cuDNN's fused SDPA
// where it loads, else our tensor-core kernels), as no position before them exists. Every
// other pass (decode steps, prompts of different lengths in one pass, a prompt continued
// past its first pass) runs split-K attention of each row over its sequence's cache
// (ops/gpu_decode.h), in calls of max(max_batch, 1024) rows at most (its workspace grows
// with rows × max_len; the flash attention reuses it).
//
// CUDA graphs: a decode step with N active sequences is captured once per N (after one
// eager run, which tunes the GEMMs outside any capture) and replayed; the rows' ids and
// positions live in device buffers written before each replay, and the attention's grid
// depends on max_len only, so the graph holds for any lengths. Prefill runs eagerly.
//
// Numerics: activations and the residual stream are bf16, every sum fp32 (as the GPU
// training model's forward). Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "model/gpu_generate.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gpu_transformer.h"
#include "model/transformer.h"

namespace esplag {

// Whether 2:4 block Linears run the prefill through cuSPARSELt (see above).
enum class GpuSparse : uint8_t {
  off,        // dense products only
  automatic,  // the layers whose weights are 2:4, when cuSPARSELt loads (else dense, with a warning)
  on          // every block Linear; Error naming the first that is not 2:4, or why cuSPARSELt is missing
};

struct GpuGeneratorOptions {
  // Positions one forward pass takes at most (prefill runs longer calls in passes); 0:
  // max(max_batch, max_len clamped to [1024, 4096], max_batch · max_len up to 8192), so that
  // a prompt of up to 4096 positions runs its attention in one flash pass, and a batch's
  // prompts share passes of up to 8192 rows (larger products run faster).
  int chunk_rows = 0;
  bool cuda_graph = true;  // replay decode steps as CUDA graphs
  // For tests: every buffer is filled with NaN before the weights are written, so that a
  // read of anything not written first shows in the logits.
  bool poison = false;
  GpuSparse sparse = GpuSparse::automatic;
  // Fewest rows a forward pass has for its 2:4 layers to run cuSPARSELt products.
  int sparse_min_rows = 256;
  // Flash attention for the prefill passes that allow it (see above); off: the split-K
  // attention over the cache for every pass.
  bool flash_prefill = true;
};

class GpuGenerator {
 public:
  // Copies the model's weights to the current device (the model is read only, but
  // Linear::dense_weight is reached through the non-const Transformer) and reserves room
  // for max_batch sequences of max_len positions (0: the model's max_seq_len, at most
  // that). Throws Error when the device lacks the memory.
  GpuGenerator(Transformer<float>& model, int max_batch, int max_len = 0, const GpuGeneratorOptions& options = {});
  ~GpuGenerator();
  GpuGenerator(const GpuGenerator&) = delete;
  GpuGenerator& operator=(const GpuGenerator&) = delete;

  // As Generator::prefill: at most max_batch prompts, each non-empty with at most
  // max_length() ids. Returns [prompts.size(), vocab_size] fp32.
  std::vector<float> prefill(const std::vector<std::vector<int32_t>>& prompts);
  // As Generator::decode_step.
  std::vector<float> decode_step(const std::vector<int32_t>& next_ids);

  const ModelConfig& config() const { return cfg_; }
  int batch() const { return static_cast<int>(length_.size()); }
  int length(int b) const { return length_.at(b); }
  int max_batch() const { return max_batch_; }
  int max_length() const { return max_len_; }
  int chunk_rows() const { return chunk_rows_; }
  size_t device_bytes() const;
  // The block Linears (weight names, in model order) whose prefill products run 2:4.
  const std::vector<std::string>& sparse_layers() const { return sparse_layers_; }
  // The 2:4 products run so far (one per layer and sparse pass): small models' 2:4 and dense
  // products can agree to the bit, so this is how a caller knows the sparse path ran.
  int64_t sparse_products() const { return sparse_products_; }
  // Forward passes whose attention ran as flash attention (see above) so far.
  int64_t flash_prefill_passes() const { return flash_prefill_passes_; }
  // Decode steps replayed from a CUDA graph so far.
  int64_t graph_launches() const { return graph_launches_; }
  // The stream every call runs on (for event timing around prefill / decode_step, which
  // return only once their logits are on the host).
  cudaStream_t stream() const { return stream_; }
  // Where a call's time goes, as GpuTransformer::set_op_timing: while on, every op of
  // prefill and decode_step is bracketed by CUDA events (decode steps run eagerly, not from
  // their graph) and op_times() sums the times by op kind since timing was switched on (the
  // block products as "gemm <layer>", 2:4 ones as "sparse gemm <layer>"). Results are the
  // same bits as with timing off.
  void set_op_timing(bool on);
  std::vector<GpuOpTime> op_times() const;

  struct Impl;

 private:
  // Runs tokens[b] at the next positions of sequence b and returns each sequence's logits at
  // its last new position (zero rows for sequences given none); `decode`: one token per
  // sequence at most (the graph path).
  std::vector<float> append(const std::vector<std::vector<int32_t>>& tokens, bool decode);
  // Compresses the block Linears that can run 2:4 (not_24: why the others cannot, by weight
  // name), as options.sparse asks; throws Error for sparse on where one cannot.
  void choose_sparse_layers(const std::map<std::string, std::string>& not_24);
  // One forward pass over the n rows staged on the device, with the head on `a` of them;
  // `sparse`: the 2:4 layers' products through cuSPARSELt; `flash_batch` > 0: the rows are
  // positions 0..n/flash_batch-1 of flash_batch sequences, and the attention runs as flash
  // attention over them (0: split-K attention over the cache).
  void forward_rows(int n, int a, bool sparse, int flash_batch);

  ModelConfig cfg_;
  GpuGeneratorOptions opt_;
  int max_batch_ = 0, max_len_ = 0, chunk_rows_ = 0;
  std::vector<int> length_;
  std::vector<std::string> sparse_layers_;
  int64_t sparse_products_ = 0;
  int64_t flash_prefill_passes_ = 0;
  int64_t graph_launches_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Impl> impl_;
};

}  // namespace esplag
