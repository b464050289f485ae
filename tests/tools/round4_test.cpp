// Hardening, round 4 (issue 34): what a hostile user found in the Llama
// program, --save_hf and checkpoint export, zero tune -- PROGRAM, memcheck,
// the estimator's inputs, low-precision and 8-bit checkpoints and the run
// report's variables. Each case lost data, crashed, gave a wrong result
// without a word, left something behind, or said too little on the code
// before; it is a refusal naming what is wrong, or the right result, now.
// The binaries run as processes, as a user runs them; nothing here waits
// for a time, only for a file or a process.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "tiny_llama.h"
#include "tool_test_util.h"

namespace zero::test {
namespace {

// A safetensors file of header `header` (the JSON) and `data` bytes of 0.
std::string safetensors_bytes(const std::string& header, size_t data) {
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return file + header + std::string(data, '\0');
}

// Python with safetensors (scripts/setup.sh installs it), for files no
// program of ours writes.
Outcome python(const std::string& code) { return run("python3 -c '" + code + "'"); }

// ---- 1. no output over an input --------------------------------------------

TEST(Round4, NoCommandWritesOverWhatItReads) {
  TempDir dir;
  const std::string m = make_llama(dir);
  const std::string weights = read_text(m + "/model.safetensors");
  ASSERT_FALSE(weights.empty());
  const std::set<std::string> model_files = entries(m);
  struct Case {
    std::string command, message;
  };
  const std::string cfg = write(dir, "mingpt.json", R"({"train_micro_batch_size_per_gpu": 16, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
  write(dir, "ds_config.json", read_text(cfg));  // a base config at tune's default --out
  const std::vector<Case> cases = {
      {kBin + "llama logits --model " + m + " --tokens 1,2,3 --out " + m + "/model.safetensors",
       "--out " + m + "/model.safetensors: this command reads that file (--model's weights " + m + "/model.safetensors)"},
      {llama_train(dir, m, "--save_hf " + m), "--save_hf " + m + ": holds --model's config.json " + m + "/config.json"},
      {llama_train(dir, m, "--summary-json " + dir.file("ds.json")), "this command reads that file (--config "},
      {llama_train(dir, m, "--summary-json " + dir.file("tok.bin")), "this command reads that file (--data "},
      {kBin + "mingpt --config " + cfg + kTiny + "--summary-json " + cfg, "this command reads that file (--config "},
      {kBin + "zero estimate --hf-config " + m + "/config.json --json " + m + "/config.json",
       "this command reads that file (--hf-config "},
      {kBin + "zero estimate --weights " + m + " --json " + m + "/model.safetensors", "(--weights " + m + "/model.safetensors)"},
      {"env -C " + dir.path() + " " + kBin +
           "zero tune --model mingpt:1,32 --device-memory 1GiB --host-memory 1GiB --config ds_config.json",
       "a tune never writes over its own --config: give --out FILE"},
      {kBin + "zero tune --model mingpt:1,32 --device-memory 1GiB --host-memory 1GiB --config " + cfg + " --out " + cfg,
       "this command reads that file (--config "},
      {kBin + "zero memcheck record --baseline " + cfg + " -- " + kBin + "mingpt --config " + cfg + kTiny,
       "this command reads that file (the program's argument " + cfg + ")"},
      {kBin + "zero memcheck record --baseline " + kBin + "mingpt -- " + kBin + "mingpt --config " + cfg + kTiny,
       "this command reads that file (the program "},
  };
  for (const auto& c : cases) {
    const Outcome r = run(c.command);
    EXPECT_EQ(r.code, 2) << c.command << "\n" << r.out;
    EXPECT_TRUE(has(r.out, c.message)) << c.command << "\n" << r.out;
  }
  EXPECT_EQ(read_text(m + "/model.safetensors"), weights);
  EXPECT_EQ(entries(m), model_files);
  EXPECT_EQ(read_text(dir.file("ds.json")), kDs);
  EXPECT_TRUE(has(read_text(cfg), "\"optimizer\""));
  // An existing baseline is replaced only with --force, and the run says so.
  write(dir, "base.json", "an earlier baseline\n");
  const std::string record = kBin + "zero memcheck record --baseline " + dir.file("base.json") + " --steps 1 -- " + kBin +
                             "mingpt --config " + cfg + kTiny + "--limit_train_batches 4";
  Outcome r = run(record);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "record writes over it only with --force")) << r.out;
  EXPECT_EQ(read_text(dir.file("base.json")), "an earlier baseline\n");
  r = run(record + " --force", 300);
  EXPECT_EQ(r.code, 2) << r.out;  // --force is record's option: before the --
  r = run(kBin + "zero memcheck record --force --baseline " + dir.file("base.json") + " --steps 1 -- " + kBin +
              "mingpt --config " + cfg + kTiny + "--limit_train_batches 4",
          300);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "replacing the earlier baseline (--force)")) << r.out;
}

