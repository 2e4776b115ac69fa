// GpuGenerator (model/gpu_generate.h): the weights' snapshot, the KV cache and the
// cached forward pass on the GPU.
#include "model/gpu_generate.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <string_view>

#include "core/cuda_check.h"
#include "core/cuda_graph.h"
#include "core/device_arena.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "model/cuda/step_marks.h"
#include "ops/gpu.h"
#include "ops/gpu_attention.h"
#include "ops/gpu_decode.h"
#include "ops/gpu_fused.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/workspace_24.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"

namespace esplag {

using gpu::bf16;

namespace {

constexpr size_t kAlign = DeviceArena::kDefaultAlignment;
// cuSPARSELt's rule for 16-bit operands: every dimension a multiple of 16.
constexpr int kSparseMultiple = 16;

// Rows of one split-K attention call at most: its workspace grows with rows × max_len, so a
// longer pass runs it in parts rather than sizing the workspace for chunk_rows.
constexpr int kSplitKRows = 1024;

int round_up_rows(int n) { return (n + kSparseMultiple - 1) / kSparseMultiple * kSparseMultiple; }

// GpuGeneratorOptions::chunk_rows's default: whole prompts of up to 4096 positions in a pass
// (one flash pass each), and a batch's prompts together up to 8192 rows (larger products:
// measured 12% faster on llama-1b at batch 32, for 380 MiB more of pass buffers).
int default_chunk_rows(int max_batch, int max_len) {
  return static_cast<int>(std::max<int64_t>(std::clamp(max_len, 1024, 4096),
                                            std::min<int64_t>(int64_t(max_batch) * max_len, 8192)));
}

// Either counts the bytes of an allocation sequence (arena null) or performs it, so the
// arena's size and its layout cannot disagree.
struct Take {
  DeviceArena* arena = nullptr;
  size_t bytes = 0;
  template <typename T>
  T* arr(const std::string& name, size_t count) {
    count = std::max<size_t>(count, 1);
    bytes += (count * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return arena ? arena->allocate_array<T>(name, count) : nullptr;
  }
};

// A host fp32 tensor into device bf16, rounded as the GPU model rounds its master weights.
void upload_bf16(bf16* dst, const float* src, size_t n) {
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) bits[i] = gpu::master_hi_bits(src[i]);
  CUDA_CHECK(cudaMemcpy(dst, bits.data(), n * sizeof(uint16_t), cudaMemcpyHostToDevice));
}

// Where the passes of a call end (increasing row indices, the last one the call's row count),
// given each sequence's new ids in row order: a pass ends before a sequence that does not
// fit whole in what is left of it, or after R rows (the header's "Passes").
std::vector<int> pass_ends(const std::vector<std::vector<int32_t>>& tokens, int R) {
  std::vector<int> ends;
  int start = 0, row = 0;
  for (const auto& t : tokens) {
    const int end = row + static_cast<int>(t.size());
    if (end - start > R && row > start) ends.push_back(start = row);
    while (end - start > R) ends.push_back(start += R);
    row = end;
  }
  if (row > start) ends.push_back(row);
  return ends;
}

// The number of sequences in a pass of n > 0 rows (seq, pos) when the rows are positions
// 0..T-1 of each, the same T for all (what flash attention computes); 0 otherwise.
int flash_sequences(const int32_t* seq, const int32_t* pos, int n) {
  int T = 0;
  while (T < n && seq[T] == seq[0]) ++T;
  if (n % T != 0) return 0;
  for (int i = 0; i < n; ++i)
    if (pos[i] != i % T || seq[i] != seq[i - i % T]) return 0;
  return n / T;
}

}  // namespace

struct GpuGenerator::Impl {
  struct Norm {
    bf16 *w = nullptr, *b = nullptr;
  };
  struct Lin {
    bf16 *w = nullptr, *b = nullptr;
    int out = 0, in = 0;
    const void* packed = nullptr;  // the compressed 2:4 weight of cuSPARSELt, when the layer runs 2:4
  };
  struct Layer {
    Norm n1, n2;
    Lin qkv, proj, fc, mproj;
  };

