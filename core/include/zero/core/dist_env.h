// Where this process sits in a distributed job, read from the standard
// environment variables of the launchers users already have:
//   torchrun / zero launch: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   Slurm (srun):           SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE,
//                           SLURM_NODELIST (first host is the master), MASTER_PORT or 29500
//   Open MPI (mpirun):      OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK,
//                           OMPI_COMM_WORLD_LOCAL_SIZE, MASTER_ADDR (default 127.0.0.1), MASTER_PORT
// None set: one process. The node this rank runs on: ZERO_NODE_ID when set
// (several "nodes" on one machine, as tests on loopback make), else
// torchrun's GROUP_RANK, Slurm's SLURM_NODEID, else rank / LOCAL_WORLD_SIZE
// (Open MPI fills nodes in order by default). ZERO_COMM_TIMEOUT_S and
// ZERO_DIST_BACKEND (below) apply to every launcher. This and config/ are the only places that read the
// environment.
#pragma once

#include <chrono>
#include <string>

namespace zero {

/// This process's place in a distributed job, as the environment variables
/// of torchrun (or zero launch), Slurm or Open MPI give it. A plain value:
/// copy it freely; from_environment() makes one.
struct DistEnv {
  /// This process's rank in the job, 0-based: RANK, SLURM_PROCID or
  /// OMPI_COMM_WORLD_RANK; below world_size.
  int rank = 0;
  /// Processes in the job: WORLD_SIZE, SLURM_NTASKS or OMPI_COMM_WORLD_SIZE.
  int world_size = 1;
  /// This process's rank on its node, 0-based: LOCAL_RANK (default: rank),
  /// SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK.
  int local_rank = 0;
  /// Processes on this node: LOCAL_WORLD_SIZE (default: world_size),
  /// SLURM_NTASKS_PER_NODE or OMPI_COMM_WORLD_LOCAL_SIZE.
  int local_world_size = 1;
  /// This rank's node, 0-based (above): collectives count the bytes they
  /// send within it and to other nodes (NOTE [bytes across nodes] in comm.cpp).
  int node = 0;
  /// Host of the rendezvous store: MASTER_ADDR, else (Slurm) the first host
  /// of SLURM_NODELIST or SLURM_JOB_NODELIST, else "127.0.0.1".
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  ///< TCP port of the rendezvous store: MASTER_PORT, default 29500.
  std::string launcher = "none";  ///< the launcher whose variables were read: "torchrun", "slurm", "openmpi" or "none"
  /// torchrun's agent already serves the store (TORCHELASTIC_USE_AGENT_STORE):
  /// every rank, rank 0 included, joins it as a client.
  bool agent_store = false;
  /// Collective and rendezvous timeout: ZERO_COMM_TIMEOUT_S, default 300 s.
  std::chrono::milliseconds timeout{300000};
  /// The c10d backend: ZERO_DIST_BACKEND, "auto" (default: NCCL for a CUDA
  /// device, Gloo for the CPU), "nccl" or "gloo" (Gloo with CUDA tensors: it
  /// stages them through host memory; several ranks can share one GPU).
  std::string backend = "auto";

  /// Reads the variables above. Throws zero::ConfigError naming the variable
  /// when one is malformed (RANK=abc, RANK >= WORLD_SIZE, ...).
  static DistEnv from_environment();
  /// Whether the job has more than one process (world_size above 1).
  bool distributed() const { return world_size > 1; }
};

/// The first host of a Slurm node list ("node[03-05,07],gpu1" -> "node03").
std::string first_slurm_host(const std::string& nodelist);

}  // namespace zero
