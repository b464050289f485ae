// zero launch, run as a user runs it (build/bin/zero launch ...) on small
// shell programs: torchrun's environment per rank, prefixed output that never
// splits a line, shutdown of every rank when one fails (SIGTERM, then SIGKILL
// after --kill-timeout), signal forwarding, exit codes and usage errors. Each
// test checks that the processes it started are gone afterwards.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "launch.h"
#include "tool_test_util.h"

extern char** environ;

namespace {

using zero::test::read_text;
using zero::test::TempDir;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const std::string kZero = std::string(ZERO_BINARY_DIR) + "/bin/zero";

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }


std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// True once `pid` no longer runs (gone, or a zombie nobody reaps: orphans in
// a container may be reparented to a pid 1 that does not reap).
bool process_gone(pid_t pid) {
  const auto deadline = Clock::now() + 30s;  // returns as soon as it is gone
  while (Clock::now() < deadline) {
    std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
    if (stat.empty()) return true;
    size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z') return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

pid_t read_pid(const std::string& path) {
  std::string text = read_text(path);
  return text.empty() ? -1 : static_cast<pid_t>(std::stol(text));
}

struct Result {
  int exit_code = -1;  // 128 + signal if the launcher was killed
  std::string out;
  std::string err;
  double seconds = 0;
};

struct RunOptions {
  std::map<std::string, std::string> env;  // added to ours; OMP_NUM_THREADS and RANK etc. are removed first
  std::chrono::seconds limit = 120s;  // only a hang reaches it, however loaded the machine
  std::function<void(pid_t launcher)> while_running;  // called once the launcher started
};

// Runs `zero launch ARGS...`, stdout and stderr to files in `dir`. A launcher
// still running after `limit` is killed and the test fails.
Result run_launch(const TempDir& dir, const std::vector<std::string>& args, const RunOptions& options = {}) {
  std::vector<std::string> argv = {kZero, "launch"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    std::string name = entry.substr(0, entry.find('='));
    if (name == "OMP_NUM_THREADS" || name == "RANK" || name == "WORLD_SIZE" || name == "MASTER_PORT")
      continue;
    env.push_back(entry);
  }
  for (const auto& [name, value] : options.env) env.push_back(name + "=" + value);
  std::vector<char*> argv_c, env_c;
  for (std::string& a : argv) argv_c.push_back(a.data());
  argv_c.push_back(nullptr);
  for (std::string& e : env) env_c.push_back(e.data());
  env_c.push_back(nullptr);

  const std::string out_path = dir.file("launcher.out"), err_path = dir.file("launcher.err");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty;
  sigemptyset(&empty);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  const auto start = Clock::now();
  int rc = ::posix_spawn(&pid, kZero.c_str(), &actions, &attr, argv_c.data(), env_c.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  Result result;
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << kZero << ": " << std::strerror(rc);
    return result;
  }
  if (options.while_running) options.while_running(pid);
  int status = 0;
  for (;;) {
    pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (Clock::now() - start > options.limit) {
      ADD_FAILURE() << "zero launch still running after " << options.limit.count() << " s; killing it";
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  result.out = read_text(out_path);
  result.err = read_text(err_path);
  return result;
}

// `/bin/sh -c SCRIPT sh DIR`: scripts find the test's directory in $1.
std::vector<std::string> sh(const std::vector<std::string>& options, const std::string& script,
                            const TempDir& dir) {
  std::vector<std::string> args = options;
  args.insert(args.end(), {"--", "/bin/sh", "-c", script, "sh", dir.path()});
  return args;
}

TEST(Launch, EveryRankGetsTorchrunEnvironmentAndOneFreePort) {
  TempDir dir;
  Result r =
      run_launch(dir, sh({"--nproc_per_node", "3"},
                         "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $ROLE_RANK "
                         "$MASTER_ADDR $MASTER_PORT\"; echo \"omp=$OMP_NUM_THREADS\" >&2",
                         dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // OMP_NUM_THREADS was unset: max(1, CPUs / 3) for every rank, and one line saying so.
  std::smatch omp;
  ASSERT_TRUE(std::regex_search(r.err, omp, std::regex(R"(\[rank 0\] omp=(\d+)\n)"))) << r.err;
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  EXPECT_GE(std::stoi(omp[1]), 1);
  EXPECT_LE(std::stoi(omp[1]), std::max(1, cpus / 3));
  EXPECT_NE(r.err.find("[rank 2] omp=" + std::string(omp[1]) + "\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("zero launch: OMP_NUM_THREADS is not set; setting it to " + std::string(omp[1]) +
                       " for each rank"),
            std::string::npos)
      << r.err;
  std::vector<std::string> lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  std::sort(lines.begin(), lines.end());
  std::regex line_re(R"(\[rank (\d)\] (\d) (\d) 3 3 0 (\d) 127\.0\.0\.1 (\d+))");
  std::string port;
  for (int rank = 0; rank < 3; ++rank) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[rank], m, line_re)) << lines[rank];
    EXPECT_EQ(m[1], std::to_string(rank));
    EXPECT_EQ(m[2], std::to_string(rank)) << "RANK";
    EXPECT_EQ(m[3], std::to_string(rank)) << "LOCAL_RANK";
    EXPECT_EQ(m[4], std::to_string(rank)) << "ROLE_RANK";
    if (rank == 0) port = m[5];
    EXPECT_EQ(m[5], port) << "every rank must see the same MASTER_PORT";
  }
  EXPECT_GT(std::stoi(port), 0);
  EXPECT_LE(std::stoi(port), 65535);
}

// --emulate_nodes: one launcher starts every node's ranks, each with the
// environment its own node's launcher would give it (GROUP_RANK the node,
// LOCAL_RANK within it), one free port, and an inherited ZERO_NODE_ID
// (which would override the node) dropped.
TEST(Launch, EmulatedNodesGiveEachRankItsNodeAndLocalRank) {
  TempDir dir;
  RunOptions o;
  o.env["ZERO_NODE_ID"] = "7";
  Result r = run_launch(dir,
                        sh({"--nnodes", "3", "--nproc_per_node", "2", "--emulate_nodes"},
                           "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE "
                           "$MASTER_ADDR $MASTER_PORT node=${ZERO_NODE_ID:-none}\"",
                           dir),
                        o);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 6u) << r.out;
  std::sort(lines.begin(), lines.end());
  const std::regex line_re(R"(\[rank (\d)\] (\d) (\d) 6 2 (\d) 3 127\.0\.0\.1 (\d+) node=none)");
  std::string port;
  for (int rank = 0; rank < 6; ++rank) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[rank], m, line_re)) << lines[rank];
    EXPECT_EQ(m[2], std::to_string(rank)) << "RANK";
    EXPECT_EQ(m[3], std::to_string(rank % 2)) << "LOCAL_RANK";
    EXPECT_EQ(m[4], std::to_string(rank / 2)) << "GROUP_RANK";
    if (rank == 0) port = m[5];
    EXPECT_EQ(m[5], port);
  }
  EXPECT_NE(port, "29500") << "a free port, not torchrun's multi-node default";
}