  std::unique_ptr<DeviceArena> arena;
  std::unique_ptr<gpu::Gemm> gemm;
  std::vector<Layer> layers;
  Norm nf;
  bf16 *wte = nullptr, *wpe = nullptr, *head = nullptr;
  bf16 *k_cache = nullptr, *v_cache = nullptr;  // [layer][max_batch][max_len][KVR]
  size_t layer_cache = 0;                       // elements of one layer's cache
  // One forward pass's buffers, chunk_rows rows each (last: max_batch rows).
  bf16 *x = nullptr, *ln = nullptr, *branch = nullptr, *qkv = nullptr, *atty = nullptr, *fc = nullptr, *act = nullptr,
       *last = nullptr;
  float* logits = nullptr;  // [max_batch, V]
  // The split-K attention's workspace for split_k_rows rows, also the flash attention's (a
  // pass runs one of them): cuDNN's forward plan needs little or none, and where it needs
  // more, attention_forward runs our kernels (which need none) with a warning.
  void* attn_ws = nullptr;
  size_t attn_ws_bytes = 0;
  int split_k_rows = 0;  // max_batch rows at least, so that a decode step is one call (one graph)
  float* lse = nullptr;  // the flash attention's log-sum-exp, [chunk_rows · n_head], never read
  // Staged rows: tokens, sequences, positions (chunk_rows each), then the head's rows (max_batch).
  int32_t* rows = nullptr;
  int32_t* host_rows = nullptr;  // pinned mirror
  float* host_logits = nullptr;  // pinned, [max_batch, V]
  std::map<int, ReplayedGraph> graphs;  // decode steps by row count
  StepMarks marks;                      // op timing (set_op_timing)
  // The 2:4 layers' compressed weights and the cuSPARSELt workspace (grown as plans ask).
  std::vector<DeviceBuffer> packed;
  gpu::Workspace24 sparse_ws{"GpuGenerator"};
  size_t packed_bytes = 0;

  ~Impl() {
    if (host_rows) cudaFreeHost(host_rows);
    if (host_logits) cudaFreeHost(host_logits);
  }

  void lay_out(const ModelConfig& c, int max_batch, int max_len, int chunk_rows, Take& t) {
    // The products' operands have room for a 2:4 product over the rows rounded up to 16.
    const size_t R = round_up_rows(chunk_rows);
    const size_t C = c.d_model, V = c.vocab_size, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
    const bool ln = c.norm == NormKind::layernorm, bias = c.bias;
    auto norm = [&](const std::string& name) {
      return Norm{t.arr<bf16>(name + ".weight", C), ln ? t.arr<bf16>(name + ".bias", C) : nullptr};
    };
    auto lin = [&](const std::string& name, size_t out, size_t in) {
      return Lin{t.arr<bf16>(name + ".weight", out * in), bias ? t.arr<bf16>(name + ".bias", out) : nullptr, int(out),
                 int(in)};
    };
    wte = t.arr<bf16>("embed.tokens.weight", V * C);
    wpe = c.pos == PosKind::learned ? t.arr<bf16>("embed.positions.weight", size_t(c.max_seq_len) * C) : nullptr;
    head = c.tie_embeddings ? wte : t.arr<bf16>("lm_head.weight", V * C);
    layers.assign(c.n_layer, {});
    for (int l = 0; l < c.n_layer; ++l) {
      const std::string p = "blocks." + std::to_string(l) + ".";
      Layer& L = layers[l];
      L.n1 = norm(p + "norm1");
      L.qkv = lin(p + "attn.qkv", Q, C);
      L.proj = lin(p + "attn.proj", C, size_t(c.n_head) * c.head_dim());
      L.n2 = norm(p + "norm2");
      L.fc = lin(p + "mlp.fc", F, C);
      L.mproj = lin(p + "mlp.proj", C, H);
    }
    nf = norm("norm_f");
    layer_cache = size_t(max_batch) * max_len * c.n_kv_head * c.head_dim();
    k_cache = t.arr<bf16>("kv_cache.keys", layer_cache * c.n_layer);
    v_cache = t.arr<bf16>("kv_cache.values", layer_cache * c.n_layer);
    x = t.arr<bf16>("rows.residual", R * C);
    this->ln = t.arr<bf16>("rows.norm", R * C);
    branch = t.arr<bf16>("rows.branch", R * C);
    qkv = t.arr<bf16>("rows.qkv", R * Q);
    atty = t.arr<bf16>("rows.attention", R * size_t(c.n_head) * c.head_dim());
    fc = t.arr<bf16>("rows.fc", R * F);
    act = t.arr<bf16>("rows.mlp", R * H);
    last = t.arr<bf16>("head.rows", max_batch * C);
    logits = t.arr<float>("head.logits", max_batch * V);
    split_k_rows = std::min(chunk_rows, std::max(max_batch, kSplitKRows));
    attn_ws_bytes = gpu::decode_attention_workspace_bytes(split_k_rows, c.n_head, c.head_dim(), max_len);
    attn_ws = t.arr<unsigned char>("attention.workspace", attn_ws_bytes);
    lse = t.arr<float>("attention.lse", size_t(chunk_rows) * c.n_head);
    rows = t.arr<int32_t>("rows.ids", 3 * size_t(chunk_rows) + max_batch);
  }

