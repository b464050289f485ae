#include "zero/core/dist_env.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "zero/core/error.h"

namespace zero {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

int env_int(const char* name, int fallback, int min_value, std::vector<std::string>& problems) {
  const char* v = env(name);
  if (v == nullptr) return fallback;
  try {
    size_t used = 0;
    const long x = std::stol(v, &used);
    if (used == std::string(v).size() && x >= min_value) return static_cast<int>(x);
  } catch (const std::exception&) {
  }
  problems.push_back("environment variable " + std::string(name) + ": expected an integer >= " +
                     std::to_string(min_value) + "; got \"" + v + "\"");
  return fallback;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // "prefix[03-05,07],other" -> prefix + first number of the range.
  const size_t comma = nodelist.find(',');
  const size_t bracket = nodelist.find('[');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket))
    return nodelist.substr(0, comma);
  const size_t end = nodelist.find_first_of("-,]", bracket + 1);
  return nodelist.substr(0, bracket) + nodelist.substr(bracket + 1, end - bracket - 1);
}

DistEnv DistEnv::from_environment() {
  DistEnv d;
  std::vector<std::string> problems;
  if (env("RANK") || env("WORLD_SIZE")) {
    d.launcher = "torchrun";
    d.rank = env_int("RANK", 0, 0, problems);
    d.world_size = env_int("WORLD_SIZE", 1, 1, problems);
    d.local_rank = env_int("LOCAL_RANK", d.rank, 0, problems);
    d.local_world_size = env_int("LOCAL_WORLD_SIZE", d.world_size, 1, problems);
    if (const char* a = env("MASTER_ADDR")) d.master_addr = a;
    if (const char* s = env("TORCHELASTIC_USE_AGENT_STORE")) d.agent_store = std::string(s) == "True";
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    d.launcher = "slurm";
    d.rank = env_int("SLURM_PROCID", 0, 0, problems);
    d.world_size = env_int("SLURM_NTASKS", 1, 1, problems);
    d.local_rank = env_int("SLURM_LOCALID", 0, 0, problems);
    d.local_world_size = env_int("SLURM_NTASKS_PER_NODE", 1, 1, problems);
    if (const char* a = env("MASTER_ADDR")) d.master_addr = a;
    else if (const char* n = env("SLURM_NODELIST")) d.master_addr = first_slurm_host(n);
    else if (const char* n2 = env("SLURM_JOB_NODELIST")) d.master_addr = first_slurm_host(n2);
  } else if (env("OMPI_COMM_WORLD_RANK")) {
    d.launcher = "openmpi";
    d.rank = env_int("OMPI_COMM_WORLD_RANK", 0, 0, problems);
    d.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, 1, problems);
    d.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0, 0, problems);
    d.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1, problems);
    if (const char* a = env("MASTER_ADDR")) d.master_addr = a;
  }
  // The node: the launcher's index of it where it gives one, else the
  // ranks of a node counted off in order.
  d.node = d.rank / std::max(1, d.local_world_size);
  if (d.launcher == "torchrun") d.node = env_int("GROUP_RANK", d.node, 0, problems);
  if (d.launcher == "slurm") d.node = env_int("SLURM_NODEID", d.node, 0, problems);
  d.node = env_int("ZERO_NODE_ID", d.node, 0, problems);
  d.master_port = env_int("MASTER_PORT", 29500, 1, problems);
  if (d.master_port > 65535) problems.push_back("environment variable MASTER_PORT: expected a port number <= 65535; got " + std::to_string(d.master_port));
  d.timeout = std::chrono::milliseconds(1000LL * env_int("ZERO_COMM_TIMEOUT_S", 300, 1, problems));
  if (const char* b = env("ZERO_DIST_BACKEND")) {
    d.backend = b;
    if (d.backend != "auto" && d.backend != "nccl" && d.backend != "gloo")
      problems.push_back("environment variable ZERO_DIST_BACKEND: expected one of auto, nccl, gloo; got \"" +
                         d.backend + "\"");
  }
  if (d.rank >= d.world_size) {
    problems.push_back("rank " + std::to_string(d.rank) + " from the " + d.launcher +
                       " environment is not below the world size " + std::to_string(d.world_size));
  }
  if (!problems.empty()) throw ConfigError(problems);
  return d;
}

}  // namespace zero
