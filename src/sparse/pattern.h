// Sparsity patterns as recipes spell them: "dense", "unstructured" (the target sparsity
// is a separate recipe field), "N:M" and VENOM's "V:N:M". Weights are row-major
// [rows = out features, cols = in features]; every structured pattern runs along cols,
// the reduction dimension K of the forward GEMM.
#pragma once
#include <cstdint>
#include <string>

namespace esplag {

struct SparsityPattern {
  enum class Kind : uint8_t { dense, unstructured, nm, vnm };

  // Groups of M consecutive columns in which at most N values are kept (0 < N < M <= 16).
  static constexpr int kMaxM = 16;
  // V:N:M runs on 2:4 sparse tensor cores: N is 2 and 4 columns are selected per block.
  static constexpr int kVnmN = 2;
  static constexpr int kVnmSelected = 4;

  Kind kind = Kind::dense;
  int v = 0;               // V:N:M block height (rows); 0 otherwise
  int n = 0;               // kept per group (N:M) or per row within the 4 selected columns (V:N:M)
  int m = 0;               // group width (N:M) or block width (V:N:M)
  double sparsity = 0.0;   // unstructured only: fraction of zeros in [0, 1]

  // Validating constructors; each throws Error with the rule that was broken.
  static SparsityPattern dense();
  static SparsityPattern unstructured(double sparsity);
  static SparsityPattern nm(int n, int m);
  static SparsityPattern vnm(int v, int n, int m);

  // Parses "dense", "unstructured", "N:M", "V:N:M" (surrounding spaces ignored; the words
  // are case-insensitive). `sparsity` is used only for "unstructured".
  static SparsityPattern parse(const std::string& text, double sparsity = 0.0);

  // Fraction of values kept: 1, 1 - sparsity, N/M, 2/M.
  double density() const;
  // The recipe spelling: parse(p.to_string(), p.sparsity) == p.
  std::string to_string() const;
  bool is_structured() const { return kind == Kind::nm || kind == Kind::vnm; }

  friend bool operator==(const SparsityPattern&, const SparsityPattern&) = default;
};

// How semi_sparse_activation prunes its input X [N, in] (model/linear_semi_sparse.h on the
// CPU, sparse/cuda/sparse_activation_linear.h on the GPU):
//   row_24:  the 2 largest |x| of every 4 consecutive features of each row (exactly 50%).
//   tile_24: the transposable greedy mask over 4×4 tiles of X (tokens × features; N is
//            padded with zero rows to a multiple of 4), so Xsᵀ is 2:4 along the tokens too
//            and the dW GEMM (reduction over tokens) can also run on sparse tensor cores;
//            what torchao does. May keep fewer than 50%.
enum class ActivationSparsity : uint8_t { row_24, tile_24 };
std::string activation_sparsity_name(ActivationSparsity a);  // "row_24", "tile_24"
// Throws Error naming the accepted spellings.
ActivationSparsity parse_activation_sparsity(const std::string& name);

// Throws Error naming `tensor_name` (with its shape and the pattern) unless
// cols % M == 0 (N:M, V:N:M) and rows % V == 0 (V:N:M). Dense and unstructured always pass.
void check_divisible(const SparsityPattern& pattern, int64_t rows, int64_t cols, const std::string& tensor_name);

}  // namespace esplag
