// A small persistent thread pool for the CPU reference ops. parallel_for splits [0, n)
// into contiguous chunks, one per worker, so which thread computes which index depends
// only on n and the thread count, and every output element is computed by exactly one
// thread in a fixed order: results are bit-identical run to run.
#pragma once
#include <cstdint>
#include <functional>

namespace esplag {

// Number of worker threads (default: hardware concurrency; ESPLAG_THREADS overrides).
int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) on disjoint chunks covering [0, n). Runs inline when n is small
// (below `grain`) or when called from inside a worker.
void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

// Runs task(i) for every i in [0, n) over the pool (parallel_for's chunks, each in
// order), for a few large independent jobs whose code may throw: an exception never
// leaves a worker; after all tasks ran, the one of the lowest i that threw is rethrown.
void parallel_tasks(int64_t n, const std::function<void(int64_t)>& task);

}  // namespace esplag
