// The CUDA paths (CTest label "gpu"): every test skips, saying why, where no
// CUDA device exists, and runs on the GPU machine (scripts/gpu/run.sh).
//   - ZeRO stages 0-3 at world size 1 on CUDA against a plain LibTorch CUDA
//     loop (fp32: parameter norm to 1e-5), bf16 and fp16 to the tolerances
//     documented below;
//   - CPU and NVMe offload against no offload; super_offload against the
//     plain offload step;
//   - activation checkpointing with dropout against no checkpointing (the
//     CUDA RNG state is replayed);
//   - save_16bit_model read by Python's torch;
//   - NCCL at world size 1; CopyStream and WaitClock on a CUDA stream;
//   - two ranks sharing the GPU through Gloo with CUDA tensors, against one;
//   - MiCS's shard and replica groups, 4 ranks as threads sharing the GPU;
//   - ZERO_TRACE and the run report on the card.
// The optimizers' device paths are in gpu_optim_test.cpp, the tools that
// start processes in gpu_tools_test.cpp; what they share in gpu_util.h.
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/Sleep.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/utils.h>

#include "data.h"
#include "model.h"
#include "zero/core/comm.h"
#include "zero/core/ledger_alloc.h"
#include "zero/core/memory_ledger.h"
#include "zero/core/streams.h"
#include "zero/partition/flat_parameters.h"
#include "zero/snapshots/checkpoint_format.h"
#include "zero/zero.h"
#include "gpu_util.h"
#include "mics_harness.h"
#include "ranks.h"

