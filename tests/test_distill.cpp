// Distillation's loss op (ops/distill.h) against a direct fp64 reference and finite
// differences, its identities (alpha 0 is the cross-entropy op bit for bit; chunking the rows
// changes nothing), the Transformer's chunked teacher logits, and the recipe's distill entry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gradcheck.h"
#include "model/transformer.h"
#include "ops/cross_entropy.h"
#include "ops/distill.h"
#include "test_util.h"
#include "train/recipe.h"

using namespace esplag;
using esplag::testing::error_of;
using esplag::testing::expect_close;
using esplag::testing::numeric_grad;
using esplag::testing::randn;

namespace {

using Vec = std::vector<double>;

// (1 - alpha)·CE + alpha·T²·KL(q_T ‖ p_T) per row, written out from the definitions in fp64.
struct Reference {
  Vec ce, kl, loss;
};
Reference reference(const Vec& z, const Vec& t, const std::vector<int32_t>& y, int N, int V, double alpha, double T) {
  Reference r{Vec(N), Vec(N), Vec(N)};
  for (int n = 0; n < N; ++n) {
    double zs = 0, ps = 0, qs = 0;
    for (int v = 0; v < V; ++v) {
      zs += std::exp(z[n * V + v]);
      ps += std::exp(z[n * V + v] / T);
      qs += std::exp(t[n * V + v] / T);
    }
    r.ce[n] = -std::log(std::exp(z[n * V + y[n]]) / zs);
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(z[n * V + v] / T) / ps, q = std::exp(t[n * V + v] / T) / qs;
      r.kl[n] += q * std::log(q / p);
    }
    r.loss[n] = (1 - alpha) * r.ce[n] + alpha * T * T * r.kl[n];
  }
  return r;
}

template <typename T>
std::vector<T> to(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}

struct OpResult {
  Vec ce, kl, grad;
};
template <typename T>
OpResult run(const Vec& z, const Vec& t, const std::vector<int32_t>& y, int N, int V, double alpha, double temp,
        double dloss) {
  auto zz = to<T>(z), tt = to<T>(t);
  std::vector<T> ce(N), kl(N), d(size_t(N) * V, T(12345));  // d is overwritten
  cpu::distill_cross_entropy(ce.data(), kl.data(), d.data(), zz.data(), tt.data(), y.data(), N, V, alpha, temp,
                             static_cast<T>(dloss));
  return {Vec(ce.begin(), ce.end()), Vec(kl.begin(), kl.end()), Vec(d.begin(), d.end())};
}

struct Case {
  int N = 5, V = 11;
  Vec z, t;
  std::vector<int32_t> y;
  explicit Case(uint64_t seed, int n = 5, int v = 11) : N(n), V(v) {
    Rng rng(seed);
    z = randn(size_t(N) * V, rng, 2.0);
    t = randn(size_t(N) * V, rng, 2.0);
    y.resize(N);
    for (auto& x : y) x = static_cast<int32_t>(rng.below(V));
  }
};

}  // namespace

TEST(DistillOp, MatchesDirectReference) {
  const Case c(7);
  for (const double alpha : {0.0, 0.3, 1.0})
    for (const double temp : {0.5, 1.0, 2.0, 4.0}) {
      const Reference want = reference(c.z, c.t, c.y, c.N, c.V, alpha, temp);
      const OpResult got = run<double>(c.z, c.t, c.y, c.N, c.V, alpha, temp, 1.0);
      expect_close(got.ce, want.ce, 1e-12, 1e-13, "ce");
      expect_close(got.kl, want.kl, 1e-10, 1e-12, "kl");
      const OpResult f = run<float>(c.z, c.t, c.y, c.N, c.V, alpha, temp, 1.0);
      expect_close(f.ce, want.ce, 1e-5, 1e-5, "float ce");
      expect_close(f.kl, want.kl, 1e-4, 1e-5, "float kl");
    }
  // A teacher equal to the student: no divergence.
  const OpResult same = run<double>(c.z, c.z, c.y, c.N, c.V, 0.5, 2.0, 1.0);
  for (double k : same.kl) EXPECT_NEAR(k, 0.0, 1e-14);
}