  // Uploads every weight; with not_24, also says there why a block Linear cannot run 2:4, by
  // weight name (absent: it can).
  void upload_weights(Transformer<float>& m, std::map<std::string, std::string>* not_24) {
    const ModelConfig& c = m.config();
    auto param = [&](bf16* dst, const std::string& name) {
      const Tensor p = m.param(name);
      upload_bf16(dst, p.data<float>(), p.numel());
    };
    auto norm = [&](const Norm& n, const std::string& name) {
      param(n.w, name + ".weight");
      if (n.b) param(n.b, name + ".bias");
    };
    std::vector<float> w;
    auto lin = [&](const Lin& l, const std::string& weight_name) {
      Linear<float>& layer = m.linear(weight_name);
      const LinearParams<float>& p = layer.params();
      w.resize(size_t(p.out_features) * p.in_features);
      layer.dense_weight(w.data());  // the effective weight: pruned, adapters folded in
      upload_bf16(l.w, w.data(), w.size());
      if (l.b) upload_bf16(l.b, p.bias, p.out_features);
      if (!not_24) return;
      // Rounding to bf16 keeps zeros zero, so a 2:4 fp32 weight is a 2:4 bf16 one.
      if (l.out % kSparseMultiple || l.in % kSparseMultiple) {
        (*not_24)[weight_name] = "its shape [" + std::to_string(l.out) + ", " + std::to_string(l.in) +
                                 "] is not a multiple of 16 (cuSPARSELt)";
        return;
      }
      const cpu::PatternCheck check = cpu::check_pattern(w.data(), l.out, l.in, SparsityPattern::nm(2, 4));
      if (!check.ok) (*not_24)[weight_name] = "it is not 2:4 along its inputs: " + check.detail;
    };
    param(wte, "embed.tokens.weight");
    if (wpe) param(wpe, "embed.positions.weight");
    if (!c.tie_embeddings) param(head, "lm_head.weight");
    for (int l = 0; l < c.n_layer; ++l) {
      const std::string p = "blocks." + std::to_string(l) + ".";
      norm(layers[l].n1, p + "norm1");
      norm(layers[l].n2, p + "norm2");
      lin(layers[l].qkv, p + "attn.qkv.weight");
      lin(layers[l].proj, p + "attn.proj.weight");
      lin(layers[l].fc, p + "mlp.fc.weight");
      lin(layers[l].mproj, p + "mlp.proj.weight");
    }
    norm(nf, "norm_f");
  }

