// load_string / load_file: parse, then read every section (sections.h), then
// the batch triangle and cross-section rules; describe() for `config check`.
#include "zero/config/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "json_text.h"
#include "sections.h"
#include "zero/core/command_files.h"
#include "zero/core/error.h"

namespace zero::config {
namespace {

using detail::AutoFill;
using detail::Context;
using detail::Got;
using detail::Json;
using detail::Kind;
using detail::Range;
using detail::Section;

// Python's // for the batch arithmetic (rules 2.1); `b` is non-zero.
int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

template <typename T>
AutoFill fill_from(const std::optional<T>& value, const char* needs) {
  return AutoFill{value ? std::optional<Json>(Json(*value)) : std::nullopt, needs};
}

struct BatchKey {
  const char* name;
  std::optional<int64_t> value;
  Origin origin = Origin::kDefault;
  std::string derivation;  // for messages: how a derived value was computed
};

// Rules 2.1-2.2, and the Hugging Face fill of "auto" (8.2).
void read_batch(Section& top, Config& config) {
  Context& ctx = top.context();
  const AutoValues& av = ctx.auto_values();
  const int64_t ws = ctx.options().world_size;
  BatchKey tbs{"train_batch_size", {}, Origin::kDefault, {}};
  BatchKey mbs{"train_micro_batch_size_per_gpu", {}, Origin::kDefault, {}};
  BatchKey gas{"gradient_accumulation_steps", {}, Origin::kDefault, {}};
  bool bad = false;
  auto read = [&](BatchKey& key, const AutoFill& fill) {
    int64_t v = 0;
    const Got got = top.read_int(key.name, v, std::nullopt, fill, /*record=*/false);
    if (got == Got::kGiven || got == Got::kFilled) {
      key.value = v;
      key.origin = got == Got::kGiven ? Origin::kGiven : ctx.is_stand_in(fill.needs) ? Origin::kAuto : Origin::kDerived;
    }
    if (got == Got::kBad) bad = true;
  };
  read(mbs, fill_from(av.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu"));
  read(gas, fill_from(av.gradient_accumulation_steps, "gradient_accumulation_steps"));
  // HF: train_batch_size = world * mbs * gas, from what it knows.
  std::optional<int64_t> fill_mbs = mbs.value ? mbs.value : av.train_micro_batch_size_per_gpu;
  std::optional<int64_t> fill_gas =
      gas.value ? gas.value : (av.gradient_accumulation_steps ? av.gradient_accumulation_steps : std::optional<int64_t>(1));
  AutoFill tbs_fill{std::nullopt, "train_micro_batch_size_per_gpu"};
  if (fill_mbs && ws > 0) tbs_fill.value = Json(ws * *fill_mbs * *fill_gas);
  read(tbs, tbs_fill);
  if (bad || ws <= 0) return;
  // Stand-ins give way to a train_batch_size in the file: the rule derives them.
  if (tbs.origin == Origin::kGiven) {
    for (BatchKey* k : {&mbs, &gas}) {
      if (k->origin == Origin::kAuto) k->value.reset(), k->origin = Origin::kDefault;
    }
  }

  auto name_value = [](const BatchKey& k) { return std::string(k.name) + " " + std::to_string(*k.value); };
  auto derive = [&](BatchKey& out, int64_t value, std::string how) {
    out.value = value;
    out.origin = Origin::kDerived;
    out.derivation = std::move(how);
  };
  auto divide = [&](BatchKey& out, const BatchKey& a, const BatchKey& b, const BatchKey* c) -> bool {
    // out = a // b // c (c: world size when null) or a // ws // b; report a zero divisor.
    if (*b.value == 0) {
      ctx.problem(b.name, "expected an integer > 0; got 0");
      return false;
    }
    int64_t v = 0;
    std::string how;
    if (c == nullptr) {
      v = floor_div(floor_div(*a.value, *b.value), ws);
      how = name_value(a) + " // " + name_value(b) + " // world_size " + std::to_string(ws);
    } else {
      v = floor_div(floor_div(*a.value, ws), *b.value);
      how = name_value(a) + " // world_size " + std::to_string(ws) + " // " + name_value(b);
    }
    derive(out, v, how);
    return true;
  };

  const bool has_tbs = tbs.value.has_value();
  const bool has_mbs = mbs.value.has_value();
  const bool has_gas = gas.value.has_value();
  bool ok = true;
  if (!has_tbs && !has_mbs) {
    ctx.problem("train_batch_size", "expected train_batch_size or train_micro_batch_size_per_gpu (or both); got "
                                    "neither (DeepSpeed: Either train_batch_size or train_micro_batch_size_per_gpu "
                                    "needs to be provided)");
    return;
  }
  if (has_tbs && has_mbs && !has_gas) {
    ok = divide(gas, tbs, mbs, nullptr);
  } else if (has_tbs && has_gas && !has_mbs) {
    ok = divide(mbs, tbs, gas, &gas);
  } else if (has_mbs && has_gas && !has_tbs) {
    derive(tbs, *mbs.value * *gas.value * ws,
           name_value(mbs) + " * " + name_value(gas) + " * world_size " + std::to_string(ws));
  } else if (has_tbs && !has_mbs) {
    derive(gas, 1, "the default when only train_batch_size is given");
    derive(mbs, floor_div(*tbs.value, ws), name_value(tbs) + " // world_size " + std::to_string(ws));
  } else if (has_mbs && !has_tbs) {
    derive(tbs, *mbs.value * ws, name_value(mbs) + " * world_size " + std::to_string(ws));
    derive(gas, 1, "the default when only train_micro_batch_size_per_gpu is given");
  }
  if (!ok) return;

  for (const BatchKey* k : {&tbs, &mbs, &gas}) {
    if (*k->value <= 0) {
      std::string text = "expected an integer > 0; got " + std::to_string(*k->value);
      if (!k->derivation.empty()) text += " (derived: " + k->derivation + ")";
      ctx.problem(k->name, text);
      ok = false;
    }
  }
  if (ok && *tbs.value != *mbs.value * *gas.value * ws) {
    std::string text = "expected train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size = " +
                       std::to_string(*mbs.value) + " * " + std::to_string(*gas.value) + " * " + std::to_string(ws) +
                       " = " + std::to_string(*mbs.value * *gas.value * ws) + "; got " + std::to_string(*tbs.value);
    for (const BatchKey* k : {&mbs, &gas}) {
      if (!k->derivation.empty()) text += " (" + std::string(k->name) + " derived: " + k->derivation + ")";
    }
    ctx.problem("train_batch_size", text);
    ok = false;
  }
  if (!ok) return;
  config.batch.train_batch_size = *tbs.value;
  config.batch.train_micro_batch_size_per_gpu = *mbs.value;
  config.batch.gradient_accumulation_steps = *gas.value;
  for (const BatchKey* k : {&tbs, &mbs, &gas}) ctx.record(k->name, *k->value, k->origin);
}

// Top-level scalars (rules 5.2-5.3, 4.7).
void read_scalars(Section& top, Config& config) {
  Context& ctx = top.context();
  const AutoValues& av = ctx.auto_values();
  top.read_double("gradient_clipping", config.gradient_clipping, Range::at_least(0),
                  fill_from(av.gradient_clipping, "gradient_clipping"));
  top.read_bool("prescale_gradients", config.prescale_gradients);
  top.read_double("gradient_predivide_factor", config.gradient_predivide_factor, Range::above(0));
  top.read_enum("gradient_allreduce_op", config.gradient_allreduce_op, {"mean", "sum"}, /*case_sensitive=*/false);
  if (config.gradient_allreduce_op == "sum" && config.zero.stage == 3) {
    ctx.problem("gradient_allreduce_op", "expected mean with ZeRO stage 3 (DeepSpeed rejects sum there); got sum");
  }
  int64_t steps = 0;
  const Got got = top.read_int("steps_per_print", steps, Range::above(0), {}, /*record=*/false);
  if (got == Got::kGiven) {
    config.steps_per_print = steps;
    ctx.record("steps_per_print", steps, Origin::kGiven);
  } else if (got != Got::kBad) {
    ctx.record("steps_per_print", nullptr, Origin::kDefault);
  }
  top.read_bool("wall_clock_breakdown", config.wall_clock_breakdown);
  top.read_bool("memory_breakdown", config.memory_breakdown);
  top.read_bool("zero_allow_untested_optimizer", config.zero_allow_untested_optimizer);
  top.read_bool("zero_force_ds_cpu_optimizer", config.zero_force_ds_cpu_optimizer);

  const std::vector<std::string> dtypes = {"fp16", "bf16", "fp32"};
  auto read_optional_dtype = [&](Section& s, const char* key, std::optional<std::string>& out, bool case_sensitive) {
    const Json* v = s.raw(key);
    if (v == nullptr || v->is_null()) {
      ctx.record(s.record_path_of(key), nullptr, Origin::kDefault);
      return;
    }
    std::string value;
    if (s.read_enum(key, value, dtypes, case_sensitive) == Got::kGiven) out = value;
  };
  read_optional_dtype(top, "communication_data_type", config.communication_data_type, false);
  std::string seq_dtype = "fp32";
  top.read_enum("seq_parallel_communication_data_type", seq_dtype, dtypes, false, /*record=*/false);
  Section data_types = top.child("data_types", Kind::kPlain);
  read_optional_dtype(data_types, "grad_accum_dtype", config.grad_accum_dtype, true);
  data_types.known({"param_dtype", "buffer_dtype"});
  data_types.finish();
}

void check_auto_values(Context& ctx) {
  const AutoValues& av = ctx.auto_values();
  if (av.precision && *av.precision != "fp32" && *av.precision != "fp16" && *av.precision != "bf16") {
    ctx.problem("AutoValues::precision", "expected one of fp32, fp16, bf16; got \"" + *av.precision + "\"");
  }
  if (av.hidden_size && *av.hidden_size <= 0) {
    ctx.problem("AutoValues::hidden_size", "expected an integer > 0; got " + std::to_string(*av.hidden_size));
  }
  if (ctx.options().world_size <= 0) {
    ctx.problem("LoadOptions::world_size", "expected an integer > 0; got " + std::to_string(ctx.options().world_size));
  }
}

}  // namespace

namespace {
// LoadOptions::auto_stand_ins: fills what the program left unset.
LoadOptions with_stand_ins(const LoadOptions& given, std::set<std::string>& names) {
  LoadOptions o = given;
  AutoValues& av = o.auto_values;
  auto fill = [&](auto& member, auto value, const char* name) {
    if (!member) member = value, names.insert(name);
  };
  fill(av.train_micro_batch_size_per_gpu, int64_t{1}, "train_micro_batch_size_per_gpu");
  fill(av.gradient_accumulation_steps, int64_t{1}, "gradient_accumulation_steps");
  fill(av.gradient_clipping, 1.0, "gradient_clipping");
  fill(av.lr, 1e-3, "lr");
  fill(av.betas, std::array<double, 2>{0.9, 0.999}, "betas");
  fill(av.eps, 1e-8, "eps");
  fill(av.weight_decay, 0.0, "weight_decay");
  fill(av.total_num_steps, int64_t{1000}, "total_num_steps");
  fill(av.warmup_num_steps, int64_t{10}, "warmup_num_steps");
  fill(av.precision, std::string("fp32"), "precision");
  fill(av.hidden_size, int64_t{1024}, "hidden_size");
  return o;
}
}  // namespace

Config load_string(const std::string& json_text, const LoadOptions& given, const std::string& name) {
  std::set<std::string> stand_ins;
  const LoadOptions options = given.auto_stand_ins ? with_stand_ins(given, stand_ins) : given;
  Context ctx(name, options);
  ctx.set_stand_ins(std::move(stand_ins));
  // Text in another encoding, or a binary file, is named as such rather than
  // reported as the JSON error at its first odd byte.
  if (const auto nul = json_text.find('\0'); nul != std::string::npos || json_text.rfind("\xff\xfe", 0) == 0 ||
                                               json_text.rfind("\xfe\xff", 0) == 0) {
    const bool wide = json_text.rfind("\xff\xfe", 0) == 0 || json_text.rfind("\xfe\xff", 0) == 0 ||
                      (json_text.size() >= 2 && (json_text[0] == '\0' || json_text[1] == '\0'));
    ctx.problem("", wide ? "is UTF-16 or UTF-32 text (a byte-order mark or NUL bytes between the characters, as some "
                           "Windows editors save): DeepSpeed and zero read UTF-8; save it as UTF-8 (iconv -f UTF-16 -t "
                           "UTF-8)"
                         : "holds a NUL byte at byte " + std::to_string(nul) + " (line " +
                               std::to_string(detail::line_of(json_text, nul)) + "): not a text file, or a damaged one");
    throw ConfigError(ctx.problems());
  }
  detail::RelaxedSyntax relaxed;
  const Json root = detail::parse_relaxed(json_text, name, ctx.problems(), &relaxed);
  // Read as DeepSpeed reads a file (hjson: comments and trailing commas are
  // fine), with a word for what other readers of the same file refuse.
  const std::string strict_readers =
      ": DeepSpeed reads it (hjson), but Hugging Face's Trainer and Accelerate read the file with Python's "
      "json.load, which refuses it";
  if (relaxed.bom)
    ctx.warn("", "starts with a UTF-8 byte-order mark: zero skips it, but Python's json.load (Hugging Face's Trainer "
                 "and Accelerate) refuses it");
  if (relaxed.comment != std::string::npos)
    ctx.warn("", "line " + std::to_string(detail::line_of(json_text, relaxed.comment)) + " has a comment" +
                     strict_readers);
  if (relaxed.trailing_comma != std::string::npos)
    ctx.warn("", "line " + std::to_string(detail::line_of(json_text, relaxed.trailing_comma)) +
                     " has a trailing comma" + strict_readers);
  if (!root.is_object()) {
    ctx.problem("", "expected a JSON object at the top level; got " + detail::show(root));
    throw ConfigError(ctx.problems());
  }
  Config config;
  config.source = name;
  config.world_size = options.world_size;
  check_auto_values(ctx);

  Section top(ctx, "", &root, Kind::kPlain);
  read_batch(top, config);
  detail::read_zero(top, config);
  detail::read_precision(top, config);
  read_scalars(top, config);
  detail::read_optimizer(top, config);
  if (options.for_training && !config.optimizer)
    ctx.warn("optimizer", "no optimizer section: the program must pass its own optimizer to zero::initialize "
                             "(InitOptions::optimizer, a torch::optim Adam, AdamW or Adagrad; mingpt and llama: "
                             "--optimizer), as a DeepSpeed client optimizer; without one, initialize refuses");
  if (config.optimizer && config.bf16.enabled && config.bf16.bf16_optimizer_states &&
      config.bf16.bf16_master_weights_and_grads && config.zero.stage > 0) {
    if (config.optimizer->optim_bits == 8)
      ctx.problem("bf16.bf16_optimizer_states", "expected false with optimizer.params.optim_bits 8 (the states are "
                                                "8-bit then); got true: give one");
    config.optimizer->bf16_states = true;
  }
  detail::read_scheduler(top, config);
  detail::read_aio(top, config);
  detail::read_activation_checkpointing(top, config);
  detail::check_features(ctx, root);
  detail::check_top_level_keys(ctx, root);

  if (!ctx.problems().empty()) throw ConfigError(ctx.problems());
  config.warnings = ctx.warnings();
  config.resolved = ctx.resolved();
  config.canonical_json = ctx.canonical().dump();
  return config;
}

namespace {
constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;
}  // namespace

Config load_file(const std::string& path, const LoadOptions& options) {
  // O_NONBLOCK: opening a FIFO with no writer must not wait; fstat refuses it next.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    // A dangling link or a loop says so (open's ENOENT would call the link missing).
    if (const std::string problem = input_file_problem("DeepSpeed config", path); !problem.empty()) throw IoError(problem);
    throw IoError("cannot open DeepSpeed config " + path + ": " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const int saved = errno;
    ::close(fd);
    const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISFIFO(st.st_mode) ? "a pipe"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : std::strerror(saved);
    throw IoError("DeepSpeed config " + path + ": expected a regular JSON file; got " + what);
  }
  if (st.st_size > kMaxConfigBytes) {
    ::close(fd);
    throw IoError("DeepSpeed config " + path + ": " + std::to_string(st.st_size) + " bytes; a config is at most " +
                  std::to_string(kMaxConfigBytes) + " bytes (16 MiB): is this the right file?");
  }
  std::string text;
  char buffer[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int saved = errno;
      ::close(fd);
      throw IoError("cannot read DeepSpeed config " + path + " at offset " + std::to_string(text.size()) + ": " +
                    std::strerror(saved));
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (static_cast<int64_t>(text.size()) > kMaxConfigBytes) {  // grew while read
      ::close(fd);
      throw IoError("DeepSpeed config " + path + ": more than " + std::to_string(kMaxConfigBytes) +
                    " bytes (16 MiB), the most a config may have");
    }
  }
  ::close(fd);
  return load_string(text, options, path);
}

int64_t partition_ranks(const Config& c) {
  const int64_t world = std::max<int64_t>(1, c.world_size);
  const int64_t s = c.zero.mics_shard_size;
  if (c.zero.stage < 2 || s <= 0 || s >= world || world % s != 0) return world;  // (the config refuses a non-divisor)
  return s;
}

std::string describe(const Config& config) {
  size_t path_width = 0;
  size_t value_width = 0;
  for (const ResolvedValue& r : config.resolved) {
    path_width = std::max(path_width, r.path.size());
    value_width = std::max(value_width, r.value.size());
  }
  std::string out;
  for (const ResolvedValue& r : config.resolved) {
    // A default that changed between DeepSpeed versions is said plainly.
    const std::string note =
        r.path == "gradient_clipping" && r.origin == Origin::kDefault
            ? ": DeepSpeed's default since June 2026 (#8068; 0.0, no clipping, before); give 0 to turn clipping off"
            : "";
    out += r.path + std::string(path_width - r.path.size() + 2, ' ') + r.value +
           std::string(value_width - r.value.size() + 2, ' ') + "(" + to_string(r.origin) + note + ")\n";
  }
  if (config.warnings.empty()) {
    out += "warnings: none\n";
  } else {
    out += "warnings:\n";
    for (const std::string& w : config.warnings) out += "  " + w + "\n";
  }
  return out;
}

const char* to_string(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "none";
}

const char* to_string(Origin origin) {
  switch (origin) {
    case Origin::kGiven:
      return "given";
    case Origin::kDefault:
      return "default";
    case Origin::kDerived:
      return "derived";
    case Origin::kAuto:
      return "auto: the program fills it at initialize; checked with this stand-in";
  }
  return "default";
}

}  // namespace zero::config