// An export replaces only what an earlier export wrote (its record), in a
// fresh folder swapped in whole; a user's file of an export's name is
// refused; what a killed export left is removed by the next.
TEST(Round4, AnExportReplacesOnlyTheFilesOfAnEarlierExport) {
  TempDir dir;
  const std::string ck = dir.file("ck");
  Outcome r = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny +
                  "--limit_train_batches 4 --stop_after_steps 2 --save_dir " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string out = dir.file("hf");
  r = run(kBin + "zero checkpoint export " + ck + " " + out + " --hf --max-shard-size 20KiB");
  ASSERT_EQ(r.code, 0) << r.out;
  int shards = 0;
  for (const auto& n : entries(out)) shards += n.rfind("model-", 0) == 0;
  EXPECT_GE(shards, 2) << "a small shard size makes several";
  write(dir, "hf/model-best-of-3.safetensors", "the user's own\n");
  write(dir, "hf/tokenizer.json", "{}\n");
  // A fresh folder of an export killed outright (its lock is free).
  ::mkdir(dir.file(".hf.zero-export-AbC123").c_str(), 0700);
  write(dir, ".hf.zero-export-AbC123/model.safetensors.tmp", std::string(1 << 16, 'x'));
  r = run(kBin + "zero checkpoint export " + ck + " " + out + " --hf");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "removed .hf.zero-export-AbC123, left by an export that did not finish")) << r.out;
  EXPECT_EQ(entries(out), (std::set<std::string>{".zero-export.json", "model-best-of-3.safetensors", "model.safetensors",
                                                 "tokenizer.json"}));
  EXPECT_EQ(read_text(out + "/model-best-of-3.safetensors"), "the user's own\n");
  EXPECT_FALSE(has(read_text(out + "/.zero-export.json"), "model-0000")) << read_text(out + "/.zero-export.json");
  for (const auto& n : entries(dir.path())) EXPECT_EQ(n.find(".zero-export-"), std::string::npos) << n;
  // A folder that holds a model.safetensors of the user's (no record).
  const std::string mine = dir.file("mine");
  ::mkdir(mine.c_str(), 0755);
  write(dir, "mine/model.safetensors", "the user's weights\n");
  r = run(kBin + "zero checkpoint export " + ck + " " + mine + " --hf");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "holds model.safetensors, which no earlier export of zero's wrote")) << r.out;
  EXPECT_EQ(read_text(mine + "/model.safetensors"), "the user's weights\n");
  // Inside the checkpoint it reads, a new folder included (it used to pass).
  r = run(kBin + "zero checkpoint export " + ck + " " + ck + "/new/hf --hf");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "lies inside the checkpoint folder DIR")) << r.out;
  EXPECT_FALSE(::access((ck + "/new").c_str(), F_OK) == 0);
}

// ---- 3. results that were wrong without a word ------------------------------