namespace {

using namespace zero_gpu_test;

// ---- stages against plain LibTorch ------------------------------------------

class GpuStages : public ::testing::TestWithParam<int> {};

// NOTE [standard library first], on the card's own build (its compiler
// differs from CI's): std::filesystem binds to libstdc++, not to LibTorch's
// copies, whose remove_all of a folder that holds anything jumps to address 0.
// Round 2 of 2026-11-27: /opt/gcc's "-lstdc++" was the static library, and
// six gpu tests crashed in remove_all although CI's build was right.
TEST(GpuBuild, StdFilesystemBindsToLibstdcxx) {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const auto fn = reinterpret_cast<const void*>(static_cast<RemoveAll>(&std::filesystem::remove_all));
  Dl_info info{};
  ASSERT_NE(::dladdr(fn, &info), 0);
  const std::string object = info.dli_fname != nullptr ? info.dli_fname : "(none)";
  EXPECT_EQ(object.find("libtorch"), std::string::npos) << "std::filesystem::remove_all is bound to " << object;
}

TEST_P(GpuStages, Fp32MatchesAPlainLibTorchCudaLoop) {
  REQUIRE_CUDA();
  const int stage = GetParam();
  const double ref = plain_loop();
  const auto got = engine_loop(R"("stage": )" + std::to_string(stage));
  EXPECT_LT(rel(got.l2, ref), 1e-5) << "stage " << stage << ": " << got.l2 << " vs " << ref;
}

// bf16 and fp16 keep fp32 master weights, so every stage follows the fp32
// loop loosely: the forward and backward run in 16 bits. Documented
// tolerance: the parameter norm within 2% of the fp32 loop after 10 steps,
// and stages 1-3 within 1e-5 of stage 0 at the same precision (the same
// arithmetic; only where the states live differs).
TEST_P(GpuStages, Bf16AndFp16FollowStage0AndTheFp32Loop) {
  REQUIRE_CUDA();
  const int stage = GetParam();
  const double fp32 = plain_loop();
  for (const std::string precision : {R"("bf16": {"enabled": true}, )",
                                      R"("fp16": {"enabled": true, "initial_scale_power": 12}, )"}) {
    const auto base = engine_loop(R"("stage": 0)", precision);
    const auto got = engine_loop(R"("stage": )" + std::to_string(stage), precision);
    EXPECT_LT(rel(got.l2, base.l2), 1e-5) << precision << " stage " << stage;
    EXPECT_LT(rel(got.l2, fp32), 2e-2) << precision << " stage " << stage;
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, GpuStages, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// ---- offload ------------------------------------------------------------------

// CPU offload runs Adam on the CPU (the fused kernel) instead of the GPU
// (ATen operations that mirror it, NOTE [device Adam]): the same operations
// rounded the same way, so equal bit for bit (2026-11-27, before the mirror:
// 1.55e-5 apart after 10 steps, ATen's fused add/addcmul/addcdiv rounding
// otherwise, amplified by bf16's compute copies). NVMe moves the same CPU
// arithmetic through swap files: equal bit for bit. offload_param only
// changes where shards live: equal bit for bit too.
TEST(GpuOffload, CpuAndNvmeOptimizerOffloadEqualNoOffload) {
  REQUIRE_CUDA();
  for (const int stage : {2, 3}) {
    const std::string s = R"("stage": )" + std::to_string(stage) + R"(, "sub_group_size": 20000)";
    const auto none = engine_loop(s, R"("bf16": {"enabled": true}, )");
    const auto cpu = engine_loop(s + R"(, "offload_optimizer": {"device": "cpu"})", R"("bf16": {"enabled": true}, )");
    // The same with the host states page-locked (NOTE [pinned host memory]).
    const auto pinned = engine_loop(s + R"(, "offload_optimizer": {"device": "cpu", "pin_memory": true})",
                                    R"("bf16": {"enabled": true}, )");
    const std::string dir = nvme_dir("opt" + std::to_string(stage));
    const auto nvme = engine_loop(s + R"(, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir +
                                      R"(", "pipeline_read": true, "pipeline_write": true})",
                                  R"("bf16": {"enabled": true}, )");
    EXPECT_EQ(cpu.l2, none.l2) << "stage " << stage;
    EXPECT_EQ(cpu.losses, none.losses) << "stage " << stage;
    EXPECT_EQ(nvme.l2, cpu.l2) << "stage " << stage;
    EXPECT_EQ(nvme.losses, cpu.losses) << "stage " << stage;
    EXPECT_EQ(pinned.l2, cpu.l2) << "stage " << stage;
    EXPECT_EQ(pinned.losses, cpu.losses) << "stage " << stage;
    // Master, moments (and the gradient partition) left the device: 2 of 18 bytes per parameter stay
    // (of 16 at stage 3, whose gradients are bf16: NOTE [16-bit gradients]).
    EXPECT_LT(cpu.device_state_bytes, none.device_state_bytes / 4) << "stage " << stage;
    EXPECT_TRUE(std::filesystem::is_empty(dir));
    zero::ckpt::remove_tree(dir);
  }
}

// NOTE [speculative step] on the card: the worker thread steps each group
// as backward completes it and sends the new values to the device's shards
// on its own copy stream while backward goes on. Equal to the plain offload
// step bit for bit, accepted (no clipping), redone (clipped) or undone (fp16
// overflows).
TEST(GpuOffload, SuperOffloadEqualsThePlainOffloadStep) {
  REQUIRE_CUDA();
  const std::string s = R"("stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 20000, )"
                        R"("offload_optimizer": {"device": "cpu", "pin_memory": true)";
  for (const double clip : {0.0, 1.0}) {
    for (const std::string precision : {R"("bf16": {"enabled": true}, )",
                                        R"("fp16": {"enabled": true, "initial_scale_power": 20, "hysteresis": 1}, )"}) {
      const auto plain = engine_loop(s + "}", precision, false, 0.0, clip);
      const auto super = engine_loop(s + R"(, "super_offload": true})", precision, false, 0.0, clip);
      EXPECT_EQ(super.l2, plain.l2) << precision << " clip " << clip;
      EXPECT_EQ(super.losses, plain.losses) << precision << " clip " << clip;
      EXPECT_EQ(super.speculation.planned, kSteps) << precision << " clip " << clip;
      if (clip == 0.0 && precision.find("bf16") != std::string::npos) EXPECT_EQ(super.speculation.validated, kSteps);
      std::printf("super_offload %sclip %g: validated %lld, redone %lld, undone %lld\n", precision.c_str(), clip,
                  static_cast<long long>(super.speculation.validated), static_cast<long long>(super.speculation.redone),
                  static_cast<long long>(super.speculation.undone));
    }
  }
}