  // The layer's 2:4 weight compressed for cuSPARSELt's forward product (W as operand A;
  // the compressed form depends on the weight's shape only, not on the rows of a product).
  void pack(Lin& l, int rows, cudaStream_t s) {
    const auto& g = gpu::SparseGemm24::get(gpu::SparseGemm24Problem::linear_forward(l.out, l.in, rows, l.b != nullptr));
    DeviceBuffer scratch(g.compress_scratch_bytes(), "GpuGenerator", "the 2:4 compression scratch");
    packed.emplace_back(g.compressed_allocation_bytes(), "GpuGenerator", "a compressed 2:4 weight");
    g.compress(packed.back().get(), l.w, scratch.get(), scratch.bytes(), s);
    CUDA_CHECK(cudaStreamSynchronize(s));  // before the scratch is freed
    l.packed = packed.back().get();
    packed_bytes += packed.back().bytes();
  }

  // y [n, out] = x [n, in] · Wᵀ (+ bias) as the 2:4 product over n rounded up to 16 rows.
  // The first product of a row count tunes its plan (which synchronises).
  void sparse_forward(bf16* y, const bf16* x, const Lin& l, int n, cudaStream_t s) {
    auto& g = gpu::SparseGemm24::get(
        gpu::SparseGemm24Problem::linear_forward(l.out, l.in, round_up_rows(n), l.b != nullptr));
    bool tuned = false;  // tune() itself searches once per plan and process
    sparse_ws.tune_once(g, tuned, {&g}, y, l.packed, x, l.b, s);
    g.matmul(y, l.packed, x, l.b, sparse_ws.get(), sparse_ws.bytes(), s);
  }
};

GpuGenerator::GpuGenerator(Transformer<float>& model, int max_batch, int max_len, const GpuGeneratorOptions& options)
    : cfg_(model.config()), opt_(options), impl_(std::make_unique<Impl>()) {
  const ModelConfig& c = cfg_;
  ESPLAG_CHECK(max_batch > 0, "GpuGenerator: max_batch must be positive, got ", max_batch);
  ESPLAG_CHECK(max_len >= 0 && max_len <= c.max_seq_len, "GpuGenerator: max_len=", max_len,
               " must be in [0, max_seq_len=", c.max_seq_len, "] (0: max_seq_len)");
  ESPLAG_CHECK(c.head_dim() <= gpu::kAttentionMaxHeadDim, "GpuGenerator: head size ", c.head_dim(), " above ",
               gpu::kAttentionMaxHeadDim);
  ESPLAG_CHECK(options.chunk_rows >= 0, "GpuGenerator: chunk_rows must not be negative, got ", options.chunk_rows);
  ESPLAG_CHECK(options.sparse_min_rows > 0, "GpuGenerator: sparse_min_rows must be positive, got ",
               options.sparse_min_rows);
  max_batch_ = max_batch;
  max_len_ = max_len == 0 ? c.max_seq_len : max_len;
  chunk_rows_ =
      std::max(max_batch, options.chunk_rows > 0 ? options.chunk_rows : default_chunk_rows(max_batch, max_len_));
  ESPLAG_CHECK(chunk_rows_ <= 65535, "GpuGenerator: chunk_rows=", chunk_rows_, " above 65535");
  Impl& im = *impl_;

  Take count;
  im.lay_out(c, max_batch_, max_len_, chunk_rows_, count);
  const size_t gemm_bytes = gpu::Gemm::kDefaultWorkspaceBytes + gpu::Gemm::kScratchBytes + 2 * kAlign;
  im.arena = std::make_unique<DeviceArena>(count.bytes + gemm_bytes, "generate");
  Take real{im.arena.get()};
  im.lay_out(c, max_batch_, max_len_, chunk_rows_, real);
  im.gemm = std::make_unique<gpu::Gemm>(*im.arena);
  if (opt_.poison) CUDA_CHECK(cudaMemset(im.arena->base(), 0xFF, im.arena->used()));  // bf16 and fp32 NaN
  std::map<std::string, std::string> not_24;
  im.upload_weights(model, opt_.sparse == GpuSparse::off ? nullptr : &not_24);
  CUDA_CHECK(cudaMallocHost(&im.host_rows, (3 * size_t(chunk_rows_) + max_batch_) * sizeof(int32_t)));
  CUDA_CHECK(cudaMallocHost(&im.host_logits, size_t(max_batch_) * c.vocab_size * sizeof(float)));
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (opt_.sparse != GpuSparse::off) choose_sparse_layers(not_24);
}

void GpuGenerator::choose_sparse_layers(const std::map<std::string, std::string>& not_24) {
  const bool required = opt_.sparse == GpuSparse::on;
  std::vector<std::pair<std::string, Impl::Lin*>> chosen;
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    Impl::Layer& L = impl_->layers[l];
    for (auto [name, lin] : {std::pair{p + "attn.qkv.weight", &L.qkv}, std::pair{p + "attn.proj.weight", &L.proj},
                             std::pair{p + "mlp.fc.weight", &L.fc}, std::pair{p + "mlp.proj.weight", &L.mproj}}) {
      const auto why = not_24.find(name);
      if (why == not_24.end())
        chosen.emplace_back(name, lin);
      else
        ESPLAG_CHECK(!required, "2:4 prefill (sparse on): ", name, " cannot run 2:4: ", why->second);
    }
  }
  if (chosen.empty()) return;
  if (!gpu::cusparselt_available()) {
    ESPLAG_CHECK(!required, "2:4 prefill (sparse on): cuSPARSELt is not available (",
                 gpu::cusparselt_unavailable_reason(), "); ESPLAG_CUSPARSELT_LIB names its file or folder");
    gpu::warn_cusparselt_fallback_once("GpuGenerator's 2:4 prefill");
    return;
  }
  for (auto& [name, lin] : chosen) {
    impl_->pack(*lin, round_up_rows(chunk_rows_), stream_);
    sparse_layers_.push_back(name);
  }
}