// A folder with model.safetensors and a sharded index: transformers reads
// model.safetensors, and so does zero now. A tied head with its own
// lm_head.weight in the file: tied as transformers ties it, and the unused
// tensor named. --model D/config.json loads D's weights.
TEST(Round4, HfFoldersAreReadAsTransformersReadsThem) {
  TempDir dir;
  const std::string m = make_llama(dir);
  const std::string logits = kBin + "llama logits --tokens 1,2,3 --model ";
  Outcome r = run(logits + m + " --out " + dir.file("a.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  // Shards of other values beside model.safetensors.
  r = python("import json; from safetensors.torch import load_file, save_file; d=\"" + m +
             "\"; t=load_file(d+\"/model.safetensors\"); save_file({k: v * 2 for k, v in t.items()}, "
             "d+\"/model-00001-of-00001.safetensors\", metadata={\"format\": \"pt\"}); "
             "json.dump({\"metadata\": {}, \"weight_map\": {k: \"model-00001-of-00001.safetensors\" for k in t}}, "
             "open(d+\"/model.safetensors.index.json\", \"w\"))");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run(logits + m + " --out " + dir.file("b.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_text(dir.file("a.safetensors")), read_text(dir.file("b.safetensors"))) << "the shards were read";
  EXPECT_TRUE(has(r.out, "load_weights " + m)) << r.out;
  // --model names the config.json: the weights beside it load.
  r = run(logits + m + "/config.json --out " + dir.file("c.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(read_text(dir.file("a.safetensors")), read_text(dir.file("c.safetensors")));
  r = run(llama_train(dir, m + "/config.json", ""));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "load_weights " + m)) << r.out;
  EXPECT_FALSE(has(r.out, "fresh initialisation")) << r.out;
  // tie_word_embeddings true with lm_head.weight in the file.
  r = python("import json; d=\"" + m + "\"; c=json.load(open(d+\"/config.json\")); c[\"tie_word_embeddings\"]=True; "
             "json.dump(c, open(d+\"/config.json\", \"w\"))");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run(logits + m + " --out " + dir.file("t.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "tensor(s) of tied parameters not used: lm_head.weight (tied to model.embed_tokens.weight)"))
      << r.out;
}

// Another family's config.json, with or without its model_type, is refused
// by the keys that would change the arithmetic; its problems are headed as
// a Hugging Face config's.
TEST(Round4, OtherFamiliesAreRefusedNamingWhatZeroDoesNotBuild) {
  TempDir dir;
  const std::string base = R"("vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2)";
  ::mkdir(dir.file("mistral").c_str(), 0755);
  ::mkdir(dir.file("gemma").c_str(), 0755);
  write(dir, "mistral/config.json", "{" + base + R"(, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})");
  write(dir, "gemma/config.json", "{" + base + R"(, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256})");
  Outcome r = run(kBin + "llama logits --model " + dir.file("mistral") + " --tokens 1 --out " + dir.file("o.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "2 problems in the Hugging Face config " + dir.file("mistral/config.json"))) << r.out;
  EXPECT_TRUE(has(r.out, "architectures: expected [\"LlamaForCausalLM\"] (zero::models builds LlamaForCausalLM only); "
                         "got [\"MistralForCausalLM\"]")) << r.out;
  EXPECT_TRUE(has(r.out, "sliding_window: Llama attends to every earlier token")) << r.out;
  EXPECT_FALSE(has(r.out, "DeepSpeed config")) << r.out;
  r = run(kBin + "zero estimate --hf-config " + dir.file("gemma/config.json"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "hidden_activation: expected \"silu\"")) << r.out;
  EXPECT_TRUE(has(r.out, "query_pre_attn_scalar: a key of Gemma's attention")) << r.out;
}

// The estimator refuses overflow and nonsense, naming the value, instead of
// answering with a negative model that fits.
TEST(Round4, TheEstimatorRefusesOverflowAndNonsense) {
  TempDir dir;
  write(dir, "huge.json", R"({"vocab_size": 64, "hidden_size": 1048576, "intermediate_size": 48, "num_hidden_layers": 2,
                              "num_attention_heads": 65536, "head_dim": 65536})");
  Outcome r = run(kBin + "zero estimate --hf-config " + dir.file("huge.json") + " --device-memory 80GB --host-memory 1TB");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "parameters from hidden_size 1048576, num_attention_heads 65536 x head_dim 65536")) << r.out;
  EXPECT_TRUE(has(r.out, "expected at most 1e15")) << r.out;
  EXPECT_FALSE(has(r.out, "fits")) << r.out;
  // safetensors headers with shapes that are nonsense.
  for (const auto& [name, shape, message] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"neg", "[-8,-8]", "has a negative dimension"},
           {"big", "[4294967296,4294967296]", "holds more bytes than the file's"}}) {
    write(dir, name + ".safetensors",
          safetensors_bytes("{\"w\": {\"dtype\": \"F32\", \"shape\": " + shape + ", \"data_offsets\": [0, 256]}}", 256));
    r = run(kBin + "zero estimate --weights " + dir.file(name + ".safetensors"));
    EXPECT_NE(r.code, 0) << name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "tensor w has shape " + shape + ", which " + message)) << r.out;
  }
  // Headers the safetensors library refuses: a shape of fractions, two
  // tensors over the same bytes, bytes after the last tensor.
  for (const auto& [name, tensors, tail, message] : std::vector<std::tuple<std::string, std::string, int, std::string>>{
           {"frac", R"("w": {"dtype": "F32", "shape": [8, 8.5], "data_offsets": [0, 256]})", 256,
            "tensor w's shape [8,8.5] is not a list of whole numbers"},
           {"overlap",
            R"("a": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}, "b": {"dtype": "F32", "shape": [32], "data_offsets": [128, 256]})",
            256, "starts at data byte 128; expected 256 (it overlaps the tensor before it"},
           {"trailing", R"("w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]})", 300,
            "44 bytes after its last tensor"}}) {
    write(dir, name + ".safetensors", safetensors_bytes("{" + tensors + "}", static_cast<size_t>(tail)));
    r = run(kBin + "zero estimate --weights " + dir.file(name + ".safetensors"));
    EXPECT_NE(r.code, 0) << name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << name << "\n" << r.out;
  }
  // A run report with a negative peak, a micro-batch of 0, a later version.
  r = run("env OMP_NUM_THREADS=1 ZERO_RUN_REPORT=" + dir.file("r") + " ZERO_STOP_AFTER_STEPS=1 " + kBin + "mingpt --config " +
          kConfigs + "mingpt_zero2.json" + kTiny + "--limit_train_batches 4");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const auto& [edit, message] : std::vector<std::pair<std::string, std::string>>{
           {"j[\"peak_bytes\"][\"device\"] = -5", "peak_bytes.device: expected a byte count, 0 or more; got -5"},
           {"j[\"config\"][\"train_micro_batch_size_per_gpu\"] = 0",
            "config.train_micro_batch_size_per_gpu: expected 1 or more; got 0"},
           {"j[\"version\"] = 99", "a run report of version 99; this zero reads version 1"}}) {
    r = python("import json; j=json.load(open(\"" + dir.file("r.rank0") + "\")); " + edit + "; json.dump(j, open(\"" +
               dir.file("bad") + "\", \"w\"))");
    ASSERT_EQ(r.code, 0) << r.out;
    r = run(kBin + "zero estimate --calibrate " + dir.file("bad") + " --device-memory 1GiB --host-memory 1GiB");
    EXPECT_NE(r.code, 0) << edit << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << edit << "\n" << r.out;
  }
}

