// The CUDA paths (CTest label "gpu"): every test skips, saying why, where no
// CUDA device exists, and runs on the GPU machine (scripts/gpu/run.sh).
//   - ZeRO stages 0-3 at world size 1 on CUDA against a plain LibTorch CUDA
//     loop (fp32: parameter norm to 1e-5), bf16 and fp16 to the tolerances
//     documented below;
//   - CPU and NVMe offload against no offload;
//   - activation checkpointing with dropout against no checkpointing (the
//     CUDA RNG state is replayed);
//   - save_16bit_model read by Python's torch;
//   - NCCL at world size 1; CopyStream and WaitClock on a CUDA stream;
//   - two ranks sharing the GPU through Gloo with CUDA tensors, against one.
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

#define REQUIRE_CUDA()                                                                                 \
  do {                                                                                                 \
    if (!torch::cuda::is_available())                                                                  \
      GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false); this test runs on the " \
                      "GPU machine: scripts/gpu/run.sh test";                                          \
  } while (0)

namespace {

const torch::Device kCuda(torch::kCUDA, 0);
const std::string kBin = std::string(ZERO_BINARY_DIR) + "/bin/";

mingpt::GPTConfig gpt(double dropout = 0.0) {
  mingpt::GPTConfig c;
  c.vocab_size = 10;
  c.block_size = 6;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.embd_pdrop = c.resid_pdrop = c.attn_pdrop = dropout;
  return c;
}

torch::Tensor loss_of(mingpt::GPT& model, const mingpt::Batch& b) {
  auto logits = model->forward(b.x.to(kCuda));
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).view({-1, logits.size(-1)}),
                                              b.y.to(kCuda).view({-1}),
                                              torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-1));
}

mingpt::Batch batch(const mingpt::Task& task, int step, int64_t size = 32) {
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < size; ++i) idx.push_back((step * size + i) % task.train_size());
  return task.train_batch(idx);
}

double norm_of(mingpt::GPT& model) {
  double s = 0;
  for (auto& p : model->parameters()) s += p.detach().to(torch::kDouble).pow(2).sum().item<double>();
  return std::sqrt(s);
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

constexpr int kSteps = 10;

// The plain LibTorch loop: AdamW and clip_grad_norm_ on CUDA, in fp32.
double plain_loop(double dropout = 0.0) {
  torch::manual_seed(3);
  mingpt::GPT model(gpt(dropout));
  model->to(kCuda);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.01));
  auto task = mingpt::make_addition_task(2);
  torch::manual_seed(9);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    loss_of(model, batch(*task, s)).backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
  }
  return norm_of(model);
}

struct RunResult {
  double l2 = 0;
  std::vector<double> losses;
  int64_t device_state_bytes = -1;  // model states on the device tier after the last step
  zero::ModelStateBytes device_states;
};

// The same through zero with `zero` (the zero_optimization section) and `extra` top-level keys.
RunResult engine_loop(const std::string& zero, const std::string& extra = "", bool checkpoint = false,
                      double dropout = 0.0) {
  torch::manual_seed(3);
  mingpt::GPT model(gpt(dropout));
  zero::InitOptions o;
  o.print_progress = false;
  o.device = kCuda;
  const std::string config = R"({"train_micro_batch_size_per_gpu": 32, "gradient_clipping": 1.0, )"
                             R"("optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], )"
                             R"("eps": 1e-8, "weight_decay": 0.01}}, )" +
                             extra + R"("zero_optimization": {)" + zero + "}}";
  auto engine = zero::initialize(model.ptr(), config, o);
  if (checkpoint) model->set_checkpointer(&engine.checkpointer());
  auto task = mingpt::make_addition_task(2);
  torch::manual_seed(9);
  RunResult r;
  for (int s = 0; s < kSteps; ++s) {
    auto loss = loss_of(model, batch(*task, s));
    r.losses.push_back(loss.item<double>());
    engine.backward(loss);
    engine.step();
  }
  r.l2 = engine.parameter_l2();
  r.device_states = engine.model_state_bytes(zero::Tier::kDevice);
  r.device_state_bytes = r.device_states.total();
  return r;
}

std::string nvme_dir(const std::string& name) {
  const std::string d = std::string(ZERO_BINARY_DIR) + "/tests/gpu_" + std::to_string(getpid()) + "_" + name;
  std::filesystem::create_directories(d);
  return d;
}

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
    // Master, moments (and the gradient partition) left the device: 2 of 18 bytes per parameter stay.
    EXPECT_LT(cpu.device_state_bytes, none.device_state_bytes / 4) << "stage " << stage;
    EXPECT_TRUE(std::filesystem::is_empty(dir));
    zero::ckpt::remove_tree(dir);
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

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

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

