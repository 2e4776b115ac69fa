// DeviceLinear: a block Linear layer of GpuTransformer, the GPU twin of Linear<T>
// (model/linear.h). The model calls the interface and never asks which kind a layer is;
// each kind is one class in its own files (model/cuda/device_linear_*.h), made by name from
// the kind table (device_linear_kind). Shapes: W [out, in], X [N, in], Y [N, out], N the
// micro-batch's tokens (at most DeviceLinearContext::tokens).
//
// What a layer asks of the model:
// - stored state: its weight in the parameter state (stored_weight_shape: dense, or another
//   form such as slope's kept values, with the row mapping between the two), and tensors of
//   its own appended after the flat layout (extra_tensors: an adapter's L and R), each with
//   bf16 weights, the master's low halves, fp32 gradients and moments; bind() hands it the
//   views at every layout;
// - shared scratch: DeviceLinearContext::scratch, by purpose (one buffer for all layers that
//   share it; the stream orders their uses); device_bytes() counts what a layer holds itself.
// Fusions across the layer's edge are the layer's to decide: forward takes the MLP's GELU
// and the pre-activation buffer (cuBLASLt's epilogue, or a separate pass after a 2:4
// product), backward_dx the GELU gradient, backward_dw the bias gradient when the model does
// not sum it itself.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#include <cuda_runtime.h>

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "model/gpu_transformer.h"
#include "model/linear.h"
#include "model/linear_kinds.h"
#include "model/linear_precision.h"
#include "ops/gpu.h"
#include "ops/gpu_fp8.h"
#include "ops/gpu_pending_scale.h"
#include "sparse/cuda/sparse_linear.h"

namespace esplag {

class Fp8ProducedCodes;

class StepMarks;
class DeviceFp8Histories;
using gpu::bf16;

// Values by the CPU trainer's tensor names ("<weight>.values", "<module>.lora_l"): the
// moments of the tensors a CPU layer trains itself.
using NamedValues = std::map<std::string, std::vector<float>>;

// What a layer's CPU twin (the host model's layer of the same kind and name) takes from it
// besides the flat layout, which the caller has copied into the host model already.
struct TwinCopy {
  const float* weight = nullptr;  // the layer's dense weight [out, in] in that copy (zeros where pruned)
  const float *m = nullptr, *v = nullptr;  // its moments in the flat layout's host copy; null: moments stay
  NamedValues *named_m = nullptr, *named_v = nullptr;  // receive the moments of the tensors the twin trains itself
};

// A CPU twin as the Linear class of its layer's kind (Twin<float>: SlopeLinear, ...), const
// as given; Error naming both kinds when it is another.
template <template <typename> class Twin, typename L>
auto& twin_as(L& twin, const std::string& kind) {
  using T = std::conditional_t<std::is_const_v<L>, const Twin<float>, Twin<float>>;
  auto* t = dynamic_cast<T*>(&twin);
  if (!t) fail("GpuTransformer: ", twin.params().name, ": a ", kind, " layer's CPU twin is of kind ", twin.kind());
  return *t;
}

// Masks a setting made from a CPU twin points into (DeviceLinearKind::setting_from_twin);
// they live as long as the setting.
struct TwinMasks {
  GpuTransformer::SlopeState slope;
  std::vector<uint8_t> mask;
};

// Buffers layers of one model share by purpose (a kind's scratch sized for the largest block
// Linear, made by the first layer that needs it). A part is a kind's own struct.
class SharedScratch {
 public:
  struct Part {
    virtual ~Part() = default;
    virtual size_t bytes() const = 0;
  };
  // The part `name`, made by `make` when there is none.
  template <typename P>
  P& get(const std::string& name, const std::function<std::unique_ptr<P>()>& make) {
    auto it = parts_.find(name);
    if (it == parts_.end()) it = parts_.emplace(name, make()).first;
    return static_cast<P&>(*it->second);
  }
  template <typename P>
  P* find(const std::string& name) const {
    auto it = parts_.find(name);
    return it == parts_.end() ? nullptr : static_cast<P*>(it->second.get());
  }
  void erase(const std::string& name) { parts_.erase(name); }
  // Frees the parts no name in `used` names.
  void keep_only(const std::set<std::string>& used);
  size_t bytes() const;

