#include "model/cuda/fp8_histories.h"

#include <algorithm>
#include <utility>

#include "core/cuda_check.h"
#include "core/error.h"

namespace esplag {

namespace {

constexpr int kRoles = 2;  // X, then dY (Fp8AmaxHistory::operand_index)

}  // namespace

DeviceFp8Histories::DeviceFp8Histories(float* device, std::vector<std::string> weight_names, int length,
                                       cudaStream_t s)
    : device_(device), names_(std::move(weight_names)), length_(length) {
  ESPLAG_CHECK(device_ && length_ >= 1, "DeviceFp8Histories: no memory, or a length below 1 (", length_, ")");
  CUDA_CHECK(cudaMemsetAsync(device_, 0, sizeof(float) * floats(int64_t(names_.size()), length_), s));
}

float* DeviceFp8Histories::at(size_t linear, ProductOperand role) const {
  return device_ + (kRoles * linear + size_t(Fp8AmaxHistory::operand_index(role))) * size_t(length_ + 2);
}

DeviceFp8Histories::Operand DeviceFp8Histories::operand(const std::string& weight_name, ProductOperand role) const {
  const auto it = std::find(names_.begin(), names_.end(), weight_name);
  ESPLAG_CHECK(it != names_.end(), "fp8 delayed scaling: no amax history for '", weight_name, "'");
  float* h = at(size_t(it - names_.begin()), role);
  return {h + 1, h};
}

void DeviceFp8Histories::roll(cudaStream_t s) {
  gpu::fp8_roll_amax_histories(device_, int64_t(kRoles * names_.size()), length_, s);
  warm_ = true;
}

void DeviceFp8Histories::reduce_max(DeviceCollectives& ranks, cudaStream_t s) {
  ranks.all_reduce_max(device_, floats(int64_t(names_.size()), length_), s);
}

void DeviceFp8Histories::to_host(std::vector<Fp8AmaxHistory>& host, cudaStream_t s) const {
  ESPLAG_CHECK(host.size() == names_.size(), "fp8 amax histories: the host model has ", host.size(),
               " block linears, the device ", names_.size());
  std::vector<float> all(floats(int64_t(names_.size()), length_));
  CUDA_CHECK(cudaMemcpyAsync(all.data(), device_, sizeof(float) * all.size(), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < host.size() && warm_; ++i) {  // not warm: nothing to keep yet
    std::vector<float> v;  // per role: this step's amax, then the past ones (without the scale)
    for (int r = 0; r < kRoles; ++r) {
      const float* h = all.data() + (kRoles * i + size_t(r)) * size_t(length_ + 2);
      v.push_back(h[0]);
      v.insert(v.end(), h + 2, h + 2 + length_);
    }
    host[i].set_values(v, "fp8 amax history of " + names_[i]);
  }
}

void DeviceFp8Histories::from_host(const std::vector<Fp8AmaxHistory>& host, cudaStream_t s) {
  ESPLAG_CHECK(host.size() == names_.size(), "fp8 amax histories: the host model has ", host.size(),
               " block linears, the device ", names_.size());
  std::vector<float> all(floats(int64_t(names_.size()), length_), 0.0f);
  const auto warm = [](const Fp8AmaxHistory& h) { return h.warm(); };
  warm_ = std::all_of(host.begin(), host.end(), warm) && !host.empty();
  ESPLAG_CHECK(warm_ || std::none_of(host.begin(), host.end(), warm),
               "fp8 amax histories: the host model's are warm for some layers only");
  for (size_t i = 0; i < host.size() && warm_; ++i) {
    ESPLAG_CHECK(host[i].length() == length_, "fp8 amax histories: ", names_[i], "'s on the host is of length ",
                 host[i].length(), "; the device's of ", length_);
    const std::vector<float> v = host[i].values();
    for (int r = 0; r < kRoles; ++r) {
      float* h = all.data() + (kRoles * i + size_t(r)) * size_t(length_ + 2);
      const float* src = v.data() + size_t(r) * size_t(length_ + 1);
      h[0] = src[0];
      h[1] = *std::max_element(src + 1, src + 1 + length_);
      std::copy(src + 1, src + 1 + length_, h + 2);
    }
  }
  CUDA_CHECK(cudaMemcpyAsync(device_, all.data(), sizeof(float) * all.size(), cudaMemcpyHostToDevice, s));
  CUDA_CHECK(cudaStreamSynchronize(s));  // `all` goes out of scope
}

Fp8OperandAmax::Fp8OperandAmax(float* own, const DeviceFp8Histories* histories, const std::string& weight_name,
                               ProductOperand role)
    : own_(own), histories_(histories) {
  if (histories_) op_ = histories_->operand(weight_name, role);
}

gpu::Fp8CastAmax Fp8OperandAmax::before_cast(const gpu::bf16* x, int64_t n, cudaStream_t s) const {
  if (from_history()) return {op_.scale, op_.current};
  gpu::fp8_amax(own_, x, n, s);
  const bool record = histories_ && !histories_->paused();
  return {own_, record ? op_.current : nullptr};
}

const float* Fp8OperandAmax::last() const { return from_history() ? op_.scale : own_; }

}  // namespace esplag
