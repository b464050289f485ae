#!/usr/bin/env bash
# zero tune on more than one node (issue 38): `zero tune --nodes 2 --ranks 2`
# on nodes emulated here (zero launch --emulate_nodes, over loopback), once
# with the ranking of this machine alone and once for each inter-node
# bandwidth given, with --allow-quantized-communication. Each tune searches
# the grid, then tries its winner with each key of more than one node
# (mics_shard_size, zero_hpz_partition_size, qwZ, qgZ). Reports, per
# bandwidth, the winner, its step here, the seconds its bytes across nodes
# add, its bytes across nodes a step against the same setup without keys,
# and the runs. Writes OUT/tune_nodes.md and OUT/tune_nodes.json.
#
#   benchmarks/tune_nodes.sh [--out DIR] [--bin DIR] [--bandwidths LIST]
#
# Default: mingpt:4,256,512,128 (its layers above the stage-3 persistence
# threshold, so they are gathered), 96 MiB of (emulated) device memory and
# 1 GiB of host memory a rank, stage 3 (where every key applies), offload
# none/cpu, micro-batches 2 and 8, one bucket size (4e5); bandwidths (bytes
# a second a rank) none, 1GB, 100MB and 10MB: about 2 minutes on two cores.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/build/tune_nodes" bin="$root/build/bin" bandwidths="none,1GB,100MB,10MB"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --bandwidths) bandwidths=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tune_nodes.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/zero" ] && [ -x "$bin/mingpt" ] || { echo "tune_nodes.sh: build zero and mingpt first (make build, or --bin DIR)" >&2; exit 1; }
mkdir -p "$out"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
grid=(--model mingpt:4,256,512,128 --ranks 2 --nodes 2 --device-memory 96MiB --host-memory 1GiB --device cpu
  --stages 3 --offload none,cpu --checkpointing none --micro-batches 2,8 --bucket-sizes 4e5 --steps 4
  --gradients host --allow-quantized-communication --force)
IFS=, read -r -a list <<<"$bandwidths"
for b in "${list[@]}"; do
  extra=()
  [ "$b" = none ] || extra=(--inter-node-bandwidth "$b")
  echo "== zero tune ${grid[*]} ${extra[*]}"
  start=$(date +%s)
  "$bin/zero" tune "${grid[@]}" ${extra[@]+"${extra[@]}"} --out "$out/$b.config.json" --json "$out/$b.json" 2>&1 |
    tee "$out/$b.log"
  echo "$(( $(date +%s) - start ))" >"$out/$b.seconds"
done

python3 - "$out" "$bandwidths" "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')" <<'PY'
import json, sys
out, bandwidths, commit = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
def keys(c):
    k = []
    if c["mics_shard_size"]: k.append("mics_shard_size %d" % c["mics_shard_size"])
    if c["zero_hpz_partition_size"]: k.append("hpZ %d" % c["zero_hpz_partition_size"])
    if c["zero_quantized_weights"]: k.append("qwZ")
    if c["zero_quantized_gradients"]: k.append("qgZ")
    return " + ".join(k) or "none"
def setup(c):
    s = "stage %d" % c["stage"]
    if c["offload_optimizer"] != "none": s += " + optimizer " + c["offload_optimizer"]
    return s + ", mb %d" % c["micro_batch"]
rows, summary = [], []
for b in bandwidths:
    r = json.load(open("%s/%s.json" % (out, b)))
    best = next(c for c in r["candidates"] if c["run_order"] == r["best"]["run_order"])
    same = [c for c in r["candidates"] if c.get("measured") and setup(c) == setup(best) and keys(c) == "none"
            and c["bucket_size"] == best["bucket_size"]]
    m = best["measured"]
    across = m["bytes_per_step"]["across_nodes"]
    plain = same[0]["measured"]["bytes_per_step"]["across_nodes"] if same else float("nan")
    tried = [c for c in r["candidates"] if c.get("measured") and keys(c) != "none"]
    row = {"bandwidth": b, "winner": setup(best), "keys": keys(best), "step_here_s": m["step_time_s"],
           "network_s": m["network_s"], "across_nodes_bytes": across, "across_vs_no_keys": across / plain,
           "runs": r["runs"], "key_runs": len(tried), "seconds": int(open("%s/%s.seconds" % (out, b)).read())}
    summary.append(row)
    rows.append("| %s | %s | %s | %.3f | %.4f | %.2f MB (%.2fx) | %d (%d with keys) | %d |" % (
        b, row["winner"], row["keys"], row["step_here_s"], row["network_s"], across / 1e6, row["across_vs_no_keys"],
        row["runs"], row["key_runs"], row["seconds"]))
md = ["zero tune on 2 emulated nodes x 2 ranks, mingpt:4,256,512,128, commit %s" % commit, "",
      "| --inter-node-bandwidth (a rank) | winner | its keys | step here s | + bytes across s | across nodes a step (vs no keys) | runs | tune s |",
      "|---|---|---|---|---|---|---|---|"] + rows
open(out + "/tune_nodes.md", "w").write("\n".join(md) + "\n")
json.dump(summary, open(out + "/tune_nodes.json", "w"), indent=2)
print("\n".join(md))
PY