// An 8-bit checkpoint whose meta.json lost its fp32_blocks states: verify
// used to say OK and a resume diverged; both refuse it now.
TEST(Round4, AMetaJsonThatLostStatesIsCaught) {
  TempDir dir;
  const std::string cfg = write(dir, "q8.json", R"({"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "optim_bits": 8}}})");
  const std::string ck = dir.file("ck");
  Outcome r = run(kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --stop_after_steps 2 --save_dir " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_EQ(run(kBin + "zero checkpoint verify " + ck).code, 0);
  r = python("import json; p=\"" + ck + "/global_step2/meta.json\"; j=json.load(open(p)); "
             "j[\"states\"]=[s for s in j[\"states\"] if not s.endswith(\"fp32_blocks\")]; json.dump(j, open(p, \"w\"))");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run(kBin + "zero checkpoint verify " + ck);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "holds the state exp_avg.fp32_blocks, which meta.json's \"states\" does not list")) << r.out;
  r = run(kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --resume " + ck);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "meta.json does not describe the files it came with")) << r.out;
}

// ZERO_STOP_AFTER_STEPS set by hand: mingpt stops there and still writes
// what it was asked for (summary, final checkpoint), saying so; with 0 it
// trains nothing, and says that too. No writer lock stays behind.
// ZERO_RUN_REPORT naming a folder or a device is refused.
TEST(Round4, TheRunReportVariablesAreNeverSilent) {
  TempDir dir;
  const std::string cfg = kConfigs + "mingpt_zero2.json";
  for (const int steps : {2, 0}) {
    const std::string ck = dir.file("ck" + std::to_string(steps)), summary = dir.file("s" + std::to_string(steps));
    const Outcome r = run("env ZERO_STOP_AFTER_STEPS=" + std::to_string(steps) + " " + kBin + "mingpt --config " + cfg + kTiny +
                          "--limit_train_batches 8 --save_dir " + ck + " --summary-json " + summary);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has(r.out, "stopped after step " + std::to_string(steps))) << r.out;
    EXPECT_TRUE(has(read_text(summary), "\"steps\": " + std::to_string(steps))) << read_text(summary);
    EXPECT_EQ(entries(ck).count(".zero-lock"), 0u);
    EXPECT_EQ(entries(ck).count("global_step" + std::to_string(steps)), 1u) << r.out;
  }
  ::mkdir(dir.file("reports").c_str(), 0755);
  for (const auto& [value, message] : std::vector<std::pair<std::string, std::string>>{
           {dir.file("reports"), "ZERO_RUN_REPORT=" + dir.file("reports") + ": is a folder; expected a file name prefix"},
           {"/dev/null", "ZERO_RUN_REPORT=/dev/null: is not a regular file"}}) {
    const Outcome r = run("env ZERO_RUN_REPORT=" + value + " " + kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 2");
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_TRUE(has(r.out, message)) << r.out;
  }
  EXPECT_TRUE(entries(dir.file("reports")).empty());
  EXPECT_NE(::access("/dev/null.rank0", F_OK), 0);
}