 private:
  std::map<std::string, std::unique_ptr<Part>> parts_;
};

// What the model shares with its Linear layers.
struct DeviceLinearContext {
  gpu::Gemm* gemm = nullptr;
  cudaStream_t stream = nullptr;
  StepMarks* marks = nullptr;
  int64_t tokens = 0;           // max_batch · max_seq_len: a full-size micro-batch
  bool gelu_mlp = false;        // the MLP's activation is GELU
  bool sparse_dispatch = true;  // GpuModelOptions::sparse_dispatch
  LinearPrecision precision;    // GpuModelOptions::precision
  // GpuModelOptions::fp8_producers with delayed scaling: fp8 layers (dense, masked, vnm, slope,
  // semi_sparse) take their operands' codes from the ops that make them
  // (DeviceLinear::takes_produced_fp8); with a SwiGLU MLP fc's dY codes too (Fp8GradCodes'
  // second pair).
  bool fp8_producers = false, swiglu_grad_codes = false;
  std::vector<std::pair<int64_t, int64_t>> shapes;  // every block Linear's [out, in]
  std::vector<GpuTransformer::SparseDispatch> dispatch;  // the decisions so far
  SharedScratch scratch;
  void* colsum_scratch = nullptr;  // gpu::column_sum_add's scratch (bias gradients as column sums)
  size_t colsum_scratch_bytes = 0;
  uint64_t* fp8_saturated = nullptr;  // the fp8 casts add the values they saturated (precision.fp8)
  // Delayed fp8 scaling's amax histories (precision.delayed()), else null.
  DeviceFp8Histories* fp8_histories = nullptr;

  // The largest of f(out, in) over the block Linear shapes (a shared scratch's size).
  size_t largest(const std::function<size_t(int64_t out, int64_t in)>& f) const;
  // Per-layer dispatch: whether layers of `kind` and this one's shape run their 2:4 products,
  // timed (`time`) for the first of them. With a GELU MLP, the 2:4 path may carry GELU passes
  // (over fc's output) that the dense one fuses into cuBLASLt's epilogues; they are timed and
  // counted against it, as `gelu` says.
  enum class GeluPasses {
    fc_and_dx,  // fc's forward and mproj's dX
    fc,         // fc's forward only (semi_sparse_activation's dX is cuBLASLt's, with it fused)
    none,       // both ways run the same passes (fp8: neither fuses them)
  };
  using ProductTimes = gpu::SparseLinear::ProductTimes;
  bool sparse_is_faster(const std::string& kind, const std::string& weight_name, int64_t out, int64_t in,
                        GeluPasses gelu, const std::function<ProductTimes()>& time);
};

// A tensor of the parameter state as one layer sees it: bf16 weights (the master's high
// halves), the master's low halves, the fp32 gradient and the moments. Null where the
// tensor is absent.
struct DeviceTensorView {
  bf16* w = nullptr;
  int16_t* w_lo = nullptr;
  float* grad = nullptr;
  float *m = nullptr, *v = nullptr;

  // Its n values to the host (master weights joined, moments; each where given), and back
  // (moments zero where not given).
  void to_host(size_t n, std::vector<float>* weights, std::vector<float>* m1, std::vector<float>* m2,
               cudaStream_t s) const;
  void from_host(size_t n, const float* weights, const float* m1, const float* m2, cudaStream_t s) const;
};

// A tensor a layer keeps in the parameter state besides its weight and bias, named
// module + suffix ("blocks.3.mlp.fc" + ".lora_l"), with weight decay.
struct DeviceLinearTensor {
  std::string suffix;
  Shape shape;
};

struct DeviceLinearParams {
  DeviceTensorView weight, bias;
  std::vector<DeviceTensorView> extra;  // extra_tensors(), in their order
};

// What a kind is made from (GpuTransformer::LinearKindSetting plus the model's context).
struct DeviceLinearSetup {
  const GpuTransformer::LinearKindSetting* setting = nullptr;
  DeviceLinearContext* context = nullptr;
  int64_t out = 0, in = 0;
  bool bias = false;
  DeviceLinearParams params;  // the views of the layout in place
  int64_t step = 0;           // optimizer steps so far
  // The layer it replaces (null for a model's first layers), alive while the new one is made.
  const class DeviceLinear* previous = nullptr;
};

class DeviceLinear {
 public:
  using Setting = GpuTransformer::LinearKindSetting;
  using Act = gpu::Gemm::Act;

