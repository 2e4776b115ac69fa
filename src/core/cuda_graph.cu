#include "core/cuda_graph.h"

#include <cstdio>
#include <exception>
#include <string>

#include "core/cuda_check.h"

namespace esplag {

void ReplayedGraph::reset() {
  if (exec_) cudaGraphExecDestroy(exec_);
  exec_ = nullptr;
  seen_ = failed_ = false;
}

void ReplayedGraph::run(cudaStream_t s, int64_t& launches, const std::function<void()>& body, const char* who) {
  if (failed_) return body();
  if (!exec_) {
    if (!seen_) {
      seen_ = true;
      return body();
    }
    auto give_up = [&](const std::string& why) {
      failed_ = true;
      (void)cudaGetLastError();  // capture errors are not sticky; leave none behind
      std::fprintf(stderr, "esplag: warning: %s: CUDA graph capture failed (%s); running eagerly\n", who,
                   why.c_str());
      body();
    };
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (const std::exception& e) {
      if (cudaStreamEndCapture(s, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      return give_up(e.what());
    }
    const cudaError_t end = cudaStreamEndCapture(s, &graph);
    if (end != cudaSuccess || !graph) return give_up(cudaGetErrorString(end));
    const cudaError_t inst = cudaGraphInstantiateWithFlags(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) {
      exec_ = nullptr;
      return give_up(cudaGetErrorString(inst));
    }
  }
  CUDA_CHECK(cudaGraphLaunch(exec_, s));
  ++launches;
}

}  // namespace esplag
