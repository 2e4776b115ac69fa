// Causal grouped-query attention through cuDNN's fused SDPA (the cudnn paths of
// ops/gpu_attention.h), built with the cuDNN frontend's graph API.
//
// Loading: the build defines NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, so the frontend calls
// no cuDNN symbol directly: its shim resolves every one with dlsym on the handle
// `cudnn_frontend::cudnn_dlhandle`, which the application must define and set. We define
// it here and set it after opening libcudnn.so.9 ourselves (the file ESPLAG_CUDNN_LIBRARY
// names if set, else the loader's path, then the usual install folders), so binaries
// start, and fall back to our kernels, where cuDNN is missing. The shim also opens a shared CUDA runtime
// (libcudart.so.12 or .13, by soname) for its own few CUDA calls — the memsets that zero
// the backward's accumulators — since our binaries link the runtime statically; where
// that soname is not on the loader's path we open it from the toolkit folder first, and
// the shim's later dlopen by soname then finds the loaded copy.
//
// Graphs: one forward graph per (device, B, T, NH, NKV, HD) and one backward graph per
// (device, B, T, NH, NKV, HD, deterministic), built on first use (validate, operation
// graph, heuristics mode A, support check, plans) and cached with their workspace size
// together with the reason when cuDNN cannot run the shape, so nothing is rebuilt or
// retried per call. The tensors are strided views of our buffers:
//   Q, K, V   [B, heads, T, HD] strides (T·C, HD, C, 1) into qkv, C = (NH + 2·NKV)·HD,
//             at offsets 0, NH·HD, (NH + NKV)·HD — the same views of dqkv for dQ, dK, dV;
//   O, dO     [B, NH, T, HD] strides (T·NH·HD, HD, NH·HD, 1);
//   Stats     [B, NH, T, 1] fp32, packed: cuDNN's logsumexp of the scaled scores in
//             natural-log units, which is exactly our lse [B, NH, T].
// Causal masking is the top-left diagonal band with right bound 0 (key j ≤ query t).
// K and V have NKV heads; cuDNN maps query head h to kv head h / (NH / NKV) as we do, and
// its backward writes dK / dV with NKV heads (the sum over the group is done inside), so
// dqkv is written in place with no separate buffers or reduction.
//
// One mutex serialises graph building and execution (a cuDNN handle and the frontend's
// per-graph execution state are not meant for concurrent use); a handle per device.
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/gpu_attention.h"

#ifdef ESPLAG_HAVE_CUDNN_FRONTEND

// The frontend reads no JSON here; leaving its bundled JSON library out keeps this file
// quick to compile and out of the way of the project's own nlohmann-json.
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

