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
// when the program reads ds.json.
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
  /// program itself.
  void reads_program_arguments(const std::vector<std::string>& argv);

  /// A file the command writes whole (replacing what was there).
  void writes(std::string what, const std::string& path);
  /// A folder whose files the command writes and replaces (an export).
  void writes_folder(std::string what, const std::string& dir);
  /// A folder the command only adds entries to (a checkpoint folder).
  void adds_to_folder(std::string what, const std::string& dir);

  /// "" when no output clashes with an input or another output; else the
  /// first clash, naming both ("--out D/model.safetensors: is the file that
  /// --model reads (D/model.safetensors); write the output elsewhere").
  std::string problem() const;

 private:
  enum class Role { kReadFile, kReadFolder, kWriteFile, kWriteFolder, kAddToFolder };
  struct Entry {
    Role role;
    std::string what, path, where;  // `where`: the absolute, resolved path
    bool exists = false;
    bool from_checkpoint = false;  // reads_checkpoint
    unsigned long long dev = 0, ino = 0;
  };
  void add(Role role, std::string what, const std::string& path);
  static std::string clash(const Entry& out, const Entry& in);
  static std::string in_save_names(const Entry& folder, const Entry& other);

  std::vector<Entry> entries_;
};

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

/// Where `path` is or would be: realpath(3) of it when it exists, else of its
/// deepest existing ancestor with the rest of the name appended ("." and ".."
/// of the rest resolved by name). Relative to the working folder.
std::string resolved_path(const std::string& path);

}  // namespace zero
