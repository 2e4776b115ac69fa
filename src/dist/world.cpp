#include "dist/world.h"

#include <charconv>
#include <optional>
#include <vector>

#include "core/error.h"

namespace esplag {

namespace {

// The default rendezvous port of torchrun, used when MASTER_PORT is unset.
constexpr int kDefaultPort = 29500;

// Reads the launcher's variables, each parsed strictly; every error names the variable and its value.
class Env {
 public:
  explicit Env(const GetEnv& getenv) : getenv_(getenv) {}

  bool has(const char* name) const { return getenv_(name) != nullptr; }
  std::optional<std::string> text(const char* name) const {
    const char* v = getenv_(name);
    return v ? std::optional<std::string>(v) : std::nullopt;
  }
  std::optional<int> integer(const char* name) const {
    const char* v = getenv_(name);
    if (!v) return std::nullopt;
    const std::string s(v);
    int x = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
    ESPLAG_CHECK(!s.empty() && ec == std::errc() && end == s.data() + s.size(), name, "='", s,
                 "' is not an integer");
    return x;
  }
  int required(const char* name, const char* launcher) const {
    const auto x = integer(name);
    ESPLAG_CHECK(x.has_value(), name, " is not set, though the environment says this process was started by ",
                 launcher);
    return *x;
  }

