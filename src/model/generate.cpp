#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/activation.h"
#include "ops/attention.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/norm.h"

namespace esplag {

KvCache::KvCache(const ModelConfig& c, int batch)
    : n_layer_(c.n_layer), row_(c.n_kv_head * c.head_dim()), max_length_(c.max_seq_len) {
  ESPLAG_CHECK(batch >= 0, "KV cache: batch must not be negative, got ", batch);
  length_.assign(batch, 0);
  k_.resize(size_t(n_layer_) * batch);
  v_.resize(size_t(n_layer_) * batch);
}

void KvCache::grow(int b, int n) {
  ESPLAG_CHECK(b >= 0 && b < batch(), "KV cache: sequence ", b, " outside the batch of ", batch());
  ESPLAG_CHECK(n >= 0 && length_[b] + n <= max_length_, "KV cache: sequence ", b, " cannot grow by ", n,
               " positions past ", max_length_);
  length_[b] += n;
  for (int l = 0; l < n_layer_; ++l) {
    k_[size_t(l) * batch() + b].resize(size_t(length_[b]) * row_);
    v_[size_t(l) * batch() + b].resize(size_t(length_[b]) * row_);
  }
}

float* KvCache::slot(std::vector<std::vector<float>>& kv, int l, int b, int pos) {
  return kv[size_t(l) * batch() + b].data() + size_t(pos) * row_;
}

namespace {

// A position run in this call: sequence b at position pos.
struct Row {
  int b, pos;
};

// The model's parameters the generator reads directly (the Linear layers it calls).
struct Weights {
  const float *wte, *wpe, *head;
  struct Norm {
    const float *w, *b;
  };
  std::vector<Norm> norm1, norm2;
  Norm norm_f;
};

Weights weights_of(const Transformer<float>& m) {
  const ModelConfig& c = m.config();
  const bool ln = c.norm == NormKind::layernorm;
  auto get = [&](const std::string& name) { return m.param(name).data<float>(); };
  auto norm = [&](const std::string& name) {
    return Weights::Norm{get(name + ".weight"), ln ? get(name + ".bias") : nullptr};
  };
  Weights w;
  w.wte = get("embed.tokens.weight");
  w.wpe = c.pos == PosKind::learned ? get("embed.positions.weight") : nullptr;
  w.head = c.tie_embeddings ? w.wte : get("lm_head.weight");
  for (int l = 0; l < c.n_layer; ++l) {
    w.norm1.push_back(norm("blocks." + std::to_string(l) + ".norm1"));
    w.norm2.push_back(norm("blocks." + std::to_string(l) + ".norm2"));
  }
  w.norm_f = norm("norm_f");
  return w;
}

void norm_forward(const ModelConfig& c, const Weights::Norm& n, float* out, const float* x, int N,
                  std::vector<float>& scratch) {
  scratch.resize(2 * size_t(N));
  if (c.norm == NormKind::layernorm)
    cpu::layernorm_forward(out, scratch.data(), scratch.data() + N, x, n.w, n.b, N, c.d_model, c.norm_eps);
  else
    cpu::rmsnorm_forward(out, scratch.data(), x, n.w, N, c.d_model, c.norm_eps);
}

void mlp_activation(const ModelConfig& c, float* act, const float* fc, int N) {
  const int64_t NF = int64_t(N) * c.d_ff;
  switch (c.mlp) {
    case MlpKind::gelu: cpu::gelu_forward(act, fc, NF); break;
    case MlpKind::swiglu: cpu::swiglu_forward(act, fc, N, c.d_ff); break;
    case MlpKind::relu2: cpu::relu2_forward(act, fc, NF); break;
  }
}

// out[r] (n_head · head_dim) = causal attention of row r's queries over positions
// 0..pos of its sequence in the cache, in cpu::attention_forward's order of operations.
void cached_attention(float* out, const float* qkv, const std::vector<Row>& rows, const KvCache& cache, int l,
                      const ModelConfig& c) {
  const int NH = c.n_head, HD = c.head_dim(), group = c.n_head / c.n_kv_head, Q = c.qkv_dim();
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(HD)));
  parallel_for(
      int64_t(rows.size()) * NH,
      [&](int64_t i0, int64_t i1) {
        std::vector<float> a;
        for (int64_t i = i0; i < i1; ++i) {
          const Row& r = rows[i / NH];
          const int h = static_cast<int>(i % NH), kv_off = (h / group) * HD;
          const float* q = qkv + (i / NH) * Q + size_t(h) * HD;
          a.resize(r.pos + 1);
          float maxv = -std::numeric_limits<float>::infinity();
          for (int j = 0; j <= r.pos; ++j) {
            const float* k = cache.key(l, r.b, j) + kv_off;
            float s = 0;
            for (int d = 0; d < HD; ++d) s += q[d] * k[d];
            a[j] = s * scale;
            maxv = std::max(maxv, a[j]);
          }
          float sum = 0;
          for (int j = 0; j <= r.pos; ++j) sum += a[j] = std::exp(a[j] - maxv);
          const float inv = 1.0f / sum;
          float* o = out + (i / NH) * NH * HD + size_t(h) * HD;
          std::fill(o, o + HD, 0.0f);
          for (int j = 0; j <= r.pos; ++j) {
            const float* v = cache.value(l, r.b, j) + kv_off;
            const float p = a[j] * inv;
            for (int d = 0; d < HD; ++d) o[d] += p * v[d];
          }
        }
      },
      4);
}

}  // namespace