// torchrun's form: the first argument that is not an option starts PROGRAM.
TEST(Launch, ProgramWithoutDashesAsTorchrunTakesIt) {
  TempDir dir;
  std::vector<std::string> args = {"--nproc_per_node", "2", "/bin/sh", "-c", "echo \"r$RANK\"", "sh"};
  Result r = run_launch(dir, args);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("[rank 0] r0\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] r1\n"), std::string::npos) << r.out;
}

TEST(Launch, MasterAddressAndPortOptionsBothSpellings) {
  TempDir dir;
  RunOptions options;
  options.env["OMP_NUM_THREADS"] = "7";
  Result r = run_launch(dir,
                        sh({"--nproc_per_node=2", "--master_addr=10.1.2.3", "--master-port", "29511"},
                           "echo \"$RANK $WORLD_SIZE $MASTER_ADDR:$MASTER_PORT omp=$OMP_NUM_THREADS\"", dir),
                        options);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "") << "OMP_NUM_THREADS was set: no line about it";
  EXPECT_NE(r.out.find("[rank 0] 0 2 10.1.2.3:29511 omp=7\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[rank 1] 1 2 10.1.2.3:29511 omp=7\n"), std::string::npos) << r.out;
}

TEST(Launch, OutputIsPrefixedPerStreamAndPartialLinesAreFlushed) {
  TempDir dir;
  Result r =
      run_launch(dir, sh({"--nproc_per_node", "2"},
                         "printf 'one\\ntwo\\n'; echo \"warn $RANK\" >&2; printf \"tail $RANK\"", dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const std::string rank : {"0", "1"}) {
    const std::string p = "[rank " + rank + "] ";
    EXPECT_NE(r.out.find(p + "one\n" + p + "two\n"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(p + "tail " + rank + "\n"), std::string::npos) << r.out;
    EXPECT_NE(r.err.find(p + "warn " + rank + "\n"), std::string::npos) << r.err;
  }
  EXPECT_EQ(r.out.find("warn"), std::string::npos) << "stderr lines must stay on stderr";
  EXPECT_EQ(lines_of(r.out).size(), 6u) << r.out;
}

TEST(Launch, LinesFromManyRanksNeverInterleave) {
  TempDir dir;
  // Each rank writes 600 KB in lines of ~300 bytes: many pipe reads end mid-line.
  const std::string payload(290, 'x');
  Result r = run_launch(
      dir, sh({"--nproc_per_node", "3"},
              "i=0; while [ $i -lt 2000 ]; do echo \"$RANK $i " + payload + "\"; i=$((i+1)); done", dir));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<std::string> lines = lines_of(r.out);
  ASSERT_EQ(lines.size(), 6000u);
  std::regex line_re(R"(\[rank (\d)\] (\d) (\d+) x{290})");
  std::vector<int> next(3, 0);
  for (const std::string& line : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, line_re)) << "a split or mixed line: " << line.substr(0, 80);
    int rank = std::stoi(m[1]);
    ASSERT_EQ(m[2], m[1]);
    ASSERT_EQ(std::stoi(m[3]), next[rank]++) << "rank " << rank << "'s lines out of order";
  }
}