 private:
  const GetEnv& getenv_;
};

// MASTER_PORT, or `fallback` when unset; a port in [1, 65535].
int master_port(const Env& env, int fallback) {
  const int port = env.integer("MASTER_PORT").value_or(fallback);
  ESPLAG_CHECK(port >= 1 && port <= 65535, "MASTER_PORT='", *env.text("MASTER_PORT"),
               "' is not a TCP port (1 to 65535)");
  return port;
}

// MASTER_ADDR; when unset, the loopback address if all ranks are on this node, else an Error saying how to set it.
std::string master_addr(const Env& env, const World& w, const std::string& how) {
  if (const auto addr = env.text("MASTER_ADDR")) {
    ESPLAG_CHECK(!addr->empty(), "MASTER_ADDR is set but empty");
    return *addr;
  }
  ESPLAG_CHECK(w.local_size == w.size, "MASTER_ADDR is not set and the ", w.size, " ranks of this ", w.launcher,
               " run are on several nodes (", w.local_size, " on this one); ", how);
  return "127.0.0.1";
}

// Checks the ranks and sizes read from `vars` (the names of rank, size, local rank, local size).
void check_ranks(const World& w, const std::vector<const char*>& vars) {
  ESPLAG_CHECK(w.size >= 1, vars[1], "='", w.size, "'", " must be at least 1");
  ESPLAG_CHECK(w.rank >= 0 && w.rank < w.size, vars[0], "='", w.rank, "'", " must be in [0, ", vars[1], "=",
               w.size, ")");
  ESPLAG_CHECK(w.local_size >= 1 && w.local_size <= w.size, vars[3], "='", w.local_size, "'", " must be in [1, ",
               vars[1], "=", w.size, "]");
  ESPLAG_CHECK(w.local_rank >= 0 && w.local_rank < w.local_size, vars[2], "='", w.local_rank, "'",
               " must be in [0, ", vars[3], "=", w.local_size, ")");
}

World torchrun_world(const Env& env) {
  ESPLAG_CHECK(env.has("RANK") && env.has("WORLD_SIZE"), env.has("RANK") ? "RANK" : "WORLD_SIZE",
               " is set but ", env.has("RANK") ? "WORLD_SIZE" : "RANK",
               " is not; a torchrun-style launch sets both (and LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
               "MASTER_PORT)");
  World w;
  w.launcher = env.text("ESPLAG_LAUNCHER").value_or("") == "esplag" ? "esplag" : "torchrun";
  w.rank = *env.integer("RANK");
  w.size = *env.integer("WORLD_SIZE");
  // Without the local variables (a hand-made launch), all ranks are taken to be on this node.
  w.local_rank = env.integer("LOCAL_RANK").value_or(w.rank);
  w.local_size = env.integer("LOCAL_WORLD_SIZE").value_or(w.size);
  check_ranks(w, {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"});
  w.master_addr = master_addr(env, w, "export MASTER_ADDR=<the address of rank 0's node> on every node");
  w.master_port = master_port(env, kDefaultPort);
  return w;
}

World mpirun_world(const Env& env) {
  World w;
  w.launcher = "mpirun";
  w.rank = env.required("OMPI_COMM_WORLD_RANK", "mpirun");
  w.size = env.required("OMPI_COMM_WORLD_SIZE", "mpirun");
  w.local_rank = env.required("OMPI_COMM_WORLD_LOCAL_RANK", "mpirun");
  w.local_size = env.required("OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun");
  check_ranks(w, {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE"});
  w.master_addr = master_addr(env, w,
                              "pass the address of rank 0's node to every rank: mpirun -x MASTER_ADDR=<address> "
                              "(and -x MASTER_PORT=<port> to change the default 29500)");
  w.master_port = master_port(env, kDefaultPort);
  return w;
}

// Slurm's tasks-per-node list, "2(x3),1" -> {2, 2, 2, 1}.
std::vector<int> tasks_per_node(const char* name, const std::string& list) {
  std::vector<int> counts;
  const auto bad = [&] { fail(name, "='", list, "' is not a Slurm tasks-per-node list such as '4(x2),1'"); };
  size_t i = 0;
  while (i < list.size()) {
    int count = 0, repeat = 1;
    auto [end, ec] = std::from_chars(list.data() + i, list.data() + list.size(), count);
    if (ec != std::errc() || count < 1) bad();
    i = end - list.data();
    if (list.compare(i, 2, "(x") == 0) {
      auto [end2, ec2] = std::from_chars(list.data() + i + 2, list.data() + list.size(), repeat);
      i = end2 - list.data();
      if (ec2 != std::errc() || repeat < 1 || i >= list.size() || list[i] != ')') bad();
      ++i;
    }
    counts.insert(counts.end(), repeat, count);
    if (i < list.size() && (list[i] != ',' || i + 1 == list.size())) bad();
    if (i < list.size()) ++i;
  }
  if (counts.empty()) bad();
  return counts;
}

World slurm_world(const Env& env) {
  World w;
  w.launcher = "slurm";
  const char* size_var = env.has("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  w.size = env.required(size_var, "srun");
  w.rank = env.required("SLURM_PROCID", "srun");
  w.local_rank = env.integer("SLURM_LOCALID").value_or(0);
  const char* local_var = env.has("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE" : "SLURM_NTASKS_PER_NODE";
  if (const auto list = env.text(local_var)) {
    const std::vector<int> counts = tasks_per_node(local_var, *list);
    const int node = env.integer("SLURM_NODEID").value_or(0);
    ESPLAG_CHECK(node >= 0 && (counts.size() == 1 || node < static_cast<int>(counts.size())), "SLURM_NODEID='",
                 node, "' has no entry in ", local_var, "='", *list, "'");
    w.local_size = counts.size() == 1 ? counts[0] : counts[node];
  } else {
    // Not given: all of the step's tasks on one node, or at least as many as this task's local id says.
    const bool one_node = env.integer("SLURM_STEP_NUM_NODES").value_or(env.integer("SLURM_NNODES").value_or(1)) == 1;
    w.local_size = one_node ? w.size : w.local_rank + 1;
  }
  check_ranks(w, {"SLURM_PROCID", size_var, "SLURM_LOCALID", local_var});
  if (env.has("MASTER_ADDR")) {
    w.master_addr = master_addr(env, w, "");
  } else {
    const char* list_var = env.has("SLURM_STEP_NODELIST") ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
    const auto list = env.text(list_var);
    ESPLAG_CHECK(list.has_value(), "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, so the node of rank 0 "
                 "is unknown; export MASTER_ADDR=<its address>");
    try {
      w.master_addr = first_slurm_host(*list);
    } catch (const Error& e) {
      fail(list_var, ": ", e.what());
    }
  }
  // Derived from the job id when not given, so that concurrent jobs on one node use different ports.
  const int job = env.has("MASTER_PORT") ? 0 : env.required("SLURM_JOB_ID", "srun");
  ESPLAG_CHECK(job >= 0, "SLURM_JOB_ID='", job, "' must not be negative");
  w.master_port = master_port(env, 20000 + job % 20000);
  return w;
}

// The first element of a bracket's content "07-09,12" -> "07".
std::string first_of_range(const std::string& content, const std::string& nodelist) {
  std::string first = content.substr(0, content.find(','));
  const std::string range_end = first.find('-') == std::string::npos ? "" : first.substr(first.find('-') + 1);
  first = first.substr(0, first.find('-'));
  const auto digits = [](const std::string& s) {
    return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
  };
  ESPLAG_CHECK(digits(first) && (range_end.empty() || digits(range_end)), "cannot read the Slurm node list '",
               nodelist, "' (expected a range such as host[01-04,07])");
  return first;
}

}  // namespace

std::string World::describe() const {
  if (!distributed() && launcher.empty()) return "single process";
  return "rank " + std::to_string(rank) + " of " + std::to_string(size) + " (local " + std::to_string(local_rank) +
         " of " + std::to_string(local_size) + "), " + (launcher.empty() ? "no launcher" : launcher) +
         ", rendezvous " + master_addr + ":" + std::to_string(master_port);
}

std::string first_slurm_host(const std::string& nodelist) {
  const auto bad = [&] { fail("cannot read the Slurm node list '", nodelist, "' (expected e.g. host[01-04,07],other)"); };
  // The first item ends at the first comma outside brackets.
  std::string host;
  int depth = 0;
  size_t open = 0;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    const char c = nodelist[i];
    if (c == '[') {
      if (depth++ != 0) bad();
      open = i;
    } else if (c == ']') {
      if (depth-- != 1) bad();
      host += first_of_range(nodelist.substr(open + 1, i - open - 1), nodelist);
    } else if (c == ',' && depth == 0) {
      break;
    } else if (depth == 0) {
      if (c == ' ') bad();
      host += c;
    }
  }
  if (depth != 0 || host.empty()) bad();
  return host;
}

World world_from_env(const GetEnv& getenv) {
  const Env env(getenv);
  if (env.has("RANK") || env.has("WORLD_SIZE")) return torchrun_world(env);
  if (env.has("OMPI_COMM_WORLD_RANK") || env.has("OMPI_COMM_WORLD_SIZE")) return mpirun_world(env);
  // A batch script (sbatch, salloc) has the job's variables but no step id; only srun starts a step.
  if (env.has("SLURM_STEP_ID") && (env.has("SLURM_STEP_NUM_TASKS") || env.has("SLURM_NTASKS"))) {
    return slurm_world(env);
  }
  return World{};
}

}  // namespace esplag
