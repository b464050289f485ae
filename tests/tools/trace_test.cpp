// ZERO_TRACE (NOTE [trace]) on a real run: two ranks of mingpt at stage 3
// with the optimizer states on NVMe, each rank's Chrome trace read back, the
// two joined by `zero trace merge`; a trace path that is not a file, or is the
// config, refused before training.
#include <sys/stat.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tool_test_util.h"

namespace zero::test {
namespace {

using nlohmann::json;

std::string stage3_nvme_config(const TempDir& dir) {
  return write(dir, "z3.json", R"({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 3, "sub_group_size": 20000, "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "nvme", "nvme_path": ")" + dir.file("swap") + R"("}}})");
}

std::string run_command(const std::string& config, const std::string& trace) {
  return "env OMP_NUM_THREADS=1 ZERO_TRACE=" + trace + " " + kBin + "zero launch --nproc_per_node 2 -- " + kBin +
         "mingpt --config " + config + " --vocab_size 64 --block_size 32 --n_layer 2 --n_embd 32 --n_head 2 "
         "--limit_train_batches 3";
}

struct Span {
  std::string cat, name;
  int64_t ts, end;
};

std::vector<Span> spans(const json& t) {
  std::vector<Span> out;
  for (const auto& e : t["traceEvents"])
    if (e["ph"] == "X")
      out.push_back({e["cat"], e["name"], e["ts"].get<int64_t>(), e["ts"].get<int64_t>() + e["dur"].get<int64_t>()});
  return out;
}

int count(const std::vector<Span>& s, const std::string& cat, const std::string& name_start = "") {
  int n = 0;
  for (const auto& x : s) n += x.cat == cat && x.name.rfind(name_start, 0) == 0;
  return n;
}

TEST(Trace, EachRankWritesItsStepsAsAChromeTrace) {
  TempDir dir;
  const std::string config = stage3_nvme_config(dir);
  ASSERT_EQ(::mkdir(dir.file("swap").c_str(), 0755), 0);
  const auto r = run(run_command(config, dir.file("t.json")), 300);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "ZERO_TRACE: a Chrome trace of each rank's steps goes to " + dir.file("t.rankR.json"))) << r.out;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string file = dir.file("t.rank" + std::to_string(rank) + ".json");
    const json t = json::parse(read_text(file));
    EXPECT_EQ(t["otherData"]["rank"], rank);
    EXPECT_EQ(t["otherData"]["world_size"], 2);
    EXPECT_EQ(t["otherData"]["dropped_events"], 0);
    const auto s = spans(t);
    // Three micro-steps: the phases, and at stage 3 each layer's forward and backward.
    EXPECT_EQ(count(s, "phase", "backward"), 3) << file;
    EXPECT_EQ(count(s, "phase", "step"), 3) << file;
    EXPECT_GE(count(s, "phase", "forward"), 3) << file;
    for (const std::string layer : {"tok_emb", "blocks.0", "blocks.1", "ln_f", "head"}) {
      EXPECT_GE(count(s, "layer", "forward " + layer), 3) << layer;
      EXPECT_EQ(count(s, "layer", "backward " + layer), 3) << layer;
    }
    // Every layer's backward lies inside a backward phase.
    for (const auto& x : s) {
      if (x.cat != "layer" || x.name.rfind("backward", 0) != 0) continue;
      bool inside = false;
      for (const auto& p : s) inside |= p.cat == "phase" && p.name == "backward" && p.ts <= x.ts && x.end <= p.end;
      EXPECT_TRUE(inside) << x.name << " at " << x.ts;
    }
    EXPECT_GE(count(s, "gather", "gather layer blocks.0"), 3);
    EXPECT_GE(count(s, "reduce", "reduce gradients"), 3);
    EXPECT_GE(count(s, "copy"), 3);
    EXPECT_GE(count(s, "wait", "wait for a gather"), 3);
    EXPECT_GE(count(s, "wait", "wait for a reduction"), 3);
    // The CPU step of each sub-group (several a step at sub_group_size 20000), inside a step phase.
    const int sub_group_steps = count(s, "optimizer", "CPU step of a sub-group");
    EXPECT_GT(sub_group_steps, 3) << "sub-groups per step > 1";
    // The optimizer states' reads and writes: async pairs, one id each.
    std::map<int64_t, std::set<std::string>> pairs;
    std::set<std::string> io;
    for (const auto& e : t["traceEvents"]) {
      if (e["ph"] != "b" && e["ph"] != "e") continue;
      pairs[e["id2"]["local"].get<int64_t>()].insert(e["ph"].get<std::string>());
      io.insert(e["name"].get<std::string>());
    }
    EXPECT_EQ(io, (std::set<std::string>{"NVMe read", "NVMe write"}));
    for (const auto& [id, phases] : pairs) EXPECT_EQ(phases.size(), 2u) << "request " << id;
  }
  // One trace of both ranks.
  const auto m = run(kBin + "zero trace merge " + dir.file("all.json") + " " + dir.file("t.rank0.json") + " " +
                     dir.file("t.rank1.json"));
  ASSERT_EQ(m.code, 0) << m.out;
  const json all = json::parse(read_text(dir.file("all.json")));
  std::set<int> pids;
  for (const auto& e : all["traceEvents"]) pids.insert(e["pid"].get<int>());
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(all["otherData"]["ranks"], json::array({0, 1}));
  // Not over an input, nor one rank twice.
  const auto over = run(kBin + "zero trace merge " + dir.file("t.rank0.json") + " " + dir.file("t.rank0.json") + " " +
                        dir.file("t.rank1.json"));
  EXPECT_EQ(over.code, 2) << over.out;
  EXPECT_TRUE(has(over.out, "OUT " + dir.file("t.rank0.json") + ": this command reads that file")) << over.out;
  const auto twice = run(kBin + "zero trace merge " + dir.file("x.json") + " " + dir.file("t.rank0.json") + " " +
                         dir.file("all.json"));
  EXPECT_EQ(twice.code, 2) << twice.out;
  EXPECT_TRUE(has(twice.out, dir.file("all.json") + ": a second trace of rank 0")) << twice.out;
  EXPECT_FALSE(entries(dir.path()).count("x.json"));
}

TEST(Trace, ATracePathThatCannotBeItsFileIsRefusedBeforeTraining) {
  TempDir dir;
  const std::string config = stage3_nvme_config(dir);
  ASSERT_EQ(::mkdir(dir.file("swap").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(dir.file("folder.rank0.json").c_str(), 0755), 0);
  const auto folder = run(run_command(config, dir.file("folder.json")), 120);
  EXPECT_NE(folder.code, 0);
  EXPECT_TRUE(has(folder.out, "ZERO_TRACE")) << folder.out;
  EXPECT_TRUE(has(folder.out, dir.file("folder.rank0.json"))) << folder.out;
  EXPECT_FALSE(has(folder.out, "batches/s")) << "refused before training\n" << folder.out;
  // One rank: the file is ZERO_TRACE itself, and may not be the config it reads.
  const auto over = run("env OMP_NUM_THREADS=1 ZERO_TRACE=" + config + " " + kBin + "mingpt --config " + config +
                        " --vocab_size 64 --block_size 32 --n_layer 1 --n_embd 32 --n_head 2 --limit_train_batches 2");
  EXPECT_NE(over.code, 0);
  EXPECT_TRUE(has(over.out, "ZERO_TRACE")) << over.out;
  EXPECT_TRUE(has(json::parse(read_text(config)).dump(), "zero_optimization")) << "the config is as it was";
}

}  // namespace
}  // namespace zero::test