TEST(Launch, FailingRankStopsTheOthersAndGivesItsStatus) {
  TempDir dir;
  Result r = run_launch(dir, sh({"--nproc_per_node", "3", "--kill-timeout", "1"},
                                "if [ \"$RANK\" = 1 ]; then until [ -e \"$1/pid0\" ] && [ -e \"$1/pid2\" ]; do sleep 0.05; "
                                "done; exit 3; fi; "
                                "echo $$ > \"$1/pid$RANK.tmp\"; mv \"$1/pid$RANK.tmp\" \"$1/pid$RANK\"; exec sleep 300",
                                dir));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_LT(r.seconds, 60.0) << "the sleeping ranks must be stopped, not waited for";
  std::smatch m;
  EXPECT_TRUE(
      std::regex_search(r.err, m, std::regex(R"(zero launch: rank 1 \(pid \d+\) exited with status 3\n)")))
      << r.err;
  EXPECT_EQ(r.err.find("rank 0 (pid"), std::string::npos) << "only the first failure is reported: " << r.err;
  for (const char* f : {"pid0", "pid2"}) {
    pid_t pid = read_pid(dir.file(f));
    ASSERT_GT(pid, 0) << f;
    EXPECT_TRUE(process_gone(pid)) << f << " " << pid;
  }
}

