#include "core/parallel.h"

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace esplag {

namespace {

thread_local bool t_inside_worker = false;

class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int n) {
    std::lock_guard lock(run_mutex_);  // never while a parallel region is running
    stop();
    done_ = false;
    // New workers wait for the next run; they must not replay the last one (its fn_ is gone).
    const uint64_t current = generation_;
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, i, current] { loop(i, current); });
  }

  void run(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock lock(run_mutex_);  // one parallel region at a time
    const int parts = static_cast<int>(std::min<int64_t>(size(), n));
    {
      std::lock_guard g(m_);
      fn_ = &fn;
      n_ = n;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    cv_.notify_all();
    t_inside_worker = true;  // nested parallel_for calls from fn run inline
    chunk(0);
    t_inside_worker = false;
    std::unique_lock g(m_);
    done_cv_.wait(g, [&] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void chunk(int i) {
    if (i >= parts_) return;
    const int64_t begin = n_ * i / parts_, end = n_ * (i + 1) / parts_;
    if (begin < end) (*fn_)(begin, end);
  }

  void loop(int index, uint64_t seen) {
    t_inside_worker = true;
    for (;;) {
      {
        std::unique_lock g(m_);
        cv_.wait(g, [&] { return done_ || generation_ != seen; });
        if (done_) return;
        seen = generation_;
        if (index >= parts_) continue;
      }
      chunk(index);
      std::lock_guard g(m_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  void stop() {
    {
      std::lock_guard g(m_);
      done_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex run_mutex_, m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  int parts_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool done_ = false;
};

int default_threads() {
  if (const char* env = std::getenv("ESPLAG_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }
void set_num_threads(int n) { pool().resize(std::max(1, n)); }

void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain) {
  if (n <= 0) return;
  if (t_inside_worker || n < 2 * std::max<int64_t>(grain, 1) || pool().size() == 1) {
    fn(0, n);
    return;
  }
  pool().run(n, fn);
}

void parallel_tasks(int64_t n, const std::function<void(int64_t)>& task) {
  if (n <= 0) return;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  parallel_for(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      try {
        task(i);
      } catch (...) {
        errors[static_cast<size_t>(i)] = std::current_exception();
      }
    }
  });
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace esplag
