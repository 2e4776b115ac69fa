// cuSPARSELt 2:4 GEMMs: the run-time loader, the per-problem plans and their process-wide
// cache, and the JSON tuning cache. See sparse/cuda/cusparselt.h for the API.
//
// Descriptors of the four (product, operand) combinations of a weight's products. W
// [out, in] row-major is always the structured descriptor (rows = out, cols = in, ld = in,
// row order); only the operation applied to it changes, so the pruned W is compressed
// straight from memory:
//
//   product  W as  m    n    k    A                         B                          D (= C)
//   fwd      A     out  N    in   W  row, op N              X [N,in] row, op T          [out,N] col, ld out
//   fwd      B     N    out  in   X [N,in] row, op N        W  row, op T                [N,out] row, ld out
//   bwd      A     in   N    out  W  row, op T              dY [N,out] row, op T        [in,N] col, ld in
//   bwd      B     N    in   out  dY [N,out] row, op N      W  row, op N                [N,in] row, ld in
//
// A column-major [m, N] D with ld = m is the row-major [N, m] the model uses, so no
// transpose runs anywhere. The BIAS epilogue adds one value per row of D (per m), which
// is a per-feature bias only when W is A.
//
// The weight gradient (structured operand S = the 2:4 estimate of dYᵀ, A only):
//
//   dw       S as A  out  in  N   S [out,N] row, op N       X [N,in] row, op N          [out,in] row, ld in
//
// semi_sparse_activation's forward (structured operand Xs, the input pruned 2:4 along its
// features, A only):
//
//   xfwd     Xs as A N   out  in   Xs [N,in] row, op N       W [out,in] = [in,out] col, op N   [N,out] row, ld out
//
// Both operands K-major (the layout of tensor-core GEMMs), Y as the model holds it. Its weight
// gradient where Xs is 2:4 along the tokens too (tile_24), the structured operand Xsᵀ as
// the fused pruning kernel writes its layout (the transposed orientation, from X as it lies):
//
//   xdw      Xsᵀ as A  in  out  N   Xsᵀ [in,N] row, op N     dY [N,out] row, op N       [in,out] col, ld in
//
// a column-major [in, out] D being the row-major dW [out, in] the optimizer holds.
//
// S is op N because that is the layout the fused MVUE kernel writes (cusparselt_layout.h's
// forward form, checked byte for byte against the library per problem; the library's op T
// layout is a different one). With m = out and n = in, dW [out, in] as the optimizer holds
// it is D row-major, so D cannot be column-major here as in the weight's products (that
// would be dWᵀ). X [N, in] as it lies is op(B) = [k = N, n = in] with op N; the same bytes
// described column-major [in, N] with op T would be equivalent, and row-major with op N is
// the combination PyTorch's cuSPARSELt binding uses for a contiguous dense operand with a
// row-major output. cuSPARSELt could still refuse it for some size: descriptor and plan
// initialisation go through LT_CHECK like every other problem, so that surfaces as an
// Error with the status and the problem key, never as a silent fallback.
//
// Element types: A and B bf16 (or both fp8 e4m3 for the forward with W as A, whose layout
// above reads both operands K-major as fp8 tensor cores need), C = D bf16, compute fp32.
#include "sparse/cuda/cusparselt.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "core/cuda_check.h"
#include "core/cuda_timing.h"
#include "core/env.h"
#include "core/error.h"

#ifdef ESPLAG_HAVE_CUSPARSELT
#include <cusparseLt.h>
#endif

