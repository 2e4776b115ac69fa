#include "model/transformer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>

#include "core/error.h"
#include "core/op_trace.h"
#include "core/rng.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/distill.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/norm.h"

namespace esplag {

namespace {
std::string block_prefix(int l) { return "blocks." + std::to_string(l) + "."; }
// Rows of the LM head computed at once: bounds the logits scratch to kHeadChunk × vocab.
constexpr int kHeadChunk = 256;

// The tensors a block's forward saves for its backward.
enum BlockTensor {
  kLn1, kLn1Mean, kLn1Rstd,  // norm1's output and statistics
  kQkv,                      // q, k, v (after RoPE)
  kAtt, kAtty,               // the attention's probabilities and output
  kResMid,                   // the residual stream after the attention
  kLn2, kLn2Mean, kLn2Rstd,  // norm2's output and statistics
  kFc, kAct,                 // the MLP's first Linear output and its activation
  kResOut,                   // the block's output
  kBlockTensors
};

std::array<size_t, kBlockTensors> block_tensor_elements(const ModelConfig& c, int B, int Tlen) {
  const size_t N = size_t(B) * Tlen, C = c.d_model;
  std::array<size_t, kBlockTensors> n{};
  n[kLn1] = n[kResMid] = n[kLn2] = n[kResOut] = N * C;
  n[kLn1Mean] = n[kLn1Rstd] = n[kLn2Mean] = n[kLn2Rstd] = N;
  n[kQkv] = N * c.qkv_dim();
  n[kAtt] = size_t(B) * c.n_head * Tlen * Tlen;
  n[kAtty] = N * c.n_head * c.head_dim();
  n[kFc] = N * c.fc_dim();
  n[kAct] = N * c.d_ff;
  return n;
}

// Whether block l stores tensor t itself; otherwise t lives in the buffers all checkpointed
// blocks share and is recomputed in the backward. full keeps the block's output (its input
// is the previous block's); selective the Linear outputs and the residual stream, so that
// only the norms, the attention's probabilities and the MLP activation are recomputed.
// RoPE rotates qkv in place, so q and k are kept rotated and RoPE is not run again.
bool block_stores(const ActivationCheckpointing& ckpt, int l, int t) {
  if (!ckpt.checkpoints(l)) return true;
  if (ckpt.mode == CheckpointMode::full) return t == kResOut;
  return t == kQkv || t == kAtty || t == kResMid || t == kFc || t == kResOut;
}
}  // namespace

template <typename T>
struct Transformer<T>::Block {
  std::string prefix;  // "blocks.3", the start of every op name in this block
  Norm norm1, norm2;
  std::unique_ptr<Linear<T>> qkv, attn_proj, fc, mlp_proj;
};

template <typename T>
struct Transformer<T>::BlockView : std::array<T*, kBlockTensors> {};

// Everything forward saves for backward, sized for B×T tokens, plus backward scratch.
template <typename T>
struct Transformer<T>::Activations {
  int B = 0, Tlen = 0;
  ActivationCheckpointing ckpt;
  using Layer = std::array<std::vector<T>, kBlockTensors>;  // by BlockTensor
  std::vector<T> embed;  // the residual stream entering block 0
  std::vector<Layer> layers;  // the tensors a block does not store are left empty
  Layer shared;               // those tensors of the checkpointed blocks, one block at a time
  std::vector<T> lnf, lnf_mean, lnf_rstd;
  // backward scratch
  std::vector<T> dres, dln, dqkv, datty, dfc, dact, dlnf, logits, dlogits, losses;
  std::vector<T> teacher_logits, kl;  // a chunk's, when distilling (allocated by the first such step)

