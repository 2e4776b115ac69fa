// NcclComm: see dist/cuda/nccl_comm.h.
#include "dist/cuda/nccl_comm.h"

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/shared_library.h"
#include "dist/host_channel.h"

#ifdef ESPLAG_HAVE_NCCL
#include <nccl.h>
#endif

namespace esplag {

#ifdef ESPLAG_HAVE_NCCL

namespace {

// The entry points used, resolved with dlsym; the types come from nccl.h.
#define ESPLAG_NCCL_ENTRY_POINTS(X)                                                                      \
  X(GetVersion) X(GetUniqueId) X(CommInitRank) X(CommDestroy) X(CommAbort) X(CommGetAsyncError) X(AllReduce) \
  X(ReduceScatter) X(AllGather) X(GroupStart) X(GroupEnd) X(GetErrorString)

struct NcclApi {
#define ESPLAG_DECLARE(name) decltype(&nccl##name) name = nullptr;
  ESPLAG_NCCL_ENTRY_POINTS(ESPLAG_DECLARE)
#undef ESPLAG_DECLARE
  std::string problem;  // why NCCL cannot be used ("" when it can)
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    NcclApi a;
    void* so = open_shared_library("ESPLAG_NCCL_LIB", "libnccl.so.2", &a.problem);
    if (!so) return a;
#define ESPLAG_RESOLVE(name)                                                                  \
  a.name = reinterpret_cast<decltype(a.name)>(::dlsym(so, "nccl" #name));                    \
  if (!a.name) {                                                                              \
    a.problem = "libnccl.so.2 has no entry point nccl" #name " (NCCL older than 2.12?)";      \
    return a;                                                                                 \
  }
    ESPLAG_NCCL_ENTRY_POINTS(ESPLAG_RESOLVE)
#undef ESPLAG_RESOLVE
    return a;
  }();
  return api;
}

const NcclApi& loaded_nccl() {
  const NcclApi& a = nccl();
  ESPLAG_CHECK(a.problem.empty(), "data-parallel training on the GPU needs NCCL: ", a.problem);
  return a;
}

}  // namespace

struct NcclComm::Handle {
  ncclComm_t comm = nullptr;
  bool aborted = false;
};

#define NCCL_CALL(what, call)                                                                          \
  do {                                                                                                 \
    const ncclResult_t r_ = (call);                                                                    \
    if (r_ != ncclSuccess && r_ != ncclInProgress) abort_and_fail(what, loaded_nccl().GetErrorString(r_)); \
  } while (0)

NcclComm::NcclComm(HostChannel& channel) : handle_(std::make_unique<Handle>()) {
  const NcclApi& a = loaded_nccl();
  rank_ = channel.rank();
  size_ = channel.size();
  timeout_s_ = channel.timeout();
  std::string id(sizeof(ncclUniqueId), '\0');
  if (rank_ == 0) {
    ncclUniqueId uid;
    const ncclResult_t r = a.GetUniqueId(&uid);
    ESPLAG_CHECK(r == ncclSuccess, "NCCL: cannot make the communicator's id: ", a.GetErrorString(r));
    id.assign(reinterpret_cast<const char*>(&uid), sizeof uid);
  }
  channel.broadcast(id, 0);
  ESPLAG_CHECK(id.size() == sizeof(ncclUniqueId), "NCCL: rank ", rank_, " received an id of ", id.size(),
               " bytes from rank 0");
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof uid);
  const ncclResult_t r = a.CommInitRank(&handle_->comm, size_, uid, rank_);
  ESPLAG_CHECK(r == ncclSuccess, "NCCL: rank ", rank_, " of ", size_, " could not join the communicator: ",
               a.GetErrorString(r));
}

NcclComm::~NcclComm() {
  if (!handle_->comm) return;
  const NcclApi& a = nccl();
  if (handle_->aborted) return;
  a.CommDestroy(handle_->comm);
}

void NcclComm::abort_and_fail(const std::string& what, const std::string& why) {
  if (handle_->comm && !handle_->aborted) {
    nccl().CommAbort(handle_->comm);
    handle_->aborted = true;
  }
  fail("data parallel: ", what, " failed on rank ", rank_, " of ", size_, ": ", why);
}

void NcclComm::all_reduce_mean(float* data, size_t n, cudaStream_t stream) {
  NCCL_CALL("all-reduce of the gradients", loaded_nccl().AllReduce(data, data, n, ncclFloat32, ncclAvg,
                                                                    handle_->comm, stream));
}

void NcclComm::all_reduce_sum(double* data, size_t n, cudaStream_t stream) {
  NCCL_CALL("all-reduce", loaded_nccl().AllReduce(data, data, n, ncclFloat64, ncclSum, handle_->comm, stream));
}

void NcclComm::all_reduce_sum(float* data, size_t n, cudaStream_t stream) {
  NCCL_CALL("all-reduce", loaded_nccl().AllReduce(data, data, n, ncclFloat32, ncclSum, handle_->comm, stream));
}

void NcclComm::all_reduce_max(float* data, size_t n, cudaStream_t stream) {
  NCCL_CALL("all-reduce", loaded_nccl().AllReduce(data, data, n, ncclFloat32, ncclMax, handle_->comm, stream));
}

void NcclComm::all_reduce_sum_int(int32_t* data, size_t n, cudaStream_t stream) {
  NCCL_CALL("all-reduce", loaded_nccl().AllReduce(data, data, n, ncclInt32, ncclSum, handle_->comm, stream));
}

void NcclComm::reduce_scatter_mean(const float* in, float* out, size_t chunk, cudaStream_t stream) {
  NCCL_CALL("reduce-scatter of the gradients",
            loaded_nccl().ReduceScatter(in, out, chunk, ncclFloat32, ncclAvg, handle_->comm, stream));
}

void NcclComm::all_gather(const void* in, void* out, size_t chunk_bytes, cudaStream_t stream) {
  NCCL_CALL("all-gather", loaded_nccl().AllGather(in, out, chunk_bytes, ncclUint8, handle_->comm, stream));
}

void NcclComm::group_begin() { NCCL_CALL("a group of collectives", loaded_nccl().GroupStart()); }

void NcclComm::group_end() { NCCL_CALL("a group of collectives", loaded_nccl().GroupEnd()); }

void NcclComm::synchronize(cudaStream_t stream, const std::string& what) {
  const NcclApi& a = loaded_nccl();
  const double timeout = timeout_s_;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t done = cudaStreamQuery(stream);
    if (done == cudaSuccess) return;
    if (done != cudaErrorNotReady) CUDA_CHECK(done);
    ncclResult_t async = ncclSuccess;
    a.CommGetAsyncError(handle_->comm, &async);
    if (async != ncclSuccess && async != ncclInProgress) abort_and_fail(what, a.GetErrorString(async));
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout)
      abort_and_fail(what, "the ranks' work did not finish within " + std::to_string(int(timeout)) +
                               " s (a rank stopped or hangs; ESPLAG_COLLECTIVE_TIMEOUT_S sets the limit)");
    std::this_thread::sleep_for(std::chrono::microseconds(waited < 1 ? 50 : 2000));
  }
}