  DeviceLinear(const std::string& kind, const DeviceLinearSetup& s);
  virtual ~DeviceLinear() = default;
  DeviceLinear(const DeviceLinear&) = delete;
  DeviceLinear& operator=(const DeviceLinear&) = delete;

  const std::string& kind() const { return kind_; }
  const std::string& weight_name() const { return weight_name_; }
  int64_t out_features() const { return out_; }
  int64_t in_features() const { return in_; }

  // --- memory ---------------------------------------------------------------------------
  // The weight's shape in the parameter state and the mapping of `rows` dense rows from row
  // row0 on (a multiple of stored_row_group()) to its stored values and back (device fp32).
  virtual Shape stored_weight_shape() const { return {out_, in_}; }
  virtual int64_t stored_row_group() const { return 1; }
  virtual void weight_to_stored(float* stored, const float* dense, int64_t row0, int64_t rows) const {}
  virtual void weight_from_stored(float* dense, const float* stored, int64_t row0, int64_t rows) const {}
  virtual std::vector<DeviceLinearTensor> extra_tensors() const { return {}; }
  // The initial values of extra tensor i (fp32; its moments start at zero).
  virtual std::vector<float> initial_extra(size_t i) const { return {}; }
  // The views into a new layout of the parameter state.
  virtual void bind(const DeviceLinearParams& p) { p_ = p; }
  // Device memory the layer holds outside the parameter state and the shared scratch.
  virtual size_t device_bytes() const { return 0; }
  // The shared scratch parts the layer uses.
  virtual void shared_parts(std::set<std::string>& used) const {}

  // --- the step ---------------------------------------------------------------------------
  // Per-step work from the current weights (after set_params, init_weights and every AdamW
  // step); prepares() says whether there is any. refresh_due(step): the preparation for
  // `step` chooses new masks (prepare(true)); masks_refreshed(step) records that it did.
  virtual bool prepares() const { return false; }
  virtual bool refresh_due(int64_t step) const { return false; }
  virtual void prepare(bool refresh) {}
  virtual void masks_refreshed(int64_t step) {}
  // After AdamW's update, before prepare: the op name to mark (null: nothing to do) and the work.
  virtual const char* after_optimizer_step_op() const { return nullptr; }
  virtual void after_optimizer_step() {}
  // Whether the next prepare after an AdamW step reads the amax of the bf16 weight the step
  // wrote (an fp8 weight cast), which AdamW can take as it writes it; the model then hands it
  // over with weight_amax_taken (a device float, valid until that prepare).
  virtual bool takes_weight_amax() const { return false; }
  virtual void weight_amax_taken(const float* amax) {}
  // Before each backward (buffers reused between a layer's dX and dW start over).
  virtual void begin_backward() {}
  // out [N, out] = act(in [N, in] · Wᵀ + b); with act gelu, pre_act receives the
  // pre-activation. `op` names the op ("gemm fc fwd (+gelu)").
  virtual void forward(bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op) = 0;
  // dinp [N, in] = dout [N, out] · W, times gelu'(pre_act) when pre_act is given.
  virtual void backward_dx(bf16* dinp, const bf16* dout, int N, const bf16* pre_act, const char* op) = 0;
  // dW (+)= doutᵀ · inp (accumulate or overwrite); with bias_grad also the bias gradient
  // (always added; else the model sums it).
  virtual void backward_dw(const bf16* dout, const bf16* inp, int N, bool accumulate, bool bias_grad,
                           const char* op) = 0;
  // forward (no activation) and backward_dx where the op that reads the output next applies a
  // scale as it loads it (gpu::PendingScale: SwiGLU, RoPE, the norms; GpuModelOptions::
  // fp8_producers). A layer may leave its output unscaled and return that scale: the fp8 2:4
  // products, which cuSPARSELt cannot scale by a device value, so save their pass over the
  // output. By default the output is final and the scale empty.
  virtual gpu::PendingScale forward_leaving_scale(bf16* out, const bf16* in, int N, const char* op) {
    forward(out, in, N, Act::none, nullptr, op);
    return {};
  }
  virtual gpu::PendingScale backward_dx_leaving_scale(bf16* dinp, const bf16* dout, int N, const char* op) {
    backward_dx(dinp, dout, N, nullptr, op);
    return {};
  }
  // --- fp8 operands written by the ops around the layer (delayed scaling) -----------------
  // Whether the ops that make this layer's operands may write their fp8 codes themselves
  // now: fp8 products that read X and dY as codes only (fp8_produced_codes), delayed
  // scaling, warm histories, not paused, producers on (GpuModelOptions::fp8_producers). Else
  // the layer casts its bf16 operands (and the targets below are an Error).
  bool takes_produced_fp8();
  // Where dout [N, out]'s maker (SwiGLU's backward) writes its codes for this layer's next
  // backward_dx and backward_dw of that dout (pointer and rows), which then take them and
  // read no dout values (nor may a bias gradient).
  gpu::Fp8Target fp8_grad_target(const bf16* dout, int N);
  // Where X [N, in]'s codes go (SwiGLU's or a norm's output) for this layer's next forward, of `in`
  // (pointer and rows, which must come next), which then takes them and reads no in values.
  gpu::Fp8Target fp8_input_target(const bf16* in, int N);
  // Where Xᵀ's codes [in, N] go (the backward's recomputed SwiGLU output or norm output) for
  // this layer's next backward_dw of N rows, which then takes them and reads no inp values.
  gpu::Fp8Target fp8_input_t_target(int N);

