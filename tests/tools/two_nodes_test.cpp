// Two nodes on loopback (issue 24): two `zero launch --nnodes 2 --node_rank
// 0|1 --nproc_per_node 2` agents make one job of 4 ranks, as torchrun's
// agents on two machines would. At every stage it trains to the same bits as
// one node of 4 ranks, its ranks write one checkpoint into one shared folder
// (committed once, by rank 0), and that checkpoint resumes on one node of 2
// ranks.
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tool_test_util.h"

namespace zero::test {
namespace {

class TwoNodes : public testing::TestWithParam<int> {};

const std::string kEnv = "env -u OMP_NUM_THREADS OMP_NUM_THREADS=1 ZERO_COMM_TIMEOUT_S=120 ";

// `zero launch --nproc_per_node ranks -- mingpt ARGS --summary-json DIR/NAME.json`:
// the summary (a failed run is a test failure, and an empty summary).
nlohmann::json mingpt_on_one_node(const TempDir& dir, int ranks, const std::string& args, const std::string& name) {
  const Outcome o = run(kEnv + kBin + "zero launch --nproc_per_node " + std::to_string(ranks) + " -- " + kBin +
                            "mingpt " + args + " --summary-json " + dir.file(name + ".json"),
                        300);
  EXPECT_EQ(o.code, 0) << o.out;
  return o.code == 0 ? nlohmann::json::parse(read_text(dir.file(name + ".json"))) : nlohmann::json::object();
}

// The same on two nodes of 2 ranks (two agents on loopback): the summary
// and node 0's output.
std::pair<nlohmann::json, std::string> mingpt_on_two_nodes(const TempDir& dir, const std::string& args,
                                                           const std::string& name) {
  const int port = free_port();
  auto node = [&](int k) {
    return kEnv + kBin + "zero launch --nnodes 2 --node_rank " + std::to_string(k) +
           " --nproc_per_node 2 --master_addr 127.0.0.1 --master_port " + std::to_string(port) + " -- " + kBin +
           "mingpt " + args + " --summary-json " + dir.file(name + ".json");
  };
  Outcome second;
  std::thread other([&] { second = run(node(1), 300); });
  const Outcome first = run(node(0), 300);
  other.join();
  EXPECT_EQ(first.code, 0) << first.out;
  EXPECT_EQ(second.code, 0) << second.out;
  const bool ok = first.code == 0 && second.code == 0;
  return {ok ? nlohmann::json::parse(read_text(dir.file(name + ".json"))) : nlohmann::json::object(), first.out};
}

TEST_P(TwoNodes, EqualOneNodeBitForBitSaveOnceAndResumeOnTwoRanks) {
  const int stage = GetParam();
  TempDir dir;
  const std::string config = write(dir, "c.json",
                                   R"({"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                                       "zero_optimization": {"stage": )" +
                                       std::to_string(stage) + R"(, "stage3_param_persistence_threshold": 0}})");
  // Half of a 2-epoch schedule: 8 of 16 steps, the rest after the resume.
  const std::string train = kBin + "mingpt --config " + config +
                            " --n_layer 2 --n_embd 32 --n_head 2 --limit_train_batches 8 --max_epochs 2 "
                            "--stop_after_steps 8 ";
  const std::string& env = kEnv;

  const Outcome one = run(env + kBin + "zero launch --nproc_per_node 4 -- " + train + "--summary-json " +
                          dir.file("one.json"), 300);
  ASSERT_EQ(one.code, 0) << one.out;

  const std::string ck = dir.file("shared ckpt");
  const int port = free_port();
  auto node = [&](int k) {
    return env + kBin + "zero launch --nnodes 2 --node_rank " + std::to_string(k) +
           " --nproc_per_node 2 --master_addr 127.0.0.1 --master_port " + std::to_string(port) + " -- " + train + "--summary-json " +
           dir.file("two.json") + " --save_dir '" + ck + "'";
  };
  Outcome second;
  std::thread other([&] { second = run(node(1), 300); });
  const Outcome first = run(node(0), 300);
  other.join();
  ASSERT_EQ(first.code, 0) << first.out;
  ASSERT_EQ(second.code, 0) << second.out;
  // Node 0 runs ranks 0 and 1 (rank 0 prints), node 1 ranks 2 and 3 (quiet).
  EXPECT_TRUE(has(first.out, "[rank 0] ")) << first.out;
  EXPECT_FALSE(has(second.out, "[rank 0] ") || has(second.out, "[rank 1] ")) << second.out;

  const auto a = nlohmann::json::parse(read_text(dir.file("one.json")));
  const auto b = nlohmann::json::parse(read_text(dir.file("two.json")));
  EXPECT_EQ(b["world_size"], 4);
  EXPECT_EQ(a["loss_curve"], b["loss_curve"]) << "stage " << stage;
  EXPECT_EQ(a["param_l2"].get<double>(), b["param_l2"].get<double>()) << "stage " << stage;
  EXPECT_EQ(b["steps"], 8);
  // NOTE [bytes across nodes]: one node's collectives cross no node; two
  // nodes send the same bytes, the ring's two crossings of them across.
  const auto& t1 = a["collective_bytes_per_step"];
  const auto& t2 = b["collective_bytes_per_step"];
  EXPECT_EQ(t1["steps"], 8);
  EXPECT_GT(t1["within_node"].get<double>(), 0) << t1;
  EXPECT_EQ(t1["across_nodes"].get<double>(), 0) << t1;
  EXPECT_GT(t2["across_nodes"].get<double>(), 0) << t2;
  // The same collectives, the same bytes (the two-node run's checkpoint
  // agreements go through the control group, which is not counted).
  EXPECT_EQ(t2["within_node"].get<double>() + t2["across_nodes"].get<double>(), t1["within_node"].get<double>());
  for (const auto& r : b["ranks"]) EXPECT_EQ(r["node"].get<int>(), r["rank"].get<int>() / 2) << r;

  // One checkpoint, every rank's file in it, committed once.
  EXPECT_EQ(read_text(ck + "/latest"), "global_step8\n");
  const auto names = entries(ck);
  EXPECT_EQ(names, (std::set<std::string>{"global_step8", "latest"})) << "left in the folder besides the checkpoint";
  const auto files = entries(ck + "/global_step8");
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(files.count("rank0000" + std::to_string(r) + ".safetensors"), 1u) << "rank " << r;
  const auto meta = nlohmann::json::parse(read_text(ck + "/global_step8/meta.json"));
  EXPECT_EQ(meta["world_size"], 4);
  const Outcome verify = run(kBin + "zero checkpoint verify '" + ck + "'");
  EXPECT_EQ(verify.code, 0) << verify.out;

  // The rest of the schedule on one node of 2 ranks, from that checkpoint.
  const Outcome resumed = run(env + kBin + "zero launch --nproc_per_node 2 -- " + kBin + "mingpt --config " + config +
                                  " --n_layer 2 --n_embd 32 --n_head 2 --limit_train_batches 8 --max_epochs 2 "
                                  "--resume '" + ck + "' --summary-json " + dir.file("resumed.json"),
                              300);
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_TRUE(has(resumed.out, "resumed from " + ck + "/global_step8 at step 8")) << resumed.out;
  // Its bytes are over the 8 steps it took, without what loading sent.
  const auto r2 = nlohmann::json::parse(read_text(dir.file("resumed.json")));
  EXPECT_EQ(r2["collective_bytes_per_step"]["steps"], 8);
  EXPECT_EQ(r2["collective_bytes_per_step"]["across_nodes"].get<double>(), 0);
  const auto r = nlohmann::json::parse(read_text(dir.file("resumed.json")));
  EXPECT_EQ(r["world_size"], 2);
  EXPECT_EQ(r["steps"], 16);
  EXPECT_TRUE(r["resumed"].get<bool>());
}

// ZeRO++ on two nodes of 2 ranks (NOTE [hpZ], NOTE [quantized gather]):
// hpZ trains to the bits of one node of 4 without it, its backward gathers
// staying in the node; with qwZ and qgZ too, a fraction of the bytes cross,
// and the loss stays near the exact run's. (stage3_max_reuse_distance 0: each layer
// is gathered again for backward, as in a model larger than the distance.)
// A checkpoint of a run with both keys
// resumes without them, and one without them resumes with them.
TEST(TwoNodesZeroPlusPlus, HpzEqualsOneNodeQuantizedKeysSendLessCheckpointsCrossTheKeys) {
  TempDir dir;
  auto config = [&](const std::string& name, const std::string& keys) {
    return write(dir, "config_" + name + ".json",
                 R"({"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                     "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                           "stage3_max_reuse_distance": 0)" +
                     keys + "}}");
  };
  const std::string plain = config("plain", ""), hpz = config("hpz", R"(, "zero_hpz_partition_size": 2)"),
                    both = config("both", R"(, "zero_hpz_partition_size": 2, "zero_quantized_weights": true,
                                              "zero_quantized_gradients": true)");
  const std::string model = " --n_layer 2 --n_embd 32 --n_head 2 --limit_train_batches 8 --max_epochs 2 ";
  auto one_node = [&](int ranks, const std::string& cfg, const std::string& name, const std::string& extra) {
    return mingpt_on_one_node(dir, ranks, "--config " + cfg + model + extra, name);
  };
  auto two_nodes = [&](const std::string& cfg, const std::string& name, const std::string& extra) {
    return mingpt_on_two_nodes(dir, "--config " + cfg + model + extra, name).first;
  };
  const std::string ck_plain = dir.file("ck_plain"), ck_both = dir.file("ck_both");
  const auto ref = one_node(4, plain, "ref", "--stop_after_steps 8 --save_dir " + ck_plain);
  const auto base = two_nodes(plain, "base", "--stop_after_steps 8");
  const auto h = two_nodes(hpz, "hpz", "--stop_after_steps 8");
  const auto q = two_nodes(both, "both", "--stop_after_steps 8 --save_dir " + ck_both);
  if (HasFailure()) return;
  EXPECT_EQ(h["loss_curve"], ref["loss_curve"]);
  EXPECT_EQ(h["param_l2"].get<double>(), ref["param_l2"].get<double>());
  const double across_base = base["collective_bytes_per_step"]["across_nodes"].get<double>();
  const double across_hpz = h["collective_bytes_per_step"]["across_nodes"].get<double>();
  const double across_both = q["collective_bytes_per_step"]["across_nodes"].get<double>();
  // Backward's gathers, about a quarter of the bytes, stay in the node; then
  // qwZ's gathers send a quarter of their fp32 bytes, and qgZ's gradients
  // cross once, as one int8 chunk a rank (NOTE [quantized gradients]).
  EXPECT_LT(across_hpz, 0.85 * across_base) << h["collective_bytes_per_step"] << base["collective_bytes_per_step"];
  EXPECT_LT(across_both, 0.5 * across_hpz) << q["collective_bytes_per_step"];
  const double loss_ref = ref["loss_curve"].back().get<double>(), loss_q = q["loss_curve"].back().get<double>();
  EXPECT_LT(std::abs(loss_q - loss_ref), 0.02 * loss_ref) << loss_q << " against " << loss_ref;
  EXPECT_NE(q["loss_curve"], ref["loss_curve"]) << "nothing was quantized";

  // Across the keys, both ways, to the end of the schedule.
  const auto without = one_node(2, plain, "without", "--resume " + ck_both);
  EXPECT_EQ(without["steps"], 16);
  const auto with = two_nodes(both, "with", "--resume " + ck_plain);
  EXPECT_EQ(with["steps"], 16);
  EXPECT_TRUE(with["resumed"].get<bool>());
}

// MiCS on two nodes of 2 ranks (NOTE [MiCS]), minGPT: with a shard group a
// node, stages 2 and 3 train as one node of 4 (within the rounding of the
// sums' other order) while only the replicas' sum of the gradients crosses
// the nodes; a shard group of the 4 ranks with the hierarchical gather
// (NOTE [hierarchical gather]) trains to the bits of one node of 4 and sends
// less across. A checkpoint of a MiCS run resumes on one node of 2 without
// it, and one without it resumes under MiCS.
TEST(TwoNodesMics, ShardGroupsInTheNodeCrossOnlyTheReplicasSumHierarchicalIsExactCheckpointsCrossTheKey) {
  TempDir dir;
  auto config = [&](const std::string& name, int stage, const std::string& keys) {
    return write(dir, "config_" + name + ".json",
                 R"({"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
                     "zero_optimization": {"stage": )" + std::to_string(stage) +
                     R"(, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0)" + keys + "}}");
  };
  const std::string plain3 = config("plain3", 3, ""), plain2 = config("plain2", 2, ""),
                    mics3 = config("mics3", 3, R"(, "mics_shard_size": 2)"),
                    mics2 = config("mics2", 2, R"(, "mics_shard_size": 2)"),
                    hier = config("hier", 3, R"(, "mics_shard_size": 4, "mics_hierarchical_params_gather": true)");
  const std::string model = " --n_layer 2 --n_embd 32 --n_head 2 --limit_train_batches 8 --max_epochs 2 ";
  auto one_node = [&](int ranks, const std::string& cfg, const std::string& name, const std::string& extra) {
    return mingpt_on_one_node(dir, ranks, "--config " + cfg + model + extra, name);
  };
  auto two_nodes = [&](const std::string& cfg, const std::string& name, const std::string& extra) {
    return mingpt_on_two_nodes(dir, "--config " + cfg + model + extra, name);
  };
  auto across = [](const nlohmann::json& j) { return j["collective_bytes_per_step"]["across_nodes"].get<double>(); };
  // Each step's loss within 0.1% of the reference's: only the order of the sums differs.
  auto near = [](const nlohmann::json& got, const nlohmann::json& want) {
    if (got["loss_curve"].size() != want["loss_curve"].size()) return false;
    for (size_t i = 0; i < got["loss_curve"].size(); ++i) {
      const double a = got["loss_curve"][i].get<double>(), b = want["loss_curve"][i].get<double>();
      if (std::abs(a - b) > 1e-3 * std::abs(b)) return false;
    }
    return std::abs(got["param_l2"].get<double>() - want["param_l2"].get<double>()) <=
           1e-4 * want["param_l2"].get<double>();
  };
  const std::string ck_plain = dir.file("ck_plain"), ck_mics = dir.file("ck_mics");
  const auto ref3 = one_node(4, plain3, "ref3", "--stop_after_steps 8 --save_dir " + ck_plain);
  const auto ref2 = one_node(4, plain2, "ref2", "--stop_after_steps 8");
  const auto [base3, base3_log] = two_nodes(plain3, "base3", "--stop_after_steps 8");
  const auto [base2, base2_log] = two_nodes(plain2, "base2", "--stop_after_steps 8");
  const auto [m3, m3_log] = two_nodes(mics3, "mics3", "--stop_after_steps 8 --save_dir " + ck_mics);
  const auto [m2, m2_log] = two_nodes(mics2, "mics2", "--stop_after_steps 8");
  const auto [h, h_log] = two_nodes(hier, "hier", "--stop_after_steps 8");
  if (HasFailure()) return;
  EXPECT_TRUE(has(m3_log, "MiCS: the model states are partitioned within 2 groups of 2 consecutive ranks")) << m3_log;
  EXPECT_TRUE(near(m3, ref3)) << m3["loss_curve"] << " against " << ref3["loss_curve"];
  EXPECT_TRUE(near(m2, ref2)) << m2["loss_curve"] << " against " << ref2["loss_curve"];
  // Stage 3's gathers and the first hop stay in the node: what crosses is
  // each rank's half of every bucket, summed in a ring of 2.
  EXPECT_LT(across(m3), 0.5 * across(base3)) << m3["collective_bytes_per_step"] << base3["collective_bytes_per_step"];
  EXPECT_LT(across(m2), 0.6 * across(base2)) << m2["collective_bytes_per_step"] << base2["collective_bytes_per_step"];
  // The gathers' values are the shards' in either hop: the same bits.
  EXPECT_EQ(h["loss_curve"], ref3["loss_curve"]);
  EXPECT_EQ(h["param_l2"].get<double>(), ref3["param_l2"].get<double>());
  EXPECT_LT(across(h), across(base3)) << h["collective_bytes_per_step"] << base3["collective_bytes_per_step"];

  // Across the key, both ways, to the end of the schedule.
  const auto without = one_node(2, plain3, "without", "--resume " + ck_mics);
  EXPECT_EQ(without["steps"], 16);
  EXPECT_TRUE(without["resumed"].get<bool>());
  const auto [with, with_log] = two_nodes(mics3, "with", "--resume " + ck_plain);
  EXPECT_EQ(with["steps"], 16);
  EXPECT_TRUE(with["resumed"].get<bool>());
  // The MiCS checkpoint holds one replica's partitions: 2, by ranks 0 and
  // 1; ranks 2 and 3 wrote their RNG states alone.
  const auto meta = nlohmann::json::parse(read_text(ck_mics + "/global_step8/meta.json"));
  EXPECT_EQ(meta["world_size"], 4);
  EXPECT_EQ(meta["layout"]["partitions"], 2) << meta["layout"];
  const auto& files = meta["files"];
  const double part0 = files["rank00000.safetensors"]["bytes"].get<double>();
  for (const char* name : {"rank00002.safetensors", "rank00003.safetensors"})
    EXPECT_LT(files[name]["bytes"].get<double>(), 0.1 * part0) << name << ": " << files;
  EXPECT_NEAR(files["rank00001.safetensors"]["bytes"].get<double>(), part0, 0.05 * part0) << files;
  const Outcome verify = run(kBin + "zero checkpoint verify '" + ck_mics + "'");
  EXPECT_EQ(verify.code, 0) << verify.out;
}

INSTANTIATE_TEST_SUITE_P(Stages, TwoNodes, testing::Values(0, 1, 2, 3),
                         [](const testing::TestParamInfo<int>& i) { return "Stage" + std::to_string(i.param); });

}  // namespace
}  // namespace zero::test