namespace esplag::gpu {

namespace {

[[maybe_unused]] double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

const char* product_name(SparseProduct p) {
  switch (p) {
    case SparseProduct::forward: return "fwd";
    case SparseProduct::backward_data: return "bwd";
    case SparseProduct::weight_grad: return "dw";
    case SparseProduct::activation_forward: return "xfwd";
    case SparseProduct::activation_weight_grad: return "xdw";
  }
  return "?";
}
const char* activation_name(SparseActivation a) {
  return a == SparseActivation::relu ? "relu" : a == SparseActivation::gelu ? "gelu" : "none";
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Problems

namespace {
// A problem of `product` over W [out, in] and `tokens` rows, without epilogue, the structured
// operand as `op`.
SparseGemm24Problem problem_of(SparseProduct product, int64_t out, int64_t in, int64_t tokens,
                               SparseOperand op = SparseOperand::a) {
  SparseGemm24Problem p;
  p.product = product;
  p.out = out;
  p.in = in;
  p.tokens = tokens;
  p.weight_operand = op;
  return p;
}
}  // namespace

SparseGemm24Problem SparseGemm24Problem::linear_forward(int64_t out, int64_t in, int64_t tokens, bool bias,
                                                        SparseActivation act, SparseOperand op) {
  SparseGemm24Problem p = problem_of(SparseProduct::forward, out, in, tokens, op);
  p.bias = bias;
  p.activation = act;
  return p;
}

SparseGemm24Problem SparseGemm24Problem::linear_backward_data(int64_t out, int64_t in, int64_t tokens,
                                                              SparseOperand op) {
  return problem_of(SparseProduct::backward_data, out, in, tokens, op);
}

SparseGemm24Problem SparseGemm24Problem::linear_weight_grad(int64_t out, int64_t in, int64_t tokens) {
  return problem_of(SparseProduct::weight_grad, out, in, tokens);
}

SparseGemm24Problem SparseGemm24Problem::linear_activation_forward(int64_t out, int64_t in, int64_t tokens) {
  return problem_of(SparseProduct::activation_forward, out, in, tokens);
}

SparseGemm24Problem SparseGemm24Problem::linear_activation_weight_grad(int64_t out, int64_t in, int64_t tokens) {
  return problem_of(SparseProduct::activation_weight_grad, out, in, tokens);
}

std::string SparseGemm24Problem::key() const {
  return detail::concat(product_name(product), " out=", out, " in=", in, " tokens=", tokens,
                        " w=", weight_operand == SparseOperand::a ? "A" : "B", " bias=", bias ? 1 : 0,
                        " act=", activation_name(activation), " ", sparse_dtype_name(dtype));
}

const char* sparse_dtype_name(SparseDtype d) { return d == SparseDtype::e4m3 ? "e4m3" : "bf16"; }

void check_sparse_gemm24_problem(const SparseGemm24Problem& p) {
  const std::string what = "2:4 sparse GEMM (" + p.key() + ")";
  const std::pair<const char*, int64_t> dims[] = {{"out", p.out}, {"in", p.in}, {"tokens", p.tokens}};
  for (const auto& [name, v] : dims) {
    ESPLAG_CHECK(v > 0, what, ": ", name, " must be positive, got ", v);
    // cuSPARSELt: rows, columns and leading dimensions of 16-bit matrices must be
    // multiples of 16 (dense and structured descriptors alike).
    ESPLAG_CHECK(v % 16 == 0, what, ": ", name, " = ", v,
                 " is not a multiple of 16, which cuSPARSELt requires of every dimension of bf16 operands "
                 "(pad the layer or run it dense)");
  }
  // cuSPARSELt's descriptors hold at most 2^31 - 1 elements per 16-bit matrix: the
  // structured operand, the dense operand and the output.
  const int64_t limit = (int64_t(1) << 31) - 1;
  // Each product's name and its three matrices: the structured one, the dense input, the
  // output (with their element counts).
  struct Roles {
    const char *which, *structured, *dense, *output;
    int64_t dense_n, output_n;
  };
  const int64_t so = p.tokens * p.out, si = p.tokens * p.in, w = p.out * p.in;
  Roles z{"the forward product", "W", "the token-side input", "the output", si, so};
  switch (p.product) {
    case SparseProduct::forward: break;
    case SparseProduct::backward_data: z = {"the backward-data product", "W", "dY", "dX", so, si}; break;
    case SparseProduct::weight_grad:
      z = {"the weight-gradient product", "the structured dY^T", "X", "dW", si, w};
      break;
    case SparseProduct::activation_forward:
      z = {"the product of a 2:4 input", "the structured X", "W", "the output", w, so};
      break;
    case SparseProduct::activation_weight_grad:
      z = {"the weight-gradient product of a 2:4 input", "the structured X^T", "dY", "dW", so, w};
      break;
  }
  const char* which = z.which;
  const std::pair<const char*, int64_t> sizes[] = {
      {z.structured, p.structured_rows() * p.structured_cols()}, {z.dense, z.dense_n}, {z.output, z.output_n}};
  for (const auto& [name, v] : sizes)
    ESPLAG_CHECK(v <= limit, what, ": ", name, " has ", v, " elements, more than cuSPARSELt's 2^31 - 1");
  if (p.product != SparseProduct::forward) {
    // (a bias of the products with a 2:4 input would run along the tokens, not the features)
    ESPLAG_CHECK(!p.bias, what, ": ", which, " has no bias");
    ESPLAG_CHECK(p.activation == SparseActivation::none, what, ": ", which, " has no activation");
  }
  // Only W has a described layout as B (cusparselt.cu's table): as B, the other structured
  // operands would be K-major along a dimension nothing here writes.
  const bool weight_products = p.product == SparseProduct::forward || p.product == SparseProduct::backward_data;
  ESPLAG_CHECK(weight_products || p.weight_operand == SparseOperand::a, what, ": ", which,
               " takes its structured operand ", z.structured, " as operand A only");
  ESPLAG_CHECK(!(p.bias && p.weight_operand == SparseOperand::b), what,
               ": a fused bias needs the weight as operand A (with W as B the epilogue would add one value "
               "per token, not per feature)");
  if (p.dtype == SparseDtype::e4m3) {
    // fp8 tensor cores read both operands K-major: the forward layout with W as A (W row-major
    // op N, X row-major op T) is that; the other layouts are not described for fp8 here.
    ESPLAG_CHECK(p.product == SparseProduct::forward && p.weight_operand == SparseOperand::a, what,
                 ": e4m3 operands are supported for the forward product with W as operand A only");
    ESPLAG_CHECK(!p.bias && p.activation == SparseActivation::none, what,
                 ": e4m3 products run without bias or activation epilogue");
    for (const auto& [name, v] : dims)
      ESPLAG_CHECK(v % 32 == 0, what, ": ", name, " = ", v,
                   " is not a multiple of 32, which cuSPARSELt requires of the dimensions of 8-bit operands");
  }
}

// ---------------------------------------------------------------------------------------
// Tuning cache (plain C++, also in builds without cusparseLt.h)

namespace {

// A minimal JSON reader for the tuning file: objects, arrays, strings (with escapes),
// numbers, true / false / null. Errors carry the byte offset.
struct Json {
  enum class Type { null, boolean, number, string, array, object } type = Type::null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;

  const Json* find(const std::string& k) const {
    for (const auto& [name, v] : obj)
      if (name == k) return &v;
    return nullptr;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& s) : s_(s) {}
  Json parse() {
    Json v = value(0);
    ws();
    if (i_ != s_.size()) error("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& what) const { fail(what, " at byte ", i_); }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) error(std::string("expected '") + c + "'");
  }
  Json value(int depth) {
    if (depth > 32) error("nesting too deep");
    ws();
    if (i_ >= s_.size()) error("unexpected end of input");
    Json v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.type = Json::Type::object;
      if (eat('}')) return v;
      do {
        ws();
        std::string k = string();
        expect(':');
        v.obj.emplace_back(std::move(k), value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.type = Json::Type::array;
      if (eat(']')) return v;
      do v.arr.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.type = Json::Type::string;
      v.str = string();
    } else if (literal("true")) {
      v.type = Json::Type::boolean;
      v.b = true;
    } else if (literal("false")) {
      v.type = Json::Type::boolean;
    } else if (literal("null")) {
    } else {
      v.type = Json::Type::number;
      const char* begin = s_.c_str() + i_;
      char* end = nullptr;
      v.num = std::strtod(begin, &end);
      if (end == begin || !std::isfinite(v.num)) error("invalid value");
      i_ += static_cast<size_t>(end - begin);
    }
    return v;
  }
  bool literal(const char* w) {
    const size_t n = std::strlen(w);
    if (s_.compare(i_, n, w) != 0) return false;
    i_ += n;
    return true;
  }
  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') error("expected a string");
    ++i_;
    std::string out;
    while (true) {
      if (i_ >= s_.size()) error("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) error("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) error("short \\u escape");
          const unsigned cp = static_cast<unsigned>(std::stoul(s_.substr(i_, 4), nullptr, 16));
          i_ += 4;
          // GPU names and problem keys are ASCII; anything else is kept as UTF-8 of the BMP.
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default: error("invalid escape");
      }
    }
  }

  const std::string& s_;
  size_t i_ = 0;
};

std::string json_quote(const std::string& s) {
  std::string o = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      o += buf;
    } else {
      o += c;
    }
  }
  return o + "\"";
}

constexpr const char* kTuningFormat = "esplag-cusparselt-tuning";
constexpr int kTuningVersion = 1;

struct TuningEntry {
  std::string gpu;
  int version = 0;
  std::string problem;
  SparseGemm24Config config;
  int max_alg_id = 0;
  double search_ms = 0;
};

class TuningCache {
 public:
  static TuningCache& instance() {
    static TuningCache* c = new TuningCache();  // never destroyed: used until exit
    return *c;
  }