GpuGenerator::~GpuGenerator() {
  if (stream_) cudaStreamSynchronize(stream_);
  impl_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

void GpuGenerator::set_op_timing(bool on) { impl_->marks.set_timing(on); }

std::vector<GpuOpTime> GpuGenerator::op_times() const { return impl_->marks.totals(); }

size_t GpuGenerator::device_bytes() const { return impl_->arena->capacity() + impl_->packed_bytes; }

std::vector<float> GpuGenerator::prefill(const std::vector<std::vector<int32_t>>& prompts) {
  ESPLAG_CHECK(!prompts.empty(), "generation needs at least one prompt");
  ESPLAG_CHECK(static_cast<int>(prompts.size()) <= max_batch_, "GpuGenerator: ", prompts.size(),
               " prompts, more than its max_batch=", max_batch_);
  for (size_t b = 0; b < prompts.size(); ++b) ESPLAG_CHECK(!prompts[b].empty(), "prompt ", b, " has no tokens");
  const std::vector<int> before = length_;
  length_.assign(prompts.size(), 0);
  try {
    return append(prompts, false);
  } catch (...) {
    length_ = before;  // a prompt that does not fit changes nothing
    throw;
  }
}

std::vector<float> GpuGenerator::decode_step(const std::vector<int32_t>& next_ids) {
  ESPLAG_CHECK(static_cast<int>(next_ids.size()) == batch(), "decode_step got ", next_ids.size(),
               " ids for a batch of ", batch(), " sequences");
  std::vector<std::vector<int32_t>> tokens(next_ids.size());
  for (size_t b = 0; b < next_ids.size(); ++b)
    if (next_ids[b] >= 0) tokens[b] = {next_ids[b]};
  return append(tokens, true);
}

std::vector<float> GpuGenerator::append(const std::vector<std::vector<int32_t>>& tokens, bool decode) {
  const int V = cfg_.vocab_size, B = batch(), R = chunk_rows_;
  for (int b = 0; b < B; ++b) {  // checked first, so an error changes nothing
    for (int32_t id : tokens[b])
      ESPLAG_CHECK(id >= 0 && id < V, "token ", id, " of sequence ", b, " is outside the vocabulary [0, ", V, ")");
    const size_t reach = length_[b] + tokens[b].size();
    ESPLAG_CHECK(reach <= size_t(max_len_), "sequence ", b, " would reach ", reach, " positions, past ",
                 max_len_ == cfg_.max_seq_len ? "the model's max_seq_len=" : "the generator's max_len=", max_len_,
                 " (positions do not slide)");
  }
  // The rows of this call, sequence after sequence, and each sequence's last one.
  std::vector<int32_t> tok, seq, pos;
  std::vector<int> last_row(B, -1);
  for (int b = 0; b < B; ++b) {
    for (size_t i = 0; i < tokens[b].size(); ++i) {
      tok.push_back(tokens[b][i]);
      seq.push_back(b);
      pos.push_back(length_[b] + static_cast<int>(i));
    }
    if (!tokens[b].empty()) last_row[b] = static_cast<int>(tok.size()) - 1;
    length_[b] += static_cast<int>(tokens[b].size());
  }
  std::vector<float> out(size_t(B) * V, 0.0f);
  Impl& im = *impl_;
  int c0 = 0;
  for (const int c1 : pass_ends(tokens, R)) {
    const int n = c1 - c0;
    std::copy_n(tok.begin() + c0, n, im.host_rows);
    std::copy_n(seq.begin() + c0, n, im.host_rows + R);
    std::copy_n(pos.begin() + c0, n, im.host_rows + 2 * R);
    std::vector<int> heads;  // the sequences whose last new row is in this chunk
    for (int b = 0; b < B; ++b)
      if (last_row[b] >= c0 && last_row[b] < c0 + n) {
        im.host_rows[3 * R + heads.size()] = last_row[b] - c0;
        heads.push_back(b);
      }
    const int a = static_cast<int>(heads.size());
    CUDA_CHECK(cudaMemcpyAsync(im.rows, im.host_rows, (3 * size_t(R) + max_batch_) * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream_));
    if (decode && opt_.cuda_graph && !im.marks.timing())  // one row per sequence: the graph of n rows holds
      im.graphs[n].run(stream_, graph_launches_, [&] { forward_rows(n, a, false, 0); }, "GpuGenerator");
    else
      forward_rows(n, a, !decode && n >= opt_.sparse_min_rows && !sparse_layers_.empty(),
                   !decode && opt_.flash_prefill ? flash_sequences(seq.data() + c0, pos.data() + c0, n) : 0);
    if (im.marks.timing()) {
      im.marks.end_ops();
      im.marks.collect(stream_);
    }
    CUDA_CHECK(cudaMemcpyAsync(im.host_logits, im.logits, size_t(a) * V * sizeof(float), cudaMemcpyDeviceToHost,
                               stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int i = 0; i < a; ++i)
      std::copy_n(im.host_logits + size_t(i) * V, V, out.data() + size_t(heads[i]) * V);
    c0 = c1;
  }
  return out;
}

void GpuGenerator::forward_rows(int n, int a, bool sparse, int flash_batch) {
  const ModelConfig& c = cfg_;
  Impl& im = *impl_;
  cudaStream_t s = stream_;
  const int C = c.d_model, V = c.vocab_size, H = c.d_ff, R = chunk_rows_;
  const int NH = c.n_head, NKV = c.n_kv_head, HD = c.head_dim();
  const int32_t *tok = im.rows, *seq = im.rows + R, *pos = im.rows + 2 * R, *heads = im.rows + 3 * R;
  auto mark = [&](std::string_view op, double flops = 0) { im.marks.mark(s, op, flops); };
  // ln = norm(x + branch), the sum kept in x (x alone when branch is null).
  auto norm = [&](const Impl::Norm& nm, const bf16* branch) {
    mark("norm");
    if (c.norm == NormKind::layernorm)
      gpu::layernorm_forward(im.ln, nullptr, nullptr, im.x, im.x, branch, nm.w, nm.b, n, C, s, float(c.norm_eps));
    else
      gpu::rmsnorm_forward(im.ln, nullptr, im.x, im.x, branch, nm.w, n, C, s, float(c.norm_eps));
  };
  // y = x · Wᵀ (+ bias) over the n rows, then GELU into gelu_out when given: the 2:4 product
  // where this pass is sparse and the layer has a compressed weight, else the dense one.
  auto linear = [&](const char* op, bf16* y, const bf16* x, const Impl::Lin& L, bf16* gelu_out = nullptr) {
    im.marks.mark_product(s, op, 2.0 * n * L.in * L.out, sparse && L.packed);
    if (sparse && L.packed) {
      im.sparse_forward(y, x, L, n, s);
      ++sparse_products_;
      if (gelu_out) {
        mark("gelu");
        gpu::gelu_forward(gelu_out, y, int64_t(n) * L.out, s);
      }
    } else if (gelu_out) {
      im.gemm->forward(gelu_out, x, L.w, L.b, n, L.in, L.out, s, gpu::Gemm::Act::gelu);
    } else {
      im.gemm->forward(y, x, L.w, L.b, n, L.in, L.out, s);
    }
  };
  if (flash_batch > 0) ++flash_prefill_passes_;
  mark("embedding");
  gpu::embedding_rows(im.x, tok, pos, im.wte, im.wpe, n, C, V, s);
  for (int l = 0; l < c.n_layer; ++l) {
    const Impl::Layer& L = im.layers[l];
    bf16* kc = im.k_cache + l * im.layer_cache;
    bf16* vc = im.v_cache + l * im.layer_cache;
    norm(L.n1, l == 0 ? nullptr : im.branch);
    linear("gemm qkv", im.qkv, im.ln, L.qkv);
    if (c.pos == PosKind::rope) {
      mark("rope");
      gpu::rope_rows(im.qkv, pos, n, NH, NKV, HD, c.rope_theta, s);
    }
    mark("kv cache store");
    gpu::store_kv_rows(kc, vc, im.qkv, seq, pos, n, NH, NKV, HD, max_len_, s);
    mark(flash_batch > 0 ? "attention (flash)" : "attention (split-K over the cache)");
    if (flash_batch > 0)  // [B, T, ·] rows: the pass's own keys and values are all there is
      gpu::attention_forward(im.atty, im.lse, im.qkv, flash_batch, n / flash_batch, NH, NKV, HD, im.attn_ws,
                             im.attn_ws_bytes, s);
    else
      for (int r0 = 0; r0 < n; r0 += im.split_k_rows) {
        const int rows = std::min(im.split_k_rows, n - r0);
        gpu::decode_attention(im.atty + size_t(r0) * NH * HD, im.qkv + size_t(r0) * c.qkv_dim(), kc, vc, seq + r0,
                              pos + r0, rows, NH, NKV, HD, max_len_, im.attn_ws, im.attn_ws_bytes, s);
      }
    linear("gemm proj", im.branch, im.atty, L.proj);
    norm(L.n2, im.branch);
    switch (c.mlp) {
      case MlpKind::gelu: linear("gemm fc", im.fc, im.ln, L.fc, im.act); break;
      case MlpKind::swiglu:
        linear("gemm fc", im.fc, im.ln, L.fc);
        mark("swiglu");
        gpu::swiglu_forward(im.act, im.fc, n, H, s);
        break;
      case MlpKind::relu2:
        linear("gemm fc", im.fc, im.ln, L.fc);
        mark("relu2");
        gpu::relu2_forward(im.act, im.fc, int64_t(n) * H, s);
        break;
    }
    linear("gemm mproj", im.branch, im.act, L.mproj);
  }
  norm(im.nf, im.branch);
  if (a == 0) return;
  mark("head (gather + gemm)", 2.0 * a * C * V);
  gpu::gather_rows(im.last, im.ln, heads, a, C, s);
  im.gemm->forward(im.logits, im.last, im.head, a, C, V, s);
}

}  // namespace esplag
