// Linked into every test binary (tests/CMakeLists.txt): nothing a test runs
// may leave files behind, whether it passed or failed on purpose.
//
// - The temporary folder: each test process gets a private TMPDIR (inherited
//   by the ranks and tools it starts), and after every test it must hold
//   nothing that was not there before the test.
// - Swap folders: after every test, no folder named zero-swap-HOST-PID-...
//   (offload/swap_folder.cpp) whose process has ended may remain under the
//   build's tests/ folder, where the tests put their nvme_path; a process
//   that ends, by an error or not, removes its own.
//
// A test that kills a rank on purpose (SIGKILL cannot clean up) removes what
// that rank left itself. ZERO_TEST_NO_LEAK_CHECK=1 turns the checks off.
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) out.insert(e->d_name);
    }
    ::closedir(d);
  }
  return out;
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// zero-swap-HOST-PID-TAG-N: the PID, or -1. HOST may hold '-', so the PID is
// the first all-digit field after "zero-swap-".
long swap_folder_pid(const std::string& name) {
  const std::string prefix = "zero-swap-";
  if (name.rfind(prefix, 0) != 0) return -1;
  size_t pos = prefix.size();
  while (pos < name.size()) {
    const size_t dash = name.find('-', pos);
    const std::string field = name.substr(pos, dash == std::string::npos ? std::string::npos : dash - pos);
    if (!field.empty() && field.find_first_not_of("0123456789") == std::string::npos) return std::stol(field);
    if (dash == std::string::npos) break;
    pos = dash + 1;
  }
  return -1;
}

// Swap folders of ended processes under `dir`, `depth` levels down.
void find_orphans(const std::string& dir, int depth, std::vector<std::string>& out) {
  for (const auto& name : entries(dir)) {
    const std::string path = dir + "/" + name;
    if (!is_dir(path)) continue;
    if (const long pid = swap_folder_pid(name); pid > 0) {
      if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) out.push_back(path);
      continue;
    }
    if (depth > 0) find_orphans(path, depth - 1, out);
  }
}

void remove_tree(const std::string& path) {
  if (is_dir(path)) {
    for (const auto& name : entries(path)) remove_tree(path + "/" + name);
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

class LeakCheck : public ::testing::EmptyTestEventListener {
 public:
  explicit LeakCheck(std::string tmp) : tmp_(std::move(tmp)) {}
  ~LeakCheck() override { remove_tree(tmp_); }

  void OnTestStart(const ::testing::TestInfo&) override {
    before_ = entries(tmp_);
    orphans_before_.clear();
    std::vector<std::string> o;
    find_orphans(std::string(ZERO_BINARY_DIR) + "/tests", 3, o);
    orphans_before_.insert(o.begin(), o.end());
  }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    std::string left;
    for (const auto& name : entries(tmp_)) {
      if (before_.count(name) == 0) {
        left += "\n  " + tmp_ + "/" + name;
        remove_tree(tmp_ + "/" + name);  // so the next test starts clean
      }
    }
    std::vector<std::string> orphans;
    find_orphans(std::string(ZERO_BINARY_DIR) + "/tests", 3, orphans);
    for (const auto& o : orphans) {
      if (orphans_before_.count(o) != 0) continue;  // not this test's
      left += "\n  " + o + " (the swap folder of an ended process)";
      remove_tree(o);
    }
    if (!left.empty()) {
      ADD_FAILURE() << info.test_suite_name() << "." << info.name() << " left files behind:" << left;
    }
  }

 private:
  std::string tmp_;
  std::set<std::string> before_, orphans_before_;
};

bool install() {
  const char* off = std::getenv("ZERO_TEST_NO_LEAK_CHECK");
  if (off != nullptr && std::string(off) == "1") return false;
  const char* base = std::getenv("TMPDIR");
  // A death test's child (gtest runs the binary again) inherits its parent's
  // private folder, which the parent checks: no folder of its own, which a
  // child ended by a signal could not remove.
  const std::string parent = base != nullptr ? base : "";
  const auto slash = parent.find_last_of('/');
  if (parent.compare(slash == std::string::npos ? 0 : slash + 1, 10, "zero-test.") == 0) return false;
  std::string pattern = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/zero-test.XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) return false;
  ::setenv("TMPDIR", pattern.c_str(), 1);
  ::testing::UnitTest::GetInstance()->listeners().Append(new LeakCheck(pattern));
  return true;
}

const bool installed = install();

}  // namespace
