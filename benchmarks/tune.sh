#!/usr/bin/env bash
# The tuner against an exhaustive run (docs/tools.md, "Picking a config: zero tune"): `zero tune`
# on a small grid, then `zero tune --exhaustive` on the same grid, which
# trains every candidate that fits. Reports the tuner's choice as a share of
# the fastest of the exhaustive run (both measured in the exhaustive run, so
# one run's noise does not decide), and the runs and time each took. Writes
# OUT/tune.md and OUT/tune.json.
#
#   benchmarks/tune.sh [--out DIR] [--bin DIR] [--program] [-- ZERO_TUNE_OPTIONS... [-- PROGRAM ARGS...]]
#
# Default grid: mingpt:4,256,512,128 on 2 ranks, per rank 80 MiB of
# (emulated) device memory and 1 GiB of host memory; stages 0-3, offload
# none/cpu/nvme (a scratch folder), checkpointing none/blocks, micro-batches
# 2, 8 and 32, one bucket size (4e5): a few minutes on two cores.
# --program: the same model and grid (checkpointing none) with mingpt run
# as a user's program (`zero tune ... -- mingpt --config {config} ...`).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/build/tune" bin="$root/build/bin" program=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --program) program=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tune.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/zero" ] && [ -x "$bin/mingpt" ] || { echo "tune.sh: build zero and mingpt first (make build, or --bin DIR)" >&2; exit 1; }
mkdir -p "$out"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/tune-bench-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
if [ $# -eq 0 ] && [ $program = 1 ]; then
  set -- --ranks 2 --device-memory 80MiB --host-memory 1GiB --nvme-path "$scratch" --checkpointing none \
    --micro-batches 2,8,32 --bucket-sizes 4e5 --steps 4 -- "$bin/mingpt" --config '{config}' --vocab_size 512 \
    --block_size 128 --n_layer 4 --n_embd 256 --n_head 4 --limit_train_batches 1000
elif [ $# -eq 0 ]; then
  set -- --model mingpt:4,256,512,128 --ranks 2 --device-memory 80MiB --host-memory 1GiB \
    --nvme-path "$scratch" --checkpointing none,blocks --micro-batches 2,8,32 --bucket-sizes 4e5 --steps 4
fi
# The tuner's options, then (after --) the program's: the outputs go before it.
opts=() prog=() after=0
for a in "$@"; do
  if [ $after = 0 ] && [ "$a" = "--" ]; then after=1
  elif [ $after = 1 ]; then prog+=("$a")
  else opts+=("$a"); fi
done
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

echo "== zero tune $*"
start=$(date +%s)
"$bin/zero" tune "${opts[@]}" --out "$out/tuned.config.json" --json "$out/tuned.json" ${prog[@]+-- "${prog[@]}"} 2>&1 |
  tee "$out/tuned.log"
tuned_s=$(( $(date +%s) - start ))
echo "== zero tune --exhaustive $*"
start=$(date +%s)
"$bin/zero" tune "${opts[@]}" --exhaustive --out "$out/exhaustive.config.json" --json "$out/exhaustive.json" \
  ${prog[@]+-- "${prog[@]}"} 2>&1 |
  tee "$out/exhaustive.log"
exhaustive_s=$(( $(date +%s) - start ))

python3 - "$out" "$tuned_s" "$exhaustive_s" "$*" <<'PY'
import json, sys
out, tuned_s, exhaustive_s, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
t = json.load(open(f"{out}/tuned.json"))
e = json.load(open(f"{out}/exhaustive.json"))
key = lambda c: (c["stage"], c["offload_optimizer"], c["offload_param"], c["checkpointing"], c["micro_batch"], c["bucket_size"])
name = lambda c: (f"stage {c['stage']}" + (f" + optimizer {c['offload_optimizer']}" if c["offload_optimizer"] != "none" else "")
                  + (f" + params {c['offload_param']}" if c["offload_param"] != "none" else "")
                  + (f", checkpointing {c['checkpointing']}" if c["checkpointing"] != "none" else "")
                  + f", micro-batch {c['micro_batch']}, buckets {c['bucket_size']:.0e}".replace("e+0", "e"))
tuned_best = next(c for c in t["candidates"] if c["run_order"] == t["best"]["run_order"])
trained = {key(c): c for c in e["candidates"] if c["status"] == "trained"}
fastest = max(trained.values(), key=lambda c: c["measured"]["tokens_per_s"])
mine = trained.get(key(tuned_best))
ratio = mine["measured"]["tokens_per_s"] / fastest["measured"]["tokens_per_s"] if mine else None
rows = sorted(trained.values(), key=lambda c: -c["measured"]["tokens_per_s"])
md = [f"# zero tune against an exhaustive run", "", f"`zero tune {args}`", "",
      f"- tuner: {t['runs']} runs in {tuned_s} s ({t['fit_estimate']} of {len(t['candidates'])} candidates fit the estimate); chose **{name(tuned_best)}**",
      f"- exhaustive: {e['runs']} runs in {exhaustive_s} s; fastest **{name(fastest)}**",
      f"- the tuner's choice, measured in the exhaustive run: "
      + (f"**{100 * ratio:.1f}%** of the fastest" if ratio is not None else "not trained there"), "",
      "| candidate (exhaustive run) | tokens/s | vs fastest | peak device | tuner |", "|---|---:|---:|---:|---|"]
tuned_status = {key(c): c["status"] for c in t["candidates"]}
for c in rows:
    m = c["measured"]
    md.append(f"| {name(c)} | {m['tokens_per_s']:.0f} | {100 * m['tokens_per_s'] / fastest['measured']['tokens_per_s']:.1f}% "
              f"| {m['peak_bytes']['device'] / 2**20:.1f} MiB | {'**chosen**' if key(c) == key(tuned_best) else tuned_status.get(key(c), '')} |")
open(f"{out}/tune.md", "w").write("\n".join(md) + "\n")
json.dump({"args": args, "tuned": {"runs": t["runs"], "seconds": tuned_s, "choice": name(tuned_best)},
           "exhaustive": {"runs": e["runs"], "seconds": exhaustive_s, "fastest": name(fastest)},
           "ratio": ratio}, open(f"{out}/tune.json", "w"), indent=2)
print("\n".join(md))
if ratio is None or ratio < 0.9:
    sys.exit("tune.sh: the tuner's choice is not within 10% of the fastest")
PY