// NOTE [partial offload] on the card: with offload_optimizer.ratio 0.5 the
// first layers' states stay on the GPU and step there (the device Adam
// mirrors the CPU kernel, NOTE [device Adam]) while the host steps the rest,
// with and without super_offload. Unclipped, the bits of ratio 1; clipped,
// the norm adds the device's and the host's sums in another order, so equal
// to rounding.
TEST(GpuOffload, PartialOffloadEqualsAllOnTheHost) {
  REQUIRE_CUDA();
  const std::string s = R"("stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 20000, )"
                        R"("offload_optimizer": {"device": "cpu", "pin_memory": true)";
  const std::string bf16 = R"("bf16": {"enabled": true}, )";
  for (const double clip : {0.0, 1.0}) {
    const auto all = engine_loop(s + "}", bf16, false, 0.0, clip);
    for (const char* more : {R"(, "ratio": 0.5})", R"(, "ratio": 0.5, "super_offload": true})"}) {
      const auto half = engine_loop(s + more, bf16, false, 0.0, clip);
      if (clip == 0.0) {
        EXPECT_EQ(half.l2, all.l2) << more;
        EXPECT_EQ(half.losses, all.losses) << more;
      } else {
        EXPECT_LT(rel(half.l2, all.l2), 1e-6) << more;
      }
      EXPECT_GT(half.device_states.optimizer_states, 0) << more;
      EXPECT_EQ(all.device_states.optimizer_states, 0);
      std::printf("ratio 0.5%s clip %g: device optimizer states %lld bytes, l2 %.17g vs %.17g\n",
                  std::string(more).find("super") != std::string::npos ? " super_offload" : "", clip,
                  static_cast<long long>(half.device_states.optimizer_states), half.l2, all.l2);
    }
  }
}

TEST(GpuOffload, Stage3ParametersOnTheHostAndOnNvmeEqualOnTheDevice) {
  REQUIRE_CUDA();
  const std::string s = R"("stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"})";
  const auto device = engine_loop(s, R"("bf16": {"enabled": true}, )");
  const auto host = engine_loop(s + R"(, "offload_param": {"device": "cpu"})", R"("bf16": {"enabled": true}, )");
  const std::string dir = nvme_dir("params");
  // One buffer for three layers: shards are read again and evicted while
  // copies to the device may still run (NOTE [stage-3 gather stream]).
  const auto nvme = engine_loop(s + R"(, "offload_param": {"device": "nvme", "nvme_path": ")" + dir +
                                    R"(", "max_in_cpu": 0, "buffer_count": 1})",
                                R"("bf16": {"enabled": true}, )");
  // The parameters are the same bits wherever their shards live; the norm
  // sums each shard's squares where it lives (the CPU or the GPU), in
  // another order: equal to rounding.
  EXPECT_LT(rel(host.l2, device.l2), 1e-12);
  EXPECT_LT(rel(nvme.l2, device.l2), 1e-12);
  EXPECT_EQ(nvme.l2, host.l2);  // both summed on the CPU
  EXPECT_EQ(nvme.losses, device.losses);
  EXPECT_EQ(host.losses, device.losses);
  // With offload_param and offload_optimizer only the always-gathered group
  // stays on the GPU: the embeddings, ln_f and the head, 1792 parameters
  // outside the blocks, padded to a multiple of 256 per rank (NOTE [flat
  // layout]): 1792 itself, in bf16. (2026-11-27 expected 2048, a power of two
  // the layout never promised; the card said 3584, and so does the CPU twin,
  // Stage3Bytes.TheAlwaysGatheredGroupIsAllThatStaysOnTheDevice.)
  const int64_t kept = zero::partition::FlatParameters::padded_size(1792, 1) * 2;
  EXPECT_EQ(host.device_states.optimizer_states, 0);
  EXPECT_EQ(host.device_states.gradients, 0);
  EXPECT_EQ(host.device_states.parameters, kept);
  EXPECT_EQ(nvme.device_states.parameters, kept);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
  zero::ckpt::remove_tree(dir);
}

