// GpuTransformer: a kind change's move of the parameter state into a new storage layout (see
// model/gpu_transformer.h, set_linear_kinds): on the device, or where there is no room for
// both layouts, through the host.
#include <numeric>

#include "core/cuda_check.h"
#include "model/cuda/gpu_transformer_impl.h"

namespace esplag {

using namespace gpu_model;

bool GpuTransformer::room_for_second_state() const {
  if (!opt_.kind_change_on_device) return false;
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  // Adapters and stored forms change the size a little; leave room for the libraries too.
  const size_t need = impl_->state.capacity() / 4 * 5 + (size_t(512) << 20);
  return free_bytes >= need;
}

namespace {

// One field of a storage layout, as fp32 values on the device (the weights' master halves
// joined and split). Offloaded fields are pinned host memory: copies let the runtime tell.
struct FieldAt {
  bf16* w = nullptr;
  int16_t* w_lo = nullptr;
  float* f = nullptr;  // the moment; null for the weights

  void read(float* out, size_t at, size_t n, cudaStream_t s) const {
    if (f)
      CUDA_CHECK(cudaMemcpyAsync(out, f + at, sizeof(float) * n, cudaMemcpyDefault, s));
    else
      gpu::master_join(out, w + at, w_lo + at, int64_t(n), s);
  }
  void write(const float* in, size_t at, size_t n, cudaStream_t s) const {
    if (f)
      CUDA_CHECK(cudaMemcpyAsync(f + at, in, sizeof(float) * n, cudaMemcpyDefault, s));
    else
      gpu::master_split(w + at, w_lo + at, in, int64_t(n), s);
  }
  // n values from `from` at `src` to this at `dst`, as they are.
  void copy_from(const FieldAt& from, size_t dst, size_t src, size_t n, cudaStream_t s) const {
    if (f) {
      CUDA_CHECK(cudaMemcpyAsync(f + dst, from.f + src, sizeof(float) * n, cudaMemcpyDefault, s));
      return;
    }
    CUDA_CHECK(cudaMemcpyAsync(w + dst, from.w + src, sizeof(bf16) * n, cudaMemcpyDefault, s));
    CUDA_CHECK(cudaMemcpyAsync(w_lo + dst, from.w_lo + src, sizeof(int16_t) * n, cudaMemcpyDefault, s));
  }
};

}  // namespace

void GpuTransformer::move_state_from(const RetiredState& old) {
  Impl& im = *impl_;
  const FieldAt from[3] = {{old.w, old.w_lo, nullptr}, {nullptr, nullptr, old.m}, {nullptr, nullptr, old.v}};
  const FieldAt to[3] = {{im.w, im.w_lo, nullptr}, {nullptr, nullptr, im.m}, {nullptr, nullptr, im.v}};
  float* stage = reinterpret_cast<float*>(im.shared);
  const size_t floats = im.sizes.total / sizeof(float);
  for (size_t k = 0; k < infos_.size(); ++k) {
    const ParamInfo &info = infos_[k], &a = old.stored[k], &b = im.stored[k];
    // The layers whose stored forms the tensor is in (null: dense).
    const auto it = old.layers.find(info.name);
    const DeviceLinear* was = a.numel != info.numel ? it->second : nullptr;
    const DeviceLinear* now = b.numel != info.numel ? &im.find_linear(info.name)->top() : nullptr;
    if (was == now && a.shape == b.shape) {  // dense on both sides, or a layer that stayed
      for (int f = 0; f < 3; ++f) to[f].copy_from(from[f], b.offset, a.offset, b.numel, stream_);
      continue;
    }
    // Through the dense form, in chunks of whole row groups of both layers.
    const int64_t cols = info.shape.at(1), a_cols = a.shape.at(1), b_cols = b.shape.at(1);
    const int64_t group = std::lcm(was ? was->stored_row_group() : 1, now ? now->stored_row_group() : 1);
    const int64_t chunk_rows = int64_t(floats) / (cols + std::max(a_cols, b_cols)) / group * group;
    ESPLAG_CHECK(chunk_rows > 0, "GpuTransformer: rows of ", info.name, " (", cols,
                 " columns) do not fit the shared scratch region");
    const int64_t rows_total = info.shape.at(0);
    for (int f = 0; f < 3; ++f)
      for (int64_t row0 = 0; row0 < rows_total; row0 += chunk_rows) {
        const int64_t rows = std::min(chunk_rows, rows_total - row0);
        float *dense = stage, *stored = stage + rows * cols;
        if (was) {
          from[f].read(stored, a.offset + size_t(row0 * a_cols), size_t(rows * a_cols), stream_);
          was->weight_from_stored(dense, stored, row0, rows);
        } else {
          from[f].read(dense, a.offset + size_t(row0 * cols), size_t(rows * cols), stream_);
        }
        if (now) {
          now->weight_to_stored(stored, dense, row0, rows);
          to[f].write(stored, b.offset + size_t(row0 * b_cols), size_t(rows * b_cols), stream_);
        } else {
          to[f].write(dense, b.offset + size_t(row0 * cols), size_t(rows * cols), stream_);
        }
      }
  }
  // The layers' own tensors: carried over by name where their size is kept, else new.
  for (const auto& [weight, slot] : im.linears) {
    const auto tensors = slot.top().extra_tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ParamInfo& b = info_named(im.stored, module_of(weight) + tensors[i].suffix);
      const auto a = std::find_if(old.stored.begin() + ptrdiff_t(infos_.size()), old.stored.end(),
                                  [&](const ParamInfo& p) { return p.name == b.name; });
      if (a != old.stored.end() && a->numel == b.numel) {
        for (int f = 0; f < 3; ++f) to[f].copy_from(from[f], b.offset, a->offset, b.numel, stream_);
        continue;
      }
      // New: its initial values, zero moments (lay_out_state zeroed them).
      stored_from_host(StateField::weight, b.offset, b.numel, slot.top().initial_extra(i).data());
    }
  }
  refresh_head_copy();
  prepare_layers();
  synchronize();
}

