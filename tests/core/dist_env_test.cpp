#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "zero/core/dist_env.h"
#include "zero/core/error.h"

namespace {

// Sets environment variables for one test and restores a clean slate after.
class EnvGuard {
 public:
  ~EnvGuard() {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                          "SLURM_NTASKS_PER_NODE", "SLURM_NODELIST", "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                          "OMPI_COMM_WORLD_LOCAL_SIZE", "ZERO_COMM_TIMEOUT_S", "GROUP_RANK", "SLURM_NODEID",
                          "ZERO_NODE_ID"})
      unsetenv(v);
  }
  void set(const char* k, const char* v) { setenv(k, v, 1); }
};

TEST(DistEnv, NothingSetIsOneProcess) {
  EnvGuard g;
  auto d = zero::DistEnv::from_environment();
  EXPECT_EQ(d.world_size, 1);
  EXPECT_FALSE(d.distributed());
  EXPECT_EQ(d.launcher, "none");
}

TEST(DistEnv, Torchrun) {
  EnvGuard g;
  g.set("RANK", "3");
  g.set("WORLD_SIZE", "8");
  g.set("LOCAL_RANK", "1");
  g.set("LOCAL_WORLD_SIZE", "2");
  g.set("MASTER_ADDR", "10.0.0.5");
  g.set("MASTER_PORT", "1234");
  auto d = zero::DistEnv::from_environment();
  EXPECT_EQ(d.launcher, "torchrun");
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 2);
  EXPECT_EQ(d.master_addr, "10.0.0.5");
  EXPECT_EQ(d.master_port, 1234);
}

TEST(DistEnv, SlurmTakesTheFirstNodeAsMaster) {
  EnvGuard g;
  g.set("SLURM_PROCID", "5");
  g.set("SLURM_NTASKS", "16");
  g.set("SLURM_LOCALID", "1");
  g.set("SLURM_NTASKS_PER_NODE", "4");
  g.set("SLURM_NODELIST", "gpu[07-10,12],login1");
  auto d = zero::DistEnv::from_environment();
  EXPECT_EQ(d.launcher, "slurm");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 16);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.master_addr, "gpu07");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, OpenMpi) {
  EnvGuard g;
  g.set("OMPI_COMM_WORLD_RANK", "1");
  g.set("OMPI_COMM_WORLD_SIZE", "2");
  g.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  auto d = zero::DistEnv::from_environment();
  EXPECT_EQ(d.launcher, "openmpi");
  EXPECT_EQ(d.rank, 1);
  EXPECT_EQ(d.world_size, 2);
  EXPECT_EQ(d.master_addr, "127.0.0.1");
}

// The node: the launcher's index (torchrun's GROUP_RANK, Slurm's
// SLURM_NODEID), else the node-sized runs of ranks in order; ZERO_NODE_ID
// over either (nodes on one machine).
TEST(DistEnv, TheNodeFromTheLauncherOrTheRanksOfANodeOrZeroNodeId) {
  {
    EnvGuard g;
    g.set("RANK", "5");
    g.set("WORLD_SIZE", "8");
    g.set("LOCAL_WORLD_SIZE", "2");
    EXPECT_EQ(zero::DistEnv::from_environment().node, 2);
    g.set("GROUP_RANK", "3");
    EXPECT_EQ(zero::DistEnv::from_environment().node, 3);
    g.set("ZERO_NODE_ID", "1");
    EXPECT_EQ(zero::DistEnv::from_environment().node, 1);
  }
  {
    EnvGuard g;
    g.set("SLURM_PROCID", "5");
    g.set("SLURM_NTASKS", "16");
    g.set("SLURM_NTASKS_PER_NODE", "4");
    g.set("SLURM_NODEID", "7");
    EXPECT_EQ(zero::DistEnv::from_environment().node, 7);
  }
  {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_RANK", "3");
    g.set("OMPI_COMM_WORLD_SIZE", "4");
    g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
    EXPECT_EQ(zero::DistEnv::from_environment().node, 1);
  }
  {
    EnvGuard g;
    EXPECT_EQ(zero::DistEnv::from_environment().node, 0);
    g.set("ZERO_NODE_ID", "x");
    try {
      zero::DistEnv::from_environment();
      ADD_FAILURE() << "a malformed ZERO_NODE_ID was taken";
    } catch (const zero::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("ZERO_NODE_ID"), std::string::npos) << e.what();
    }
  }
}

TEST(DistEnv, MalformedValuesNameTheVariable) {
  EnvGuard g;
  g.set("RANK", "abc");
  g.set("WORLD_SIZE", "2");
  try {
    zero::DistEnv::from_environment();
    FAIL();
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("RANK: expected an integer >= 0; got \"abc\""), std::string::npos)
        << e.what();
  }
  g.set("RANK", "2");
  try {
    zero::DistEnv::from_environment();
    FAIL();
  } catch (const zero::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("not below the world size 2"), std::string::npos) << e.what();
  }
}

TEST(DistEnv, FirstSlurmHost) {
  EXPECT_EQ(zero::first_slurm_host("node1"), "node1");
  EXPECT_EQ(zero::first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(zero::first_slurm_host("n[003-005]"), "n003");
  EXPECT_EQ(zero::first_slurm_host("n[7,9]"), "n7");
}

}  // namespace