namespace cudnn_frontend {
// Declared by the frontend's shim, defined by the application (see the top of the file).
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace esplag::gpu {

namespace {

namespace fe = cudnn_frontend;

// ---------------------------------------------------------------------------------------
// The library

struct Library {
  bool ok = false;
  std::string status;
};

void* open_first(const std::vector<std::string>& candidates, std::string* from, std::string* errors) {
  for (const std::string& c : candidates) {
    dlerror();
    if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      *from = c;
      return h;
    }
    const char* e = dlerror();
    *errors += (errors->empty() ? "" : "; ") + std::string(e ? e : c.c_str());
  }
  return nullptr;
}

Library load_library() {
  Library lib;
  // ESPLAG_CUDNN_LIBRARY: the file to open (nothing else is tried), or "off" to run
  // without cuDNN (A/B comparisons, ruling cuDNN out when chasing a problem).
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("ESPLAG_CUDNN_LIBRARY"); env && *env) {
    if (std::strcmp(env, "off") == 0) {
      lib.status = "disabled by ESPLAG_CUDNN_LIBRARY=off";
      return lib;
    }
    candidates.push_back(env);
  } else {
    candidates.push_back("libcudnn.so.9");
    for (const char* dir : {"/usr/lib/x86_64-linux-gnu", "/usr/local/cuda/lib64", "/usr/local/cuda/lib"})
      candidates.push_back(std::string(dir) + "/libcudnn.so.9");
  }
  std::string from, errors;
  void* h = open_first(candidates, &from, &errors);
  if (!h) {
    lib.status = "cannot open cuDNN (" + errors + "); set ESPLAG_CUDNN_LIBRARY to the path of libcudnn.so.9";
    return lib;
  }
  using VersionFn = size_t (*)();
  auto version_fn = reinterpret_cast<VersionFn>(dlsym(h, "cudnnGetVersion"));
  if (!version_fn) {
    lib.status = from + " has no cudnnGetVersion";
    dlclose(h);
    return lib;
  }
  const size_t v = version_fn();
  const std::string version =
      std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  if (v < 90000) {
    lib.status = "cuDNN " + version + " at " + from + " is older than 9.0";
    dlclose(h);
    return lib;
  }

  // The shared CUDA runtime the shim will ask for (see the top of the file).
  const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  std::string rt_from, rt_errors;
  if (!open_first({cudart, "/usr/local/cuda/lib64/" + cudart, "/usr/local/cuda/targets/x86_64-linux/lib/" + cudart},
                  &rt_from, &rt_errors)) {
    lib.status = "cuDNN " + version + " found at " + from + " but no shared CUDA runtime " + cudart + " (" +
                 rt_errors + ")";
    dlclose(h);
    return lib;
  }

  fe::cudnn_dlhandle = h;
  lib.ok = true;
  lib.status = "cuDNN " + version + " (" + from + ")";
  return lib;
}

const Library& library() {
  static const Library lib = load_library();
  return lib;
}

// ---------------------------------------------------------------------------------------
// Graphs

// Tensor uids of the variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };

struct Shape {
  int device, B, T, NH, NKV, HD;
  auto tie() const { return std::tie(device, B, T, NH, NKV, HD); }
  bool operator<(const Shape& o) const { return tie() < o.tie(); }
};

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;  // null when cuDNN cannot run the shape
  int64_t workspace = 0;
  std::string error;  // why not, when graph is null
};

struct State {
  std::mutex mutex;
  std::map<int, cudnnHandle_t> handles;  // per device, never destroyed (process lifetime)
  std::map<Shape, Plan> fwd;
  std::map<std::pair<Shape, bool>, Plan> bwd;
};

State& state() {
  static State* s = new State;  // leaked on purpose: no teardown order issues with the library
  return *s;
}

std::string describe(const Shape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH) +
         " NKV=" + std::to_string(s.NKV) + " HD=" + std::to_string(s.HD);
}

Shape current_shape(int B, int T, int NH, int NKV, int HD) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  return {device, B, T, NH, NKV, HD};
}

// The calling thread's device's handle (state().mutex held).
cudnnHandle_t handle_for(int device) {
  auto& handles = state().handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  const cudnnStatus_t st = fe::detail::create_handle(&h);
  if (st != CUDNN_STATUS_SUCCESS) fail("cudnnCreate failed: ", fe::detail::get_error_string(st));
  handles.emplace(device, h);
  return h;
}

void check(fe::error_t e, const char* step) {
  if (!e.is_good()) throw std::runtime_error(std::string(step) + ": " + e.get_message());
}

std::shared_ptr<fe::graph::Graph> new_graph(int device) {
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  // Given rather than queried, so building needs no CUDA call through the shim's runtime.
  g->set_sm_version(major * 10 + minor);
  return g;
}

// A [B, heads, T, HD] view with token stride `row` (elements).
std::shared_ptr<fe::graph::Tensor_attributes> view(fe::graph::Graph& g, const char* name, int64_t uid,
                                                   const Shape& s, int64_t heads, int64_t row) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({s.B, heads, s.T, s.HD})
                      .set_stride({int64_t(s.T) * row, s.HD, row, 1}));
}

void finish(fe::graph::Graph& g, cudnnHandle_t handle, Plan& plan) {
  check(g.validate(), "validate");
  check(g.build_operation_graph(handle), "build_operation_graph");
  check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  check(g.check_support(), "check_support");
  check(g.build_plans(), "build_plans");
  check(g.get_workspace_size(plan.workspace), "get_workspace_size");
}

