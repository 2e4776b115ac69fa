#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "profile/what_if.h"

using namespace esplag;

namespace {

// A 3 -> {B 2, C 5} -> D 4 -> E 1; makespan 13, critical path A C D E, B has slack 3.
// A, B, C are dense GEMMs, D attention, E loss.
OpGraph diamond() {
  OpGraph g;
  const int a = g.add_node("blocks.0.mlp.fc.fwd", 3, OpCategory::dense_gemm);
  const int b = g.add_node("blocks.0.B", 2, OpCategory::dense_gemm);
  const int c = g.add_node("blocks.0.C", 5, OpCategory::dense_gemm);
  const int d = g.add_node("blocks.0.attn.D", 4, OpCategory::attention);
  const int e = g.add_node("loss.E", 1, OpCategory::loss);
  g.add_edge(a, b);
  g.add_edge(a, c);
  g.add_edge(b, d);
  g.add_edge(c, d);
  g.add_edge(d, e);
  return g;
}

std::vector<WhatIfSpec> specs(std::initializer_list<std::string> texts) {
  std::vector<std::string> v(texts);
  return parse_what_if_specs(v);
}

// The message of the Error thrown by parsing `text` ("" if none is thrown).
std::string error_of(const std::string& text) {
  try {
    parse_what_if_spec(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string csv_error_of(const std::string& content) {
  try {
    parse_what_if_csv(content, "bench.csv");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(haystack, needle)                                         \
  do {                                                                       \
    const std::string h_ = (haystack);                                       \
    EXPECT_NE(h_.find(needle), std::string::npos) << "message: " << h_;      \
  } while (0)

}  // namespace

TEST(WhatIfSpec, ParsesPatternsAndFactors) {
  WhatIfSpec s = parse_what_if_spec("re:.*mlp.*=1.5x");
  EXPECT_FALSE(s.category.has_value());
  EXPECT_EQ(s.pattern, ".*mlp.*");
  EXPECT_DOUBLE_EQ(s.factor, 1.5);
  EXPECT_EQ(s.text, "re:.*mlp.*=1.5x");
  EXPECT_EQ(s.factor_str(), "1.5x");

  s = parse_what_if_spec("category:dense_gemm=2");
  ASSERT_TRUE(s.category.has_value());
  EXPECT_EQ(*s.category, OpCategory::dense_gemm);
  EXPECT_DOUBLE_EQ(s.factor, 2);

  s = parse_what_if_spec("attention=inf");
  ASSERT_TRUE(s.category.has_value());
  EXPECT_EQ(*s.category, OpCategory::attention);
  EXPECT_TRUE(std::isinf(s.factor));
  EXPECT_EQ(s.factor_str(), "free");

  s = parse_what_if_spec("mlp.fc=3");  // plain text is a regex over names
  EXPECT_FALSE(s.category.has_value());
  EXPECT_EQ(s.pattern, "mlp.fc");
  EXPECT_DOUBLE_EQ(s.factor, 3);

  s = parse_what_if_spec("re:loss=2");  // re: forces a regex even for a category name
  EXPECT_FALSE(s.category.has_value());
  EXPECT_EQ(s.pattern, "loss");

  s = parse_what_if_spec("re:a=b=2");  // split at the last '='
  EXPECT_EQ(s.pattern, "a=b");
  EXPECT_DOUBLE_EQ(s.factor, 2);

  s = parse_what_if_spec("  re:fwd$ = 0.5X ");
  EXPECT_EQ(s.pattern, "fwd$");
  EXPECT_DOUBLE_EQ(s.factor, 0.5);

  EXPECT_TRUE(std::isinf(parse_what_if_spec("x=INFx").factor));
  EXPECT_DOUBLE_EQ(parse_what_if_spec("x=+2e0").factor, 2);
  EXPECT_EQ(*parse_what_if_spec("Category:Optimizer=2").category, OpCategory::optimizer);
}

TEST(WhatIfSpec, MatchesNamesBySearchAndCategoriesExactly) {
  GraphNode n;
  n.name = "blocks.3.mlp.fc.fwd";
  n.category = OpCategory::dense_gemm;
  EXPECT_TRUE(parse_what_if_spec("mlp.fc=2").matches(n));
  EXPECT_TRUE(parse_what_if_spec("re:^blocks\\.3\\.=2").matches(n));
  EXPECT_FALSE(parse_what_if_spec("re:^mlp=2").matches(n));
  EXPECT_FALSE(parse_what_if_spec("re:blocks\\.30=2").matches(n));
  EXPECT_TRUE(parse_what_if_spec("dense_gemm=2").matches(n));
  EXPECT_FALSE(parse_what_if_spec("category:sparse_gemm=2").matches(n));
}

TEST(WhatIfSpec, MalformedSpecsGivePreciseErrors) {
  EXPECT_HAS(error_of(""), "empty");
  EXPECT_HAS(error_of("   "), "empty");
  EXPECT_HAS(error_of("re:.*mlp.*"), "missing '='");
  EXPECT_HAS(error_of("re:.*mlp.*"), "'re:.*mlp.*'");
  EXPECT_HAS(error_of("=2"), "empty pattern");
  EXPECT_HAS(error_of("  =2"), "empty pattern");
  EXPECT_HAS(error_of("re:=2"), "empty regex");
  EXPECT_HAS(error_of("re:mlp([=2"), "invalid regex 'mlp(['");
  EXPECT_HAS(error_of("mlp(=2"), "invalid regex 'mlp('");
  EXPECT_HAS(error_of("re:*x=2"), "invalid regex '*x'");
  EXPECT_HAS(error_of("mlp="), "missing factor");
  EXPECT_HAS(error_of("mlp=  "), "missing factor");
  EXPECT_HAS(error_of("mlp=fast"), "factor 'fast' is not a number");
  EXPECT_HAS(error_of("mlp=1.5y"), "factor '1.5y' is not a number");
  EXPECT_HAS(error_of("mlp=1.5xx"), "is not a number");
  EXPECT_HAS(error_of("mlp=x"), "is not a number");
  EXPECT_HAS(error_of("mlp=nan"), "is not a number");
  EXPECT_HAS(error_of("mlp=0"), "factor must be > 0, got '0'");
  EXPECT_HAS(error_of("mlp=0x"), "must be > 0");
  EXPECT_HAS(error_of("mlp=-2x"), "must be > 0, got '-2x'");
  EXPECT_HAS(error_of("mlp=-inf"), "must be > 0");
  EXPECT_HAS(error_of("mlp=1e999"), "out of range");
  EXPECT_HAS(error_of("category:gemm=2"), "unknown category 'gemm'");
  EXPECT_HAS(error_of("category:gemm=2"), "dense_gemm, sparse_gemm");
  EXPECT_HAS(error_of("category:=2"), "empty category");
  // Every message names the spec it is about.
  EXPECT_HAS(error_of("mlp=fast"), "what-if spec 'mlp=fast'");
  EXPECT_HAS(error_of("category:gemm=2"), "what-if spec 'category:gemm=2'");
  EXPECT_EQ(error_of("mlp=2"), "");
}

// The malformed inputs a user is likely to give, each spelled the way it would be typed, on the
// command line and in a CSV (where the message also names the file and line).
TEST(WhatIfSpec, MalformedPatternsAndFactorsAsTyped) {
  // Bad regex.
  EXPECT_HAS(error_of("re:[a-=2"), "invalid regex '[a-'");
  EXPECT_HAS(error_of("blocks.(0=2"), "invalid regex 'blocks.(0'");
  EXPECT_HAS(error_of("re:a{2,1}=2"), "invalid regex");
  // Bad factor: zero, negative, not a number.
  for (const char* zero : {"mlp=0", "mlp=0.0", "mlp=-0", "mlp=0e5", "mlp=+0x"})
    EXPECT_HAS(error_of(zero), "factor must be > 0");
  for (const char* neg : {"mlp=-1", "mlp=-0.5x", "mlp=-1e3"}) EXPECT_HAS(error_of(neg), "factor must be > 0");
  EXPECT_HAS(error_of("mlp=-1"), "got '-1'");
  for (const char* nan : {"mlp=abc", "mlp=1,5", "mlp=2 x 3", "mlp=0x10", "mlp=x2", "mlp=--1"})
    EXPECT_HAS(error_of(nan), "is not a number");
  EXPECT_HAS(error_of("mlp=abc"), "factor 'abc' is not a number (expected e.g. 1.5, 1.5x or inf)");
  // Missing '='.
  for (const char* no_eq : {"mlp", "category:dense_gemm", "re:^a$ 2", "dense_gemm:2"})
    EXPECT_HAS(error_of(no_eq), "missing '='");
  EXPECT_HAS(error_of("="), "empty pattern");
  // Unknown category (case-insensitive names; the list of valid ones is given).
  EXPECT_HAS(error_of("category:Gemm=2"), "unknown category 'Gemm'");
  EXPECT_HAS(error_of("category:dense-gemm=2"), "expected one of dense_gemm, sparse_gemm");
  EXPECT_EQ(error_of("category:DENSE_GEMM=2"), "");
  // The same in a CSV.
  EXPECT_HAS(csv_error_of("pattern,factor\nre:[a-,2\n"), "bench.csv:2: what-if spec 're:[a-=2': invalid regex");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,0\n"), "bench.csv:2:");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,0\n"), "factor must be > 0, got '0'");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,2\nmlp,-3x\n"), "bench.csv:3:");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,abc\n"), "factor 'abc' is not a number");
  EXPECT_HAS(csv_error_of("pattern,factor\ncategory:nope,2\n"), "bench.csv:2: what-if spec 'category:nope=2': unknown category 'nope'");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,\n"), "missing factor");
}

TEST(WhatIfCsv, ReadsPatternFactorAndNameSpeedupColumns) {
  auto v = parse_what_if_csv(
      "# kernel benchmark\n"
      "pattern,factor\n"
      "re:.*mlp.*,1.5x\n"
      "\n"
      "category:attention,inf\n");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].pattern, ".*mlp.*");
  EXPECT_DOUBLE_EQ(v[0].factor, 1.5);
  EXPECT_EQ(v[0].text, "re:.*mlp.*=1.5x");
  EXPECT_EQ(*v[1].category, OpCategory::attention);
  EXPECT_TRUE(std::isinf(v[1].factor));

  // Columns by header name, in any order, among others; CRLF; quoted regex with a comma.
  v = parse_what_if_csv(
      "shape,speedup,name,tflops\r\n"
      "4096x4096,1.97,\"re:^blocks\\.[0-9]{1,2}\\.mlp\",812\r\n"
      "1x1, 2 ,dense_gemm,1\r\n");
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].pattern, "^blocks\\.[0-9]{1,2}\\.mlp");
  EXPECT_DOUBLE_EQ(v[0].factor, 1.97);
  EXPECT_EQ(*v[1].category, OpCategory::dense_gemm);
  EXPECT_DOUBLE_EQ(v[1].factor, 2);

  v = parse_what_if_csv("pattern,factor\n\"say \"\"hi\"\"\",2\n");
  EXPECT_EQ(v[0].pattern, "say \"hi\"");
}