#include "zero/optim/flat_optimizer.h"

namespace {

// 8-bit Adam states on the device run the ATen path (NOTE [8-bit states]):
// separate element-wise kernels (no multiply-add contracted across them),
// divisions by tensors, sqrt through fp64, E4M3 through c10's conversion;
// so its codes, scales, parameters and bf16 copy equal the CPU's fused
// pass, bit for bit, over steps and three parameter groups.
TEST(GpuOptim, EightBitStatesOnTheDeviceEqualTheCpuKernel) {
  REQUIRE_CUDA();
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.weight_decay = 0.1;
  cfg.optim_bits = 8;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  const int64_t n = 100003, blocks = (n + 255) / 256;
  torch::manual_seed(5);
  auto p_cpu = torch::randn({n});
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}), torch::zeros({n}, torch::kUInt8),
                                torch::zeros({blocks})};
  std::vector<at::Tensor> s_dev;
  for (const auto& t : s_cpu) s_dev.push_back(t.to(kCuda));
  auto low_cpu = torch::empty({n}, torch::kBFloat16), low_dev = low_cpu.to(kCuda);
  const auto scale = torch::logspace(-4, 0, n);  // gradients of very different sizes within a block
  for (int64_t step = 1; step <= 5; ++step) {
    const auto g = torch::randn({n}) * scale;
    std::vector<zero::optim::FlatOptimizer::Run> runs;
    for (int r = 0; r < 3; ++r) {
      zero::optim::StepParams sp;
      sp.step = step;
      sp.lr = 1e-3 * (r + 1);
      sp.weight_decay = 0.1 * r;
      runs.push_back({r * (n / 3), r < 2 ? n / 3 : n - 2 * (n / 3), sp});
    }
    opt->update_runs(runs, p_cpu, g, s_cpu, &low_cpu);
    const auto g_dev = g.to(kCuda);
    opt->update_runs(runs, p_dev, g_dev, s_dev, &low_dev);
  }
  EXPECT_TRUE(p_cpu.equal(p_dev.cpu())) << (p_cpu - p_dev.cpu()).abs().max().item<float>();
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "state " << i;
  EXPECT_TRUE(low_cpu.equal(low_dev.cpu()));
}

// min_8bit_size on the device: the blocks marked fp32 step as fp32 Adam in
// ATen operations (within their rounding of the CPU's fused pass), the
// 8-bit blocks as the CPU's, bit for bit; the marks stay.
TEST(GpuOptim, EightBitStatesWithFp32BlocksOnTheDevice) {
  REQUIRE_CUDA();
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.optim_bits = 8;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  const auto specs = opt->state_specs();
  const int64_t n = 10003, blocks = (n + 255) / 256;
  const std::vector<int64_t> fp32_blocks{0, 1, 7, 20, blocks - 1};
  torch::manual_seed(6);
  auto p_cpu = torch::randn({n});
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}),
                                torch::zeros({n}, torch::kUInt8), torch::zeros({blocks}),
                                torch::zeros({specs[4].side_numel(5)}), torch::zeros({specs[5].side_numel(5)})};
  s_cpu[0].fill_(7);  // codes the marking zeroes in its blocks (under a zero scale they stand for 0)
  s_cpu[2].fill_(7);
  std::vector<at::Tensor> s_dev;
  for (const auto& t : s_cpu) s_dev.push_back(t.to(kCuda));
  zero::optim::mark_fp32_blocks(fp32_blocks, s_cpu);  // the device's: index_copy_ and index_fill_ there
  zero::optim::mark_fp32_blocks(fp32_blocks, s_dev);
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "marked state " << i;
  for (int64_t step = 1; step <= 4; ++step) {
    const auto g = torch::randn({n});
    zero::optim::StepParams sp;
    sp.step = step;
    opt->update_runs({{0, n, sp}}, p_cpu, g, s_cpu, nullptr);
    const auto g_dev = g.to(kCuda);
    opt->update_runs({{0, n, sp}}, p_dev, g_dev, s_dev, nullptr);
  }
  const auto p_back = p_dev.cpu();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t a = b * 256, len = std::min<int64_t>(256, n - a);
    const bool fp32 = std::find(fp32_blocks.begin(), fp32_blocks.end(), b) != fp32_blocks.end();
    if (fp32) EXPECT_TRUE(torch::allclose(p_cpu.narrow(0, a, len), p_back.narrow(0, a, len), 1e-6, 1e-7)) << b;
    else EXPECT_TRUE(p_cpu.narrow(0, a, len).equal(p_back.narrow(0, a, len))) << b;
  }
  for (size_t i : {0, 1, 2, 3}) EXPECT_TRUE(s_cpu[i].equal(s_dev[i].cpu())) << "state " << i;  // codes, scales and marks
  EXPECT_EQ(s_dev[1].lt(0).sum().item<int64_t>(), static_cast<int64_t>(fp32_blocks.size()));
}