  std::string path() {
    std::lock_guard<std::mutex> lock(mu_);
    return path_locked();
  }
  void set_path(const std::string& p) {
    std::lock_guard<std::mutex> lock(mu_);
    explicit_path_ = p;
    load_locked();
  }
  void reload() {
    std::lock_guard<std::mutex> lock(mu_);
    load_locked();
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    return entries_.size();
  }
  bool lookup(const std::string& gpu, int version, const std::string& problem, TuningEntry* out) {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    auto it = entries_.find(key(gpu, version, problem));
    if (it == entries_.end()) return false;
    *out = it->second;
    return true;
  }
  [[maybe_unused]] void store(const TuningEntry& e) {
    std::lock_guard<std::mutex> lock(mu_);
    ensure_loaded_locked();
    entries_[key(e.gpu, e.version, e.problem)] = e;
    write_locked();
  }

 private:
  static std::string key(const std::string& gpu, int version, const std::string& problem) {
    return gpu + "|" + std::to_string(version) + "|" + problem;
  }
  std::string path_locked() const {
    if (!explicit_path_.empty()) return explicit_path_;
    if (const char* e = std::getenv("ESPLAG_CUSPARSELT_TUNING"); e && *e) return e;
    if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
      return (std::filesystem::path(x) / "esplag" / "cusparselt-tuning.json").string();
    if (const char* h = std::getenv("HOME"); h && *h)
      return (std::filesystem::path(h) / ".cache" / "esplag" / "cusparselt-tuning.json").string();
    return "cusparselt-tuning.json";
  }
  void ensure_loaded_locked() {
    if (!loaded_) load_locked();
  }
  void warn(const std::string& msg) { std::cerr << "esplag: warning: " << msg << std::endl; }

  void load_locked() {
    loaded_ = true;
    entries_.clear();
    const std::string p = path_locked();
    std::error_code ec;
    if (!std::filesystem::exists(p, ec)) return;  // nothing tuned yet
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in.good() && !in.eof()) {
      warn("cannot read the cuSPARSELt tuning cache " + p + "; ignoring it (problems will be searched again)");
      return;
    }
    try {
      const Json root = JsonParser(ss.str()).parse();
      ESPLAG_CHECK(root.type == Json::Type::object, "the top level is not an object");
      const Json* fmt = root.find("format");
      ESPLAG_CHECK(fmt && fmt->type == Json::Type::string && fmt->str == kTuningFormat,
                   "\"format\" is not \"", kTuningFormat, "\"");
      const Json* ver = root.find("version");
      ESPLAG_CHECK(ver && ver->type == Json::Type::number && ver->num == kTuningVersion, "\"version\" is not ",
                   kTuningVersion);
      const Json* list = root.find("entries");
      ESPLAG_CHECK(list && list->type == Json::Type::array, "\"entries\" is not an array");
      std::map<std::string, TuningEntry> loaded;
      for (size_t i = 0; i < list->arr.size(); ++i) {
        const Json& e = list->arr[i];
        ESPLAG_CHECK(e.type == Json::Type::object, "entry ", i, " is not an object");
        auto str = [&](const char* k) {
          const Json* v = e.find(k);
          ESPLAG_CHECK(v && v->type == Json::Type::string, "entry ", i, ": \"", k, "\" is missing or not a string");
          return v->str;
        };
        auto num = [&](const char* k) {
          const Json* v = e.find(k);
          ESPLAG_CHECK(v && v->type == Json::Type::number, "entry ", i, ": \"", k, "\" is missing or not a number");
          return v->num;
        };
        auto integer = [&](const char* k) {
          const double d = num(k);
          ESPLAG_CHECK(d == std::floor(d) && std::fabs(d) < 1e9, "entry ", i, ": \"", k, "\" is not an integer");
          return static_cast<int>(d);
        };
        TuningEntry t;
        t.gpu = str("gpu");
        t.version = integer("cusparselt");
        t.problem = str("problem");
        t.config.alg_id = integer("alg_id");
        t.config.split_k = integer("split_k");
        t.config.split_k_mode = integer("split_k_mode");
        t.config.split_k_buffers = integer("split_k_buffers");
        t.max_alg_id = integer("max_alg_id");
        t.search_ms = num("search_ms");
        ESPLAG_CHECK(t.config.alg_id >= 0 && t.config.split_k >= 1, "entry ", i, ": alg_id ", t.config.alg_id,
                     " / split_k ", t.config.split_k, " out of range");
        loaded[key(t.gpu, t.version, t.problem)] = t;
      }
      entries_ = std::move(loaded);
    } catch (const Error& e) {
      warn("the cuSPARSELt tuning cache " + p + " is corrupt (" + e.what() +
           "); ignoring it: problems will be searched again and the file rewritten");
    } catch (const std::exception& e) {
      warn("the cuSPARSELt tuning cache " + p + " is corrupt (" + e.what() +
           "); ignoring it: problems will be searched again and the file rewritten");
    }
  }

  void write_locked() {
    const std::string p = path_locked();
    std::ostringstream os;
    os << "{\n  \"format\": " << json_quote(kTuningFormat) << ",\n  \"version\": " << kTuningVersion
       << ",\n  \"entries\": [";
    bool first = true;
    for (const auto& [k, e] : entries_) {
      char ms[64];
      std::snprintf(ms, sizeof ms, "%.3f", e.search_ms);
      os << (first ? "\n" : ",\n") << "    {\"gpu\": " << json_quote(e.gpu) << ", \"cusparselt\": " << e.version
         << ", \"problem\": " << json_quote(e.problem) << ", \"alg_id\": " << e.config.alg_id
         << ", \"split_k\": " << e.config.split_k << ", \"split_k_mode\": " << e.config.split_k_mode
         << ", \"split_k_buffers\": " << e.config.split_k_buffers << ", \"max_alg_id\": " << e.max_alg_id
         << ", \"search_ms\": " << ms << "}";
      first = false;
    }
    os << (first ? "]\n}\n" : "\n  ]\n}\n");
    const std::string text = os.str();
    // Atomic replacement: a reader sees the old file or the new one, never a torn write
    // (two processes tuning at once: the last rename wins, each file complete).
    const std::filesystem::path target(p);
    const std::string tmp = p + ".tmp." + std::to_string(::getpid());
    std::error_code ec;
    if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path(), ec);
    bool ok = false;
    if (std::FILE* f = std::fopen(tmp.c_str(), "wb")) {
      ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
      ok = (std::fflush(f) == 0) && ok;
      ok = (::fsync(::fileno(f)) == 0) && ok;
      ok = (std::fclose(f) == 0) && ok;
      if (ok) ok = std::rename(tmp.c_str(), p.c_str()) == 0;
      if (!ok) std::remove(tmp.c_str());
    }
    if (!ok)
      warn("cannot write the cuSPARSELt tuning cache " + p + " (" + std::strerror(errno) +
           "); the tuning is kept for this process only");
  }