TEST(WhatIfCsv, ErrorsNameTheSourceAndLine) {
  EXPECT_HAS(csv_error_of("op,speed\nx,2\n"), "bench.csv:1:");
  EXPECT_HAS(csv_error_of("op,speed\nx,2\n"), "'pattern' (or 'name')");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,2\nmlp,fast\n"), "bench.csv:3:");
  EXPECT_HAS(csv_error_of("pattern,factor\nmlp,2\nmlp,fast\n"), "factor 'fast' is not a number");
  EXPECT_HAS(csv_error_of("pattern,factor\n# c\nre:(,2\n"), "bench.csv:3: what-if spec");
  EXPECT_HAS(csv_error_of("pattern,factor\nre:(,2\n"), "invalid regex '('");
  EXPECT_HAS(csv_error_of("pattern,factor\nonly-one-field\n"), "bench.csv:2: expected at least 2 fields");
  EXPECT_HAS(csv_error_of("pattern,factor\n\"unterminated,2\n"), "bench.csv:2: unterminated");
  EXPECT_HAS(csv_error_of("pattern,factor\n,2\n"), "empty pattern");
  EXPECT_HAS(csv_error_of("pattern,factor\n# nothing\n"), "no what-if rows");
  EXPECT_HAS(csv_error_of("# only comments\n"), "no header");
  EXPECT_HAS(csv_error_of(""), "no header");
}

