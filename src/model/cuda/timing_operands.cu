#include "model/cuda/timing_operands.h"

#include "core/device_fill.h"

namespace esplag {

TimingOperands::TimingOperands(int64_t tokens, int64_t in, int64_t out, cudaStream_t s)
    : arena(2 * sizeof(__nv_bfloat16) * size_t(tokens * (in + out)) + 4 * DeviceArena::kDefaultAlignment,
            "dispatch timing") {
  const size_t nx = size_t(tokens * in), ny = size_t(tokens * out);
  x = arena.allocate_array<__nv_bfloat16>("x", nx);
  dx = arena.allocate_array<__nv_bfloat16>("dx", nx);
  y = arena.allocate_array<__nv_bfloat16>("y", ny);
  dy = arena.allocate_array<__nv_bfloat16>("dy", ny);
  fill_nonzero_bf16(x, nx, 1, 1.f, s);
  fill_nonzero_bf16(dy, ny, 2, 1.f, s);
}

}  // namespace esplag