  std::mutex mu_;
  std::string explicit_path_;
  bool loaded_ = false;
  std::map<std::string, TuningEntry> entries_;
};

std::atomic<bool>& search_flag() {
  static std::atomic<bool> on(env_flag("ESPLAG_CUSPARSELT_SEARCH", true));
  return on;
}

}  // namespace

std::string cusparselt_tuning_path() { return TuningCache::instance().path(); }
void set_cusparselt_tuning_path(const std::string& path) { TuningCache::instance().set_path(path); }
void reload_cusparselt_tuning_cache() { TuningCache::instance().reload(); }
void set_cusparselt_search(bool on) { search_flag() = on; }
bool cusparselt_search_enabled() { return search_flag(); }
size_t cusparselt_tuning_entries() { return TuningCache::instance().size(); }

bool cusparselt_tuning_lookup(const SparseGemm24Problem& p, SparseGemm24Config* config) {
  if (!cusparselt_available()) return false;
  TuningEntry e;
  if (!TuningCache::instance().lookup(current_gpu_name(), cusparselt_version(), p.key(), &e)) return false;
  if (config) *config = e.config;
  return true;
}

namespace {

__global__ void widen_kernel(float* __restrict__ dst, const bf16* __restrict__ src, int64_t n, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = __bfloat162float(src[i]);
  dst[i] = accumulate ? dst[i] + v : v;
}

}  // namespace

void widen_sparse_output(float* dst, const bf16* src, int64_t n, bool accumulate, cudaStream_t stream) {
  if (n <= 0) return;
  const int threads = 256;
  widen_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, stream>>>(dst, src, n, accumulate);
  CUDA_CHECK_LAUNCH("widen_sparse_output");
}

void warn_cusparselt_fallback_once(std::string_view who, std::string_view why) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> warned;
  std::lock_guard<std::mutex> lock(mu);
  if (!warned.insert(std::string(who)).second) return;
  std::cerr << "esplag: warning: " << who << " runs dense GEMMs: ";
  if (why.empty())
    std::cerr << "cuSPARSELt is not available (" << cusparselt_unavailable_reason() << ")";
  else
    std::cerr << why;
  std::cerr << std::endl;
}

// ---------------------------------------------------------------------------------------
// The process-wide plan cache

namespace {

struct PlanCache {
  std::mutex mu;
  std::unordered_map<std::string, std::unique_ptr<SparseGemm24>> plans;
};

PlanCache& plan_cache() {
  static PlanCache* c = new PlanCache();  // never destroyed: plans outlive static destructors
  return *c;
}

}  // namespace

SparseGemm24& SparseGemm24::get(const SparseGemm24Problem& p) {
  PlanCache& c = plan_cache();
  const std::string k = p.key();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.plans.find(k);
  if (it != c.plans.end()) return *it->second;
  auto obj = std::make_unique<SparseGemm24>(p, Algorithm::tuned);
  SparseGemm24& ref = *obj;
  c.plans.emplace(k, std::move(obj));
  return ref;
}

void clear_sparse_gemm24_cache() {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.plans.clear();
}

size_t sparse_gemm24_cached_plans() {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.plans.size();
}

#ifdef ESPLAG_HAVE_CUSPARSELT

// ---------------------------------------------------------------------------------------
// Loader