// NOTE [frozen groups] on the card: minGPT with its blocks' attention frozen
// (InitOptions::trainable) trains at stage 3, the frozen shards on the
// device, in pinned host memory and on NVMe, to the losses of stage 0; the
// ledger counts them where they live. (CPU twin: runtime_tests Frozen.*.)
TEST(GpuFrozen, FrozenAttentionAtStage3EqualsStage0) {
  REQUIRE_CUDA();
  auto run = [](const std::string& zero_section) {
    return engine_loop(zero_section, "", false, 0.0, /*clip=*/0.0,
                       [](zero::InitOptions& o) { o.trainable = zero::frozen_matching({"\\.attn\\."}); });
  };
  const std::string s3 = R"("stage": 3, "stage3_param_persistence_threshold": 0)";
  const std::string dir = nvme_dir("frozen");
  const auto ref = run(R"("stage": 0)");
  const auto device = run(s3);
  const auto host = run(s3 + R"(, "offload_param": {"device": "cpu"})");
  const auto nvme = run(s3 + R"(, "offload_param": {"device": "nvme", "nvme_path": ")" + dir + R"(", "max_in_cpu": 0})");
  EXPECT_EQ(device.losses, ref.losses);
  EXPECT_EQ(host.losses, ref.losses);
  EXPECT_EQ(nvme.losses, ref.losses);
  // 3 blocks' attention: 4 x 64 x 64 weights and 4 x 64 biases each, fp32.
  const int64_t frozen = 3 * (4 * 64 * 64 + 4 * 64) * 4;
  EXPECT_EQ(ref.frozen_device, frozen) << "whole below stage 3";
  EXPECT_EQ(device.frozen_device, frozen) << "one rank: its shards are the whole";
  EXPECT_EQ(host.frozen_pinned, frozen);
  EXPECT_GE(nvme.frozen_nvme, frozen);
  zero::ckpt::remove_tree(dir);
}

// ---- activation checkpointing -----------------------------------------------

// With dropout, the recompute must draw the forward's masks: the CUDA RNG
// state is saved and restored around it. Otherwise the gradients belong to
// other masks and the runs part at the first step.
TEST(GpuCheckpointing, DropoutRecomputesTheSameMasks) {
  REQUIRE_CUDA();
  const std::string s = R"("stage": 2)";
  const auto plain = engine_loop(s, "", false, 0.1);
  const auto ckpt = engine_loop(s, "", true, 0.1);
  const auto cpu = engine_loop(s, R"("activation_checkpointing": {"cpu_checkpointing": true}, )", true, 0.1);
  EXPECT_LT(rel(ckpt.l2, plain.l2), 1e-6);
  EXPECT_LT(rel(cpu.l2, plain.l2), 1e-6);
  ASSERT_EQ(ckpt.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_NEAR(ckpt.losses[i], plain.losses[i], 1e-5 * std::abs(plain.losses[i])) << "step " << i;
    EXPECT_NEAR(cpu.losses[i], plain.losses[i], 1e-5 * std::abs(plain.losses[i])) << "step " << i;
  }
}

// ---- save_16bit_model ---------------------------------------------------------

std::string run_output(const std::string& cmd) {
  std::string out;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    if (pclose(p) != 0) out = "FAILED: " + out;
  }
  return out;
}

