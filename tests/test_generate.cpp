// Incremental generation (model/generate.h) against the full forward: the logits of prefill
// and of every decode step equal Transformer::forward_last_logits over the same prefix, for
// GPT-2- and LLaMA-style models (learned positions / RoPE, tied / untied heads, GQA), with
// sparse Linear kinds, and for batches of prompts of different lengths; a batch generates
// what each prompt generates alone; bad input is an Error that leaves the cache as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/generate.h"
#include "model/linear_kinds.h"
#include "model/sampling.h"
#include "model/transformer.h"
#include "test_util.h"

using namespace esplag;

namespace {

constexpr int kVocab = 37;

ModelConfig small_config(const std::string& flavour) {
  ModelConfig c = model_preset(flavour == "gpt2" ? "tiny" : "llama-tiny");  // llama-tiny: 4 heads, 2 kv heads
  c.vocab_size = kVocab;
  c.max_seq_len = 20;
  if (flavour == "gpt2") c.n_layer = 2;
  return c;
}

std::unique_ptr<Transformer<float>> make_model(const std::string& flavour, const std::string& kind = "dense") {
  auto m = std::make_unique<Transformer<float>>(small_config(flavour));
  m->init_weights(11);
  if (kind != "dense") {
    LinearOptions o;
    o.kind = kind;
    if (kind == "slope") o.lora_rank = 4, o.lora_enabled = true, o.seed = 3;
    for (const auto& name : m->linear_names())
      m->replace_linear(name, make_linear(m->linear_params(name), o, &m->linear(name)));
    m->after_optimizer_step();
  }
  return m;
}

std::vector<int32_t> random_tokens(int n, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& id : t) id = static_cast<int32_t>(rng.below(kVocab));
  return t;
}

// The full forward's logits at the last position of tokens[0, len).
std::vector<float> full_logits(Transformer<float>& m, const std::vector<int32_t>& tokens, int len) {
  std::vector<float> out(kVocab);
  m.forward_last_logits(tokens.data(), 1, len, out.data());
  return out;
}

// Row b of a [batch, vocab] logits block against the reference, within 1e-4 of its largest magnitude.
void expect_row_close(const std::vector<float>& got, int b, const std::vector<float>& want, const std::string& what) {
  float scale = 0, worst = 0;
  for (int v = 0; v < kVocab; ++v) {
    scale = std::max(scale, std::fabs(want[v]));
    worst = std::max(worst, std::fabs(got[size_t(b) * kVocab + v] - want[v]));
  }
  EXPECT_LE(worst, 1e-4f * std::max(scale, 1.0f)) << what;
}

// Prefill of `prompt` tokens then one decode step per remaining token, each checked.
void check_against_full_forward(Transformer<float>& m, int prompt, int total) {
  const std::vector<int32_t> seq = random_tokens(total, 5 + prompt);
  Generator gen(m);
  std::vector<float> logits = gen.prefill({std::vector<int32_t>(seq.begin(), seq.begin() + prompt)});
  expect_row_close(logits, 0, full_logits(m, seq, prompt), "prefill of " + std::to_string(prompt));
  for (int t = prompt; t < total; ++t) {
    logits = gen.decode_step({seq[t]});
    expect_row_close(logits, 0, full_logits(m, seq, t + 1), "decode at position " + std::to_string(t));
  }
  EXPECT_EQ(gen.cache().length(0), total);
}

// Greedy continuation of each prompt by `gen`, n tokens each.
std::vector<std::vector<int32_t>> greedy(Generator& gen, const std::vector<std::vector<int32_t>>& prompts, int n) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::vector<float> logits = gen.prefill(prompts);
  Rng unused(0);
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> next(prompts.size());
    for (size_t b = 0; b < prompts.size(); ++b)
      out[b].push_back(next[b] = sample_token(logits.data() + b * kVocab, kVocab, {.temperature = 0}, unused));
    logits = gen.decode_step(next);
  }
  return out;
}

class GenerateFlavours : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(GenerateFlavours, PrefillAndDecodeEqualTheFullForwardAtEveryPosition) {
  for (const char* kind : {"dense", "semi_sparse", "slope"}) {
    SCOPED_TRACE(kind);
    auto m = make_model(GetParam(), kind);
    check_against_full_forward(*m, 1, 20);  // decoding from the first position up to max_seq_len
    check_against_full_forward(*m, 7, 13);
  }
}

