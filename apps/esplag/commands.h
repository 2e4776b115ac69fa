// Subcommands of the esplag CLI that live in their own files. Each takes the arguments
// after its name, returns the exit code, and throws esplag::Error on bad input.
#pragma once
#include <string>
#include <vector>

namespace esplag::cli {

// esplag bench train|gemm|layer|sparsify|attention|vnm|sparse-adamw  (apps/esplag/bench.cpp)
int cmd_bench(const std::vector<std::string>& argv);

}  // namespace esplag::cli
