#include "sparse/pattern.h"

#include <cctype>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace esplag {

namespace {

bool is_allowed_v(int v) { return v == 16 || v == 32 || v == 64 || v == 128; }

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// A field of "N:M" / "V:N:M": decimal digits only, at most 9 of them (no sign, no spaces).
int parse_field(const std::string& text, const std::string& field, const char* what) {
  ESPLAG_CHECK(!field.empty(), "sparsity pattern \"", text, "\": ", what, " is empty");
  for (char c : field)
    ESPLAG_CHECK(std::isdigit(static_cast<unsigned char>(c)), "sparsity pattern \"", text, "\": ", what, " \"",
                 field, "\" is not a non-negative integer");
  ESPLAG_CHECK(field.size() <= 9, "sparsity pattern \"", text, "\": ", what, " \"", field, "\" is too large");
  return std::stoi(field);
}

// The rule an N:M / V:N:M pattern breaks, or "" when it is valid.
std::string nm_error(int n, int m) {
  if (n < 1) return detail::concat("N must be at least 1, got ", n);
  if (m > SparsityPattern::kMaxM) return detail::concat("M must be at most ", SparsityPattern::kMaxM, ", got ", m);
  if (n >= m) return detail::concat("N must be smaller than M, got N = ", n, " >= M = ", m);
  return "";
}

std::string vnm_error(int v, int n, int m) {
  if (!is_allowed_v(v)) return detail::concat("V must be one of 16, 32, 64, 128, got ", v);
  if (n != SparsityPattern::kVnmN)
    return detail::concat("N must be 2 (2:4 sparse tensor cores inside each block), got ", n);
  if (m < SparsityPattern::kVnmSelected || m > SparsityPattern::kMaxM)
    return detail::concat("M must be in ", SparsityPattern::kVnmSelected, "..", SparsityPattern::kMaxM,
                          " (4 of every M columns are selected per block), got ", m);
  return "";
}

}  // namespace

SparsityPattern SparsityPattern::dense() { return SparsityPattern{}; }

SparsityPattern SparsityPattern::unstructured(double sparsity) {
  ESPLAG_CHECK(std::isfinite(sparsity) && sparsity >= 0.0 && sparsity <= 1.0,
               "unstructured sparsity must be in [0, 1], got ", sparsity);
  SparsityPattern p;
  p.kind = Kind::unstructured;
  p.sparsity = sparsity;
  return p;
}

SparsityPattern SparsityPattern::nm(int n, int m) {
  const std::string err = nm_error(n, m);
  ESPLAG_CHECK(err.empty(), "N:M pattern ", n, ":", m, ": ", err);
  SparsityPattern p;
  p.kind = Kind::nm;
  p.n = n;
  p.m = m;
  return p;
}

SparsityPattern SparsityPattern::vnm(int v, int n, int m) {
  const std::string err = vnm_error(v, n, m);
  ESPLAG_CHECK(err.empty(), "V:N:M pattern ", v, ":", n, ":", m, ": ", err);
  SparsityPattern p;
  p.kind = Kind::vnm;
  p.v = v;
  p.n = n;
  p.m = m;
  return p;
}

SparsityPattern SparsityPattern::parse(const std::string& raw, double sparsity) {
  const std::string text = trim(raw);
  const std::string word = lower(text);
  if (word == "dense") return dense();
  if (word == "unstructured") return unstructured(sparsity);

  std::vector<std::string> fields;
  size_t start = 0;
  for (;;) {
    const size_t colon = text.find(':', start);
    fields.push_back(text.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (fields.size() == 1)
    fail("sparsity pattern \"", raw, "\" is not recognised: expected dense, unstructured, N:M (e.g. 2:4) or V:N:M "
         "(e.g. 64:2:8)");
  ESPLAG_CHECK(fields.size() <= 3, "sparsity pattern \"", raw, "\" has ", fields.size(),
               " fields: expected N:M (2 fields) or V:N:M (3 fields)");
  if (fields.size() == 2) {
    const int n = parse_field(raw, fields[0], "N");
    const int m = parse_field(raw, fields[1], "M");
    const std::string err = nm_error(n, m);
    ESPLAG_CHECK(err.empty(), "sparsity pattern \"", raw, "\" (N:M): ", err);
    return nm(n, m);
  }
  const int v = parse_field(raw, fields[0], "V");
  const int n = parse_field(raw, fields[1], "N");
  const int m = parse_field(raw, fields[2], "M");
  const std::string err = vnm_error(v, n, m);
  ESPLAG_CHECK(err.empty(), "sparsity pattern \"", raw, "\" (V:N:M): ", err);
  return vnm(v, n, m);
}

double SparsityPattern::density() const {
  switch (kind) {
    case Kind::dense: return 1.0;
    case Kind::unstructured: return 1.0 - sparsity;
    case Kind::nm: return static_cast<double>(n) / m;
    case Kind::vnm: return static_cast<double>(kVnmN) / m;
  }
  return 1.0;
}

std::string SparsityPattern::to_string() const {
  switch (kind) {
    case Kind::dense: return "dense";
    case Kind::unstructured: return "unstructured";
    case Kind::nm: return detail::concat(n, ":", m);
    case Kind::vnm: return detail::concat(v, ":", n, ":", m);
  }
  return "dense";
}

void check_divisible(const SparsityPattern& p, int64_t rows, int64_t cols, const std::string& tensor_name) {
  if (!p.is_structured()) return;
  ESPLAG_CHECK(cols % p.m == 0, "tensor '", tensor_name, "' of shape [", rows, ", ", cols, "]: cols (", cols,
               ") is not a multiple of M = ", p.m, " required by sparsity pattern ", p.to_string());
  if (p.kind == SparsityPattern::Kind::vnm)
    ESPLAG_CHECK(rows % p.v == 0, "tensor '", tensor_name, "' of shape [", rows, ", ", cols, "]: rows (", rows,
                 ") is not a multiple of V = ", p.v, " required by sparsity pattern ", p.to_string());
}

std::string activation_sparsity_name(ActivationSparsity a) {
  return a == ActivationSparsity::row_24 ? "row_24" : "tile_24";
}

ActivationSparsity parse_activation_sparsity(const std::string& name) {
  if (name == "row_24") return ActivationSparsity::row_24;
  if (name == "tile_24") return ActivationSparsity::tile_24;
  fail("unknown activation sparsity pattern '", name, "' (expected row_24 or tile_24)");
}

}  // namespace esplag
