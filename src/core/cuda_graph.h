// Work on a stream replayed as a CUDA graph: run eagerly the first time (libraries tune and
// load their kernels outside any capture), captured the second, replayed from then on. A
// capture that a library refuses leaves the graph eager, with one warning on stderr.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "core/cuda_graph.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>

namespace esplag {

class ReplayedGraph {
 public:
  ReplayedGraph() = default;
  ~ReplayedGraph() { reset(); }
  ReplayedGraph(const ReplayedGraph&) = delete;
  ReplayedGraph& operator=(const ReplayedGraph&) = delete;

  // Runs `body` (which queues work on s) as this graph; counts replays in `launches`. `who`
  // names the owner in the warning of a refused capture.
  void run(cudaStream_t s, int64_t& launches, const std::function<void()>& body, const char* who);
  // Forgets the capture (the buffers it baked in changed): the next run is eager again.
  void reset();

 private:
  bool seen_ = false;    // ran once eagerly
  bool failed_ = false;  // capture refused: stays eager
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace esplag