  BlockView view(int l) {
    BlockView v;
    for (int t = 0; t < kBlockTensors; ++t) v[t] = (block_stores(ckpt, l, t) ? layers[l][t] : shared[t]).data();
    return v;
  }
};

std::vector<ParamInfo> transformer_param_layout(const ModelConfig& cfg) {
  cfg.validate();
  std::vector<ParamInfo> infos;
  auto add = [&](const std::string& name, const Shape& shape, bool decay) {
    ParamInfo i;
    i.name = name;
    i.shape = shape;
    i.numel = static_cast<size_t>(shape_numel(shape));
    i.decay = decay;
    i.offset = infos.empty() ? 0 : infos.back().offset + infos.back().numel;
    infos.push_back(std::move(i));
  };
  const int C = cfg.d_model, V = cfg.vocab_size;
  const bool ln = cfg.norm == NormKind::layernorm;
  add("embed.tokens.weight", {V, C}, true);
  if (cfg.pos == PosKind::learned) add("embed.positions.weight", {cfg.max_seq_len, C}, true);
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string b = block_prefix(l);
    auto linear = [&](const std::string& name, int out, int in) {
      add(b + name + ".weight", {out, in}, true);
      if (cfg.bias) add(b + name + ".bias", {out}, false);
    };
    add(b + "norm1.weight", {C}, false);
    if (ln) add(b + "norm1.bias", {C}, false);
    linear("attn.qkv", cfg.qkv_dim(), C);
    linear("attn.proj", C, cfg.n_head * cfg.head_dim());
    add(b + "norm2.weight", {C}, false);
    if (ln) add(b + "norm2.bias", {C}, false);
    linear("mlp.fc", cfg.fc_dim(), C);
    linear("mlp.proj", C, cfg.d_ff);
  }
  add("norm_f.weight", {C}, false);
  if (ln) add("norm_f.bias", {C}, false);
  if (!cfg.tie_embeddings) add("lm_head.weight", {V, C}, true);
  return infos;
}

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config) : cfg_(config) {
  cfg_.validate();
  const int L = cfg_.n_layer;
  const bool ln = cfg_.norm == NormKind::layernorm;
  infos_ = transformer_param_layout(cfg_);
  const size_t total = infos_.back().offset + infos_.back().numel;
  params_.assign(total, T(0));
  grads_ = ZeroedArray<T>(total);

  // Pointers into the flat buffers never move after this point: cache them.
  auto norm = [&](const std::string& name) {
    Norm n;
    n.name = name;
    n.w = p(name + ".weight");
    n.dw = g(name + ".weight");
    if (ln) n.b = p(name + ".bias"), n.db = g(name + ".bias");
    return n;
  };
  wte_ = p("embed.tokens.weight");
  dwte_ = g("embed.tokens.weight");
  if (cfg_.pos == PosKind::learned) wpe_ = p("embed.positions.weight"), dwpe_ = g("embed.positions.weight");
  head_w_ = cfg_.tie_embeddings ? wte_ : p("lm_head.weight");
  head_dw_ = cfg_.tie_embeddings ? dwte_ : g("lm_head.weight");
  norm_f_ = norm("norm_f");
  fp8_histories_.assign(transformer_linear_names(cfg_).size(), Fp8AmaxHistory(linear_precision_.amax_history));
  blocks_.resize(L);
  for (int l = 0; l < L; ++l) {
    const std::string b = block_prefix(l);
    blocks_[l].prefix = b.substr(0, b.size() - 1);
    blocks_[l].norm1 = norm(b + "norm1");
    blocks_[l].norm2 = norm(b + "norm2");
    blocks_[l].qkv = std::make_unique<DenseLinear<T>>(linear_params(b + "attn.qkv.weight"));
    blocks_[l].attn_proj = std::make_unique<DenseLinear<T>>(linear_params(b + "attn.proj.weight"));
    blocks_[l].fc = std::make_unique<DenseLinear<T>>(linear_params(b + "mlp.fc.weight"));
    blocks_[l].mlp_proj = std::make_unique<DenseLinear<T>>(linear_params(b + "mlp.proj.weight"));
  }
}

template <typename T>
Transformer<T>::~Transformer() = default;

template <typename T>
const ParamInfo& Transformer<T>::param_info(const std::string& name) const {
  for (const auto& info : infos_)
    if (info.name == name) return info;
  fail("model has no parameter named '", name, "'");
}

template <typename T>
T* Transformer<T>::p(const std::string& name) {
  return params_.data() + param_info(name).offset;
}
template <typename T>
T* Transformer<T>::g(const std::string& name) {
  return grads_.data() + param_info(name).offset;
}

template <typename T>
Tensor Transformer<T>::param(const std::string& name) const {
  const auto& info = param_info(name);
  // The view is writable: callers that hold a const model only read through it.
  return Tensor::borrow(const_cast<T*>(params_.data()) + info.offset, info.shape, sizeof(T) == 4 ? DType::f32 : DType::f64,
                        Device::cpu, name);
}
template <typename T>
Tensor Transformer<T>::grad(const std::string& name) const {
  const auto& info = param_info(name);
  return Tensor::borrow(const_cast<T*>(grads_.data()) + info.offset, info.shape, sizeof(T) == 4 ? DType::f32 : DType::f64,
                        Device::cpu, name + ".grad");
}