TEST(DistillOp, GradientMatchesFiniteDifferences) {
  const Case c(8);
  const double dloss = 0.7;
  for (const double alpha : {0.0, 0.4, 1.0})
    for (const double temp : {1.0, 3.0}) {
      Vec z = c.z;
      auto loss = [&] {
        const Reference r = reference(z, c.t, c.y, c.N, c.V, alpha, temp);
        double s = 0;
        for (double l : r.loss) s += l;
        return dloss * s;
      };
      const Vec want = numeric_grad(z, loss);
      const OpResult got = run<double>(c.z, c.t, c.y, c.N, c.V, alpha, temp, dloss);
      expect_close(got.grad, want, 1e-6, 1e-8, "dlogits");
    }
}

TEST(DistillOp, AlphaZeroIsTheCrossEntropyBitForBit) {
  const Case c(9, 17, 29);
  std::vector<float> z = to<float>(c.z), t = to<float>(c.t);
  std::vector<float> ce(c.N), kl(c.N), d(z.size()), ce0(c.N), d0(z.size());
  const float dloss = 0.3f;
  cpu::distill_cross_entropy(ce.data(), kl.data(), d.data(), z.data(), t.data(), c.y.data(), c.N, c.V, 0.0, 2.0, dloss);
  cpu::softmax_cross_entropy(ce0.data(), d0.data(), z.data(), c.y.data(), c.N, c.V, dloss);
  EXPECT_EQ(std::memcmp(ce.data(), ce0.data(), ce.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(d.data(), d0.data(), d.size() * sizeof(float)), 0);
  for (float k : kl) EXPECT_GT(k, 0.0f);  // the KL is still measured
}

TEST(DistillOp, RowChunksGiveTheWholeResult) {
  const Case c(10, 23, 13);
  const OpResult whole = run<float>(c.z, c.t, c.y, c.N, c.V, 0.6, 2.0, 0.5);
  for (const int chunk : {1, 4, 7}) {
    Vec ce, kl, grad;
    for (int r0 = 0; r0 < c.N; r0 += chunk) {
      const int rows = std::min(chunk, c.N - r0);
      const Vec z(c.z.begin() + r0 * c.V, c.z.begin() + (r0 + rows) * c.V);
      const Vec t(c.t.begin() + r0 * c.V, c.t.begin() + (r0 + rows) * c.V);
      const std::vector<int32_t> y(c.y.begin() + r0, c.y.begin() + r0 + rows);
      const OpResult part = run<float>(z, t, y, rows, c.V, 0.6, 2.0, 0.5);
      ce.insert(ce.end(), part.ce.begin(), part.ce.end());
      kl.insert(kl.end(), part.kl.begin(), part.kl.end());
      grad.insert(grad.end(), part.grad.begin(), part.grad.end());
    }
    // Every row is computed by itself: chunks change nothing, not even the rounding.
    EXPECT_EQ(ce, whole.ce) << "chunk " << chunk;
    EXPECT_EQ(kl, whole.kl) << "chunk " << chunk;
    EXPECT_EQ(grad, whole.grad) << "chunk " << chunk;
  }
}

TEST(DistillOp, RefusesBadArguments) {
  const Case c(11, 2, 5);
  std::vector<double> ce(2), kl(2);
  auto call = [&](double alpha, double temp, int32_t target) {
    std::vector<int32_t> y = {0, target};
    return error_of([&] {
      cpu::distill_cross_entropy(ce.data(), kl.data(), static_cast<double*>(nullptr), c.z.data(), c.t.data(), y.data(),
                                 2, 5, alpha, temp, 1.0);
    });
  };
  EXPECT_NE(call(1.5, 1.0, 0).find("alpha must be in [0, 1]"), std::string::npos);
  EXPECT_NE(call(0.5, 0.0, 0).find("temperature must be positive"), std::string::npos);
  EXPECT_NE(call(0.5, 1.0, 5).find("target 5 at row 1"), std::string::npos);
  EXPECT_EQ(call(0.5, 1.0, 4), "(no error)");
}

// The model's chunked head: the distillation loss of a micro-batch over more rows than one
// head chunk (256) equals the op on the full logits, and its gradient is the finite
// differences' of that loss; alpha 0 is forward_backward's exactly.
TEST(DistillModel, ChunkedHeadMatchesFullLogits) {
  ModelConfig cfg;
  cfg.n_layer = 1, cfg.d_model = 8, cfg.n_head = 2, cfg.n_kv_head = 2, cfg.d_ff = 16, cfg.max_seq_len = 160,
  cfg.vocab_size = 7;
  Transformer<double> student(cfg), teacher(cfg);
  student.init_weights(1);
  teacher.init_weights(2);
  const int B = 2, T = 150, N = B * T;  // 300 rows: two head chunks
  Rng rng(3);
  std::vector<int32_t> x(N), y(N);
  for (auto& v : x) v = static_cast<int32_t>(rng.below(cfg.vocab_size));
  for (auto& v : y) v = static_cast<int32_t>(rng.below(cfg.vocab_size));
  teacher.forward_hidden(x.data(), B, T);
  const DistillTarget<double> target{0.4, 2.0, [&](int r0, int rows, double* out) { teacher.head_logits(r0, rows, out); }};

  // The op on the full logits of both models.
  std::vector<double> zs(size_t(N) * cfg.vocab_size), zt(zs.size());
  teacher.head_logits(0, N, zt.data());
  student.forward_hidden(x.data(), B, T);
  student.head_logits(0, N, zs.data());
  std::vector<double> ce(N), kl(N);
  cpu::distill_cross_entropy(ce.data(), kl.data(), static_cast<double*>(nullptr), zs.data(), zt.data(), y.data(), N,
                             cfg.vocab_size, 0.4, 2.0, 1.0);
  double want_ce = 0, want_kl = 0;
  for (int n = 0; n < N; ++n) want_ce += ce[n] / N, want_kl += kl[n] / N;

  student.zero_grad();
  const LossParts parts = student.forward_backward(x.data(), y.data(), B, T, 1.0, target);
  EXPECT_NEAR(parts.ce, want_ce, 1e-12);
  EXPECT_NEAR(parts.kl, want_kl, 1e-12);
  EXPECT_NEAR(parts.loss, 0.6 * want_ce + 0.4 * 4.0 * want_kl, 1e-12);

  // Finite differences of the loss on a few weights of the head and of the first block.
  for (const char* name : {"embed.tokens.weight", "blocks.0.mlp.fc.weight"}) {
    const ParamInfo& info = student.param_info(name);
    for (size_t i : {size_t(0), info.numel / 2, info.numel - 1}) {
      double* w = student.params() + info.offset + i;
      const double saved = *w, eps = 1e-6;
      auto loss_at = [&](double v) {
        *w = v;
        teacher.forward_hidden(x.data(), B, T);
        Transformer<double> probe(cfg);  // the same weights, fresh gradients
        std::copy(student.params(), student.params() + student.num_params(), probe.params());
        return probe.forward_backward(x.data(), y.data(), B, T, 1.0, target).loss;
      };
      const double numeric = (loss_at(saved + eps) - loss_at(saved - eps)) / (2 * eps);
      *w = saved;
      EXPECT_NEAR(student.grads()[info.offset + i], numeric, 1e-7 + 1e-5 * std::abs(numeric)) << name << "[" << i << "]";
    }
  }

  // alpha 0: the plain step's loss and gradients bit for bit.
  Transformer<float> a(cfg), b(cfg), tf(cfg);
  a.init_weights(1), b.init_weights(1), tf.init_weights(2);
  tf.forward_hidden(x.data(), B, T);
  const DistillTarget<float> zero{0.0, 2.0, [&](int r0, int rows, float* out) { tf.head_logits(r0, rows, out); }};
  a.zero_grad(), b.zero_grad();
  const double plain = a.forward_backward(x.data(), y.data(), B, T, 0.5);
  const LossParts distilled = b.forward_backward(x.data(), y.data(), B, T, 0.5, zero);
  EXPECT_EQ(plain, distilled.loss);
  EXPECT_GT(distilled.kl, 0.0);
  EXPECT_EQ(std::memcmp(a.grads(), b.grads(), a.num_params() * sizeof(float)), 0);
}

// --- the recipe's distill entry ----------------------------------------------------------

TEST(DistillRecipe, ParsesSchedulesAndRoundTrips) {
  Recipe r = Recipe::parse(
      "- slope: {params: ['re:.*mlp.*']}\n- distill: {teacher: runs/dense, alpha: 0.7, temperature: 3, start: 2, "
      "until: 0.5}\n",
      "run.yaml");
  ASSERT_NE(r.distill(), nullptr);
  EXPECT_EQ(r.distill()->teacher, "runs/dense");
  EXPECT_EQ(r.distill()->alpha, 0.7);
  EXPECT_EQ(r.distill()->temperature, 3.0);
  LinearShapes shapes{{"blocks.0.mlp.fc.weight", {64, 32}}, {"blocks.0.attn.qkv.weight", {96, 32}}};
  r.validate(shapes, 10);
  EXPECT_FALSE(r.distills_at(1));
  EXPECT_TRUE(r.distills_at(2));
  EXPECT_TRUE(r.distills_at(4));
  EXPECT_FALSE(r.distills_at(5));
  EXPECT_EQ(r.plan_at(3).size(), 1u);  // distill claims no weight
  EXPECT_NE(r.describe().find("distill from runs/dense: alpha 0.7, temperature 3, steps [2, 5)"), std::string::npos)
      << r.describe();
  const Recipe back = Recipe::parse(r.to_yaml(), "again");
  EXPECT_EQ(back.to_yaml(), r.to_yaml());
  EXPECT_EQ(back.distill()->teacher, "runs/dense");

  // Defaults: alpha 0.5, temperature 2, the whole run.
  Recipe d = Recipe::parse("- distill: {teacher: t}\n", "run.yaml");
  d.validate(shapes, 10);
  EXPECT_EQ(d.distill()->alpha, 0.5);
  EXPECT_EQ(d.distill()->temperature, 2.0);
  EXPECT_TRUE(d.distills_at(0) && d.distills_at(9));
  EXPECT_EQ(Recipe::parse("- semi_sparse: {params: [x]}\n", "r").distill(), nullptr);
}

TEST(DistillRecipe, RefusesBadKeys) {
  auto err = [](const std::string& yaml) { return error_of([&] { Recipe::parse(yaml, "run.yaml"); }); };
  EXPECT_NE(err("- distill: {alpha: 0.5}\n").find("run.yaml: recipe[0] (distill): missing required key 'teacher'"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: t, alpha: 1.5}\n").find("recipe[0] (distill): key 'alpha' must be in [0, 1]"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: t, alpha: x}\n").find("key 'alpha' must be a number, got 'x'"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: t, temperature: 0}\n").find("key 'temperature' must be positive, got 0"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: t, temperature: -1}\n").find("key 'temperature' must be positive"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: t, params: [x]}\n").find("unknown key 'params' (known: teacher, alpha, "
                                                               "temperature, start, until)"),
            std::string::npos);
  EXPECT_NE(err("- distill: {teacher: a}\n- distill: {teacher: b}\n")
                .find("recipe[1] (distill): a recipe distills from one teacher; recipe[0] is a distill entry already"),
            std::string::npos);
  EXPECT_NE(err("- distil: {teacher: a}\n").find("known: gradual_magnitude, kernel_replacement, distill"),
            std::string::npos);
  Recipe r = Recipe::parse("- distill: {teacher: t, start: 5, until: 3}\n", "run.yaml");
  EXPECT_NE(error_of([&] { r.validate({}, 10); }).find("recipe[0] (distill): until (3) must be after start (5)"),
            std::string::npos);
  Recipe far = Recipe::parse("- distill: {teacher: t, start: 50}\n", "run.yaml");
  EXPECT_NE(error_of([&] { far.validate({}, 10); }).find("key 'start': step 50 is beyond the end of training"),
            std::string::npos);
}