namespace {

// Every entry point used, resolved with dlsym; the types come from the header.
#define ESPLAG_CUSPARSELT_ENTRY_POINTS(X)                                                   \
  X(Init) X(Destroy) X(GetVersion) X(GetErrorName) X(GetErrorString) X(DenseDescriptorInit) \
  X(StructuredDescriptorInit) X(MatDescriptorDestroy) X(MatmulDescriptorInit)               \
  X(MatmulDescSetAttribute) X(MatmulAlgSelectionInit) X(MatmulAlgSelectionDestroy)          \
  X(MatmulAlgSetAttribute) X(MatmulAlgGetAttribute) X(MatmulGetWorkspace) X(MatmulPlanInit)  \
  X(MatmulPlanDestroy) X(Matmul) X(MatmulSearch) X(SpMMAPrune2) X(SpMMAPruneCheck2)         \
  X(SpMMACompressedSize2) X(SpMMACompress2)

struct Api {
#define ESPLAG_DECLARE(name) decltype(&cusparseLt##name) name = nullptr;
  ESPLAG_CUSPARSELT_ENTRY_POINTS(ESPLAG_DECLARE)
#undef ESPLAG_DECLARE
};

struct Library {
  Api api;
  cusparseLtHandle_t handle{};
  int device = -1;
  int version = 0;
  bool ok = false;
  std::string reason;
};

Library* load_library() {
  auto* lib = new Library();  // never destroyed: the handle must outlive every plan
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("ESPLAG_CUSPARSELT_LIB"); env && *env) {
    std::error_code ec;
    const std::filesystem::path p(env);
    candidates.push_back(std::filesystem::is_directory(p, ec) ? (p / "libcusparseLt.so.0").string() : p.string());
  }
  candidates.push_back("libcusparseLt.so.0");
  void* so = nullptr;
  std::string tried;
  for (const std::string& c : candidates) {
    so = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (so) break;
    const char* err = ::dlerror();
    tried += (tried.empty() ? "" : "; ") + (err ? std::string(err) : c + ": not found");
  }
  if (!so) {
    lib->reason = "cannot load libcusparseLt.so.0 (" + tried +
                  "); put its folder on LD_LIBRARY_PATH or name the file or folder in ESPLAG_CUSPARSELT_LIB";
    return lib;
  }
  Api& a = lib->api;
#define ESPLAG_RESOLVE(name)                                                                   \
  a.name = reinterpret_cast<decltype(a.name)>(::dlsym(so, "cusparseLt" #name));               \
  if (!a.name) {                                                                               \
    lib->reason = "libcusparseLt.so.0 has no entry point cusparseLt" #name                    \
                  " (cuSPARSELt older than the 0.8 this build was written for?)";               \
    return lib;                                                                                \
  }
  ESPLAG_CUSPARSELT_ENTRY_POINTS(ESPLAG_RESOLVE)
#undef ESPLAG_RESOLVE
  int dev = 0;
  const cudaError_t ce = cudaGetDevice(&dev);
  if (ce != cudaSuccess) {
    lib->reason = std::string("no CUDA device (") + cudaGetErrorString(ce) + ")";
    cudaGetLastError();
    return lib;
  }
  const cusparseStatus_t st = a.Init(&lib->handle);
  if (st != CUSPARSE_STATUS_SUCCESS) {
    lib->reason = std::string("cusparseLtInit failed: ") + a.GetErrorName(st) + " (" + a.GetErrorString(st) +
                  "); cuSPARSELt needs a GPU of compute capability 8.0 or newer";
    return lib;
  }
  lib->device = dev;
  int v = 0;
  if (a.GetVersion(&lib->handle, &v) == CUSPARSE_STATUS_SUCCESS) lib->version = v;
  lib->ok = true;
  return lib;
}

Library& library() {
  static Library* lib = load_library();
  return *lib;
}

// Every cuSPARSELt call goes through this: a failure throws Error with the call as
// written, the library's name and description of the status, the problem, file and line.
[[noreturn]] void throw_lt_error(cusparseStatus_t st, const char* call, const std::string& context, const char* file,
                                 int line) {
  const Api& a = library().api;
  fail("cuSPARSELt error ", a.GetErrorName ? a.GetErrorName(st) : "?", " (",
       a.GetErrorString ? a.GetErrorString(st) : "?", ") in ", call, context.empty() ? "" : " for ", context, " at ",
       file, ":", line);
}

#define LT_CHECK(call, context)                                                                     \
  do {                                                                                              \
    const cusparseStatus_t esplag_lt_st_ = (call);                                                  \
    if (esplag_lt_st_ != CUSPARSE_STATUS_SUCCESS)                                                   \
      ::esplag::gpu::throw_lt_error(esplag_lt_st_, #call, (context), __FILE__, __LINE__);           \
  } while (0)

Library& usable_library(const std::string& what) {
  Library& lib = library();
  ESPLAG_CHECK(lib.ok, what, ": cuSPARSELt is not available: ", lib.reason);
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  ESPLAG_CHECK(dev == lib.device, what, ": the cuSPARSELt handle belongs to device ", lib.device,
               " but the current device is ", dev);
  return lib;
}

}  // namespace

bool cusparselt_available() { return library().ok; }
std::string cusparselt_unavailable_reason() { return library().ok ? std::string() : library().reason; }
int cusparselt_version() { return library().ok ? library().version : 0; }

// ---------------------------------------------------------------------------------------
// Plans

namespace {

// One matmul descriptor + algorithm selection + plan. The plan may refer to the
// descriptor and the selection by address, so a Bound never moves (held by unique_ptr).
struct Bound {
  const cusparseLtHandle_t* handle = nullptr;
  cusparseLtMatmulDescriptor_t matmul{};
  cusparseLtMatmulAlgSelection_t alg{};
  cusparseLtMatmulPlan_t plan{};
  bool has_alg = false, has_plan = false;
  size_t workspace = 0;

  Bound() = default;
  Bound(const Bound&) = delete;
  Bound& operator=(const Bound&) = delete;
  ~Bound() {
    const Api& a = library().api;
    if (has_plan) a.MatmulPlanDestroy(&plan);
    if (has_alg) a.MatmulAlgSelectionDestroy(&alg);
  }
};

}  // namespace

struct SparseGemm24::Impl {
  SparseGemm24Problem p;
  Algorithm which = Algorithm::tuned;
  std::string ctx;  // the problem, for messages
  Library* lib = nullptr;

  cusparseLtMatDescriptor_t a{}, b{}, c{};
  bool has_a = false, has_b = false, has_c = false;
  cusparseOperation_t op_a = CUSPARSE_OPERATION_NON_TRANSPOSE, op_b = CUSPARSE_OPERATION_NON_TRANSPOSE;
  bool weight_is_a = true;
  cusparseOperation_t op_w = CUSPARSE_OPERATION_NON_TRANSPOSE;

  size_t compressed = 0, compress_scratch = 0;
  bool have_config = false;  // config holds a chosen (searched or cached) configuration
  SparseGemm24Config config;
  bool tuned = false, from_cache = false;
  int max_alg_id = 0;
  size_t workspace_hint = 0;  // of the plan built with the current configuration and no bias
  double plan_ms = 0, search_ms = 0;

  mutable std::mutex mu;
  // Plans per bias pointer: whether a plan reads BIAS_POINTER from the descriptor at
  // matmul time or copies it when initialised is not specified, so each bias address
  // gets a plan initialised with it (one per layer, once), which is right either way.
  mutable std::map<const void*, std::unique_ptr<Bound>> bound;
  int* d_valid = nullptr;  // PruneCheck's device flag

  cusparseLtMatDescriptor_t* weight_descr() { return weight_is_a ? &a : &b; }
  const cusparseLtMatDescriptor_t* weight_descr() const { return weight_is_a ? &a : &b; }

  ~Impl() {
    bound.clear();
    const Api& api = library().api;
    if (has_a) api.MatDescriptorDestroy(&a);
    if (has_b) api.MatDescriptorDestroy(&b);
    if (has_c) api.MatDescriptorDestroy(&c);
    if (d_valid) cudaFree(d_valid);
  }

  void apply_config(Bound& bd, const SparseGemm24Config& cfg) const {
    const Api& api = lib->api;
    LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &cfg.alg_id,
                                       sizeof(cfg.alg_id)),
             ctx);
    // Split-k attributes only where they differ from what this algorithm starts with, so
    // that an unsplit configuration never sets values (such as an "invalid" mode) that
    // the library only reports.
    const SparseGemm24Config start = read_config(bd);
    if (cfg.split_k != start.split_k)
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K, &cfg.split_k,
                                         sizeof(cfg.split_k)),
               ctx);
    if (cfg.split_k_mode != start.split_k_mode) {
      const cusparseLtSplitKMode_t mode = static_cast<cusparseLtSplitKMode_t>(cfg.split_k_mode);
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &mode, sizeof(mode)),
               ctx);
    }
    if (cfg.split_k_buffers != start.split_k_buffers)
      LT_CHECK(api.MatmulAlgSetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS,
                                         &cfg.split_k_buffers, sizeof(cfg.split_k_buffers)),
               ctx);
  }

  SparseGemm24Config read_config(const Bound& bd) const {
    const Api& api = lib->api;
    SparseGemm24Config cfg;
    LT_CHECK(api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &cfg.alg_id,
                                       sizeof(cfg.alg_id)),
             ctx);
    int v = 0;
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K, &v, sizeof(v)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k = std::max(v, 1);
    cusparseLtSplitKMode_t mode{};
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &mode, sizeof(mode)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k_mode = static_cast<int>(mode);
    if (api.MatmulAlgGetAttribute(&lib->handle, &bd.alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS, &v, sizeof(v)) ==
        CUSPARSE_STATUS_SUCCESS)
      cfg.split_k_buffers = v;
    return cfg;
  }

  // A new descriptor + selection + plan for `bias` with `cfg` (null: the library default).
  std::unique_ptr<Bound> make_bound(const bf16* bias, const SparseGemm24Config* cfg) const {
    const Api& api = lib->api;
    auto bd = std::make_unique<Bound>();
    LT_CHECK(api.MatmulDescriptorInit(&lib->handle, &bd->matmul, op_a, op_b, &a, &b, &c, &c, CUSPARSE_COMPUTE_32F),
             ctx);
    const int on = 1;
    if (p.activation != SparseActivation::none) {
      const auto attr = p.activation == SparseActivation::relu ? CUSPARSELT_MATMUL_ACTIVATION_RELU
                                                               : CUSPARSELT_MATMUL_ACTIVATION_GELU;
      const cusparseStatus_t st = api.MatmulDescSetAttribute(&lib->handle, &bd->matmul, attr, &on, sizeof(on));
      ESPLAG_CHECK(st == CUSPARSE_STATUS_SUCCESS, ctx, ": cuSPARSELt ", lib->version, " has no ",
                   p.activation == SparseActivation::relu ? "ReLU" : "GELU", " epilogue for bf16 operands (",
                   api.GetErrorName(st), "); run the GEMM without activation and apply it separately");
    }
    if (p.bias) {
      const void* ptr = bias;
      LT_CHECK(api.MatmulDescSetAttribute(&lib->handle, &bd->matmul, CUSPARSELT_MATMUL_BIAS_POINTER, &ptr,
                                          sizeof(ptr)),
               ctx);
    }
    LT_CHECK(api.MatmulAlgSelectionInit(&lib->handle, &bd->alg, &bd->matmul, CUSPARSELT_MATMUL_ALG_DEFAULT), ctx);
    bd->has_alg = true;
    if (cfg) apply_config(*bd, *cfg);
    LT_CHECK(api.MatmulPlanInit(&lib->handle, &bd->plan, &bd->matmul, &bd->alg), ctx);
    bd->has_plan = true;
    LT_CHECK(api.MatmulGetWorkspace(&lib->handle, &bd->plan, &bd->workspace), ctx);
    return bd;
  }

  // The plan for `bias`, built on first use (caller holds mu).
  Bound& bound_for(const bf16* bias) const {
    auto it = bound.find(bias);
    if (it != bound.end()) return *it->second;
    auto bd = make_bound(bias, have_config ? &config : nullptr);
    Bound& ref = *bd;
    bound.emplace(bias, std::move(bd));
    return ref;
  }

  void check_operands(const void* compressed_w, const void* dense, const bf16* out, const bf16* bias) const {
    ESPLAG_CHECK(compressed_w && dense && out, ctx, ": null operand (compressed ", compressed_w, ", dense ",
                 static_cast<const void*>(dense), ", out ", static_cast<const void*>(out), ")");
    if (p.bias)
      ESPLAG_CHECK(bias, ctx, ": the problem has a bias but no bias pointer was given");
    else
      ESPLAG_CHECK(!bias, ctx, ": a bias pointer was given but the problem has no bias (make it with bias = true)");
    const void* ptrs[] = {compressed_w, dense, out, bias};
    for (const void* q : ptrs)
      ESPLAG_CHECK(reinterpret_cast<uintptr_t>(q) % 16 == 0, ctx, ": operand ", q, " is not 16-byte aligned");
  }
};