template <typename T>
void Transformer<T>::init_weights(uint64_t seed) {
  Rng rng(seed);
  const double residual_scale = 1.0 / std::sqrt(2.0 * cfg_.n_layer);
  for (const auto& info : infos_) {
    T* w = params_.data() + info.offset;
    const bool is_norm = info.name.find("norm") != std::string::npos;
    const bool is_bias = info.name.size() > 5 && info.name.compare(info.name.size() - 5, 5, ".bias") == 0;
    if (is_bias) {
      std::fill(w, w + info.numel, T(0));
    } else if (is_norm) {
      std::fill(w, w + info.numel, T(1));
    } else {
      const bool residual_out = info.name.find("attn.proj.weight") != std::string::npos ||
                                info.name.find("mlp.proj.weight") != std::string::npos;
      const double std = cfg_.init_std * (residual_out ? residual_scale : 1.0);
      fill_normal(rng, w, info.numel, std);
    }
  }
}

template <typename T>
void Transformer<T>::zero_grad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
  for (const auto& name : linear_names())
    for (auto& op : linear(name).owned_params()) std::fill(op.grad, op.grad + shape_numel(op.shape), T(0));
}

template <typename T>
std::vector<OwnedParam<T>> Transformer<T>::trainable_params() {
  std::vector<std::string> skipped;
  std::vector<OwnedParam<T>> owned;
  for (const auto& name : linear_names()) {
    Linear<T>& l = linear(name);
    if (!l.trains_dense_weight()) skipped.push_back(name);
    for (auto& op : l.owned_params()) owned.push_back(std::move(op));
  }
  std::vector<OwnedParam<T>> out;
  for (const auto& info : infos_) {
    if (std::find(skipped.begin(), skipped.end(), info.name) != skipped.end()) continue;
    out.push_back({info.name, info.shape, params_.data() + info.offset, grads_.data() + info.offset, info.decay});
  }
  for (auto& op : owned) out.push_back(std::move(op));
  return out;
}

template <typename T>
void Transformer<T>::on_step_begin(int64_t step) {
  for (const auto& name : linear_names()) linear(name).on_step_begin(step);
}

template <typename T>
void Transformer<T>::after_optimizer_step() {
  for (const auto& name : linear_names()) linear(name).after_optimizer_step();
}

template <typename T>
LinearParams<T> Transformer<T>::linear_params(const std::string& weight_name) {
  const auto& info = param_info(weight_name);
  ESPLAG_CHECK(info.shape.size() == 2, "parameter '", weight_name, "' is not a matrix");
  LinearParams<T> lp;
  lp.name = weight_name;
  lp.module = weight_name.substr(0, weight_name.size() - 7);  // without ".weight"
  if (weight_name.rfind("blocks.", 0) == 0) lp.layer = std::stoi(weight_name.substr(7));
  lp.out_features = static_cast<int>(info.shape[0]);
  lp.in_features = static_cast<int>(info.shape[1]);
  lp.weight = params_.data() + info.offset;
  lp.dweight = grads_.data() + info.offset;
  lp.precision = linear_precision_;
  const std::vector<std::string> names = linear_names();
  const auto at = std::find(names.begin(), names.end(), weight_name);
  if (at != names.end()) lp.fp8_history = &fp8_histories_[size_t(at - names.begin())];
  const std::string bias_name = weight_name.substr(0, weight_name.size() - 7) + ".bias";  // "weight" -> "bias"
  for (const auto& bi : infos_)
    if (bi.name == bias_name) {
      lp.bias = params_.data() + bi.offset;
      lp.dbias = grads_.data() + bi.offset;
    }
  return lp;
}

