#!/usr/bin/env bash
# offload_optimizer.ratio (NOTE [partial offload]) on this machine's CPU
# ranks: minGPT at stage 3 with the optimizer offloaded to the CPU (fp32,
# 12.8M parameters: group 0 and four layers of 3.1M), at ratios 1, 0.5,
# 0.25 and 0, and stage 3 without offload, alternating ROUNDS times, on 1
# rank (OMP_NUM_THREADS=1) and on 2. Prints each run's median step time (its
# first 2 steps left out) against ratio 1's of the round, the bytes the
# offloaded optimizer moved between device and host per step (gradients
# down, new values up), and rank 0's optimizer states on each tier. The
# device here is the CPU: what a partial offload saves is the staging
# copies, not a faster optimizer (the card's table is scripts/gpu/bench.py's).
#   benchmarks/partial_offload.sh [--bin DIR] [--rounds N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/build/bin" rounds=2
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "partial_offload.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/mingpt" ] || { echo "partial_offload.sh: $bin/mingpt is not built (make build, or --bin DIR)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/zero-partial-offload.XXXXXX")
trap 'rm -rf "$work"' EXIT
steps=12
config() {  # $1: an offload_optimizer section, or "" for none
  cat <<EOF_CONFIG
{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0${1:+, \"offload_optimizer\": $1}}}
EOF_CONFIG
}
model=(--vocab_size 256 --block_size 64 --n_layer 4 --n_embd 512 --n_head 8 --limit_train_batches $steps)
run() {  # $1 ranks, $2 offload section, $3 summary
  config "$2" >"$work/c.json"
  local launch=("$bin/mingpt")
  [ "$1" -gt 1 ] && launch=("$bin/zero" launch --nproc_per_node "$1" -- "$bin/mingpt")
  env OMP_NUM_THREADS=1 "${launch[@]}" --config "$work/c.json" "${model[@]}" --summary-json "$3" \
    >"$work/log" 2>&1 || { echo "partial_offload.sh: the run failed:" >&2; tail -20 "$work/log" >&2; exit 1; }
}
row() {  # $1 ranks, $2 round, $3 label, $4 summary, $5 ratio 1's summary
  python3 - "$@" <<'EOF_PY'
import json, statistics, sys
ranks, rnd, label, path, base = sys.argv[1:6]
s, b = json.load(open(path)), json.load(open(base))
med = lambda j: statistics.median(j["step_time_s"][2:])
tiers = s["ranks"][0]["model_state_bytes_by_tier"]
dev, host = tiers["device"]["optimizer_states"], tiers["host"]["optimizer_states"]
share = host / (dev + host) if dev + host else 0.0
mib = lambda x: f"{x / 2**20:.1f}"
print(f"| {ranks} | {rnd} | {label} | {med(s):.4f} | {med(s) / med(b):.3f} | "
      f"{mib(s.get('transfer_bytes', 0) / len(s['step_time_s']))} | {mib(dev)} | {mib(host)} | {share:.2f} |")
EOF_PY
}
echo "| ranks | round | configuration | step (s) | vs ratio 1 | MiB moved a step | device states MiB | host states MiB | host share |"
echo "|---|---|---|---|---|---|---|---|---|"
for ranks in 1 2; do
  for i in $(seq "$rounds"); do
    run "$ranks" '{"device": "cpu"}' "$work/r1.json"
    row "$ranks" "$i" "ratio 1" "$work/r1.json" "$work/r1.json"
    for r in 0.5 0.25 0; do
      run "$ranks" "{\"device\": \"cpu\", \"ratio\": $r}" "$work/r.json"
      row "$ranks" "$i" "ratio $r" "$work/r.json" "$work/r1.json"
    done
    run "$ranks" "" "$work/none.json"
    row "$ranks" "$i" "no offload" "$work/none.json" "$work/r1.json"
  done
done