void GpuTransformer::state_to_host(RetiredState& old) const {
  const Impl& im = *impl_;
  old.host_params = params_to_host();
  optimizer_state_to_host(old.host_m, old.host_v);
  for (size_t k = infos_.size(); k < im.stored.size(); ++k) {
    const ParamInfo& i = im.stored[k];
    RetiredState::HostTensor& t = old.host_own[i.name];
    for (auto [field, host] :
         {std::pair{StateField::weight, &t.w}, std::pair{StateField::m, &t.m}, std::pair{StateField::v, &t.v}}) {
      host->resize(i.numel);
      stored_to_host(field, i.offset, i.numel, host->data());
    }
  }
}

void GpuTransformer::state_from_host(const RetiredState& old) {
  Impl& im = *impl_;
  const int64_t steps = step_;
  if (state_written_) {  // else the state is zero and stays so: nothing was given yet
    set_params(old.host_params.data(), old.host_params.size());  // also prepares every layer
    set_optimizer_state(old.host_m.data(), old.host_v.data(), old.host_m.size(), steps);
  }
  // The layers' own tensors: carried over by name where their size is kept, else new.
  for (const auto& [weight, slot] : im.linears) {
    const auto tensors = slot.top().extra_tensors();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const ParamInfo& at = info_named(im.stored, module_of(weight) + tensors[i].suffix);
      const auto it = old.host_own.find(at.name);
      const bool kept = it != old.host_own.end() && it->second.w.size() == at.numel;
      const std::vector<float> zeros(kept ? 0 : at.numel, 0.f);
      const std::vector<float> fresh = kept ? std::vector<float>() : slot.top().initial_extra(i);
      stored_from_host(StateField::weight, at.offset, at.numel, kept ? it->second.w.data() : fresh.data());
      stored_from_host(StateField::m, at.offset, at.numel, kept ? it->second.m.data() : zeros.data());
      stored_from_host(StateField::v, at.offset, at.numel, kept ? it->second.v.data() : zeros.data());
    }
  }
}

}  // namespace esplag