TEST(GpuSave, Save16BitModelLoadsInPythonTorch) {
  REQUIRE_CUDA();
  if (run_output("python3 -c 'import torch' 2>&1").rfind("FAILED", 0) == 0)
    GTEST_SKIP() << "python3 cannot import torch here";
  torch::manual_seed(3);
  mingpt::GPT model(gpt());
  zero::InitOptions o;
  o.print_progress = false;
  o.device = kCuda;
  auto engine = zero::initialize(
      model.ptr(),
      R"({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", )"
      R"("params": {"lr": 0.003}}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, )"
      R"("stage3_gather_16bit_weights_on_model_save": true}})",
      o);
  auto task = mingpt::make_addition_task(2);
  for (int s = 0; s < 3; ++s) {
    engine.backward(loss_of(model, batch(*task, s, 8)));
    engine.step();
  }
  const std::string path = nvme_dir("save") + "/model.safetensors";
  engine.save_16bit_model(path);
  std::ostringstream names;
  for (const auto& item : model->named_parameters(true)) names << item.key() << ",";
  const std::string script =
      "import torch, math, sys\n"
      "from safetensors.torch import load_file\n"
      "sd = load_file(sys.argv[1])\n"
      "names = [n for n in sys.argv[2].split(',') if n]\n"
      "missing = [n for n in names if n not in sd]\n"
      "assert not missing, missing\n"
      "assert all(sd[n].dtype == torch.bfloat16 for n in names), [sd[n].dtype for n in names]\n"
      "print(repr(math.sqrt(sum(float(sd[n].double().pow(2).sum()) for n in names))))\n";
  std::ofstream(path + ".py") << script;
  // stdout alone holds the figure (import torch may warn on stderr, e.g.
  // about NumPy); stderr is kept for a failure's message.
  const std::string err_path = path + ".stderr";
  const std::string out = run_output("python3 " + path + ".py " + path + " '" + names.str() + "' 2>" + err_path);
  std::ifstream err_in(err_path);
  const std::string err{std::istreambuf_iterator<char>(err_in), std::istreambuf_iterator<char>()};
  ASSERT_EQ(out.rfind("FAILED", 0), std::string::npos) << out << err;
  const auto last = out.find_last_not_of("\n");
  const auto line_start = out.rfind('\n', last);
  const std::string figure = out.substr(line_start == std::string::npos ? 0 : line_start + 1);
  double l2 = 0;
  try {
    l2 = std::stod(figure);
  } catch (const std::exception&) {
    FAIL() << "python printed no norm: stdout " << out << "\nstderr " << err;
  }
  EXPECT_LT(rel(l2, engine.parameter_l2()), 1e-9) << out;
  zero::ckpt::remove_tree(std::filesystem::path(path).parent_path().string());
}

// ---- collectives and streams ----------------------------------------------------

int free_port() { return 20000 + static_cast<int>(getpid() % 20000); }

TEST(GpuComm, NcclAtWorldSizeOne) {
  REQUIRE_CUDA();
  zero::DistEnv env;
  env.master_port = free_port();
  auto comm = zero::Comm::connect(env, kCuda);
  ASSERT_EQ(comm->device(), kCuda);
  auto t = torch::arange(8, torch::TensorOptions().dtype(torch::kFloat).device(kCuda));
  comm->all_reduce_sum(t).wait();
  EXPECT_TRUE(torch::equal(t.cpu(), torch::arange(8, torch::kFloat)));
  auto out = torch::empty({8}, t.options());
  comm->all_gather(out, t).wait();
  EXPECT_TRUE(torch::equal(out.cpu(), torch::arange(8, torch::kFloat)));
  auto rs = torch::empty({8}, t.options());
  comm->reduce_scatter_sum(rs, t).wait();
  EXPECT_TRUE(torch::equal(rs.cpu(), torch::arange(8, torch::kFloat)));
  auto b = torch::full({4}, 3.0f, t.options().dtype(torch::kBFloat16));
  comm->broadcast(b, 0).wait();
  comm->barrier();
  EXPECT_EQ(comm->exchange(7, "test")[0], 7);
}