// A bf16 master and bf16 states on the device (NOTE [16-bit master]): the
// stochastic rounding's words on the GPU are the CPU's (the same bits from
// the same fp32 values), and a step of update_stored there tracks the CPU's
// (whose inner fp32 Adam differs by ATen's rounding) within a bf16 step.
TEST(GpuOptim, Bf16MasterOnTheDeviceRoundsAsTheCpu) {
  REQUIRE_CUDA();
  torch::manual_seed(6);
  const int64_t n = 1 << 20;
  const auto x = torch::randn({n}) * torch::exp(torch::randn({n}) * 4);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const zero::optim::Rounding r{true, (uint64_t{3} << 32) - 1000, 9};
    const auto cpu = zero::optim::round_to(x, dtype, r, 1);
    const auto dev = zero::optim::round_to(x.to(kCuda), dtype, r, 1);
    EXPECT_TRUE(cpu.view(torch::kShort).equal(dev.cpu().view(torch::kShort))) << c10::toString(dtype);
  }
  zero::config::OptimizerConfig cfg;
  cfg.type = zero::config::OptimizerType::kAdamW;
  cfg.weight_decay = 0.1;
  cfg.bf16_states = true;
  const auto opt = zero::optim::FlatOptimizer::create(cfg);
  auto p_cpu = torch::randn({n}).to(torch::kBFloat16);
  auto p_dev = p_cpu.to(kCuda);
  std::vector<at::Tensor> s_cpu{torch::zeros({n}, torch::kBFloat16), torch::zeros({n}, torch::kBFloat16)};
  std::vector<at::Tensor> s_dev{s_cpu[0].to(kCuda), s_cpu[1].to(kCuda)};
  auto low_dev = torch::empty({n}, torch::TensorOptions().dtype(torch::kBFloat16).device(kCuda));
  for (int64_t step = 1; step <= 5; ++step) {
    const auto g = torch::randn({n});
    zero::optim::FlatOptimizer::Run run{0, n, {}};
    run.params.step = step;
    const zero::optim::Rounding r{true, 0, step};
    zero::optim::update_stored(*opt, {run}, p_cpu, g, s_cpu, nullptr, r);
    const auto g_dev = g.to(kCuda);
    zero::optim::update_stored(*opt, {run}, p_dev, g_dev, s_dev, &low_dev, r);
  }
  EXPECT_TRUE(low_dev.equal(p_dev)) << "the model's copy is the master's bits";
  const auto diff = (p_cpu.to(torch::kFloat) - p_dev.cpu().to(torch::kFloat)).abs();
  const auto step = p_cpu.to(torch::kFloat).abs() / 128 + 1e-30;
  const double beyond = diff.gt(step * 1.01).to(torch::kFloat).mean().item<double>();
  EXPECT_LT(beyond, 1e-3) << "elements more than a bf16 step apart";
  EXPECT_GT(diff.eq(0).to(torch::kFloat).mean().item<double>(), 0.9) << "most elements the same bits";
}