TEST(Launch, RankIgnoringSigtermIsKilledAfterTheKillTimeout) {
  TempDir dir;
  Result r = run_launch(dir, sh({"--nproc_per_node", "2", "--kill-timeout=1"},
                                "if [ \"$RANK\" = 1 ]; then until [ -e \"$1/pid0\" ]; do sleep 0.05; done; exit 3; fi; "
                                "trap '' TERM; echo $$ > \"$1/pid0.tmp\"; mv \"$1/pid0.tmp\" \"$1/pid0\"; exec sleep 300",
                                dir));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  EXPECT_GE(r.seconds, 1.0) << "SIGKILL came before the kill timeout";
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_NE(r.err.find("zero launch: ranks still running 1 s after SIGTERM; sending SIGKILL"),
            std::string::npos)
      << r.err;
  pid_t pid = read_pid(dir.file("pid0"));
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(process_gone(pid));
}

TEST(Launch, RankKilledBySignalGives128PlusSignal) {
  TempDir dir;
  Result r = run_launch(dir, sh({"--nproc_per_node", "2", "--kill-timeout", "1"},
                                "if [ \"$RANK\" = 1 ]; then sleep 0.2; kill -9 $$; fi; exec sleep 300", dir));
  EXPECT_EQ(r.exit_code, 137) << r.err;
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex(R"(zero launch: rank 1 \(pid \d+\) was killed by signal SIGKILL\n)")))
      << r.err;
}

TEST(Launch, ProcessesLeftInARanksGroupAreKilled) {
  TempDir dir;
  // The background sleep keeps the rank's stdout open; the launcher must
  // still finish, and take the sleep with it.
  Result r =
      run_launch(dir, sh({"--nproc_per_node", "1"}, "sleep 300 & echo $! > \"$1/orphan\"; echo done", dir));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_EQ(r.out, "[rank 0] done\n");
  pid_t pid = read_pid(dir.file("orphan"));
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(process_gone(pid));
}

TEST(Launch, SigintIsForwardedToEveryRank) {
  TempDir dir;
  RunOptions options;
  options.while_running = [&](pid_t launcher) {
    const auto deadline = Clock::now() + 120s;
    while (Clock::now() < deadline && !(exists(dir.file("pid0")) && exists(dir.file("pid1")))) {
      std::this_thread::sleep_for(10ms);
    }
    std::this_thread::sleep_for(50ms);  // past the echo, into the exec'd sleep
    ::kill(launcher, SIGINT);
  };
  Result r = run_launch(dir,
                        sh({"--nproc_per_node", "2"},
                           "echo $$ > \"$1/pid$RANK.tmp\"; "
                           "mv \"$1/pid$RANK.tmp\" \"$1/pid$RANK\"; exec sleep 300",
                           dir),
                        options);
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.err;
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_NE(r.err.find("zero launch: received SIGINT; forwarding it to the ranks"), std::string::npos)
      << r.err;
  for (const char* f : {"pid0", "pid1"}) {
    pid_t pid = read_pid(dir.file(f));
    ASSERT_GT(pid, 0) << f;
    EXPECT_TRUE(process_gone(pid)) << f;
  }
}