SparseGemm24::SparseGemm24(const SparseGemm24Problem& p, Algorithm alg) : impl_(std::make_unique<Impl>()) {
  const auto t0 = std::chrono::steady_clock::now();
  Impl& m = *impl_;
  m.p = p;
  m.which = alg;
  m.ctx = "2:4 sparse GEMM (" + p.key() + ")";
  check_sparse_gemm24_problem(p);
  m.lib = &usable_library(m.ctx);
  const Api& api = m.lib->api;
  const cusparseLtHandle_t* h = &m.lib->handle;
  const cusparseOperation_t N = CUSPARSE_OPERATION_NON_TRANSPOSE, T = CUSPARSE_OPERATION_TRANSPOSE;
  constexpr uint32_t kAlign = 16;
  const int64_t out = p.out, in = p.in, tok = p.tokens;
  const bool fwd = p.product == SparseProduct::forward;
  m.weight_is_a = p.weight_operand == SparseOperand::a;
  const cudaDataType in_type = p.dtype == SparseDtype::e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;

  // The tables at the top of this file. The structured operand is always row-major as it
  // lies in memory: W [out, in], or S [out, tokens] for weight_grad.
  auto structured = [&](cusparseLtMatDescriptor_t* d) {
    const int64_t rows = p.structured_rows(), cols = p.structured_cols();
    LT_CHECK(api.StructuredDescriptorInit(h, d, rows, cols, cols, kAlign, in_type, CUSPARSE_ORDER_ROW,
                                          CUSPARSELT_SPARSITY_50_PERCENT),
             m.ctx);
  };
  // The input operands in the problem's type; the output (C = D) always bf16.
  auto dense = [&](cusparseLtMatDescriptor_t* d, int64_t rows, int64_t cols, int64_t ld, cusparseOrder_t order,
                   cudaDataType type) {
    LT_CHECK(api.DenseDescriptorInit(h, d, rows, cols, ld, kAlign, type, order), m.ctx);
  };
  const int64_t feat_in = fwd ? in : out;    // features of the token-side input
  const int64_t feat_out = fwd ? out : in;   // features of the output
  if (p.product == SparseProduct::activation_forward) {
    structured(&m.a);  // Xs [N, in] row-major, op N
    m.has_a = true;
    dense(&m.b, in, out, in, CUSPARSE_ORDER_COL, in_type);  // W [out, in] as column-major [in, out], op N
    m.has_b = true;
    dense(&m.c, tok, out, out, CUSPARSE_ORDER_ROW, CUDA_R_16BF);  // Y [N, out] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (p.product == SparseProduct::activation_weight_grad) {
    structured(&m.a);  // Xs^T [in, N] row-major, op N
    m.has_a = true;
    dense(&m.b, tok, out, out, CUSPARSE_ORDER_ROW, in_type);  // dY [N, out] row-major, op N
    m.has_b = true;
    dense(&m.c, in, out, in, CUSPARSE_ORDER_COL, CUDA_R_16BF);  // dW^T [in, out] column-major = dW [out, in] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (p.product == SparseProduct::weight_grad) {
    structured(&m.a);  // S [out, N] row-major, op N
    m.has_a = true;
    dense(&m.b, tok, in, in, CUSPARSE_ORDER_ROW, in_type);  // X [N, in] row-major, op N
    m.has_b = true;
    dense(&m.c, out, in, in, CUSPARSE_ORDER_ROW, CUDA_R_16BF);  // dW [out, in] row-major
    m.has_c = true;
    m.op_a = m.op_b = m.op_w = N;
  } else if (m.weight_is_a) {
    structured(&m.a);
    m.has_a = true;
    dense(&m.b, tok, feat_in, feat_in, CUSPARSE_ORDER_ROW, in_type);
    m.has_b = true;
    dense(&m.c, feat_out, tok, feat_out, CUSPARSE_ORDER_COL, CUDA_R_16BF);
    m.has_c = true;
    m.op_a = fwd ? N : T;
    m.op_b = T;
    m.op_w = m.op_a;
  } else {
    dense(&m.a, tok, feat_in, feat_in, CUSPARSE_ORDER_ROW, in_type);
    m.has_a = true;
    structured(&m.b);
    m.has_b = true;
    dense(&m.c, tok, feat_out, feat_out, CUSPARSE_ORDER_ROW, CUDA_R_16BF);
    m.has_c = true;
    m.op_a = N;
    m.op_b = fwd ? T : N;
    m.op_w = m.op_b;
  }
  LT_CHECK(api.SpMMACompressedSize2(h, m.weight_descr(), &m.compressed, &m.compress_scratch), m.ctx);

  if (alg == Algorithm::tuned) {
    TuningEntry e;
    if (TuningCache::instance().lookup(current_gpu_name(), m.lib->version, p.key(), &e)) {
      m.config = e.config;
      m.have_config = true;
    }
  }
  // The plan without bias pointer (or with null) is built now, so that shape errors
  // surface here and workspace_bytes() is known; a stale tuning entry that the library
  // rejects falls back to the default configuration.
  std::lock_guard<std::mutex> lock(m.mu);
  std::unique_ptr<Bound> first;
  if (m.have_config) {
    try {
      first = m.make_bound(nullptr, &m.config);
      m.tuned = m.from_cache = true;
    } catch (const Error& e) {
      std::cerr << "esplag: warning: the tuned cuSPARSELt configuration (alg " << m.config.alg_id << ", split-k "
                << m.config.split_k << ") of " << p.key() << " was rejected (" << e.what()
                << "); using the default configuration" << std::endl;
      m.have_config = false;
    }
  }
  if (!first) first = m.make_bound(nullptr, nullptr);
  if (!m.have_config) m.config = m.read_config(*first);
  int max_id = 0;
  if (api.MatmulAlgGetAttribute(h, &first->alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, &max_id, sizeof(max_id)) ==
      CUSPARSE_STATUS_SUCCESS)
    m.max_alg_id = max_id;
  m.workspace_hint = first->workspace;
  if (!p.bias) m.bound.emplace(nullptr, std::move(first));
  CUDA_CHECK(cudaMalloc(&m.d_valid, sizeof(int)));
  m.plan_ms = ms_since(t0);
}