TEST_P(GenerateFlavours, ABatchOfDifferentLengthsIsEachSequenceAlone) {
  auto m = make_model(GetParam());
  const std::vector<int32_t> a = random_tokens(15, 1), b = random_tokens(15, 2), c = random_tokens(15, 3);
  Generator gen(*m);
  // Prompts of 1, 6 and 3 tokens; then sequence b sits out one step (a finished sequence).
  std::vector<float> logits = gen.prefill({{a[0]}, {b.begin(), b.begin() + 6}, {c.begin(), c.begin() + 3}});
  std::vector<int> len = {1, 6, 3};
  const std::vector<const std::vector<int32_t>*> seqs = {&a, &b, &c};
  for (int step = 0; step < 6; ++step) {
    for (int s = 0; s < 3; ++s)
      expect_row_close(logits, s, full_logits(*m, *seqs[s], len[s]),
                       "sequence " + std::to_string(s) + " at length " + std::to_string(len[s]));
    std::vector<int32_t> next = {a[len[0]], step == 2 ? -1 : b[len[1]], c[len[2]]};
    logits = gen.decode_step(next);
    for (int s = 0; s < 3; ++s) len[s] += next[s] >= 0;
    if (step == 2) {
      EXPECT_TRUE(std::all_of(logits.begin() + kVocab, logits.begin() + 2 * kVocab, [](float x) { return x == 0; }));
      logits = gen.decode_step({-1, b[len[1]], -1});  // the skipped sequence catches up
      ++len[1];
      expect_row_close(logits, 1, full_logits(*m, b, len[1]), "sequence 1 alone in its step");
      logits = gen.decode_step({a[len[0]++], -1, c[len[2]++]});
      logits = gen.decode_step({-1, -1, -1});  // nothing to run: all rows zero, nothing moves
      EXPECT_TRUE(std::all_of(logits.begin(), logits.end(), [](float x) { return x == 0; }));
      logits = gen.decode_step({a[len[0]++], b[len[1]++], c[len[2]++]});
    }
  }
  EXPECT_EQ(gen.cache().length(0), len[0]);
  EXPECT_EQ(gen.cache().length(1), len[1]);
  EXPECT_EQ(gen.cache().length(2), len[2]);
}

TEST_P(GenerateFlavours, ABatchGeneratesWhatEachPromptGeneratesAlone) {
  for (const char* kind : {"dense", "slope"}) {
    SCOPED_TRACE(kind);
    auto m = make_model(GetParam(), kind);
    const std::vector<std::vector<int32_t>> prompts = {random_tokens(2, 7), random_tokens(9, 8), random_tokens(5, 9)};
    Generator batch(*m);
    const auto together = greedy(batch, prompts, 8);
    for (size_t b = 0; b < prompts.size(); ++b) {
      Generator alone(*m);
      EXPECT_EQ(greedy(alone, {prompts[b]}, 8)[0], together[b]) << "prompt " << b;
    }
    // The greedy tokens are the full forward's argmax at every step.
    std::vector<int32_t> seq = prompts[1];
    for (int32_t id : together[1]) {
      const std::vector<float> ref = full_logits(*m, seq, static_cast<int>(seq.size()));
      EXPECT_EQ(id, std::max_element(ref.begin(), ref.end()) - ref.begin());
      seq.push_back(id);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Flavours, GenerateFlavours, ::testing::Values("gpt2", "llama"));

TEST(Generate, TheCacheHoldsOnlyTheKeyValueHeads) {
  auto m = make_model("llama");
  Generator gen(*m);
  gen.prefill({random_tokens(3, 1)});
  EXPECT_EQ(gen.cache().row_size(), m->config().n_kv_head * m->config().head_dim());
  EXPECT_LT(m->config().n_kv_head, m->config().n_head);
}

TEST(Generate, BadInputIsAnErrorAndChangesNothing) {
  auto m = make_model("llama");
  Generator gen(*m);
  EXPECT_THROW(gen.prefill({}), Error);
  EXPECT_THROW(gen.prefill({{1, 2}, {}}), Error);
  EXPECT_THROW(gen.prefill({random_tokens(21, 1)}), Error);  // past max_seq_len = 20
  EXPECT_THROW(gen.prefill({{1, kVocab}}), Error);
  const std::vector<int32_t> seq = random_tokens(20, 4);
  gen.prefill({{seq.begin(), seq.begin() + 18}, {seq[0]}});
  EXPECT_THROW(gen.decode_step({seq[18]}), Error);  // one id for two sequences
  EXPECT_THROW(gen.decode_step({seq[18], kVocab}), Error);
  gen.decode_step({seq[18], -1});
  const std::vector<float> last = gen.decode_step({seq[19], -1});  // position 19: the last there is
  const std::string msg = esplag::testing::error_of([&] { gen.decode_step({seq[0], seq[1]}); });
  EXPECT_NE(msg.find("max_seq_len=20"), std::string::npos) << msg;
  EXPECT_EQ(gen.cache().length(0), 20);
  EXPECT_EQ(gen.cache().length(1), 1);  // the failed step appended nothing to sequence 1 either
  expect_row_close(last, 0, full_logits(*m, seq, 20), "last position");
}

TEST(Generate, ALayerReplacedBetweenStepsIsUsedFromTheNextStep) {
  auto m = make_model("llama");
  const std::vector<int32_t> seq = random_tokens(8, 6);
  Generator gen(*m);
  gen.prefill({{seq.begin(), seq.begin() + 5}});
  gen.decode_step({seq[5]});
  const std::vector<float> before = full_logits(*m, seq, 7);
  // The last block's MLP feeds no cached key or value, so the next step's logits are those of
  // the model with the new layer at every position.
  const std::string name = "blocks." + std::to_string(m->config().n_layer - 1) + ".mlp.fc.weight";
  LinearOptions o;
  o.kind = "semi_sparse";
  m->replace_linear(name, make_linear(m->linear_params(name), o, &m->linear(name)));
  m->after_optimizer_step();
  const std::vector<float> after = full_logits(*m, seq, 7);
  ASSERT_NE(before, after);  // the replacement changes the logits
  expect_row_close(gen.decode_step({seq[6]}), 0, after, "the step after the replacement");
}