TEST(WhatIfCsv, ReadsAFileAndReportsAMissingOne) {
  const auto dir = std::filesystem::temp_directory_path() / "esplag_test_profile_what_if";
  std::filesystem::create_directories(dir);
  const auto path = (dir / "bench.csv").string();
  {
    std::ofstream out(path);
    out << "name,speedup\nre:mlp,1.25\n";
  }
  const auto v = read_what_if_csv(path);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_DOUBLE_EQ(v[0].factor, 1.25);
  std::filesystem::remove_all(dir);
  try {
    read_what_if_csv(path);
    FAIL() << "a missing file must throw";
  } catch (const Error& e) {
    EXPECT_HAS(e.what(), "cannot open");
    EXPECT_HAS(e.what(), path);
  }
}

TEST(WhatIf, SpeedingUpAnOpWithSlackChangesNothing) {
  const OpGraph g = diamond();
  const auto r = what_if(g, specs({"re:\\.B$=2"}));
  EXPECT_DOUBLE_EQ(r.baseline_ns, 13);
  EXPECT_DOUBLE_EQ(r.predicted_ns, 13);
  EXPECT_DOUBLE_EQ(r.speedup(), 1);
  ASSERT_EQ(r.per_spec.size(), 1u);
  EXPECT_EQ(r.per_spec[0].matched_ops, 1);
  EXPECT_DOUBLE_EQ(r.per_spec[0].matched_ns, 2);
  EXPECT_DOUBLE_EQ(r.per_spec[0].matched_critical_ns, 0);
  // Even free, B is off the critical path: the Amdahl bound is the baseline.
  EXPECT_DOUBLE_EQ(r.per_spec[0].amdahl_bound_ns, 13);
  EXPECT_EQ(r.spec_of_node, (std::vector<int>{-1, 0, -1, -1, -1}));
}