SparseGemm24::~SparseGemm24() = default;

const SparseGemm24Problem& SparseGemm24::problem() const { return impl_->p; }
size_t SparseGemm24::compressed_bytes() const { return impl_->compressed; }
size_t SparseGemm24::compress_scratch_bytes() const { return impl_->compress_scratch; }

size_t SparseGemm24::workspace_bytes() const {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  size_t ws = m.workspace_hint;
  for (const auto& [ptr, bd] : m.bound) ws = std::max(ws, bd->workspace);
  return ws;
}

void SparseGemm24::prune(void* pruned, const void* dense, cudaStream_t stream) const {
  const Impl& m = *impl_;
  ESPLAG_CHECK(pruned && dense, m.ctx, ": prune needs device pointers");
  LT_CHECK(m.lib->api.SpMMAPrune2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, dense, pruned,
                                  CUSPARSELT_PRUNE_SPMMA_TILE, stream),
           m.ctx);
}

bool SparseGemm24::is_pruned(const void* w, cudaStream_t stream) const {
  const Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  // cuSPARSELt only writes the flag when it finds a violation: clear it first.
  CUDA_CHECK(cudaMemsetAsync(m.d_valid, 0, sizeof(int), stream));
  LT_CHECK(m.lib->api.SpMMAPruneCheck2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, w,
                                       m.d_valid, stream),
           m.ctx);
  int invalid = 1;
  CUDA_CHECK(cudaMemcpyAsync(&invalid, m.d_valid, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return invalid == 0;  // cuSPARSELt writes 0 when the matrix is 2:4
}

void SparseGemm24::compress(void* compressed, const void* pruned, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) const {
  const Impl& m = *impl_;
  ESPLAG_CHECK(compressed && pruned, m.ctx, ": compress needs device pointers");
  ESPLAG_CHECK(scratch_bytes >= m.compress_scratch, m.ctx, ": compress needs ", m.compress_scratch,
               " bytes of scratch, got ", scratch_bytes);
  LT_CHECK(m.lib->api.SpMMACompress2(&m.lib->handle, m.weight_descr(), m.weight_is_a ? 1 : 0, m.op_w, pruned,
                                     compressed, scratch, stream),
           m.ctx);
}

void SparseGemm24::matmul(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) const {
  const Impl& m = *impl_;
  m.check_operands(compressed, dense, out, bias);
  std::lock_guard<std::mutex> lock(m.mu);
  Bound& bd = m.bound_for(bias);
  ESPLAG_CHECK(workspace_bytes >= bd.workspace, m.ctx, ": the plan needs ", bd.workspace,
               " bytes of workspace, got ", workspace_bytes);
  const float alpha = 1.f, beta = 0.f;
  const void* A = m.weight_is_a ? compressed : static_cast<const void*>(dense);
  const void* B = m.weight_is_a ? static_cast<const void*>(dense) : compressed;
  cudaStream_t streams[1] = {stream};
  LT_CHECK(m.lib->api.Matmul(&m.lib->handle, &bd.plan, &alpha, A, B, &beta, out, out,
                             bd.workspace ? workspace : nullptr, streams, 1),
           m.ctx);
}

void SparseGemm24::search(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  Impl& m = *impl_;
  m.check_operands(compressed, dense, out, bias);
  std::lock_guard<std::mutex> lock(m.mu);
  // Search from the default configuration on a plan of its own; the plans in use are
  // replaced afterwards by ones built from the configuration found.
  auto bd = m.make_bound(bias, nullptr);
  ESPLAG_CHECK(workspace_bytes >= bd->workspace, m.ctx, ": the search needs ", bd->workspace,
               " bytes of workspace, got ", workspace_bytes);
  const float alpha = 1.f, beta = 0.f;
  const void* A = m.weight_is_a ? compressed : static_cast<const void*>(dense);
  const void* B = m.weight_is_a ? static_cast<const void*>(dense) : compressed;
  cudaStream_t streams[1] = {stream};
  const auto t0 = std::chrono::steady_clock::now();
  LT_CHECK(m.lib->api.MatmulSearch(&m.lib->handle, &bd->plan, &alpha, A, B, &beta, out, out,
                                   bd->workspace ? workspace : nullptr, streams, 1),
           m.ctx);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  m.search_ms = ms_since(t0);
  m.config = m.read_config(*bd);
  m.have_config = true;
  m.tuned = true;
  m.from_cache = false;
  m.bound.clear();
  // The plan without bias is rebuilt at once (workspace_bytes() reads it); bias plans on use.
  auto fresh = m.make_bound(nullptr, &m.config);
  m.workspace_hint = fresh->workspace;
  if (!m.p.bias) m.bound.emplace(nullptr, std::move(fresh));
  TuningEntry e;
  e.gpu = current_gpu_name();
  e.version = m.lib->version;
  e.problem = m.p.key();
  e.config = m.config;
  e.max_alg_id = m.max_alg_id;
  e.search_ms = m.search_ms;
  TuningCache::instance().store(e);
}

bool SparseGemm24::tune(bf16* out, const void* compressed, const void* dense, const bf16* bias, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  if (impl_->which != Algorithm::tuned || impl_->tuned || !cusparselt_search_enabled()) return false;
  search(out, compressed, dense, bias, workspace, workspace_bytes, stream);
  return true;
}

bool sparse_gemm24_activation_supported(SparseActivation act) {
  if (act == SparseActivation::none) return cusparselt_available();
  static std::mutex mu;
  static std::map<SparseActivation, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(act);
  if (it != known.end()) return it->second;
  bool ok = false;
  if (cusparselt_available()) {
    try {
      SparseGemm24 probe(SparseGemm24Problem::linear_forward(16, 16, 16, false, act),
                         SparseGemm24::Algorithm::library_default);
      ok = true;
    } catch (const Error&) {
    }
  }
  known[act] = ok;
  return ok;
}

bool SparseGemm24::tuned() const { return impl_->tuned; }
bool SparseGemm24::from_tuning_cache() const { return impl_->from_cache; }
SparseGemm24Config SparseGemm24::config() const { return impl_->config; }
int SparseGemm24::max_alg_id() const { return impl_->max_alg_id; }
double SparseGemm24::plan_build_ms() const { return impl_->plan_ms; }
double SparseGemm24::search_ms() const { return impl_->search_ms; }
size_t SparseGemm24::plans() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->bound.size();
}