// NOTE [MiCS] on the card: 4 ranks as threads share the GPU through Gloo
// (CUDA tensors), on 2 nodes of 2, each case against its shard group alone,
// bit for bit as on the CPU (tests/partition/mics_test.cpp): stage 3 with
// the optimizer offloaded (the replicas' sum of a CUDA chunk before it goes
// to the host), stage 2 accumulating on the device (the boundary's sum of a
// CUDA partition), and the hierarchical gather on the gather stream.
TEST(GpuMics, ReplicasOfTheSameDataStepToTheBitsOfTheirShardGroupAlone) {
  REQUIRE_CUDA();
  using namespace zero::partition::mics_test;
  constexpr int kSteps = 2;
  for (const Case& c : {Case{"stage3_offload", 3, true}, Case{"stage2_accumulating", 2, false, 2},
                        Case{"stage3_hierarchical", 3, false, 1, 4, 4, false, true}}) {
    SCOPED_TRACE(c.name);
    std::vector<Trained> alone(static_cast<size_t>(c.shard));
    std::mutex mu;
    zero::testing::on_ranks(
        c.shard,
        [&](int rank, zero::Comm& comm) {
          zero::MemoryLedger ledger;
          Trained t = train(c, &comm, nullptr, rank, kSteps, ledger, kCuda);
          std::lock_guard<std::mutex> lock(mu);
          alone[static_cast<size_t>(rank)] = t;
        },
        0, kCuda);
    zero::testing::on_ranks(
        c.world,
        [&](int rank, zero::Comm& world) {
          const auto groups = zero::partition::make_mics_groups(world, c.shard);
          zero::MemoryLedger ledger;
          const Trained got = train(c, groups.partition, groups.replicas, rank % c.shard, kSteps, ledger, kCuda);
          const Trained& want = alone[static_cast<size_t>(rank % c.shard)];
          EXPECT_TRUE(torch::equal(got.params, want.params)) << "rank " << rank;
          EXPECT_EQ(got.norms, want.norms) << "rank " << rank;
        },
        2, kCuda);
  }
}

TEST(GpuStreams, ACopyStreamCopyIsOrderedAndItsHostBufferReusable) {
  REQUIRE_CUDA();
  zero::CopyStream stream(kCuda);
  const int64_t n = 1 << 24;
  auto host = torch::arange(n, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  auto dev = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).device(kCuda));
  at::cuda::sleep(20'000'000);  // the compute stream is busy: the copy waits for it
  zero::StreamEvent done = stream.copy(dev, host, /*host_source=*/true);
  done.block_current();
  // On the compute stream, after the copy; in double, whose partial sums of
  // these integers are exact (a float sum rounds in the reduction's order).
  auto sum = dev.sum(torch::kDouble);
  done.synchronize();
  host.fill_(-1);  // the host may write its buffer again
  EXPECT_EQ(sum.item<double>(), static_cast<double>(n) * (n - 1) / 2);
  // Device to host, read by the host after synchronize().
  auto back = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).pinned_memory(true));
  stream.copy(back, dev).synchronize();
  EXPECT_EQ(back[n - 1].item<float>(), static_cast<float>(n - 1));
}

// The pinned tier on a GPU (NOTE [pinned host memory]): a long-lived buffer
// is page-locked at exactly the size asked, not by LibTorch's caching host
// allocator (which would hold the next power of two: 16 MiB here), copied
// asynchronously, freed and taken off the ledger; an activation buffer comes
// from that allocator (reused every micro-step); zero elements on the device
// are no error.
TEST(GpuMemory, PinnedBuffersArePageLockedExactAndCopied) {
  REQUIRE_CUDA();
  zero::MemoryLedger ledger;
  ledger.set_page_locking(true, 0);
  auto* torch_host = at::getHostAllocator(at::kCUDA);
  const int64_t torch_active = torch_host->get_stats().active_bytes.current;
  const int64_t n = (3 << 20) + 5;
  auto host = zero::LedgerAlloc::host_empty(ledger, n, torch::kFloat, /*pin=*/true, zero::Kind::kCommBuffers, "test ring");
  // Page-locked as the driver says: LibTorch's is_pinned() asks its own host
  // allocator, which knows nothing of cudaHostAlloc's memory (2026-11-27's
  // failure here), until it has made a block itself.
  EXPECT_TRUE(zero::page_locked(host));
  EXPECT_EQ(ledger.get(zero::Tier::kPinnedHost).current_bytes, n * 4);
  EXPECT_EQ(torch_host->get_stats().active_bytes.current, torch_active) << "LibTorch's pinned allocator was used";
  host.fill_(2);
  auto dev = torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat).device(kCuda));
  zero::CopyStream stream(kCuda);
  stream.copy(dev, host, /*host_source=*/true).synchronize();
  EXPECT_EQ(dev.sum(torch::kDouble).item<double>(), 2.0 * static_cast<double>(n));
  stream.copy(host, dev.mul(3)).synchronize();
  EXPECT_EQ(host[n - 1].item<float>(), 6.0f);
  host.reset();
  EXPECT_EQ(ledger.get(zero::Tier::kPinnedHost).current_bytes, 0);
  auto act = zero::LedgerAlloc::empty(ledger, 1000, torch::kBFloat16, at::kCPU, zero::Tier::kPinnedHost,
                                      zero::Kind::kActivations, "kept input");
  EXPECT_TRUE(act.is_pinned());
  EXPECT_TRUE(zero::page_locked(act));
  EXPECT_FALSE(zero::page_locked(torch::empty({16})));
  EXPECT_GT(torch_host->get_stats().active_bytes.current, torch_active) << "activations use the caching allocator";
  act.reset();
  auto none = zero::LedgerAlloc::empty(ledger, 0, torch::kBFloat16, kCuda, zero::Tier::kDevice, zero::Kind::kActivations,
                                       "nothing");
  EXPECT_EQ(none.numel(), 0);
  EXPECT_TRUE(none.is_cuda());
}

