// The launch environment: torchrun, mpirun (Open MPI) and Slurm's srun, their precedence,
// and one error naming the variable for every malformed or contradictory value.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "core/error.h"
#include "dist/world.h"

namespace {

using esplag::World;
using Env = std::map<std::string, std::string>;

World world(const Env& env) {
  return esplag::world_from_env([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The Error of world(env), which must mention every one of `needles`.
void expect_error(const Env& env, const std::vector<std::string>& needles) {
  try {
    world(env);
    FAIL() << "no error; expected one mentioning " << needles.front();
  } catch (const esplag::Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

const Env kTorchrun = {{"RANK", "3"},        {"WORLD_SIZE", "8"},    {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29511"}};
const Env kMpirun = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}};
const Env kSrun = {{"SLURM_STEP_ID", "0"},       {"SLURM_STEP_NUM_TASKS", "4"},         {"SLURM_NTASKS", "16"},
                   {"SLURM_PROCID", "3"},        {"SLURM_LOCALID", "1"},                {"SLURM_NODEID", "1"},
                   {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                   {"SLURM_JOB_NODELIST", "gpu[01-09]"},  {"SLURM_JOB_ID", "123456"}};

Env with(Env env, const Env& changes) {
  for (const auto& [k, v] : changes) env[k] = v;
  return env;
}

Env without(Env env, const std::string& name) {
  env.erase(name);
  return env;
}

TEST(DistWorld, NoLauncherIsOneProcess) {
  const World w = world({{"SLURM_JOB_ID", "5"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_EQ(w.size, 1);
  EXPECT_EQ(w.rank, 0);
  EXPECT_FALSE(w.distributed());
  EXPECT_EQ(w.launcher, "");  // a batch script without srun: no step id
  EXPECT_EQ(w.describe(), "single process");
}

TEST(DistWorld, Torchrun) {
  const World w = world(kTorchrun);
  EXPECT_EQ(w.launcher, "torchrun");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.master_addr, "10.0.0.1");
  EXPECT_EQ(w.master_port, 29511);
  EXPECT_TRUE(w.distributed());
  EXPECT_EQ(w.describe(), "rank 3 of 8 (local 1 of 2), torchrun, rendezvous 10.0.0.1:29511");
  EXPECT_EQ(world(with(kTorchrun, {{"ESPLAG_LAUNCHER", "esplag"}})).launcher, "esplag");
}

TEST(DistWorld, TorchrunDefaultsOnOneNode) {
  const World w = world({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.master_addr, "127.0.0.1");
  EXPECT_EQ(w.master_port, 29500);
}

TEST(DistWorld, TorchrunErrors) {
  expect_error(without(kTorchrun, "WORLD_SIZE"), {"RANK is set but WORLD_SIZE is not"});
  expect_error(without(kTorchrun, "RANK"), {"WORLD_SIZE is set but RANK is not"});
  expect_error(with(kTorchrun, {{"RANK", "two"}}), {"RANK='two'", "not an integer"});
  expect_error(with(kTorchrun, {{"RANK", "3x"}}), {"RANK='3x'"});
  expect_error(with(kTorchrun, {{"RANK", "8"}}), {"RANK='8'", "WORLD_SIZE=8"});
  expect_error(with(kTorchrun, {{"RANK", "-1"}}), {"RANK='-1'"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "0"}}), {"WORLD_SIZE='0'", "at least 1"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "2"}}), {"LOCAL_RANK='2'", "LOCAL_WORLD_SIZE=2"});
  expect_error(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "9"}}), {"LOCAL_WORLD_SIZE='9'"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "70000"}}), {"MASTER_PORT='70000'", "TCP port"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "0"}}), {"MASTER_PORT='0'"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", ""}}), {"MASTER_PORT=''", "not an integer"});
  expect_error(with(kTorchrun, {{"MASTER_ADDR", ""}}), {"MASTER_ADDR", "empty"});
  expect_error(without(kTorchrun, "MASTER_ADDR"), {"MASTER_ADDR is not set", "several nodes"});
}

TEST(DistWorld, Mpirun) {
  const World w = world(kMpirun);
  EXPECT_EQ(w.launcher, "mpirun");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.local_rank, 2);
  EXPECT_EQ(w.local_size, 4);
  EXPECT_EQ(w.master_addr, "127.0.0.1");  // one node: the loopback address
  EXPECT_EQ(w.master_port, 29500);
  const World set = world(with(kMpirun, {{"MASTER_ADDR", "node1"}, {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(set.master_addr, "node1");
  EXPECT_EQ(set.master_port, 1234);
}

TEST(DistWorld, MpirunErrors) {
  expect_error(with(kMpirun, {{"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}),
               {"MASTER_ADDR is not set", "several nodes", "mpirun -x MASTER_ADDR="});
  expect_error(without(kMpirun, "OMPI_COMM_WORLD_LOCAL_RANK"), {"OMPI_COMM_WORLD_LOCAL_RANK is not set"});
  expect_error(with(kMpirun, {{"OMPI_COMM_WORLD_RANK", "4"}}), {"OMPI_COMM_WORLD_RANK='4'"});
  expect_error(with(kMpirun, {{"OMPI_COMM_WORLD_SIZE", "x"}}), {"OMPI_COMM_WORLD_SIZE='x'"});
}

TEST(DistWorld, Srun) {
  const World w = world(kSrun);
  EXPECT_EQ(w.launcher, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);  // the step's tasks, not the job's
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 2);
  EXPECT_EQ(w.master_addr, "gpu07");  // the step's first node
  EXPECT_EQ(w.master_port, 20000 + 123456 % 20000);
  EXPECT_EQ(world(with(kSrun, {{"SLURM_JOB_ID", "123457"}})).master_port, 20000 + 123457 % 20000);
  // The job's variables when the step's are missing; MASTER_ADDR/MASTER_PORT win when set.
  Env job = without(without(without(kSrun, "SLURM_STEP_NUM_TASKS"), "SLURM_STEP_NODELIST"), "SLURM_STEP_TASKS_PER_NODE");
  job = with(job, {{"SLURM_NTASKS_PER_NODE", "8"}, {"SLURM_PROCID", "9"}});
  const World j = world(job);
  EXPECT_EQ(j.size, 16);
  EXPECT_EQ(j.local_size, 8);
  EXPECT_EQ(j.master_addr, "gpu01");
  const World m = world(with(kSrun, {{"MASTER_ADDR", "10.1.1.1"}, {"MASTER_PORT", "4000"}}));
  EXPECT_EQ(m.master_addr, "10.1.1.1");
  EXPECT_EQ(m.master_port, 4000);
}

TEST(DistWorld, SrunTasksPerNodeList) {
  // Nodes 0 and 1 run 3 tasks each, node 2 runs 1.
  const Env env = with(kSrun, {{"SLURM_STEP_NUM_TASKS", "7"}, {"SLURM_STEP_TASKS_PER_NODE", "3(x2),1"},
                               {"SLURM_NODEID", "2"}, {"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(world(env).local_size, 1);
  EXPECT_EQ(world(with(env, {{"SLURM_NODEID", "1"}, {"SLURM_PROCID", "4"}})).local_size, 3);
}

TEST(DistWorld, SrunErrors) {
  expect_error(with(kSrun, {{"SLURM_PROCID", "4"}}), {"SLURM_PROCID='4'", "SLURM_STEP_NUM_TASKS=4"});
  expect_error(without(kSrun, "SLURM_PROCID"), {"SLURM_PROCID is not set"});
  expect_error(with(kSrun, {{"SLURM_STEP_TASKS_PER_NODE", "2(x"}}), {"SLURM_STEP_TASKS_PER_NODE='2(x'"});
  expect_error(with(kSrun, {{"SLURM_STEP_TASKS_PER_NODE", "2,"}}), {"SLURM_STEP_TASKS_PER_NODE='2,'"});
  expect_error(with(kSrun, {{"SLURM_NODEID", "5"}, {"SLURM_STEP_TASKS_PER_NODE", "2,2"}}), {"SLURM_NODEID='5'"});
  expect_error(with(kSrun, {{"SLURM_STEP_NODELIST", "gpu[07-"}}), {"SLURM_STEP_NODELIST", "gpu[07-"});
  expect_error(without(kSrun, "SLURM_JOB_ID"), {"SLURM_JOB_ID is not set"});
  expect_error(without(without(kSrun, "SLURM_STEP_NODELIST"), "SLURM_JOB_NODELIST"), {"SLURM_JOB_NODELIST", "MASTER_ADDR"});
}

TEST(DistWorld, Precedence) {
  Env all = kSrun;
  for (const auto& [k, v] : kMpirun) all[k] = v;
  EXPECT_EQ(world(all).launcher, "mpirun");  // mpirun inside a Slurm allocation
  for (const auto& [k, v] : kTorchrun) all[k] = v;
  EXPECT_EQ(world(all).launcher, "torchrun");  // srun torchrun ...
  EXPECT_EQ(world(all).rank, 3);
}

TEST(DistWorld, FirstSlurmHost) {
  EXPECT_EQ(esplag::first_slurm_host("gpu[07-09,12],cpu3"), "gpu07");
  EXPECT_EQ(esplag::first_slurm_host("a,b"), "a");
  EXPECT_EQ(esplag::first_slurm_host("n[1-2]"), "n1");
  EXPECT_EQ(esplag::first_slurm_host("node5"), "node5");
  EXPECT_EQ(esplag::first_slurm_host("n[3,1]"), "n3");
  EXPECT_EQ(esplag::first_slurm_host("rack[2-3]-n[010-020]"), "rack2-n010");
  for (const char* bad : {"", "n[1-2", "n]1", "n[]", "n[a-b]", "n[[1]]", ",a", "a b"})
    EXPECT_THROW(esplag::first_slurm_host(bad), esplag::Error) << bad;
}

}  // namespace