std::string NcclComm::version() {
  const NcclApi& a = nccl();
  if (!a.problem.empty()) return a.problem;
  int v = 0;
  a.GetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

#else  // no nccl.h at build time

struct NcclComm::Handle {};

NcclComm::NcclComm(HostChannel&) {
  fail("data-parallel training on the GPU needs NCCL, and this esplag was built without nccl.h "
       "(install NCCL's headers and reconfigure)");
}
NcclComm::~NcclComm() = default;
void NcclComm::abort_and_fail(const std::string& what, const std::string& why) { fail(what, ": ", why); }
void NcclComm::all_reduce_mean(float*, size_t, cudaStream_t) {}
void NcclComm::all_reduce_sum(double*, size_t, cudaStream_t) {}
void NcclComm::all_reduce_sum(float*, size_t, cudaStream_t) {}
void NcclComm::reduce_scatter_mean(const float*, float*, size_t, cudaStream_t) {}
void NcclComm::group_begin() {}
void NcclComm::group_end() {}
void NcclComm::all_gather(const void*, void*, size_t, cudaStream_t) {}
void NcclComm::all_reduce_sum_int(int32_t*, size_t, cudaStream_t) {}
void NcclComm::all_reduce_max(float*, size_t, cudaStream_t) {}
void NcclComm::synchronize(cudaStream_t, const std::string&) {}
std::string NcclComm::version() { return "built without nccl.h"; }

#endif

}  // namespace esplag