TEST(GpuStreams, WaitClockMeasuresAStallOfTheStreamNotOfTheHost) {
  REQUIRE_CUDA();
  zero::CopyStream stream(kCuda);
  zero::WaitClock clock(kCuda);
  zero::StreamEvent slow = stream.run([] { at::cuda::sleep(200'000'000); });  // ~0.1 s on the side stream
  const auto t0 = std::chrono::steady_clock::now();
  clock.time([&] { slow.block_current(); });  // the compute stream waits; the host does not
  const double host_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(host_s, 0.02);
  EXPECT_GT(clock.seconds(), 0.03) << "the stall measured by events";
  // A wait that blocks the host while the stream idles (as Gloo's do):
  // counted once, not as host time plus the same time of idle stream.
  torch::cuda::synchronize();
  clock.reset();
  clock.time([] { std::this_thread::sleep_for(std::chrono::milliseconds(100)); });
  EXPECT_GT(clock.seconds(), 0.09);
  EXPECT_LT(clock.seconds(), 0.15) << "counted twice";
}

// ---- two ranks on one GPU through Gloo --------------------------------------------


// mingpt on `world` ranks on cuda:0 with Gloo; returns its summary, or the
// line of the log where Gloo refused a CUDA collective (then `refused` is set).
nlohmann::json mingpt_on_gpu(int world, int stage, std::string* refused) {
  const std::string work = nvme_dir("ranks_w" + std::to_string(world) + "_s" + std::to_string(stage));
  const std::string cfg = work + "/config.json";
  std::ofstream(cfg) << R"({"train_batch_size": 32, "gradient_clipping": 0.05, "optimizer": {"type": "AdamW", )"
                     << R"("params": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01}}, )"
                     << R"("zero_optimization": {"stage": )" << stage
                     << R"(, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000}})";
  std::ostringstream cmd;
  cmd << "ZERO_DIST_BACKEND=gloo OMP_NUM_THREADS=1 ";
  if (world > 1) cmd << kBin << "zero launch --nproc_per_node " << world << " -- ";
  cmd << kBin << "mingpt --config " << cfg << " --device cuda:0 --n_layer 2 --n_head 2 --n_embd 64 --dropout 0 "
      << "--max_epochs 1 --limit_train_batches 10 --summary-json " << work << "/summary.json > " << work
      << "/log 2>&1";
  const int rc = std::system(cmd.str().c_str());
  const std::string log = slurp(work + "/log");
  nlohmann::json j;
  if (rc == 0) {
    j = nlohmann::json::parse(slurp(work + "/summary.json"));
  } else {
    for (const char* marker : {"not supported", "unsupported", "Unsupported"}) {
      const auto at = log.find(marker);
      if (at != std::string::npos && refused != nullptr) {
        const auto begin = log.rfind('\n', at), end = log.find('\n', at);
        *refused = log.substr(begin == std::string::npos ? 0 : begin + 1, end - begin);
      }
    }
    if (refused == nullptr || refused->empty()) ADD_FAILURE() << cmd.str() << "\n" << log;
  }
  zero::ckpt::remove_tree(work);
  return j;
}

class GpuTwoRanks : public ::testing::TestWithParam<int> {};

