// cuSPARSELt 2:4 GEMM problems: the factories of a Linear layer's products, their keys (of
// the plan and tuning caches) and the rules a problem must meet. See sparse/cuda/cusparselt.h.
#include "sparse/cuda/cusparselt.h"

#include <utility>

#include "core/error.h"

namespace esplag::gpu {

namespace {

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
                        " act=", activation_name(activation), " ", sparse_dtype_name(dtype),
                        device_scale ? " scale=device" : "");
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
  ESPLAG_CHECK(!p.device_scale || p.dtype == SparseDtype::e4m3, what,
               ": a device scale (of fp8 operands) is for e4m3 products only");
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

}  // namespace esplag::gpu