#else  // !ESPLAG_HAVE_CUSPARSELT

// Built without cusparseLt.h: the library is never loaded and every sparse GEMM throws;
// callers see cusparselt_available() == false and run dense.

namespace {
constexpr const char* kNoHeader =
    "this build has no cusparseLt.h (run scripts/fetch-vendor-headers.sh and reconfigure)";
}

bool cusparselt_available() { return false; }
std::string cusparselt_unavailable_reason() { return kNoHeader; }
int cusparselt_version() { return 0; }

struct SparseGemm24::Impl {
  SparseGemm24Problem p;
};

SparseGemm24::SparseGemm24(const SparseGemm24Problem& p, Algorithm) : impl_(std::make_unique<Impl>()) {
  impl_->p = p;
  check_sparse_gemm24_problem(p);
  fail("2:4 sparse GEMM (", p.key(), "): cuSPARSELt is not available: ", kNoHeader);
}
SparseGemm24::~SparseGemm24() = default;
const SparseGemm24Problem& SparseGemm24::problem() const { return impl_->p; }
size_t SparseGemm24::compressed_bytes() const { return 0; }
size_t SparseGemm24::compress_scratch_bytes() const { return 0; }
size_t SparseGemm24::workspace_bytes() const { return 0; }
void SparseGemm24::prune(void*, const void*, cudaStream_t) const { fail(kNoHeader); }
bool SparseGemm24::is_pruned(const void*, cudaStream_t) const { fail(kNoHeader); }
void SparseGemm24::compress(void*, const void*, void*, size_t, cudaStream_t) const { fail(kNoHeader); }
void SparseGemm24::matmul(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) const {
  fail(kNoHeader);
}
void SparseGemm24::search(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) {
  fail(kNoHeader);
}
bool SparseGemm24::tune(bf16*, const void*, const void*, const bf16*, void*, size_t, cudaStream_t) { return false; }
bool sparse_gemm24_activation_supported(SparseActivation) { return false; }
bool SparseGemm24::tuned() const { return false; }
bool SparseGemm24::from_tuning_cache() const { return false; }
SparseGemm24Config SparseGemm24::config() const { return {}; }
int SparseGemm24::max_alg_id() const { return 0; }
double SparseGemm24::plan_build_ms() const { return 0; }
double SparseGemm24::search_ms() const { return 0; }
size_t SparseGemm24::plans() const { return 0; }

#endif  // ESPLAG_HAVE_CUSPARSELT

}  // namespace esplag::gpu