std::vector<std::string> transformer_linear_names(const ModelConfig& config) {
  std::vector<std::string> names;
  for (int l = 0; l < config.n_layer; ++l)
    for (const char* n : {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"})
      names.push_back(block_prefix(l) + n + ".weight");
  return names;
}

template <typename T>
std::vector<std::string> Transformer<T>::linear_names() const {
  return transformer_linear_names(cfg_);
}

template <typename T>
Linear<T>& Transformer<T>::linear(const std::string& weight_name) {
  for (int l = 0; l < cfg_.n_layer; ++l) {
    auto& b = blocks_[l];
    for (auto* slot : {&b.qkv, &b.attn_proj, &b.fc, &b.mlp_proj})
      if ((*slot)->params().name == weight_name) return **slot;
  }
  fail("model has no linear layer with weight '", weight_name, "'");
}

template <typename T>
void Transformer<T>::replace_linear(const std::string& weight_name, std::unique_ptr<Linear<T>> impl) {
  ESPLAG_CHECK(impl && impl->params().name == weight_name, "replacement for '", weight_name,
               "' must be built on that layer's parameters");
  for (int l = 0; l < cfg_.n_layer; ++l) {
    auto& b = blocks_[l];
    for (auto* slot : {&b.qkv, &b.attn_proj, &b.fc, &b.mlp_proj})
      if ((*slot)->params().name == weight_name) {
        fp8_saturated_replaced_ += (*slot)->fp8_saturated();
        impl->set_precision(linear_precision_);
        *slot = std::move(impl);
        return;
      }
  }
  fail("model has no linear layer with weight '", weight_name, "'");
}

template <typename T>
void Transformer<T>::set_linear_precision(const LinearPrecision& precision) {
  if (precision.amax_history != linear_precision_.amax_history || precision.delayed() != linear_precision_.delayed())
    for (auto& h : fp8_histories_) h.resize(precision.amax_history);
  linear_precision_ = precision;
  for (const auto& name : linear_names()) linear(name).set_precision(precision);
}

template <typename T>
void Transformer<T>::roll_fp8_histories() {
  if (!linear_precision_.delayed()) return;
  for (auto& h : fp8_histories_) h.roll();
}

template <typename T>
int64_t Transformer<T>::fp8_saturated() const {
  int64_t n = fp8_saturated_replaced_;
  for (const auto& b : blocks_)
    for (const auto* slot : {&b.qkv, &b.attn_proj, &b.fc, &b.mlp_proj}) n += (*slot)->fp8_saturated();
  return n;
}

size_t transformer_activation_elements(const ModelConfig& c, int B, int Tlen, const ActivationCheckpointing& ckpt) {
  const size_t N = size_t(B) * Tlen, C = c.d_model, Q = c.qkv_dim(), F = c.fc_dim(), H = c.d_ff;
  const size_t AC = size_t(c.n_head) * c.head_dim();
  const std::array<size_t, kBlockTensors> n = block_tensor_elements(c, B, Tlen);
  size_t blocks = 0;  // as Activations::layers and Activations::shared
  for (int t = 0; t < kBlockTensors; ++t) {
    for (int l = 0; l < c.n_layer; ++l)
      if (block_stores(ckpt, l, t)) blocks += n[t];
    if (c.n_layer > 0 && !block_stores(ckpt, 0, t)) blocks += n[t];  // block 0 is checkpointed if any is
  }
  const size_t chunk = std::min<size_t>(N, kHeadChunk);
  return N * C + blocks + N * (C + 2) + N * (3 * C + Q + AC + F + H) + chunk * (2 * size_t(c.vocab_size) + 1);
}

template <typename T>
void Transformer<T>::ensure_activations(int B, int Tlen) {
  ESPLAG_CHECK(Tlen > 0 && Tlen <= cfg_.max_seq_len, "sequence length ", Tlen, " outside [1, max_seq_len=",
               cfg_.max_seq_len, "]");
  ESPLAG_CHECK(B > 0, "batch size must be positive, got ", B);
  if (acts_ && acts_->B == B && acts_->Tlen == Tlen) return;
  acts_ = std::make_unique<Activations>();
  auto& a = *acts_;
  a.B = B;
  a.Tlen = Tlen;
  a.ckpt = ckpt_;
  const size_t N = size_t(B) * Tlen, C = cfg_.d_model, Q = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.d_ff;
  const size_t AC = size_t(cfg_.n_head) * cfg_.head_dim();
  const std::array<size_t, kBlockTensors> n = block_tensor_elements(cfg_, B, Tlen);
  a.embed.resize(N * C);
  a.layers.resize(cfg_.n_layer);
  for (int t = 0; t < kBlockTensors; ++t) {
    for (int l = 0; l < cfg_.n_layer; ++l)
      if (block_stores(ckpt_, l, t)) a.layers[l][t].resize(n[t]);
    if (cfg_.n_layer > 0 && !block_stores(ckpt_, 0, t)) a.shared[t].resize(n[t]);
  }
  a.lnf.resize(N * C), a.lnf_mean.resize(N), a.lnf_rstd.resize(N);
  a.dres.resize(N * C), a.dln.resize(N * C), a.dqkv.resize(N * Q), a.datty.resize(N * AC);
  a.dfc.resize(N * F), a.dact.resize(N * H), a.dlnf.resize(N * C);
  const size_t chunk = std::min<size_t>(N, kHeadChunk);
  a.logits.resize(chunk * cfg_.vocab_size), a.dlogits.resize(chunk * cfg_.vocab_size), a.losses.resize(chunk);
}

template <typename T>
void Transformer<T>::norm_forward(const Norm& n, T* out, T* mean, T* rstd, const T* x, int N, int layer) {
  const int C = cfg_.d_model;
  ScopedOp op({n.name, "fwd"}, OpCategory::norm, layer, 8.0 * N * C, 2.0 * sizeof(T) * N * C, {x, n.w}, {out});
  if (cfg_.norm == NormKind::layernorm)
    cpu::layernorm_forward(out, mean, rstd, x, n.w, n.b, N, C, cfg_.norm_eps);
  else
    cpu::rmsnorm_forward(out, rstd, x, n.w, N, C, cfg_.norm_eps);
}

// Adds into dinp, which is the residual-stream gradient itself.
template <typename T>
void Transformer<T>::norm_backward(const Norm& n, T* dinp, const T* dout, const T* x, const T* mean, const T* rstd,
                                   int N, int layer) {
  const int C = cfg_.d_model;
  ScopedOp op({n.name, "bwd"}, OpCategory::norm, layer, 16.0 * N * C, 3.0 * sizeof(T) * N * C, {dout, x, n.w},
              {dinp, n.dw});
  if (cfg_.norm == NormKind::layernorm)
    cpu::layernorm_backward(dinp, n.dw, n.db, dout, x, n.w, mean, rstd, N, C);
  else
    cpu::rmsnorm_backward(dinp, n.dw, dout, x, n.w, rstd, N, C);
}

template <typename T>
void Transformer<T>::forward_body(const int32_t* inputs, int B, int Tlen) {
  ensure_activations(B, Tlen);
  auto& a = *acts_;
  const int N = B * Tlen, C = cfg_.d_model, V = cfg_.vocab_size;
  const int64_t NC = int64_t(N) * C;
  for (int i = 0; i < N; ++i)
    ESPLAG_CHECK(inputs[i] >= 0 && inputs[i] < V, "input token ", inputs[i], " at position ", i,
                 " is outside the vocabulary [0, ", V, ")");
  {
    ScopedOp op("embed.fwd", OpCategory::elementwise, -1, NC, 3.0 * sizeof(T) * NC, {inputs, wte_}, {a.embed.data()});
    cpu::embedding_forward(a.embed.data(), inputs, wte_, wpe_, B, Tlen, C);
  }
  const T* x = a.embed.data();
  for (int l = 0; l < cfg_.n_layer; ++l) {
    const BlockView v = a.view(l);
    block_forward(l, x, v, B, Tlen, false);
    x = v[kResOut];
  }
  norm_forward(norm_f_, a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), x, N, -1);
}

template <typename T>
void Transformer<T>::block_forward(int l, const T* x, const BlockView& v, int B, int Tlen, bool to_activation) {
  const int N = B * Tlen, NH = cfg_.n_head, KV = cfg_.n_kv_head, HD = cfg_.head_dim();
  const int64_t NC = int64_t(N) * cfg_.d_model;
  auto& blk = blocks_[l];
  norm_forward(blk.norm1, v[kLn1], v[kLn1Mean], v[kLn1Rstd], x, N, l);
  blk.qkv->forward(v[kQkv], v[kLn1], N);
  if (cfg_.pos == PosKind::rope) {
    ScopedOp op({blk.prefix, "rope.fwd"}, OpCategory::elementwise, l, 3.0 * N * (NH + KV) * HD,
                2.0 * sizeof(T) * N * (NH + KV) * HD, {v[kQkv]}, {v[kQkv]});
    cpu::rope_forward(v[kQkv], B, Tlen, NH, KV, HD, cfg_.rope_theta);
  }
  attention_forward(l, v, B, Tlen);
  blk.attn_proj->forward(v[kResMid], v[kAtty], N);
  {
    ScopedOp op({blk.prefix, "residual1.fwd"}, OpCategory::elementwise, l, NC, 3.0 * sizeof(T) * NC,
                {v[kResMid], x}, {v[kResMid]});
    cpu::residual_forward(v[kResMid], v[kResMid], x, NC);
  }
  norm_forward(blk.norm2, v[kLn2], v[kLn2Mean], v[kLn2Rstd], v[kResMid], N, l);
  blk.fc->forward(v[kFc], v[kLn2], N);
  mlp_activation_forward(l, v, N);
  if (to_activation) return;
  blk.mlp_proj->forward(v[kResOut], v[kAct], N);
  ScopedOp op({blk.prefix, "residual2.fwd"}, OpCategory::elementwise, l, NC, 3.0 * sizeof(T) * NC,
              {v[kResOut], v[kResMid]}, {v[kResOut]});
  cpu::residual_forward(v[kResOut], v[kResOut], v[kResMid], NC);
}

// Writes the attention's output (v[kAtty]) and probabilities (v[kAtt]) from q, k, v.
template <typename T>
void Transformer<T>::attention_forward(int l, const BlockView& v, int B, int Tlen) {
  const int N = B * Tlen, NH = cfg_.n_head, HD = cfg_.head_dim();
  ScopedOp op({blocks_[l].prefix, "attn.sdpa.fwd"}, OpCategory::attention, l, 2.0 * B * NH * double(Tlen) * Tlen * HD,
              sizeof(T) * (double(N) * cfg_.qkv_dim() + double(B) * NH * Tlen * Tlen + double(N) * NH * HD),
              {v[kQkv]}, {v[kAtty], v[kAtt]});
  cpu::attention_forward(v[kAtty], v[kAtt], v[kQkv], B, Tlen, NH, cfg_.n_kv_head, HD);
}

template <typename T>
void Transformer<T>::mlp_activation_forward(int l, const BlockView& v, int N) {
  const int64_t NF = int64_t(N) * cfg_.d_ff;
  ScopedOp op({blocks_[l].prefix, "mlp.act.fwd"}, OpCategory::elementwise, l, 8.0 * NF,
              sizeof(T) * double(N) * (cfg_.fc_dim() + cfg_.d_ff), {v[kFc]}, {v[kAct]});
  switch (cfg_.mlp) {
    case MlpKind::gelu: cpu::gelu_forward(v[kAct], v[kFc], NF); break;
    case MlpKind::swiglu: cpu::swiglu_forward(v[kAct], v[kFc], N, cfg_.d_ff); break;
    case MlpKind::relu2: cpu::relu2_forward(v[kAct], v[kFc], NF); break;
  }
}

// The same ops on the same inputs as the forward, so the recomputed tensors are the forward's
// bit for bit. A Linear's forward run again is a pure function of its weights and input: it
// chooses no mask and draws no random numbers (sparse_dw draws in the backward only).
template <typename T>
void Transformer<T>::recompute_block(int l, const T* x, const BlockView& v, int B, int Tlen) {
  if (ckpt_.mode == CheckpointMode::full) {
    block_forward(l, x, v, B, Tlen, true);
    return;
  }
  // selective: the attention output it writes again equals the kept one.
  const int N = B * Tlen;
  auto& blk = blocks_[l];
  norm_forward(blk.norm1, v[kLn1], v[kLn1Mean], v[kLn1Rstd], x, N, l);
  attention_forward(l, v, B, Tlen);
  norm_forward(blk.norm2, v[kLn2], v[kLn2Mean], v[kLn2Rstd], v[kResMid], N, l);
  mlp_activation_forward(l, v, N);
}

template <typename T>
LossParts Transformer<T>::head_loss(const int32_t* targets, int N, bool train, double loss_scale,
                                   const DistillTarget<T>* distill) {
  auto& a = *acts_;
  const int C = cfg_.d_model, V = cfg_.vocab_size;
  if (train) std::fill(a.dlnf.begin(), a.dlnf.end(), T(0));
  if (distill) a.teacher_logits.resize(a.logits.size()), a.kl.resize(a.losses.size());
  double ce = 0, kl = 0;
  for (int r0 = 0; r0 < N; r0 += kHeadChunk) {
    const int rows = std::min(kHeadChunk, N - r0);
    const T* h = a.lnf.data() + size_t(r0) * C;
    const double gemm_flops = 2.0 * rows * C * V;
    {
      ScopedOp op("lm_head.fwd", OpCategory::dense_gemm, -1, gemm_flops, sizeof(T) * (double(rows) * (C + V) + double(V) * C),
                  {h, head_w_}, {a.logits.data()});
      cpu::linear_forward(a.logits.data(), h, head_w_, static_cast<const T*>(nullptr), rows, C, V);
    }
    T* dlogits = train ? a.dlogits.data() : static_cast<T*>(nullptr);
    const T dloss = static_cast<T>(loss_scale / N);
    if (distill) {
      distill->teacher_logits(r0, rows, a.teacher_logits.data());
      ScopedOp op("lm_head.distill", OpCategory::loss, -1, 12.0 * rows * V, 3.0 * sizeof(T) * rows * V,
                  {a.logits.data(), a.teacher_logits.data(), targets}, {a.losses.data(), a.kl.data(), a.dlogits.data()});
      cpu::distill_cross_entropy(a.losses.data(), a.kl.data(), dlogits, a.logits.data(), a.teacher_logits.data(),
                                 targets + r0, rows, V, distill->alpha, distill->temperature, dloss);
      for (int i = 0; i < rows; ++i) kl += a.kl[i];
    } else {
      ScopedOp op("lm_head.cross_entropy", OpCategory::loss, -1, 5.0 * rows * V, 2.0 * sizeof(T) * rows * V,
                  {a.logits.data(), targets}, {a.losses.data(), a.dlogits.data()});
      cpu::softmax_cross_entropy(a.losses.data(), dlogits, a.logits.data(), targets + r0, rows, V, dloss);
    }
    for (int i = 0; i < rows; ++i) ce += a.losses[i];
    if (train) {
      ScopedOp op("lm_head.bwd", OpCategory::dense_gemm, -1, 2.0 * gemm_flops,
                  sizeof(T) * (double(rows) * (2 * C + V) + 2.0 * V * C), {a.dlogits.data(), h, head_w_},
                  {a.dlnf.data(), head_dw_});
      cpu::linear_backward(a.dlnf.data() + size_t(r0) * C, head_dw_, static_cast<T*>(nullptr), a.dlogits.data(), h,
                           head_w_, rows, C, V);
    }
  }
  LossParts parts;
  parts.ce = ce / N;
  parts.kl = kl / N;
  parts.loss = distill ? (1.0 - distill->alpha) * parts.ce + distill->alpha * distill->temperature *
                                                                   distill->temperature * parts.kl
                       : parts.ce;
  return parts;
}

template <typename T>
void Transformer<T>::backward_body(const int32_t* inputs, int B, int Tlen) {
  auto& a = *acts_;
  const int N = B * Tlen, C = cfg_.d_model, NH = cfg_.n_head, KV = cfg_.n_kv_head, HD = cfg_.head_dim();
  const int64_t NC = int64_t(N) * C, NF = int64_t(N) * cfg_.d_ff;
  auto zero = [](std::vector<T>& v) { std::fill(v.begin(), v.end(), T(0)); };
  zero(a.dres);
  const T* x_last = cfg_.n_layer ? a.layers.back()[kResOut].data() : a.embed.data();
  norm_backward(norm_f_, a.dres.data(), a.dlnf.data(), x_last, a.lnf_mean.data(), a.lnf_rstd.data(), N, -1);
  for (int l = cfg_.n_layer - 1; l >= 0; --l) {
    const BlockView L = a.view(l);
    auto& blk = blocks_[l];
    const T* x_in = l ? a.layers[l - 1][kResOut].data() : a.embed.data();
    if (ckpt_.checkpoints(l)) recompute_block(l, x_in, L, B, Tlen);
    // MLP half: dres holds d(res_out) = d(res_mid) through the residual.
    zero(a.dact);
    blk.mlp_proj->backward(a.dact.data(), a.dres.data(), L[kAct], N);
    zero(a.dfc);
    {
      ScopedOp op({blk.prefix, "mlp.act.bwd"}, OpCategory::elementwise, l, 12.0 * NF,
                  sizeof(T) * double(N) * (2 * cfg_.fc_dim() + cfg_.d_ff), {L[kFc], a.dact.data()},
                  {a.dfc.data()});
      switch (cfg_.mlp) {
        case MlpKind::gelu: cpu::gelu_backward(a.dfc.data(), L[kFc], a.dact.data(), NF); break;
        case MlpKind::swiglu: cpu::swiglu_backward(a.dfc.data(), L[kFc], a.dact.data(), N, cfg_.d_ff); break;
        case MlpKind::relu2: cpu::relu2_backward(a.dfc.data(), L[kFc], a.dact.data(), NF); break;
      }
    }
    zero(a.dln);
    blk.fc->backward(a.dln.data(), a.dfc.data(), L[kLn2], N);
    norm_backward(blk.norm2, a.dres.data(), a.dln.data(), L[kResMid], L[kLn2Mean], L[kLn2Rstd], N, l);
    // Attention half: dres now holds d(res_mid) = d(x_in) through the residual.
    zero(a.datty);
    blk.attn_proj->backward(a.datty.data(), a.dres.data(), L[kAtty], N);
    zero(a.dqkv);
    {
      ScopedOp op({blk.prefix, "attn.sdpa.bwd"}, OpCategory::attention, l, 4.0 * B * NH * double(Tlen) * Tlen * HD,
                  sizeof(T) * (2.0 * N * cfg_.qkv_dim() + double(B) * NH * Tlen * Tlen + double(N) * NH * HD),
                  {a.datty.data(), L[kQkv], L[kAtt]}, {a.dqkv.data()});
      cpu::attention_backward(a.dqkv.data(), a.datty.data(), L[kQkv], L[kAtt], B, Tlen, NH, KV, HD);
    }
    if (cfg_.pos == PosKind::rope) {
      ScopedOp op({blk.prefix, "rope.bwd"}, OpCategory::elementwise, l, 3.0 * N * (NH + KV) * HD,
                  2.0 * sizeof(T) * N * (NH + KV) * HD, {a.dqkv.data()}, {a.dqkv.data()});
      cpu::rope_backward(a.dqkv.data(), B, Tlen, NH, KV, HD, cfg_.rope_theta);
    }
    zero(a.dln);
    blk.qkv->backward(a.dln.data(), a.dqkv.data(), L[kLn1], N);
    norm_backward(blk.norm1, a.dres.data(), a.dln.data(), x_in, L[kLn1Mean], L[kLn1Rstd], N, l);
  }
  ScopedOp op("embed.bwd", OpCategory::elementwise, -1, NC, 3.0 * sizeof(T) * NC, {a.dres.data(), inputs},
              {dwte_, dwpe_});
  cpu::embedding_backward(dwte_, dwpe_, a.dres.data(), inputs, B, Tlen, C);
}

template <typename T>
double Transformer<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int Tlen,
                                        double loss_scale) {
  forward_body(inputs, B, Tlen);
  const double loss = head_loss(targets, B * Tlen, true, loss_scale).loss;
  backward_body(inputs, B, Tlen);
  return loss;
}

