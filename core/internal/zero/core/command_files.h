// NOTE [outputs and inputs]
// No command writes over what it reads. Every program and tool (mingpt,
// llama, zero tune, memcheck, estimate, checkpoint, the engine's own
// outputs) names, before any work, each file and folder it will read and
// each it will write, and asks this one rule whether they clash:
// - an output file may not be a file the command reads (the same path after
//   links are followed, or another name of the same inode), nor lie inside
//   a folder it reads whole, nor be another output;
// - an output folder whose files are replaced (an export) may not be, hold
//   or lie inside anything the command reads;
// - a folder the command only adds entries to (a checkpoint folder: new tag
//   folders and `latest`, which a resume from it reads first) may hold what
//   it reads, but may not be a file it reads or lie inside a folder it reads
//   whole.
// - what a save adds to a checkpoint folder (`latest`, its tag folders
//   global_stepN, hidden working folders) replaces what is there under
//   those names: no input but the resume's own (its latest and tag folder)
//   and no other output may lie there.
// Paths that do not exist yet are compared by where they would be: the real
// path of their deepest existing folder, then the rest of the name. The
// refusal names both paths and both flags. A program's arguments that the
// command cannot interpret (zero tune and memcheck run any program) count as
// inputs when they name an existing file: `--baseline ds.json` is refused
// when the program reads ds.json; one that names an existing folder makes
// its files inputs (`--out DIR/model.safetensors` is refused when the
// program is given `--model DIR`).
// Places are compared by path and by device and inode, folders too: a bind
// mount of a folder, a hard link and a symbolic link are the same place.
// The outputs the environment names (ZERO_TRACE, ZERO_RUN_REPORT) are
// outputs of every program that starts an engine: the programs add them
// (writes_environment_outputs) and declare their files (declare); the
// engine checks the declared files, the config and the environment's
// outputs again at initialize, so that a library user's run is held to the
// rule too.
// Streams: /dev/stdout, /dev/stderr and /dev/fd/N (or /proc/self/fd/N)
// name the process's open stream, written in place (appended where the
// stream is); they take part in no clash. Any other place under /dev or
// /proc, a device, a pipe or a socket is refused as an output, never
// replaced (output_place_problem).
#pragma once

#include <string>
#include <vector>

namespace zero {

/// The files of one command and the rule between them. Not thread-safe; one
/// per command. Cheap: stat(2) and realpath(3) per path, nothing read.
class CommandFiles {
 public:
  /// A file the command reads. `what` names it for the user ("--config",
  /// "--model's config.json"). A path that does not exist is kept too (a
  /// later check says it is missing; this rule only compares).
  void reads(std::string what, const std::string& path);
  /// A folder the command reads whole (a checkpoint's tag folder): nothing
  /// may be written inside it.
  void reads_folder(std::string what, const std::string& dir);
  /// The same, for what a resume reads of a checkpoint folder (its
  /// `latest`, its tag folder): these may lie where a save into the same
  /// folder adds its entries (the resume reads them first).
  void reads_checkpoint(std::string what, const std::string& path, bool whole_folder);
  /// Each argument of a program the command runs that names an existing
  /// regular file (whole, or after the '=' of --flag=value), and the
  /// program itself; one that names a folder makes what the folder holds
  /// now inputs (but the working folder, or a folder that holds it).
  void reads_program_arguments(const std::vector<std::string>& argv);

  /// A file the command writes whole (replacing what was there). A stream
  /// (/dev/stdout) is kept out of the comparisons.
  void writes(std::string what, const std::string& path);
  /// The files the environment has every engine write: ZERO_TRACE's and
  /// ZERO_RUN_REPORT's, for rank `rank` of `world_size` (from RANK and
  /// WORLD_SIZE when negative, as the launcher sets them).
  /// A stream there (/dev/stdout) is a problem() of its own: ZERO_RUN_REPORT
  /// is a prefix, and each of several ranks writes a trace of its own.
  void writes_environment_outputs(int rank = -1, int world_size = -1);
  /// A folder whose files the command writes and replaces (an export).
  void writes_folder(std::string what, const std::string& dir);
  /// A folder the command only adds entries to (a checkpoint folder).
  void adds_to_folder(std::string what, const std::string& dir);

  /// "" when no output clashes with an input or another output; else the
  /// first clash, naming both ("--out D/model.safetensors: is the file that
  /// --model reads (D/model.safetensors); write the output elsewhere").
  std::string problem() const;

  /// Keeps `files` as the process's command files, for the engine's check
  /// at initialize (replacing what an earlier declare kept).
  static void declare(const CommandFiles& files);
  /// What declare kept (empty when nothing was declared).
  static CommandFiles declared();

 private:
  // kReadFolderFiles: a folder a program the command runs is given; what
  // it holds now may be read, what is added to it is not.
  enum class Role { kReadFile, kReadFolder, kReadFolderFiles, kWriteFile, kWriteFolder, kAddToFolder };
  struct Entry {
    Role role;
    std::string what, path, where;  // `where`: the absolute, resolved path
    bool exists = false;
    bool from_checkpoint = false;  // reads_checkpoint
    unsigned long long dev = 0, ino = 0;
  };
  void add(Role role, std::string what, const std::string& path);
  static bool same(const Entry& a, const Entry& b);
  static bool inside(const Entry& child, const Entry& folder);
  static std::string clash(const Entry& out, const Entry& in);
  static std::string in_save_names(const Entry& folder, const Entry& other);

  std::vector<Entry> entries_;
  std::string refused_;  // what cannot be an output at all (writes_environment_outputs), said first
};

/// Writes all of `data` to the open stream `fd` (named `path`), after
/// flushing the C and C++ streams so that what the program printed comes
/// first. "" when written, else what failed: the offset and errno's text.
std::string write_to_stream(const std::string& path, int fd, const std::string& data);

/// The file descriptor a stream path names: 1 for /dev/stdout (and
/// /dev/fd/1, /proc/self/fd/1, or a link to one of them), 2 for
/// /dev/stderr, N for /dev/fd/N; -1 for any other path.
int stream_output_fd(const std::string& path);

/// Why an output at `path` (named `what`) would replace what is not a
/// file: a place under /dev or /proc that is not a stream, or a device,
/// pipe or socket there now. "" when the place takes a file (or is a
/// stream).
std::string output_place_problem(const std::string& what, const std::string& path);

/// The file that rank `rank` writes for ZERO_RUN_REPORT=`prefix`.
std::string run_report_file(const std::string& prefix, long long rank);

/// Why `path`, a file the command reads (named `what`: "--config",
/// "DIR/config.json"), cannot be read as one, or "" when it can: it does not
/// exist, is a folder, a dangling link (naming its target), a link loop, not
/// a regular file (a device, pipe or socket), or unreadable (errno's text).
std::string input_file_problem(const std::string& what, const std::string& path);

/// The file a command-line `flag` such as --config names, as a path that
/// zero::initialize reads as a file: a name starting with '{' (which
/// initialize would take for JSON text) gets "./" in front. Throws
/// UsageError when no such file exists and the value looks like JSON text:
/// the flag takes a file; JSON text is for C++ callers of initialize.
std::string config_file_argument(const std::string& flag, const std::string& value);

/// Where `path` is or would be: realpath(3) of it when it exists; a dangling
/// link, where its target would be; else realpath(3) of its deepest
/// existing ancestor with the rest of the name appended ("." and ".." of the
/// rest resolved by name). Relative to the working folder.
std::string resolved_path(const std::string& path);

}  // namespace zero