// ---- 4. leftovers ----------------------------------------------------------

// The program's own children go with it: a memcheck killed outright (kill
// -9) leaves none of the program's processes running.
TEST(Round4, AToolKilledOutrightTakesTheProgramsChildrenAlong) {
  TempDir dir;
  const std::string script = write(dir, "prog.sh", "#!/bin/sh\nsleep 1000 &\necho $! > " + dir.file("child.pid") +
                                                       "\nwait\n");
  ::chmod(script.c_str(), 0755);
  const pid_t tool = ::fork();
  if (tool == 0) {
    ::execl((kBin + "zero").c_str(), "zero", "memcheck", "record", "--baseline", dir.file("b.json").c_str(), "--",
            script.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  pid_t child = 0;
  for (int i = 0; i < 1200 && child == 0; ++i) {  // until the program has started its child
    child = static_cast<pid_t>(std::atoi(read_text(dir.file("child.pid")).c_str()));
    if (child == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GT(child, 0);
  ASSERT_TRUE(running(child));
  ::kill(tool, SIGKILL);
  int status = 0;
  ::waitpid(tool, &status, 0);
  EXPECT_TRUE(ended_within_two_minutes(child)) << "the program's child " << child << " outlived the tool";
  // A tool killed outright cannot remove its scratch folder; the next one
  // removes it (its lock is free), which the leak check after this test sees.
  const Outcome next = run(kBin + "zero memcheck record --baseline " + dir.file("b2.json") + " -- true");
  EXPECT_NE(next.code, 0) << "`true` trains no step\n" << next.out;
}

// A failed run leaves no empty folder its early checks would have made.
TEST(Round4, AFailedRunLeavesNoFoldersBehind) {
  TempDir dir;
  const std::string save = dir.file("new/ck"), hf = dir.file("out/hf");
  Outcome r = run(kBin + "mingpt --config " + kConfigs + "mingpt_zero2.json" + kTiny + "--device-memory 4KiB --save_dir " + save);
  EXPECT_EQ(r.code, 3) << r.out;  // out of memory at initialize
  EXPECT_NE(::access(dir.file("new").c_str(), F_OK), 0) << "left " << dir.file("new");
  const std::string m = make_llama(dir);
  r = run(llama_train(dir, m, "--device-memory 4KiB --save_hf " + hf + " --save_dir " + save));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(::access(dir.file("out").c_str(), F_OK), 0) << "left " << dir.file("out");
  EXPECT_NE(::access(dir.file("new").c_str(), F_OK), 0) << "left " << dir.file("new");
}

// ---- 5. errors that say what is wrong -----------------------------------------

TEST(Round4, ErrorsNameTheFlagTheKeyOrTheFile) {
  TempDir dir;
  const std::string m = make_llama(dir);
  // --save_hf at stage 3 without the gather key: before training.
  write(dir, "z3.json", R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
                            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
  Outcome r = run(kBin + "llama train --model " + m + " --config " + dir.file("z3.json") + " --data " + dir.file("tok.bin") +
                  " --block_size 8 --steps 1 --save_hf " + dir.file("out"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--save_hf " + dir.file("out") + ": " + dir.file("z3.json") +
                             ": zero_optimization.stage3_gather_16bit_weights_on_model_save: expected true")) << r.out;
  EXPECT_FALSE(has(r.out, "train [")) << "it trained first:\n" << r.out;
  // A tensor of another dtype where the model has a weight.
  ::mkdir(dir.file("int").c_str(), 0755);
  r = python("from safetensors.torch import load_file, save_file; t=load_file(\"" + m + "/model.safetensors\"); "
             "t[\"lm_head.weight\"]=t[\"lm_head.weight\"].int(); save_file(t, \"" + dir.file("int/model.safetensors") +
             "\", metadata={\"format\": \"pt\"})");
  ASSERT_EQ(r.code, 0) << r.out;
  ::symlink((m + "/config.json").c_str(), dir.file("int/config.json").c_str());
  r = run(kBin + "llama logits --model " + dir.file("int") + " --tokens 1 --out " + dir.file("o.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "lm_head.weight in " + dir.file("int") + "/model.safetensors is I32; expected a floating-point tensor"))
      << r.out;
  // A folder, a loop and a dangling link where a file is expected.
  ::symlink(dir.file("loop").c_str(), dir.file("loop").c_str());
  ::symlink(dir.file("gone.json").c_str(), dir.file("dangling.json").c_str());
  for (const auto& [command, message] : std::vector<std::pair<std::string, std::string>>{
           {kBin + "mingpt --config " + dir.file("dangling.json") + kTiny,
            dir.file("dangling.json") + ": a dangling link (to " + dir.file("gone.json") + ", which does not exist)"},
           {kBin + "mingpt --config " + dir.file("loop") + kTiny, dir.file("loop") + ": a loop of symbolic links"},
           {kBin + "zero estimate --hf-config " + dir.file("loop"), "a loop of symbolic links"},
           {kBin + "zero estimate --weights " + dir.file("dangling.json"), "a dangling link"},
           {llama_train(dir, m, "").replace(llama_train(dir, m, "").find(dir.file("tok.bin")), dir.file("tok.bin").size(),
                                            dir.path()),
            "--data " + dir.path() + ": is a folder; expected a file"},
           {kBin + "zero memcheck check --baseline " + dir.file("dangling.json") + " -- true", "a dangling link"},
           {kBin + "mingpt --config '{\"train_batch_size\": 16}'" + kTiny,
            "--config {\"train_batch_size\": 16}: no such file; --config takes the path of a DeepSpeed config file"},
           {kBin + "zero tune --model mingpt:1,32 --device-memory 1GiB --host-memory 1GiB --nvme-path " + dir.file("tok.bin"),
            "--nvme-path " + dir.file("tok.bin") + ": is a file; expected a folder"},
           {kBin + "zero nvme-tune --path " + dir.file("tok.bin"), "--path " + dir.file("tok.bin") + ": is a file"},
           {kBin + "zero nvme-tune --path /proc", "--path /proc: cannot write in the folder"},
           {llama_train(dir, m, "").replace(llama_train(dir, m, "").find("--block_size 8"), 14, "--block_size 100"),
            "--block_size 100: more than the model's max_position_embeddings 64"},
           {llama_train(dir, m, "--save_dir " + dir.file("ck") + " --save_hf " + dir.file("ck") + "/global_step1"),
            "which a save there replaces"},
       }) {
    r = run(command);
    EXPECT_NE(r.code, 0) << command << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << command << "\n" << r.out;
  }
  // llama logits reads a training config with "auto" values.
  write(dir, "auto.json", R"({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}})");
  r = run(kBin + "llama logits --model " + m + " --config " + dir.file("auto.json") + " --tokens 1,2 --out " +
          dir.file("auto.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  // --slack 0 is a slack (its default), not an error.
  r = run(kBin + "zero memcheck check --baseline " + dir.file("none.json") + " --slack 0 -- true");
  EXPECT_FALSE(has(r.out, "--slack")) << r.out;
  // zero tune's base config may leave the micro-batch to it.
  write(dir, "nobatch.json", R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
  r = run(kBin + "zero tune --model mingpt:1,32 --device-memory 1KiB --host-memory 1KiB --config " + dir.file("nobatch.json") +
          " --out " + dir.file("t.json"));
  EXPECT_FALSE(has(r.out, "train_batch_size or train_micro_batch_size_per_gpu")) << r.out;
  // Keys that would do nothing say so.
  write(dir, "quiet.json", R"({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
      "bf16": {"enabled": true, "stochastic_rounding": false},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "min_8bit_size": 0}}})");
  r = run(kBin + "zero config check " + dir.file("quiet.json"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "optimizer.params.min_8bit_size: ignored")) << r.out;
  EXPECT_TRUE(has(r.out, "bf16.stochastic_rounding: ignored: it rounds a 16-bit master")) << r.out;
}

// ---- 7. what a second hostile read found ---------------------------------------

// A save replaces only a checkpoint: a user's global_step2 folder, a
// `latest` that is a folder, an output named like a save's entry, are
// refused before training, and what the user had stays.
TEST(Round4, ASaveReplacesOnlyCheckpoints) {
  TempDir dir;
  const std::string cfg = kConfigs + "mingpt_zero2.json";
  const std::string train = kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --stop_after_steps 2 ";
  const std::string d = dir.file("ck");
  ::mkdir(d.c_str(), 0755);
  ::mkdir((d + "/global_step2").c_str(), 0755);
  write(dir, "ck/global_step2/notes.txt", "the user's notes\n");
  Outcome r = run(train + "--save_dir " + d);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "holds " + d + "/global_step2, which is not a checkpoint")) << r.out;
  EXPECT_FALSE(has(r.out, "train [")) << "it trained first:\n" << r.out;
  EXPECT_EQ(read_text(d + "/global_step2/notes.txt"), "the user's notes\n");
  ::unlink((d + "/global_step2/notes.txt").c_str());
  ::rmdir((d + "/global_step2").c_str());
  ::mkdir((d + "/latest").c_str(), 0755);
  r = run(train + "--save_dir " + d);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "holds " + d + "/latest, which is not a file")) << r.out;
  ::rmdir((d + "/latest").c_str());
  // Outputs where a save writes.
  for (const std::string& name : {"latest", "global_step2/summary.json", ".x.incoming"}) {
    r = run(train + "--save_dir " + d + " --summary-json " + d + "/" + name);
    EXPECT_EQ(r.code, 2) << name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "which a save there replaces")) << name << "\n" << r.out;
  }
  // The same run saves, and verify --clean leaves a user's folder of a
  // save's working name alone (it holds files no save writes).
  r = run(train + "--save_dir " + d);
  ASSERT_EQ(r.code, 0) << r.out;
  ::mkdir((d + "/.mine.incoming").c_str(), 0755);
  write(dir, "ck/.mine.incoming/data.txt", "kept\n");
  ::mkdir((d + "/.global_step9.incoming").c_str(), 0755);
  write(dir, "ck/.global_step9.incoming/rank00000.safetensors", "left by a killed save");
  r = run(kBin + "zero checkpoint verify " + d + " --clean");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "removed .global_step9.incoming")) << r.out;
  EXPECT_EQ(read_text(d + "/.mine.incoming/data.txt"), "kept\n");
}