template <typename T>
LossParts Transformer<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int Tlen,
                                           double loss_scale, const DistillTarget<T>& distill) {
  ESPLAG_CHECK(distill.teacher_logits, "forward_backward: distillation needs the teacher's logits");
  forward_body(inputs, B, Tlen);
  const LossParts parts = head_loss(targets, B * Tlen, true, loss_scale, &distill);
  backward_body(inputs, B, Tlen);
  return parts;
}

namespace {

// Forward-only passes (evaluation, sampling, a distillation teacher) cast with current
// scaling and record nothing: the histories are the training steps'.
struct Fp8HistoriesPaused {
  std::vector<Fp8AmaxHistory>& histories;
  explicit Fp8HistoriesPaused(std::vector<Fp8AmaxHistory>& h) : histories(h) {
    for (auto& x : histories) x.set_paused(true);
  }
  ~Fp8HistoriesPaused() {
    for (auto& x : histories) x.set_paused(false);
  }
};

}  // namespace

template <typename T>
double Transformer<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int Tlen) {
  const Fp8HistoriesPaused forward_only(fp8_histories_);
  forward_body(inputs, B, Tlen);
  return head_loss(targets, B * Tlen, false, 1.0).loss;
}

template <typename T>
void Transformer<T>::forward_hidden(const int32_t* inputs, int B, int Tlen) {
  const Fp8HistoriesPaused forward_only(fp8_histories_);
  forward_body(inputs, B, Tlen);
}

