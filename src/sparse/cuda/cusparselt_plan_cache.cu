// The process-wide cache of cuSPARSELt 2:4 GEMM plans: one SparseGemm24 per problem key,
// built on first use and kept until cleared. See sparse/cuda/cusparselt.h.
#include "sparse/cuda/cusparselt.h"

#include <memory>
#include <mutex>
#include <unordered_map>

namespace esplag::gpu {

namespace {

struct PlanCache {
  std::mutex mu;
  std::unordered_map<std::string, std::unique_ptr<SparseGemm24>> plans;
};

PlanCache& plan_cache() {
  static PlanCache* c = new PlanCache();  // never destroyed: plans outlive static destructors
  return *c;
}

}  // namespace

SparseGemm24& SparseGemm24::get(const SparseGemm24Problem& p) {
  PlanCache& c = plan_cache();
  const std::string k = p.key();
  std::lock_guard<std::mutex> lock(c.mu);
  auto it = c.plans.find(k);
  if (it != c.plans.end()) return *it->second;
  auto obj = std::make_unique<SparseGemm24>(p, Algorithm::tuned);
  SparseGemm24& ref = *obj;
  c.plans.emplace(k, std::move(obj));
  return ref;
}

void clear_sparse_gemm24_cache() {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.plans.clear();
}

size_t sparse_gemm24_cached_plans() {
  PlanCache& c = plan_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  return c.plans.size();
}

}  // namespace esplag::gpu
