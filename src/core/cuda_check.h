// Check macros for the CUDA runtime and cuBLASLt. A failing call throws esplag::Error
// naming the call as written, the source file and line, and the library's own name and
// description of the error, so a failure far from its cause still says where it happened.
//
// Only for the CUDA build (ESPLAG_CUDA=ON defines ESPLAG_HAVE_CUDA).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/cuda_check.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace esplag::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  fail("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", call, " at ", file, ":",
       line);
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  fail("cuBLAS error ", cublasLtGetStatusName(status), " (", cublasLtGetStatusString(status), ") in ", call,
       " at ", file, ":", line);
}

// A launch error is reported by the next runtime call; an asynchronous fault from an
// earlier kernel can surface here too, which the message says so the reader looks further back.
inline void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    fail("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") launching ", kernel, " at ", file,
         ":", line, " (may also be an asynchronous error from an earlier kernel)");
}

}  // namespace esplag::detail

#define CUDA_CHECK(call)                                                                 \
  do {                                                                                   \
    const cudaError_t esplag_cuda_err_ = (call);                                         \
    if (esplag_cuda_err_ != cudaSuccess)                                                 \
      ::esplag::detail::throw_cuda_error(esplag_cuda_err_, #call, __FILE__, __LINE__);   \
  } while (0)

#define CUBLAS_CHECK(call)                                                                   \
  do {                                                                                       \
    const cublasStatus_t esplag_cublas_st_ = (call);                                         \
    if (esplag_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                          \
      ::esplag::detail::throw_cublas_error(esplag_cublas_st_, #call, __FILE__, __LINE__);    \
  } while (0)

// After every kernel launch: CUDA_CHECK_LAUNCH("layernorm_forward").
#define CUDA_CHECK_LAUNCH(kernel_name) ::esplag::detail::check_launch(kernel_name, __FILE__, __LINE__)