template <typename T>
void Transformer<T>::head_logits(int row0, int rows, T* out) const {
  ESPLAG_CHECK(acts_ && row0 >= 0 && rows >= 0 && row0 + rows <= acts_->B * acts_->Tlen, "head_logits: rows [", row0,
               ", ", row0 + rows, ") outside the last forward's micro-batch");
  ScopedOp op("lm_head.fwd", OpCategory::dense_gemm, -1, 2.0 * rows * cfg_.d_model * cfg_.vocab_size,
              sizeof(T) * (double(rows) * (cfg_.d_model + cfg_.vocab_size) + double(cfg_.vocab_size) * cfg_.d_model),
              {head_w_}, {out});
  cpu::linear_forward(out, acts_->lnf.data() + size_t(row0) * cfg_.d_model, head_w_, static_cast<const T*>(nullptr),
                      rows, cfg_.d_model, cfg_.vocab_size);
}

template <typename T>
void Transformer<T>::forward_last_logits(const int32_t* inputs, int B, int Tlen, T* out) {
  const Fp8HistoriesPaused forward_only(fp8_histories_);
  forward_body(inputs, B, Tlen);
  const int C = cfg_.d_model, V = cfg_.vocab_size;
  for (int b = 0; b < B; ++b)
    cpu::linear_forward(out + size_t(b) * V, acts_->lnf.data() + (size_t(b) * Tlen + Tlen - 1) * C, head_w_,
                        static_cast<const T*>(nullptr), 1, C, V);
}

template <typename T>
void Transformer<T>::set_checkpointing(const ActivationCheckpointing& checkpointing) {
  ESPLAG_CHECK(checkpointing.every >= 1, "activation checkpointing: every must be at least 1, got ",
               checkpointing.every);
  ckpt_ = checkpointing;
  acts_.reset();  // reallocated for the new mode by the next forward
}

template <typename T>
size_t Transformer<T>::activation_elements() const {
  if (!acts_) return 0;
  const Activations& a = *acts_;
  size_t n = 0;
  auto add = [&](const std::vector<T>& v) { n += v.size(); };
  for (const auto* v : {&a.embed, &a.lnf, &a.lnf_mean, &a.lnf_rstd, &a.dres, &a.dln, &a.dqkv, &a.datty, &a.dfc,
                        &a.dact, &a.dlnf, &a.logits, &a.dlogits, &a.losses, &a.teacher_logits, &a.kl})
    add(*v);
  for (const auto& layer : a.layers)
    for (const auto& v : layer) add(v);
  for (const auto& v : a.shared) add(v);
  return n;
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace esplag