TEST_P(GpuTwoRanks, GlooWithCudaTensorsMatchesOneProcess) {
  REQUIRE_CUDA();
  const int stage = GetParam();
  std::string refused;
  const auto one = mingpt_on_gpu(1, 0, nullptr);
  const auto two = mingpt_on_gpu(2, stage, &refused);
  if (!refused.empty()) GTEST_SKIP() << "c10d's Gloo refused a collective of stage " << stage << " on CUDA tensors: " << refused;
  ASSERT_FALSE(one.empty());
  ASSERT_FALSE(two.empty());
  EXPECT_EQ(two["world_size"].get<int>(), 2);
  EXPECT_EQ(two["device"].get<std::string>(), "cuda:0");
  EXPECT_LT(rel(two["param_l2"].get<double>(), one["param_l2"].get<double>()), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Stages, GpuTwoRanks, ::testing::Values(0, 1, 2, 3),
                         [](const auto& info) { return "stage" + std::to_string(info.param); });

// NOTE [run report] on the card: the engine's report of a run stopped by
// ZERO_STOP_AFTER_STEPS has the caching allocator's device peak, and a
// ZERO_DEVICE_MEMORY budget below what the run needs ends it out of memory
// (the caching allocator's memory fraction; c10's error in the log).
TEST(GpuReport, TheRunReportAndABudgetOnTheCard) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("report");
  const std::string cfg = work + "/config.json";
  std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}, )"
                     << R"("optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 2}})";
  const std::string run = "OMP_NUM_THREADS=1 ZERO_RUN_REPORT=" + work + "/r ZERO_STOP_AFTER_STEPS=2 " + kBin +
                          "mingpt --config " + cfg + " --device cuda:0 --n_layer 2 --n_head 2 --n_embd 64 "
                          "--limit_train_batches 10";
  ASSERT_EQ(std::system((run + " > " + work + "/log 2>&1").c_str()), 0) << slurp(work + "/log");
  const auto r = nlohmann::json::parse(slurp(work + "/r.rank0"));
  EXPECT_EQ(r["outcome"], "stopped");
  EXPECT_EQ(r["steps"], 2);
  EXPECT_EQ(r["device"], "cuda:0");
  EXPECT_GT(r["peak_bytes"]["device"].get<int64_t>(), r["model_state_bytes"]["parameters"].get<int64_t>());
  EXPECT_NE(std::system(("ZERO_DEVICE_MEMORY=64KiB " + run + " > " + work + "/oom.log 2>&1").c_str()), 0);
  EXPECT_NE(slurp(work + "/oom.log").find("out of memory"), std::string::npos) << slurp(work + "/oom.log");
  zero::ckpt::remove_tree(work);
}

// ZERO_TRACE on the card (NOTE [trace]): stage 3 with the optimizer on the
// CPU; the layers, the gathers and both directions of the offload's copies.
TEST(GpuTrace, StageThreeWithCpuOffloadOnTheCard) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("trace");
  const std::string cfg = work + "/config.json";
  std::ofstream(cfg) << R"({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true}, )"
                     << R"("optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": )"
                     << R"({"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}}})";
  const std::string run = "OMP_NUM_THREADS=1 ZERO_TRACE=" + work + "/t.json " + kBin + "mingpt --config " + cfg +
                          " --device cuda:0 --n_layer 2 --n_head 2 --n_embd 64 --limit_train_batches 3";
  ASSERT_EQ(std::system((run + " > " + work + "/log 2>&1").c_str()), 0) << slurp(work + "/log");
  const auto t = nlohmann::json::parse(slurp(work + "/t.json"));
  std::map<std::string, int> n;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "X") ++n[e["cat"].get<std::string>() + ": " + e["name"].get<std::string>()];
  EXPECT_EQ(n["phase: backward"], 3) << t.dump(1);
  EXPECT_EQ(n["layer: backward blocks.0"], 3);
  EXPECT_GE(n["gather: gather layer blocks.1"], 3);
  EXPECT_GT(n["copy: device to host"], 0) << "reduced gradients to the host";
  EXPECT_GT(n["copy: host to device"], 0) << "new parameters to the device";
  EXPECT_GE(n["optimizer: CPU step of a sub-group"], 3);
  zero::ckpt::remove_tree(work);
}

}  // namespace
