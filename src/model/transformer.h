// The transformer language model on the CPU: parameters in one flat buffer (with a
// gradient buffer of the same layout), explicit forward and backward over its layers, and
// the LM head's cross-entropy fused in chunks so the full logits are never stored.
// T is float for training and double for the finite-difference gradient checks.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/zeroed_array.h"
#include "model/activation_checkpointing.h"
#include "model/config.h"
#include "model/fp8_amax_history.h"
#include "model/linear.h"

namespace esplag {

struct ParamInfo {
  std::string name;
  Shape shape;
  size_t offset = 0;  // in elements, into the flat buffers
  size_t numel = 0;
  bool decay = false;  // AdamW weight decay applies to matrices, not to norms and biases
};

// The flat parameter layout of a model of `config` (names, shapes, offsets, decay) in the
// order of its flat buffers: the one definition Transformer and GpuTransformer both use.
std::vector<ParamInfo> transformer_param_layout(const ModelConfig& config);
// The weight names of the block Linear layers of a model of `config`, block by block (qkv,
// attn.proj, fc, mlp.proj): Transformer<T>::linear_names().
std::vector<std::string> transformer_linear_names(const ModelConfig& config);
// Elements of the activations Transformer<T> keeps for micro-batches of B×T tokens with
// `checkpointing`: what the forward saves for the backward in every block (less in
// checkpointed blocks, plus the buffers their recomputation shares), the final norm, the
// backward's scratch and the chunked logits (what ensure_activations allocates).
size_t transformer_activation_elements(const ModelConfig& config, int B, int T,
                                       const ActivationCheckpointing& checkpointing = {});

// Distillation into a model (ops/distill.h): its loss becomes (1 - alpha)·CE + alpha·temperature²·KL of
// the softened distributions, the teacher's to its own. teacher_logits writes the teacher's logits
// of rows [row0, row0 + rows) of the micro-batch into out [rows, vocab], one head chunk at a time,
// so neither model's full logits are ever held.
template <typename T>
struct DistillTarget {
  double alpha = 0, temperature = 1;
  std::function<void(int row0, int rows, T* out)> teacher_logits;
};

// A micro-batch's mean loss and, when distilling, its two parts (the mean CE and the mean KL).
struct LossParts {
  double loss = 0, ce = 0, kl = 0;
};

template <typename T>
class Transformer {
 public:
  explicit Transformer(const ModelConfig& config);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return cfg_; }

  // --- parameters -------------------------------------------------------------------
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  const ParamInfo& param_info(const std::string& name) const;  // throws naming unknown params
  size_t num_params() const { return params_.size(); }
  T* params() { return params_.data(); }
  T* grads() { return grads_.data(); }
  const T* params() const { return params_.data(); }
  // A view of one parameter (or its gradient) in the flat buffer.
  Tensor param(const std::string& name) const;
  Tensor grad(const std::string& name) const;
  // GPT-2 initialisation: N(0, init_std), residual projections scaled by 1/sqrt(2·n_layer),
  // biases 0, norm weights 1. Deterministic in the seed.
  void init_weights(uint64_t seed);
  // Zeroes every gradient: the flat buffer and the ones Linear kinds own.
  void zero_grad();

  // What the optimizer trains: every flat parameter except the weights of Linear kinds
  // that train another form of them, plus every parameter the kinds own (compressed
  // kept values, adapters). In a fixed order, so reductions over it are deterministic.
  std::vector<OwnedParam<T>> trainable_params();
  // Forwarded to every Linear (see linear.h).
  void on_step_begin(int64_t step);
  void after_optimizer_step();

