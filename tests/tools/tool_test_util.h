// Helpers shared by the tools tests (one binary, tools_tests).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <ftw.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace zero::test {

// A fresh directory of plain files, removed with them on destruction. (Not
// std::filesystem::remove_all: libtorch.so, which this binary links through
// zero_runtime_core, exports a copy of it that crashes.)
class TempDir {
 public:
  TempDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/zero_tools_test.XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp " + pattern + ": " + std::strerror(errno));
    path_ = made;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {  // everything in it, folders too (nftw, not following links)
    ::nftw(
        path_.c_str(),
        [](const char* p, const struct stat*, int type, struct FTW*) {
          (type == FTW_DP ? ::rmdir(p) : ::unlink(p));
          return 0;
        },
        16, FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// Entries of a folder ("." and ".." left out), sorted.
inline std::set<std::string> entries(const std::string& path) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.insert(e->d_name);
    ::closedir(d);
  }
  return out;
}

/// The whole text of a file ("" when it cannot be read).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Running the binaries (build/bin/zero, build/bin/mingpt) as a user would.
using Clock = std::chrono::steady_clock;
// ZERO_TEST_BIN_DIR runs the cases against other binaries (an older build's,
// to see each case fail there).
const std::string kBin = std::getenv("ZERO_TEST_BIN_DIR") != nullptr ? std::string(std::getenv("ZERO_TEST_BIN_DIR")) + "/"
                                                                     : std::string(ZERO_BINARY_DIR) + "/bin/";
const std::string kConfigs = std::string(ZERO_SOURCE_DIR) + "/configs/";

struct Outcome {
  int code = -1;  // exit status; 128 + N when killed by signal N
  std::string out;
  double seconds = 0;
};

// `command` through sh, stdout and stderr together, at most `limit_s` seconds.
inline Outcome run(const std::string& command, int limit_s = 60) {
  Outcome r;
  const auto start = Clock::now();
  FILE* p = ::popen(("timeout -s KILL " + std::to_string(limit_s) + " " + command + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return r;
}

inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// torchrun's environment for rank `rank` of `world`, as a command prefix.
inline std::string rank_env(int rank, int world, int port, int timeout_s = 60) {
  return "env -u OMP_NUM_THREADS OMP_NUM_THREADS=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
         " WORLD_SIZE=" + std::to_string(world) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
         " RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) +
         " ZERO_COMM_TIMEOUT_S=" + std::to_string(timeout_s) + " ";
}

// Whether process `pid` runs: it exists and is not a zombie (an orphan's
// zombie may wait long for its reaper).
inline bool running(pid_t pid) {
  const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

// Waits for process `pid` to end (up to two minutes, returning as soon as it
// has); whether it did.
inline bool ended_within_two_minutes(pid_t pid) {
  for (int i = 0; i < 1200; ++i) {
    if (!running(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return !running(pid);
}

inline std::string write(const TempDir& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir.file(name)) << text;
  return dir.file(name);
}

}  // namespace zero::test