Plan build_forward(const Shape& s, cudnnHandle_t handle) {
  Plan plan;
  auto g = new_graph(s.device);
  const int64_t C = int64_t(s.NH + 2 * s.NKV) * s.HD, OC = int64_t(s.NH) * s.HD;
  auto Q = view(*g, "Q", kQ, s, s.NH, C), K = view(*g, "K", kK, s, s.NKV, C), V = view(*g, "V", kV, s, s.NKV, C);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("attention_forward")
                     .set_generate_stats(true)
                     .set_attn_scale(static_cast<float>(1.0 / std::sqrt(double(s.HD))))
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0);
  auto [O, Stats] = g->sdpa(Q, K, V, options);
  O->set_output(true).set_uid(kO).set_dim({s.B, s.NH, s.T, s.HD}).set_stride({int64_t(s.T) * OC, s.HD, OC, 1});
  Stats->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.B, s.NH, s.T, 1})
      .set_stride({int64_t(s.NH) * s.T, s.T, 1, 1});
  finish(*g, handle, plan);
  plan.graph = g;
  return plan;
}

Plan build_backward(const Shape& s, bool deterministic, cudnnHandle_t handle) {
  Plan plan;
  auto g = new_graph(s.device);
  const int64_t C = int64_t(s.NH + 2 * s.NKV) * s.HD, OC = int64_t(s.NH) * s.HD;
  auto Q = view(*g, "Q", kQ, s, s.NH, C), K = view(*g, "K", kK, s, s.NKV, C), V = view(*g, "V", kV, s, s.NKV, C);
  auto O = view(*g, "O", kO, s, s.NH, OC), dO = view(*g, "dO", kdO, s, s.NH, OC);
  auto Stats = g->tensor(fe::graph::Tensor_attributes()
                             .set_name("Stats")
                             .set_uid(kStats)
                             .set_data_type(fe::DataType_t::FLOAT)
                             .set_dim({s.B, s.NH, s.T, 1})
                             .set_stride({int64_t(s.NH) * s.T, s.T, 1, 1}));
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("attention_backward")
                     .set_attn_scale(static_cast<float>(1.0 / std::sqrt(double(s.HD))))
                     .set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT)
                     .set_diagonal_band_right_bound(0)
                     .set_deterministic_algorithm(deterministic);
  auto [dQ, dK, dV] = g->sdpa_backward(Q, K, V, O, dO, Stats, options);
  const std::vector<int64_t> stride = {int64_t(s.T) * C, s.HD, C, 1};
  dQ->set_output(true).set_uid(kdQ).set_dim({s.B, s.NH, s.T, s.HD}).set_stride(stride);
  dK->set_output(true).set_uid(kdK).set_dim({s.B, s.NKV, s.T, s.HD}).set_stride(stride);
  dV->set_output(true).set_uid(kdV).set_dim({s.B, s.NKV, s.T, s.HD}).set_stride(stride);
  finish(*g, handle, plan);
  plan.graph = g;
  return plan;
}

// Find or build a plan (state().mutex held); a failure is cached with its reason, so a
// shape cuDNN cannot run is tried once.
const Plan& forward_plan(const Shape& s) {
  State& st = state();
  auto it = st.fwd.find(s);
  if (it != st.fwd.end()) return it->second;
  Plan plan;
  try {
    plan = build_forward(s, handle_for(s.device));
  } catch (const std::exception& e) {
    plan = Plan{};
    plan.error = std::string("cuDNN cannot build the forward graph: ") + e.what();
  }
  return st.fwd.emplace(s, std::move(plan)).first->second;
}

const Plan& backward_plan(const Shape& s, bool deterministic) {
  State& st = state();
  const auto key = std::make_pair(s, deterministic);
  auto it = st.bwd.find(key);
  if (it != st.bwd.end()) return it->second;
  Plan plan;
  try {
    plan = build_backward(s, deterministic, handle_for(s.device));
  } catch (const std::exception& e) {
    plan = Plan{};
    plan.error = std::string("cuDNN cannot build the ") + (deterministic ? "deterministic " : "") +
                 "backward graph: " + e.what();
  }
  return st.bwd.emplace(key, std::move(plan)).first->second;
}

void execute(const Plan& plan, const char* what, const Shape& s, std::unordered_map<int64_t, void*>& pack,
             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  ESPLAG_CHECK(plan.graph, what, " (cudnn) ", describe(s), ": ", plan.error);
  ESPLAG_CHECK(workspace_bytes >= size_t(plan.workspace) && (plan.workspace == 0 || workspace), what, " (cudnn) ",
               describe(s), ": workspace of ", workspace_bytes, " bytes is too small, the plan needs ",
               plan.workspace, " (attention_workspace_bytes)");
  cudnnHandle_t h = handle_for(s.device);
  const cudnnStatus_t st = fe::detail::set_stream(h, stream);
  ESPLAG_CHECK(st == CUDNN_STATUS_SUCCESS, what, " (cudnn): cudnnSetStream failed: ", fe::detail::get_error_string(st));
  std::string error;
  try {
    fe::error_t e = plan.graph->execute(h, pack, plan.workspace ? workspace : nullptr);
    if (!e.is_good()) error = e.get_message();
  } catch (const std::exception& ex) {
    error = std::string("threw ") + ex.what();
  }
  ESPLAG_CHECK(error.empty(), what, " (cudnn) ", describe(s), ": execute failed: ", error);
}

}  // namespace

