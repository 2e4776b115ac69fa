// The cuSPARSELt loader: dlopen of libcusparseLt.so.0 (or the file or folder named by
// ESPLAG_CUSPARSELT_LIB), its entry points, the handle, and the availability the public
// header reports. See sparse/cuda/cusparselt_loader.h.
#include "sparse/cuda/cusparselt.h"

#include <dlfcn.h>

#include <iostream>
#include <mutex>
#include <set>
#include <string>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/shared_library.h"

#ifdef ESPLAG_HAVE_CUSPARSELT
#include "sparse/cuda/cusparselt_loader.h"
#endif

namespace esplag::gpu {

void warn_cusparselt_fallback_once(std::string_view who, std::string_view why) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> warned;
  std::lock_guard<std::mutex> lock(mu);
  if (!warned.insert(std::string(who)).second) return;
  std::cerr << "esplag: warning: " << who << " runs dense GEMMs: ";
  if (why.empty())
    std::cerr << "cuSPARSELt is not available (" << cusparselt_unavailable_reason() << ")";
  else
    std::cerr << why;
  std::cerr << std::endl;
}

#ifdef ESPLAG_HAVE_CUSPARSELT

namespace {

CusparseltLibrary* load_library() {
  auto* lib = new CusparseltLibrary();  // never destroyed: the handle must outlive every plan
  void* so = open_shared_library("ESPLAG_CUSPARSELT_LIB", "libcusparseLt.so.0", &lib->reason);
  if (!so) return lib;
  CusparseltApi& a = lib->api;
#define ESPLAG_RESOLVE(name)                                                                   \
  a.name = reinterpret_cast<decltype(a.name)>(::dlsym(so, "cusparseLt" #name));               \
  if (!a.name) {                                                                               \
    lib->reason = "libcusparseLt.so.0 has no entry point cusparseLt" #name                    \
                  " (cuSPARSELt older than the 0.8 this build was written for?)";               \
    return lib;                                                                                \
  }
  ESPLAG_CUSPARSELT_ENTRY_POINTS(ESPLAG_RESOLVE)
#undef ESPLAG_RESOLVE
  int dev = 0;
  const cudaError_t ce = cudaGetDevice(&dev);
  if (ce != cudaSuccess) {
    lib->reason = std::string("no CUDA device (") + cudaGetErrorString(ce) + ")";
    cudaGetLastError();
    return lib;
  }
  const cusparseStatus_t st = a.Init(&lib->handle);
  if (st != CUSPARSE_STATUS_SUCCESS) {
    lib->reason = std::string("cusparseLtInit failed: ") + a.GetErrorName(st) + " (" + a.GetErrorString(st) +
                  "); cuSPARSELt needs a GPU of compute capability 8.0 or newer";
    return lib;
  }
  lib->device = dev;
  int v = 0;
  if (a.GetVersion(&lib->handle, &v) == CUSPARSE_STATUS_SUCCESS) lib->version = v;
  lib->ok = true;
  return lib;
}

}  // namespace

CusparseltLibrary& cusparselt_library() {
  static CusparseltLibrary* lib = load_library();
  return *lib;
}

void throw_cusparselt_error(cusparseStatus_t st, const char* call, const std::string& context, const char* file,
                            int line) {
  const CusparseltApi& a = cusparselt_library().api;
  fail("cuSPARSELt error ", a.GetErrorName ? a.GetErrorName(st) : "?", " (",
       a.GetErrorString ? a.GetErrorString(st) : "?", ") in ", call, context.empty() ? "" : " for ", context, " at ",
       file, ":", line);
}

CusparseltLibrary& usable_cusparselt_library(const std::string& what) {
  CusparseltLibrary& lib = cusparselt_library();
  ESPLAG_CHECK(lib.ok, what, ": cuSPARSELt is not available: ", lib.reason);
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  ESPLAG_CHECK(dev == lib.device, what, ": the cuSPARSELt handle belongs to device ", lib.device,
               " but the current device is ", dev);
  return lib;
}

bool cusparselt_available() { return cusparselt_library().ok; }
std::string cusparselt_unavailable_reason() {
  return cusparselt_library().ok ? std::string() : cusparselt_library().reason;
}
int cusparselt_version() { return cusparselt_library().ok ? cusparselt_library().version : 0; }

#else  // !ESPLAG_HAVE_CUSPARSELT

// Built without cusparseLt.h: the library is never loaded; callers see
// cusparselt_available() == false and run dense.

bool cusparselt_available() { return false; }
std::string cusparselt_unavailable_reason() {
  return "this build has no cusparseLt.h (run scripts/fetch-vendor-headers.sh and reconfigure)";
}
int cusparselt_version() { return 0; }

#endif  // ESPLAG_HAVE_CUSPARSELT

}  // namespace esplag::gpu