Generator::Generator(Transformer<float>& model) : model_(model), cache_(model.config(), 0) {}

std::vector<float> Generator::prefill(const std::vector<std::vector<int32_t>>& prompts) {
  ESPLAG_CHECK(!prompts.empty(), "generation needs at least one prompt");
  for (size_t b = 0; b < prompts.size(); ++b)
    ESPLAG_CHECK(!prompts[b].empty(), "prompt ", b, " has no tokens");
  cache_ = KvCache(model_.config(), static_cast<int>(prompts.size()));
  return append(prompts);
}

std::vector<float> Generator::decode_step(const std::vector<int32_t>& next_ids) {
  ESPLAG_CHECK(static_cast<int>(next_ids.size()) == cache_.batch(), "decode_step got ", next_ids.size(),
               " ids for a batch of ", cache_.batch(), " sequences");
  std::vector<std::vector<int32_t>> tokens(next_ids.size());
  for (size_t b = 0; b < next_ids.size(); ++b)
    if (next_ids[b] >= 0) tokens[b] = {next_ids[b]};
  return append(tokens);
}

std::vector<float> Generator::append(const std::vector<std::vector<int32_t>>& tokens) {
  const ModelConfig& c = model_.config();
  const int C = c.d_model, V = c.vocab_size, Q = c.qkv_dim(), KVR = cache_.row_size();
  const Weights w = weights_of(model_);
  // The rows of this call, sequence by sequence, and their embeddings.
  std::vector<Row> rows;
  std::vector<int> last_row(tokens.size(), -1);
  ESPLAG_CHECK(static_cast<int>(tokens.size()) == cache_.batch(), "got tokens for ", tokens.size(),
               " sequences, the batch has ", cache_.batch());
  for (size_t b = 0; b < tokens.size(); ++b) {  // checked first, so an error changes nothing
    for (int32_t id : tokens[b])
      ESPLAG_CHECK(id >= 0 && id < V, "token ", id, " of sequence ", b, " is outside the vocabulary [0, ", V, ")");
    ESPLAG_CHECK(cache_.length(b) + tokens[b].size() <= size_t(c.max_seq_len), "sequence ", b, " would reach ",
                 cache_.length(b) + tokens[b].size(), " positions, past the model's max_seq_len=", c.max_seq_len,
                 " (positions do not slide)");
  }
  for (size_t b = 0; b < tokens.size(); ++b) {
    const int start = cache_.length(b);
    cache_.grow(static_cast<int>(b), static_cast<int>(tokens[b].size()));
    for (size_t i = 0; i < tokens[b].size(); ++i) rows.push_back({static_cast<int>(b), start + static_cast<int>(i)});
    if (!tokens[b].empty()) last_row[b] = static_cast<int>(rows.size()) - 1;
  }
  const int N = static_cast<int>(rows.size());
  std::vector<float> out(tokens.size() * size_t(V), 0.0f);
  if (N == 0) return out;
  std::vector<float> x(size_t(N) * C), ln(x.size()), res(x.size()), qkv(size_t(N) * Q), scratch;
  std::vector<float> atty(size_t(N) * c.n_head * c.head_dim()), fc(size_t(N) * c.fc_dim()), act(size_t(N) * c.d_ff);
  for (size_t b = 0, r = 0; b < tokens.size(); r += tokens[b].size(), ++b)
    if (!tokens[b].empty()) {
      const float* wpe = w.wpe ? w.wpe + size_t(rows[r].pos) * C : nullptr;  // from the sequence's first new position
      cpu::embedding_forward(x.data() + r * C, tokens[b].data(), w.wte, wpe, 1, static_cast<int>(tokens[b].size()), C);
    }

  const int64_t NC = int64_t(N) * C;
  // The Linear layers are looked up on every call rather than kept: replace_linear destroys the
  // layer it replaces, so a kept pointer could dangle; the lookups are about 1% of a step of
  // even a d_model=64 model.
  for (int l = 0; l < c.n_layer; ++l) {
    const std::string prefix = "blocks." + std::to_string(l) + ".";
    norm_forward(c, w.norm1[l], ln.data(), x.data(), N, scratch);
    model_.linear(prefix + "attn.qkv.weight").forward(qkv.data(), ln.data(), N);
    if (c.pos == PosKind::rope)  // each sequence's new rows continue from its first new position
      for (size_t b = 0, r = 0; b < tokens.size(); r += tokens[b].size(), ++b)
        if (!tokens[b].empty())
          cpu::rope_forward(qkv.data() + r * Q, 1, static_cast<int>(tokens[b].size()), c.n_head, c.n_kv_head,
                            c.head_dim(), c.rope_theta, rows[r].pos);
    for (int r = 0; r < N; ++r) {
      const float* k = qkv.data() + size_t(r) * Q + size_t(c.n_head) * c.head_dim();
      std::copy(k, k + KVR, cache_.key(l, rows[r].b, rows[r].pos));
      std::copy(k + KVR, k + 2 * KVR, cache_.value(l, rows[r].b, rows[r].pos));
    }
    cached_attention(atty.data(), qkv.data(), rows, cache_, l, c);
    model_.linear(prefix + "attn.proj.weight").forward(res.data(), atty.data(), N);
    cpu::residual_forward(res.data(), res.data(), x.data(), NC);
    norm_forward(c, w.norm2[l], ln.data(), res.data(), N, scratch);
    model_.linear(prefix + "mlp.fc.weight").forward(fc.data(), ln.data(), N);
    mlp_activation(c, act.data(), fc.data(), N);
    model_.linear(prefix + "mlp.proj.weight").forward(x.data(), act.data(), N);
    cpu::residual_forward(x.data(), x.data(), res.data(), NC);
  }

  // The final norm and the head, on each sequence's last new row only.
  std::vector<int> seqs;
  for (size_t b = 0; b < tokens.size(); ++b)
    if (last_row[b] >= 0) seqs.push_back(static_cast<int>(b));
  const int A = static_cast<int>(seqs.size());
  std::vector<float> last(size_t(A) * C), logits(size_t(A) * V);
  for (int i = 0; i < A; ++i)
    std::copy_n(x.data() + size_t(last_row[seqs[i]]) * C, C, last.data() + size_t(i) * C);
  norm_forward(c, w.norm_f, ln.data(), last.data(), A, scratch);
  cpu::linear_forward(logits.data(), ln.data(), w.head, static_cast<const float*>(nullptr), A, C, V);
  for (int i = 0; i < A; ++i) std::copy_n(logits.data() + size_t(i) * V, V, out.data() + size_t(seqs[i]) * V);
  return out;
}

}  // namespace esplag