  // --- kind changes -----------------------------------------------------------------------
  // Whether `s` leaves the layer as it is (same kind and options; schedules aside).
  virtual bool keeps(const Setting& s) const;
  // Options that change without a rebuild (a refresh schedule).
  virtual void update(const Setting& s) {}
  // Once the parameter state is laid out with the layer in place (masks applied, dispatch).
  virtual void attach() {}
  // The rank of the low-rank adapter the layer is (0: it is none; see make_device_adapter).
  virtual int adapter_rank() const { return 0; }
  // sparse_dw (GpuTransformer::sparse_dw) and its draws so far.
  virtual bool sparse_dw() const { return false; }
  virtual uint64_t sparse_dw_draws() const { return 0; }

  // --- the CPU twin (a host model training on this GPU model, train/gpu_step.cu) ---------
  // Into the twin: what the flat layout does not hold (kept values and their moments, masks,
  // an adapter, draw counts).
  virtual void to_twin(Linear<float>& twin, const TwinCopy& c) const {}
  // From a twin that trains its kept values itself: their moments (by name in m, v) spread
  // over this weight's slice of the flat layout (dense_m, dense_v; zero where pruned). False
  // for a kind whose twin trains its flat weight.
  virtual bool moments_from_twin(const Linear<float>& twin, const NamedValues& m, const NamedValues& v,
                                 float* dense_m, float* dense_v) const {
    return false;
  }
  // The layer's extra tensors (an adapter's L and R) from the twin's, with their moments
  // where m and v hold them (else zero).
  virtual void extras_from_twin(Linear<float>& twin, const NamedValues* m, const NamedValues* v) {}

 protected:
  // The codes of X, Xᵀ and dY that this layer's fp8 products would take from their
  // producers (model/cuda/fp8_produced_codes.h), or null where they take none.
  virtual Fp8ProducedCodes* fp8_produced_codes() { return nullptr; }
  // Sets the sparse dW draw count of a twin (through its saved state, as a checkpoint would).
  static void set_twin_draws(Linear<float>& twin, uint64_t draws);
  // The moments of a twin's n kept values ("<weight>.values" in m and v) spread over the
  // layer's dense slices dense_m, dense_v at their slots; where m and v lack them (the layer
  // became this kind at this step), the slices stay zero.
  static void scatter_kept_moments(const std::string& weight_name, const linear_detail::SlotIndex& slots, size_t n,
                                   const NamedValues& m, const NamedValues& v, float* dense_m, float* dense_v);