TEST(Launch, ProgramThatCannotBeExecutedGives127) {
  TempDir dir;
  std::ofstream(dir.file("not_executable")) << "#!/bin/sh\necho hi\n";
  struct Case {
    std::string program;
    std::string reason;
  };
  ::mkdir(dir.file("folder").c_str(), 0755);
  for (const Case& c : {Case{dir.file("not_executable"),
                             "Permission denied (it is not executable: chmod +x " + dir.file("not_executable") + ")"},
                        Case{dir.file("folder"), "Permission denied (it is a folder; expected a program, an executable file)"},
                        Case{"no-such-program-in-path-zero", "No such file or directory"}}) {
    Result r = run_launch(dir, {"--nproc_per_node", "2", "--", c.program, "arg"});
    EXPECT_EQ(r.exit_code, 127) << c.program << "\n" << r.err;
    EXPECT_NE(r.err.find("zero launch: cannot execute " + c.program + ": " + c.reason + "\n"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "");
  }
}

// Parsing is tested in-process (launch() returns before starting anything):
// starting build/bin/zero costs most of a second of LibTorch loading.
TEST(LaunchOptions, UsageErrorsNameTheOptionAndWhatWasExpected) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--nproc_per_nod", "2", "--", "/bin/true"},
       "--nproc_per_nod: unknown option; did you mean --nproc_per_node?"},
      {{"--kill-timout", "1", "--", "/bin/true"},
       "--kill-timout: unknown option; did you mean --kill-timeout?"},
      {{"--master_prot=1", "--", "/bin/true"}, "--master_prot: unknown option; did you mean --master_port?"},
      {{"--frobnicate", "--", "/bin/true"}, "--frobnicate: unknown option\n"},
      {{"--nproc_per_node", "0", "--", "/bin/true"},
       "--nproc_per_node: expected a number of ranks >= 1; got \"0\""},
      {{"--nproc_per_node=two", "--", "/bin/true"},
       "--nproc_per_node: expected a number of ranks >= 1; got \"two\""},
      {{"--master_port", "70000", "--", "/bin/true"},
       "--master_port: expected a port number in 1..65535; got \"70000\""},
      {{"--master_addr=", "--", "/bin/true"}, "--master_addr: expected an address; got \"\""},
      {{"--kill-timeout", "-1", "--", "/bin/true"},
       "--kill-timeout: expected a number of seconds >= 0; got \"-1\""},
      {{"--nproc_per_node", "--", "/bin/true"}, "--nproc_per_node: expected a value"},
      {{"--nproc_per_node", "2"}, "expected PROGRAM ARGS... (or -- PROGRAM ARGS...) after the options"},
      {{"--nproc_per_node", "2", "--"}, "expected a PROGRAM after --"},
      {{"--emulate_nodes=1", "--", "/bin/true"}, "--emulate_nodes takes no value; got \"--emulate_nodes=1\""},
      {{"--nnodes", "2", "--emulate_nodes", "2", "--", "/bin/true"},
       "--emulate_nodes takes no value; got \"2\" after it (the nodes are --nnodes N)"},
      {{"--emulate_nodes", "--", "/bin/true"}, "--emulate_nodes goes with --nnodes N (N > 1)"},
      {{"--nnodes", "2", "--emulate_nodes", "--node_rank", "1", "--", "/bin/true"},
       "--emulate_nodes starts every node here, on 127.0.0.1: drop --node_rank"},
      {{"--nnodes", "2", "--emulate-nodes", "--master_addr", "10.0.0.1", "--", "/bin/true"},
       "--emulate_nodes starts every node here, on 127.0.0.1: drop --master_addr"},
  };
  for (const Case& c : cases) {
    testing::internal::CaptureStderr();
    const int code = zero::tools::launch(c.args);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(code, 2) << c.message;
    EXPECT_NE(err.find("zero launch: " + c.message), std::string::npos) << err;
    EXPECT_NE(err.find("usage: zero launch"), std::string::npos) << err;
  }
  testing::internal::CaptureStdout();
  EXPECT_EQ(zero::tools::launch({"--help"}), 0);
  EXPECT_NE(testing::internal::GetCapturedStdout().find("--kill-timeout SECONDS"), std::string::npos);
}

// The same through the binary: the command is wired into `zero`.
TEST(Launch, UnknownOptionSuggestsTheNearest) {
  TempDir dir;
  Result r = run_launch(dir, {"--nproc-per-nod", "2", "--", "/bin/true"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("zero launch: --nproc-per-nod: unknown option; did you mean --nproc_per_node?\n"),
            std::string::npos)
      << r.err;
}

}  // namespace
