// The commands of the esplag CLI, one file each (bench: its subcommands in bench.cpp).
// Each is a Command (args.h): its option table, its help, and the function that runs it
// with the parsed options, returns the exit code, and throws esplag::Error on bad input.
#pragma once
#include <iostream>
#include <string>
#include <vector>

#include "args.h"

namespace esplag::cli {

extern const Command kDataPrepare;     // data.cpp
extern const Command kTokenizerTrain;  // data.cpp
extern const Command kTrain;           // train.cpp
extern const Command kEval;            // eval.cpp
extern const Command kSample;          // sample.cpp
extern const Command kProfile;         // profile.cpp
extern const Command kSparsity;        // sparsity.cpp
extern const Command kExport;          // export.cpp
extern const Command kImport;          // import.cpp
extern const Command kPlan;            // plan.cpp
// bench train|gemm|layer|attention|sparsify|sparse-adamw|vnm|slope-merged (bench.cpp)
const std::vector<const Command*>& bench_commands();

// Progress lines of the library, printed as they come.
inline void print_line(const std::string& s) { std::cout << s << std::endl; }

}  // namespace esplag::cli