bool attention_cudnn_available() { return library().ok; }
std::string attention_cudnn_status() { return library().status; }

namespace detail {

std::string cudnn_attention_support(int B, int T, int NH, int NKV, int HD, bool deterministic, size_t* fwd_workspace,
                                    size_t* bwd_workspace) {
  const Library& lib = library();
  if (!lib.ok) return lib.status;
  const Shape s = current_shape(B, T, NH, NKV, HD);
  std::lock_guard<std::mutex> lock(state().mutex);
  const Plan& f = forward_plan(s);
  if (!f.graph) return f.error;
  const Plan& b = backward_plan(s, deterministic);
  if (!b.graph) return b.error;
  if (fwd_workspace) *fwd_workspace = size_t(f.workspace);
  if (bwd_workspace) *bwd_workspace = size_t(b.workspace);
  return {};
}

void cudnn_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD,
                             void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  ESPLAG_CHECK(library().ok, "attention_forward (cudnn): ", library().status);
  const Shape s = current_shape(B, T, NH, NKV, HD);
  bf16* q = const_cast<bf16*>(qkv);
  std::unordered_map<int64_t, void*> pack = {{kQ, q},
                                             {kK, q + size_t(NH) * HD},
                                             {kV, q + size_t(NH + NKV) * HD},
                                             {kO, out},
                                             {kStats, lse}};
  std::lock_guard<std::mutex> lock(state().mutex);
  execute(forward_plan(s), "attention_forward", s, pack, workspace, workspace_bytes, stream);
}

void cudnn_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                              int T, int NH, int NKV, int HD, bool deterministic, void* workspace,
                              size_t workspace_bytes, cudaStream_t stream) {
  ESPLAG_CHECK(library().ok, "attention_backward (cudnn): ", library().status);
  const Shape s = current_shape(B, T, NH, NKV, HD);
  bf16* q = const_cast<bf16*>(qkv);
  const size_t koff = size_t(NH) * HD, voff = size_t(NH + NKV) * HD;
  std::unordered_map<int64_t, void*> pack = {{kQ, q},
                                             {kK, q + koff},
                                             {kV, q + voff},
                                             {kO, const_cast<bf16*>(out)},
                                             {kdO, const_cast<bf16*>(dout)},
                                             {kStats, const_cast<float*>(lse)},
                                             {kdQ, dqkv},
                                             {kdK, dqkv + koff},
                                             {kdV, dqkv + voff}};
  std::lock_guard<std::mutex> lock(state().mutex);
  execute(backward_plan(s, deterministic), "attention_backward", s, pack, workspace, workspace_bytes, stream);
}

}  // namespace detail

}  // namespace esplag::gpu

#else  // no cuDNN frontend headers at build time: the cudnn paths report why they cannot run

namespace esplag::gpu {

namespace {
constexpr const char* kNoFrontend =
    "built without the cuDNN frontend headers (scripts/fetch-vendor-headers.sh, then reconfigure)";
}

bool attention_cudnn_available() { return false; }
std::string attention_cudnn_status() { return kNoFrontend; }

namespace detail {

std::string cudnn_attention_support(int, int, int, int, int, bool, size_t*, size_t*) { return kNoFrontend; }

void cudnn_attention_forward(bf16*, float*, const bf16*, int, int, int, int, int, void*, size_t, cudaStream_t) {
  fail("attention_forward (cudnn): ", kNoFrontend);
}

void cudnn_attention_backward(bf16*, const bf16*, const bf16*, const bf16*, const float*, int, int, int, int, int,
                              bool, void*, size_t, cudaStream_t) {
  fail("attention_backward (cudnn): ", kNoFrontend);
}

}  // namespace detail

}  // namespace esplag::gpu

#endif
