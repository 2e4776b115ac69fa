// The cuSPARSELt library opened at run time (internal to sparse/cuda/cusparselt*.cu): the
// dlopen of libcusparseLt, its entry points resolved with dlsym, the process's handle, and
// LT_CHECK for every call. The public side (cusparselt_available() and friends) is in
// sparse/cuda/cusparselt.h. Only in builds with cusparseLt.h (ESPLAG_HAVE_CUSPARSELT).
#pragma once

#ifndef ESPLAG_HAVE_CUSPARSELT
#error "sparse/cuda/cusparselt_loader.h needs cusparseLt.h (run scripts/fetch-vendor-headers.sh and reconfigure)"
#endif

#include <cusparseLt.h>

#include <string>

namespace esplag::gpu {

// Every entry point used, resolved with dlsym; the types come from the header.
#define ESPLAG_CUSPARSELT_ENTRY_POINTS(X)                                                   \
  X(Init) X(Destroy) X(GetVersion) X(GetErrorName) X(GetErrorString) X(DenseDescriptorInit) \
  X(StructuredDescriptorInit) X(MatDescriptorDestroy) X(MatmulDescriptorInit)               \
  X(MatmulDescSetAttribute) X(MatmulAlgSelectionInit) X(MatmulAlgSelectionDestroy)          \
  X(MatmulAlgSetAttribute) X(MatmulAlgGetAttribute) X(MatmulGetWorkspace) X(MatmulPlanInit)  \
  X(MatmulPlanDestroy) X(Matmul) X(MatmulSearch) X(SpMMAPrune2) X(SpMMAPruneCheck2)         \
  X(SpMMACompressedSize2) X(SpMMACompress2)

// The entry points, each named as cuSPARSELt's function without its prefix (api.Matmul).
struct CusparseltApi {
#define ESPLAG_DECLARE(name) decltype(&cusparseLt##name) name = nullptr;
  ESPLAG_CUSPARSELT_ENTRY_POINTS(ESPLAG_DECLARE)
#undef ESPLAG_DECLARE
};

struct CusparseltLibrary {
  CusparseltApi api;
  cusparseLtHandle_t handle{};
  int device = -1;  // the device the handle was created on
  int version = 0;  // cusparselt_version()
  bool ok = false;
  std::string reason;  // why not ok
};

// The process's library, loaded on first use (thread-safe) and never unloaded: the handle
// must outlive every plan.
CusparseltLibrary& cusparselt_library();
// The library for `what` (the problem, for messages); throws esplag::Error when it is not
// available or its handle belongs to another device than the current one.
CusparseltLibrary& usable_cusparselt_library(const std::string& what);

// Throws Error with the call as written, the library's name and description of the status,
// the context (the problem), file and line.
[[noreturn]] void throw_cusparselt_error(cusparseStatus_t st, const char* call, const std::string& context,
                                         const char* file, int line);

// Every cuSPARSELt call goes through this.
#define LT_CHECK(call, context)                                                                     \
  do {                                                                                              \
    const cusparseStatus_t esplag_lt_st_ = (call);                                                  \
    if (esplag_lt_st_ != CUSPARSE_STATUS_SUCCESS)                                                   \
      ::esplag::gpu::throw_cusparselt_error(esplag_lt_st_, #call, (context), __FILE__, __LINE__);   \
  } while (0)

}  // namespace esplag::gpu
