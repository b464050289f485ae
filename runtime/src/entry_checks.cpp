// What zero::Init and initialize check and say before a run: the config's
// warnings (NOTE [config warnings], engine_util.h), and the files the
// environment names against the program's (NOTE [outputs and inputs]).
#include <map>
#include <string>

#include "engine_util.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"
#include "zero/core/log.h"

namespace zero::detail {

void check_environment_outputs(const std::string& config_source, const DistEnv& dist) {
  CommandFiles files = CommandFiles::declared();
  if (!config_source.empty() && config_source != "<string>") files.reads("the config", config_source);
  files.writes_environment_outputs(dist.rank, dist.world_size);
  if (const std::string problem = files.problem(); !problem.empty()) throw UsageError(problem);
}

void print_config_warnings(const config::Config& config, const DistEnv& dist,
                           const std::map<std::string, std::string>& flags) {
  static const std::map<std::string, std::string> kPaths = {
      {"lr", "optimizer.params.lr"},
      {"weight_decay", "optimizer.params.weight_decay"},
      {"eps", "optimizer.params.eps"},
      {"gradient_clipping", "gradient_clipping"},
      {"train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu"},
      {"gradient_accumulation_steps", "gradient_accumulation_steps"}};
  for (const auto& item : flags)  // every rank: a rank alone would leave the others in a collective
    ZERO_CHECK(kPaths.count(item.first) > 0, "InitOptions::auto_value_flags: no member " + item.first);
  if (dist.rank != 0) return;
  for (const auto& w : config.warnings) log::warning_once("config:" + w, w);  // each names the file already
  for (const auto& [name, flag] : flags) {
    const auto path = kPaths.find(name);
    for (const auto& r : config.resolved)
      if (r.path == path->second && r.origin == config::Origin::kGiven) {
        const std::string w = flag + " is not used: " + config.source + " gives " + r.path + " = " + r.value +
                              " itself (write \"auto\" there for the flag to fill it)";
        log::warning_once("config:" + w, w);
      }
  }
}

}  // namespace zero::detail