TEST(WhatIf, SpeedingUpTheCriticalOpMovesThePath) {
  const OpGraph g = diamond();
  // C 5 -> 1: path becomes A B D E = 3 + 2 + 4 + 1 = 10, not 13 - 4 = 9.
  const auto r = what_if(g, specs({"re:\\.C$=5x"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 10);
  EXPECT_EQ(r.predicted.critical_path, (std::vector<int>{0, 1, 3, 4}));
  EXPECT_DOUBLE_EQ(r.speedup(), 1.3);
  EXPECT_DOUBLE_EQ(r.per_spec[0].predicted_alone_ns, 10);
  EXPECT_DOUBLE_EQ(r.per_spec[0].amdahl_bound_ns, 10);  // B's path limits it too
  EXPECT_DOUBLE_EQ(r.per_spec[0].matched_critical_ns, 5);

  // C 2x: 2.5 -> A C D E still critical: 3 + 2.5 + 4 + 1 = 10.5.
  EXPECT_DOUBLE_EQ(what_if(g, specs({"re:\\.C$=2"})).predicted_ns, 10.5);
}

TEST(WhatIf, AmdahlBoundPerPatternAndFirstMatchWins) {
  const OpGraph g = diamond();
  // C and D are matched by the first spec (2x); the second (C free) decides no op.
  const auto r = what_if(g, specs({"re:\\.(C|attn\\.D)$=2", "re:\\.C$=inf"}));
  // C 2.5, D 2: A 0-3, B 3-5, C 3-5.5, D 5.5-7.5, E 7.5-8.5.
  EXPECT_DOUBLE_EQ(r.predicted_ns, 8.5);
  EXPECT_EQ(r.spec_of_node, (std::vector<int>{-1, -1, 0, 0, -1}));
  ASSERT_EQ(r.per_spec.size(), 2u);
  EXPECT_EQ(r.per_spec[0].matched_ops, 2);
  EXPECT_EQ(r.per_spec[0].applied_ops, 2);
  EXPECT_DOUBLE_EQ(r.per_spec[0].predicted_alone_ns, 8.5);
  EXPECT_DOUBLE_EQ(r.per_spec[0].amdahl_bound_ns, 6);  // A 3 + B 2 + E 1
  EXPECT_EQ(r.per_spec[1].matched_ops, 1);
  EXPECT_EQ(r.per_spec[1].applied_ops, 0);
  EXPECT_DOUBLE_EQ(r.per_spec[1].predicted_alone_ns, 10);
  EXPECT_DOUBLE_EQ(r.per_spec[1].amdahl_bound_ns, 10);

  // The other order: C free, D 2x -> A 3, B 3-5, D 5-7, E 7-8.
  const auto s = what_if(g, specs({"re:\\.C$=inf", "re:\\.(C|attn\\.D)$=2"}));
  EXPECT_DOUBLE_EQ(s.predicted_ns, 8);
  EXPECT_EQ(s.spec_of_node, (std::vector<int>{-1, -1, 0, 1, -1}));
}

TEST(WhatIf, CategorySpecsAndEverythingFree) {
  const OpGraph g = diamond();
  // dense_gemm (A, B, C) 2x: A 1.5, C 2.5 -> 1.5 + 2.5 + 4 + 1 = 9.
  auto r = what_if(g, specs({"dense_gemm=2"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 9);
  EXPECT_EQ(r.per_spec[0].matched_ops, 3);
  EXPECT_DOUBLE_EQ(r.per_spec[0].amdahl_bound_ns, 5);  // D + E
  r = what_if(g, specs({"category:attention=4"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 10);
  r = what_if(g, specs({"re:.=inf"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 0);
  EXPECT_TRUE(std::isinf(r.speedup()));
  // A slowdown is a factor below 1.
  r = what_if(g, specs({"loss=0.5"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 14);
  // No specs: the prediction is the baseline.
  r = what_if(g, {});
  EXPECT_DOUBLE_EQ(r.predicted_ns, 13);
  EXPECT_TRUE(r.per_spec.empty());
}

TEST(WhatIf, ParallelStreamsOnlyTheCriticalStreamMatters) {
  OpGraph g;
  const int a1 = g.add_node("s0.a1", 4, OpCategory::dense_gemm, 0);
  const int a2 = g.add_node("s0.a2", 4, OpCategory::dense_gemm, 0);
  const int b1 = g.add_node("s1.b1", 5, OpCategory::comm, 1);
  const int b2 = g.add_node("s1.b2", 5, OpCategory::comm, 1);
  const int a3 = g.add_node("s0.a3", 4, OpCategory::dense_gemm, 0);
  g.add_edge(a1, a2);
  g.add_edge(a2, a3);
  g.add_edge(b1, b2);
  g.add_edge(b2, a3);
  // a1, a2 have 2 of slack: even free they change nothing.
  EXPECT_DOUBLE_EQ(what_if(g, specs({"re:a[12]$=inf"})).predicted_ns, 14);
  // comm 2x: 14 -> 12, and the path moves to stream 0.
  const auto r = what_if(g, specs({"comm=2"}));
  EXPECT_DOUBLE_EQ(r.predicted_ns, 12);
  EXPECT_EQ(r.predicted.critical_path, (std::vector<int>{a1, a2, a3}));
  EXPECT_DOUBLE_EQ(r.per_spec[0].amdahl_bound_ns, 12);
}