  // --- compute ------------------------------------------------------------------------
  // One micro-batch: forward, loss, and backward. Adds d(mean loss · loss_scale)/dθ into
  // the gradient buffer (so accumulation over micro-batches is loss_scale = 1/steps).
  // Returns the mean loss over the B·T positions.
  double forward_backward(const int32_t* inputs, const int32_t* targets, int B, int Tlen, double loss_scale);
  // The same with the distillation loss; with alpha = 0 its gradients and loss are the plain
  // forward_backward's bit for bit.
  LossParts forward_backward(const int32_t* inputs, const int32_t* targets, int B, int Tlen, double loss_scale,
                             const DistillTarget<T>& distill);
  // Mean loss without gradients.
  double forward_loss(const int32_t* inputs, const int32_t* targets, int B, int Tlen);
  // Logits of the last position of each sequence: out [B, vocab].
  void forward_last_logits(const int32_t* inputs, int B, int Tlen, T* out);
  // The forward up to the final norm (a teacher's part of distillation), then the logits of
  // rows [row0, row0 + rows) of that micro-batch: out [rows, vocab].
  void forward_hidden(const int32_t* inputs, int B, int Tlen);
  void head_logits(int row0, int rows, T* out) const;
  // Which blocks keep less of their forward and recompute it in the backward; gradients
  // stay bit-identical (activation_checkpointing.h). Default: none.
  void set_checkpointing(const ActivationCheckpointing& checkpointing);
  const ActivationCheckpointing& checkpointing() const { return ckpt_; }
  // Elements of the activation buffers allocated now (0 before the first forward).
  size_t activation_elements() const;

  // --- the Linear seam ------------------------------------------------------------------
  // Weight names of every block linear, e.g. "blocks.0.attn.qkv.weight".
  std::vector<std::string> linear_names() const;
  Linear<T>& linear(const std::string& weight_name);
  LinearParams<T> linear_params(const std::string& weight_name);
  // Installs `impl` with the model's linear precision.
  void replace_linear(const std::string& weight_name, std::unique_ptr<Linear<T>> impl);
  // The precision of every block linear's products (train.precision, model/linear_precision.h):
  // the current layers take it, and so do the layers installed later. Default: full precision.
  void set_linear_precision(const LinearPrecision& precision);
  const LinearPrecision& linear_precision() const { return linear_precision_; }
  // Operand values the block linears' fp8 casts saturated so far, replaced layers included.
  int64_t fp8_saturated() const;
  // Delayed fp8 scaling: the amax history of every block linear, in linear_names() order
  // (their length is the precision's amax_history).
  std::vector<Fp8AmaxHistory>& fp8_histories() { return fp8_histories_; }
  // An optimizer step is over: every history takes its amaxes.
  void roll_fp8_histories();

 private:
  struct Norm {
    std::string name;  // "blocks.3.norm1"
    T *w = nullptr, *b = nullptr, *dw = nullptr, *db = nullptr;
  };
  struct Block;
  struct Activations;
  struct BlockView;  // where one block's saved tensors are (its own buffers or the shared ones)
  void norm_forward(const Norm& n, T* out, T* mean, T* rstd, const T* x, int N, int layer);
  void norm_backward(const Norm& n, T* dinp, const T* dout, const T* x, const T* mean, const T* rstd, int N,
                     int layer);
  T* p(const std::string& name);
  T* g(const std::string& name);
  void ensure_activations(int B, int Tlen);
  // Runs the blocks and final norm; leaves the final hidden states in acts_->lnf.
  void forward_body(const int32_t* inputs, int B, int Tlen);
  // Block l on input x; with to_activation, only up to the MLP activation (what the
  // backward reads: the recomputation of a full checkpoint).
  void block_forward(int l, const T* x, const BlockView& v, int B, int Tlen, bool to_activation);
  void attention_forward(int l, const BlockView& v, int B, int Tlen);
  void mlp_activation_forward(int l, const BlockView& v, int N);
  // Recomputes what checkpointed block l did not keep.
  void recompute_block(int l, const T* x, const BlockView& v, int B, int Tlen);
  // LM head + cross-entropy (or the distillation loss) over rows in chunks; with train, also
  // the head's backward.
  LossParts head_loss(const int32_t* targets, int N, bool train, double loss_scale,
                      const DistillTarget<T>* distill = nullptr);
  void backward_body(const int32_t* inputs, int B, int Tlen);

  ModelConfig cfg_;
  std::vector<ParamInfo> infos_;
  std::vector<T> params_;
  ZeroedArray<T> grads_;  // backed only once written: GPU training never touches it
  std::vector<Block> blocks_;
  Norm norm_f_;
  T *wte_ = nullptr, *dwte_ = nullptr, *wpe_ = nullptr, *dwpe_ = nullptr, *head_w_ = nullptr, *head_dw_ = nullptr;
  ActivationCheckpointing ckpt_;
  LinearPrecision linear_precision_;
  std::vector<Fp8AmaxHistory> fp8_histories_;  // sized once: the layers keep pointers into it
  int64_t fp8_saturated_replaced_ = 0;         // by layers since replaced
  std::unique_ptr<Activations> acts_;
};

}  // namespace esplag