  // The 2:4 forward and input gradient of a layer whose gpu::SparseLinear runs them: the bias
  // in cuSPARSELt's epilogue, the MLP's GELU and its gradient as passes of their own (the
  // dense products fuse them into cuBLASLt's epilogues).
  void forward_24(gpu::SparseLinear& sp, bf16* out, const bf16* in, int N, Act act, bf16* pre_act, const char* op);
  // The same for another 2:4 product, which writes the pre-activation y (bias included).
  void forward_24(const std::function<void(bf16* y)>& product, bf16* out, int N, Act act, bf16* pre_act,
                  const char* op);
  void backward_dx_24(gpu::SparseLinear& sp, bf16* dinp, const bf16* dout, int N, const bf16* pre_act,
                      const char* op);
  // dinp *= gelu'(pre_act), when pre_act is given.
  void gelu_backward_pass(bf16* dinp, const bf16* pre_act, int N);

  const std::string kind_, weight_name_;
  const int64_t out_, in_;
  DeviceLinearContext& ctx_;
  DeviceLinearParams p_;
};

// A kind of block Linear on the GPU: its name, what its settings may carry, and its factory.
struct DeviceLinearKind {
  std::string name;
  bool takes_mask = false;          // LinearKindSetting::mask, required when a layer becomes this kind
  bool takes_slope_masks = false;   // LinearKindSetting::slope_masks
  bool takes_adapter = false;       // LinearKindSetting::lora_rank
  bool takes_sparse_dw = false;     // LinearKindSetting::sparse_dw
  bool needs_cusparselt = false;    // and a shape and micro-batch in multiples of 16
  bool stores_other_weight = false; // stored_weight_shape is not [out, in]: a change lays the state out again
  bool trains_own_tensor = false;   // the CPU trains another tensor ("<weight>.values"): moments restart
  // Made before the state's new layout (it defines it), else after it, in ascending order.
  int build_order = 1;
  // What its dispatch times (GpuTransformer::sparse_dispatch_summary).
  std::string dispatch_times = "prepare + forward + dX";
  // Checks of its own options, always (check) and when a layer becomes this kind (check_change).
  std::function<void(const GpuTransformer::LinearKindSetting&, int64_t out, int64_t in)> check, check_change;
  std::function<std::unique_ptr<DeviceLinear>(const DeviceLinearSetup&)> make;
  // The setting that gives a layer its CPU twin's state (the twin is of this kind): its
  // options, sparse dW seed and draws and, with `masks`, its masks (in `held`; for slope,
  // refresh step `step` when the twin has not refreshed yet). Null: the name is all.
  std::function<void(const Linear<float>& twin, int64_t step, bool masks, GpuTransformer::LinearKindSetting& s,
                     TwinMasks& held)>
      setting_from_twin;
};

// The kinds the GPU has, the built-in ones in the order of the documentation, then the
// registered ones. References stay valid across registrations.
const std::deque<DeviceLinearKind>& device_linear_kinds();
// Adds a kind whose registry entry (model/linear_registry.h) is registered with `gpu` set.
// Error for a name the table has, or one the registry lacks. Not thread-safe.
void register_device_linear_kind(DeviceLinearKind kind);
// The kind named `kind` (Error naming the layer and the kinds there are).
const DeviceLinearKind& device_linear_kind(const std::string& kind, const std::string& weight_name);
// "dense, masked and slope": the names of the kinds `pick` accepts.
std::string device_linear_kind_names(const std::function<bool(const DeviceLinearKind&)>& pick);
// The checks of a setting for the kind it names that come before knowing whether the layer
// changes (Error naming the layer), and those of a change to it.
void check_device_linear_setting(const GpuTransformer::LinearKindSetting& s, const DeviceLinearKind& kind,
                                 int64_t out, int64_t in, int64_t tokens);
void check_device_linear_change(const GpuTransformer::LinearKindSetting& s, const DeviceLinearKind& kind,
                                int64_t out, int64_t in, int64_t tokens);
// The low-rank adapter of rank setup.setting->lora_rank around `inner` (slope's lazy adapter,
// model/cuda/device_linear_adapter.h): the model calls it in place of inner.
std::unique_ptr<DeviceLinear> make_device_adapter(const DeviceLinearSetup& setup, DeviceLinear& inner);
// The per-layer dispatch decisions as GpuTransformer::sparse_dispatch_summary says them.
std::string sparse_dispatch_summary(const std::vector<GpuTransformer::SparseDispatch>& decisions);

}  // namespace esplag