// NOTE [device Adam]: one fp32 Adam step on the device equals the fused CPU
// pass bit for bit, decoupled (AdamW) and L2 (Adam), over steps.
TEST(GpuOptim, Fp32AdamOnTheDeviceEqualsTheCpuKernel) {
  REQUIRE_CUDA();
  const int64_t n = 100003;
  for (const bool adamw : {true, false}) {
    zero::config::OptimizerConfig cfg;
    cfg.type = adamw ? zero::config::OptimizerType::kAdamW : zero::config::OptimizerType::kAdam;
    cfg.adam_w_mode = adamw;
    cfg.weight_decay = 0.1;
    const auto opt = zero::optim::FlatOptimizer::create(cfg);
    auto p_cpu = torch::randn({n});
    auto p_dev = p_cpu.to(kCuda);
    std::vector<at::Tensor> s_cpu{torch::zeros({n}), torch::zeros({n})};
    std::vector<at::Tensor> s_dev{s_cpu[0].to(kCuda), s_cpu[1].to(kCuda)};
    for (int64_t step = 1; step <= 5; ++step) {
      const auto g = torch::randn({n}) * 0.01;
      zero::optim::StepParams sp{step, 3e-3, 0.9, 0.95};
      opt->update(sp, p_cpu, g, s_cpu);
      const auto g_dev = g.to(kCuda);
      opt->update(sp, p_dev, g_dev, s_dev);
    }
    EXPECT_TRUE(p_cpu.equal(p_dev.cpu())) << (adamw ? "AdamW" : "Adam");
    EXPECT_TRUE(s_cpu[0].equal(s_dev[0].cpu()));
    EXPECT_TRUE(s_cpu[1].equal(s_dev[1].cpu()));
  }
}

// ---- the tools that start processes, on the card (issue 35) -------------------

std::string write_file(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

int sh(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

const std::string kTinyGpt = " --n_layer 2 --n_head 2 --n_embd 64 --dropout 0 --device cuda:0 ";

// zero tune -- mingpt ... --device cuda:0 {config}: the winner trains.
TEST(GpuTools, TunePicksAConfigThatTrains) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("tune");
  const std::string out = work + "/best.json";
  const std::string cmd = "OMP_NUM_THREADS=1 " + kBin + "zero tune --device-memory 2GiB --host-memory 4GiB --stages 0,2,3 "
                          "--micro-batches 8,16 --steps 3 --trials 3 --out " + out + " -- " + kBin + "mingpt --config {config}" +
                          kTinyGpt + "--limit_train_batches 6 > " + work + "/tune.log 2>&1";
  ASSERT_EQ(sh(cmd), 0) << slurp(work + "/tune.log");
  ASSERT_EQ(sh(kBin + "mingpt --config " + out + kTinyGpt + "--limit_train_batches 6 > " + work + "/train.log 2>&1"), 0)
      << slurp(work + "/train.log");
  zero::ckpt::remove_tree(work);
}

// mingpt --find-max-params with a device budget on the card.
TEST(GpuTools, FindMaxParamsWithADeviceBudget) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("findmax");
  const std::string cfg = write_file(work + "/z3.json", R"({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 3}})");
  const std::string cmd = "OMP_NUM_THREADS=1 " + kBin + "mingpt --config " + cfg + " --device cuda:0 --vocab_size 256 "
                          "--block_size 64 --find-max-params --device-memory 256MiB --head_dim 32 --probe_steps 2 "
                          "--summary-json " + work + "/s.json > " + work + "/log 2>&1";
  ASSERT_EQ(sh(cmd), 0) << slurp(work + "/log");
  const auto s = nlohmann::json::parse(slurp(work + "/s.json"));
  EXPECT_GT(s["largest"]["num_parameters"].get<int64_t>(), 0) << s.dump(1);
  EXPECT_LE(s["largest"]["peak_bytes"]["device"].get<int64_t>(), int64_t{256} << 20) << s.dump(1);
  zero::ckpt::remove_tree(work);
}

// zero memcheck record, then check, of a run on the card.
TEST(GpuTools, MemcheckRecordThenCheck) {
  REQUIRE_CUDA();
  const std::string work = nvme_dir("memcheck");
  const std::string cfg = write_file(work + "/z2.json", R"({"train_micro_batch_size_per_gpu": 8, "bf16": {"enabled": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "zero_optimization": {"stage": 2}})");
  const std::string program = " -- " + kBin + "mingpt --config " + cfg + kTinyGpt + "--limit_train_batches 6";
  ASSERT_EQ(sh(kBin + "zero memcheck record --baseline " + work + "/b.json --steps 2" + program + " > " + work +
               "/record.log 2>&1"),
            0)
      << slurp(work + "/record.log");
  ASSERT_EQ(sh(kBin + "zero memcheck check --baseline " + work + "/b.json --steps 2" + program + " > " + work +
               "/check.log 2>&1"),
            0)
      << slurp(work + "/check.log");
  EXPECT_NE(slurp(work + "/check.log").find("no figure grew"), std::string::npos) << slurp(work + "/check.log");
  zero::ckpt::remove_tree(work);
}

}  // namespace