// zero tune replaces its own files (it marks them), anything else at --out
// or --json only with --force.
TEST(Round4, TuneReplacesOnlyItsOwnFiles) {
  TempDir dir;
  write(dir, "notes.json", "{\"mine\": 1}\n");
  const std::string tune = kBin + "zero tune --model mingpt:1,32 --device-memory 1GiB --host-memory 1GiB ";
  Outcome r = run(tune + "--out " + dir.file("notes.json"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--out " + dir.file("notes.json") + ": exists and was not written by zero tune; give --force"))
      << r.out;
  r = run(tune + "--out " + dir.file("new.json") + " --json " + dir.file("notes.json"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--json " + dir.file("notes.json") + ": exists and was not written by zero tune")) << r.out;
  write(dir, "ds_config.json", read_text(dir.file("notes.json")));
  r = run("env -C " + dir.path() + " " + tune);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--out (default) ds_config.json: exists and was not written by zero tune")) << r.out;
  EXPECT_EQ(read_text(dir.file("notes.json")), "{\"mine\": 1}\n");
  EXPECT_EQ(read_text(dir.file("ds_config.json")), "{\"mine\": 1}\n");
}

// The export's record keeps each file's size and time: a config.json the
// user edited after an export is theirs now, and the next export refuses
// to replace it. --config must be a model's config.json, of this model.
TEST(Round4, AnExportKeepsFilesChangedSinceAndChecksItsConfig) {
  TempDir dir;
  const std::string m = make_llama(dir);
  const std::string ck = dir.file("ck");
  Outcome r = run(llama_train(dir, m, "--save_dir " + ck));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string out = dir.file("hf"), exp = kBin + "zero checkpoint export " + ck + " " + out + " --hf --config ";
  r = run(exp + dir.file("ds.json"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--config " + dir.file("ds.json") + ": has no \"model_type\"")) << r.out;
  write(dir, "other.json", R"({"model_type": "llama", "vocab_size": 128, "hidden_size": 32})");
  r = run(exp + dir.file("other.json"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "vocab_size is 128, but the checkpoint's model.embed_tokens.weight has shape [64, 32]")) << r.out;
  r = run(exp + m + "/config.json");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run(exp + m + "/config.json");
  ASSERT_EQ(r.code, 0) << "an export replaces its own files:\n" << r.out;
  write(dir, "hf/config.json", read_text(out + "/config.json") + " ");  // edited by hand
  r = run(exp + m + "/config.json");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "holds config.json, which an earlier export wrote but something has changed since")) << r.out;
  EXPECT_EQ(read_text(out + "/config.json").back(), ' ');
}

// A damaged meta.json is refused by name: a chunk of 0 elements divided by
// zero (SIGFPE), a negative one looped, a world size of text was read as
// a count; mingpt's position of a damaged client_state is refused too.
TEST(Round4, ADamagedMetaJsonIsRefusedByName) {
  TempDir dir;
  const std::string cfg = kConfigs + "mingpt_zero2.json";
  const std::string ck = dir.file("ck");
  Outcome r = run(kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --stop_after_steps 2 --save_dir " + ck);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string meta = ck + "/global_step2/meta.json", kept = read_text(meta);
  for (const auto& [edit, message] : std::vector<std::pair<std::string, std::string>>{
           {"j[\"layout\"][\"groups\"][0][\"chunk_numel\"] = 0", "has chunk_numel 0; expected 1 or more"},
           {"j[\"layout\"][\"groups\"][0][\"chunk_numel\"] = -4096", "has chunk_numel -4096; expected 1 or more"},
           {"j[\"layout\"][\"groups\"][0][\"params\"][0][\"offset\"] = 10**12", "lies outside its group's"},
           {"j[\"layout\"][\"groups\"][0][\"params\"][0][\"shape\"] = [-1, 4]", "which is not a tensor's shape"},
           {"j[\"world_size\"] = \"two\"", "world_size: expected an integer from 1 to"},
           {"j[\"global_steps\"] = -3", "global_steps: expected an integer from 0 to"}}) {
    r = python("import json; p=\"" + meta + "\"; j=json.load(open(p)); " + edit + "; json.dump(j, open(p, \"w\"))");
    ASSERT_EQ(r.code, 0) << r.out;
    r = run(kBin + "zero checkpoint verify " + ck, 60);
    EXPECT_EQ(r.code, 1) << edit << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << edit << "\n" << r.out;
    r = run(kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --resume " + ck, 60);
    EXPECT_NE(r.code, 0) << edit << "\n" << r.out;
    EXPECT_TRUE(has(r.out, message)) << edit << "\n" << r.out;
    write(dir, "ck/global_step2/meta.json", kept);
  }
  r = python("import json; p=\"" + meta + "\"; j=json.load(open(p)); j[\"client_state\"][\"step_in_epoch\"] = -1; "
             "json.dump(j, open(p, \"w\"))");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run(kBin + "mingpt --config " + cfg + kTiny + "--limit_train_batches 4 --resume " + ck, 60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "client_state.step_in_epoch: expected a whole number, 0 or more; got -1")) << r.out;
}

// ZERO_RUN_REPORT naming the config the run reads (as rank 0's file).
TEST(Round4, TheRunReportIsNeverTheConfig) {
  TempDir dir;
  const std::string cfg = write(dir, "rep.rank0", read_text(kConfigs + "mingpt_zero2.json"));
  const Outcome r = run("env ZERO_RUN_REPORT=" + dir.file("rep") + " " + kBin + "mingpt --config " + cfg + kTiny +
                        "--limit_train_batches 2");
  EXPECT_NE(r.code, 0) << r.out;
  // The program checks the environment's outputs with its own (issue 51).
  EXPECT_TRUE(has(r.out, "this command reads that file (--config " + cfg + ")")) << r.out;
  EXPECT_EQ(read_text(cfg), read_text(kConfigs + "mingpt_zero2.json"));
}

// ---- 6. configs that leave the optimizer to the program -----------------------

// Three real configs of trainers that pass their own optimizer (axolotl's,
// FastChat's, accelerate's) and DeepSpeed's own test config without one
// train with mingpt's optimizer (NOTE [client optimizer]).
TEST(Round4, ConfigsWithoutAnOptimizerTrainWithTheProgramsOwn) {
  const std::string corpus = std::string(ZERO_SOURCE_DIR) + "/tests/config/ds_configs/";
  for (const char* name : {"11_axolotl_zero3_bf16_cpuoffload_all_unprefixed.json", "13_fastchat_s2_minimal_auto.json",
                           "07_accelerate_alst_seq_parallel_comm_dtype.json",
                           "37_deepspeed_megatron_gpt2_scheduler_no_optimizer.json"}) {
    const Outcome check = run(kBin + "zero config check " + corpus + name);
    EXPECT_EQ(check.code, 0) << name << "\n" << check.out;
    EXPECT_TRUE(has(check.out, "the program must pass its own optimizer")) << name << "\n" << check.out;
    // The configs set their own micro-batch: no --batch_size here.
    const Outcome r = run(kBin + "mingpt --config " + corpus + name +
                              " --n_layer 1 --n_embd 32 --n_head 2 --limit_train_batches 4 --optimizer adamw",
                          300);
    EXPECT_FALSE(has(r.out, corpus + name + ": " + corpus + name)) << "the file named twice\n" << r.out;
    EXPECT_EQ(r.code, 0) << name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "optimizer: the program's torch::optim::AdamW")) << name << "\n" << r.out;
  }
}

}  // namespace
}  // namespace zero::test
