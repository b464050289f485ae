#!/usr/bin/env bash
# MiCS on two nodes (issue 38 §4; NOTE [MiCS], NOTE [hierarchical gather]):
# the bytes that cross the nodes a step, and the loss of a text model, with
# mics_shard_size 2 (a shard group a node, the states replicated across the
# nodes) and mics_shard_size 4 with mics_hierarchical_params_gather (one
# shard group over both nodes, its gathers in two hops), against the same run
# without them. Every run is on two nodes of 2 ranks (`zero launch --nnodes 2`
# twice, on loopback); the reference is one node of 4 without the keys.
#
# 1. Bytes: minGPT (4 layers of width 128, 797K parameters) on the addition
#    task, 6 steps of 32 samples, stages 2 and 3, fp32 and bf16. The
#    summaries give each step's bytes summed over the ranks, and each rank's
#    (the busiest rank's across is the "max rank" column). The largest
#    difference of a step's loss from one node of 4, and whether the run has
#    its bits (the hierarchical gather must). Stage 3 sets
#    stage3_max_reuse_distance 0, so that backward gathers each layer again.
# 2. Loss: after --loss-steps (200) steps of a character-level minGPT on this
#    repository's docs and of the Llama program (2 layers of
#    benchmarks/configs/llama_small_config.json, byte tokens of the same
#    text), bf16 at stage 3, mics_shard_size 2 against no key: the last
#    step's loss and the mean of the last 20. Only the order of the sums
#    differs, so this is also how far two exact runs part (a control for
#    zeropp.sh's quantized runs).
#
#   benchmarks/mics.sh [--loss-steps N] [--skip-loss] [--out DIR] [--bin DIR]
#
# Writes OUT/mics.md and OUT/mics.json (default OUT build/mics).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
loss_steps=200
skip_loss=0
out="$root/build/mics"
bin="$root/build/bin"
while [ $# -gt 0 ]; do
  case "$1" in
    --loss-steps) loss_steps="$2"; shift 2 ;;
    --skip-loss) skip_loss=1; shift ;;
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "mics.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$loss_steps" in ''|*[!0-9]*) echo "mics.sh: --loss-steps $loss_steps: expected a whole number" >&2; exit 2 ;; esac
for b in zero mingpt llama; do
  [ -x "$bin/$b" ] || { echo "mics.sh: $bin/$b not found; build first (make build)" >&2; exit 2; }
done
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=benchmarks/two_nodes_lib.sh
. "$here/two_nodes_lib.sh"

keys_of() {
  case "$1" in
    none) echo "" ;;
    shard2) echo ', "mics_shard_size": 2' ;;
    hier4) echo ', "mics_shard_size": 4, "mics_hierarchical_params_gather": true' ;;
  esac
}
config() {  # config FILE STAGE PRECISION KEYS
  local extra=""
  [ "$3" = fp32 ] || extra=", \"$3\": {\"enabled\": true}"
  cat >"$1" <<EOF
{"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": $2, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0$(keys_of "$4")}$extra}
EOF
}

# 1. Bytes.
rows=()
train=("$bin/mingpt" --n_layer 4 --n_embd 128 --n_head 4 --limit_train_batches 6 --max_epochs 1 --stop_after_steps 6)
for stage in 2 3; do
  for precision in fp32 bf16; do
    ref="$work/ref_${stage}_$precision.json"
    config "$work/none_${stage}_$precision.json" "$stage" "$precision" none
    echo "bytes, stage $stage, $precision: 1 node x 4 ranks, no key" >&2
    env OMP_NUM_THREADS=1 "$bin/zero" launch --nproc_per_node 4 -- "${train[@]}" \
      --config "$work/none_${stage}_$precision.json" --summary-json "$ref" >"$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
    keys_list="none shard2"
    [ "$stage" = 3 ] && keys_list="none shard2 hier4"
    for keys in $keys_list; do
      cfg="$work/${keys}_${stage}_$precision.json"
      config "$cfg" "$stage" "$precision" "$keys"
      echo "bytes, stage $stage, $precision: 2 nodes x 2 ranks, $keys" >&2
      two_nodes "$work/log" "${train[@]}" --config "$cfg" --summary-json "$work/bytes_${keys}_${stage}_$precision.json"
      rows+=("bytes $stage $precision $keys $work/bytes_${keys}_${stage}_$precision.json $ref")
    done
  done
done

# 2. Loss.
if [ "$skip_loss" = 0 ]; then
  text_data "$work"
  for keys in none shard2; do
    cfg="$work/loss_$keys.json"
    config "$cfg" 3 bf16 "$keys"
    echo "loss, minGPT on text, $loss_steps steps: $keys" >&2
    two_nodes "$work/log" "$bin/mingpt" --config "$cfg" --data "$work/text.txt" --n_layer 4 --n_embd 128 --n_head 4 \
      --block_size 64 --limit_train_batches "$loss_steps" --max_epochs 1 --summary-json "$work/mingpt_$keys.json"
    rows+=("mingpt 3 bf16 $keys $work/mingpt_$keys.json -")
    echo "loss, Llama on text, $loss_steps steps: $keys" >&2
    two_nodes "$work/log" "$bin/llama" train --model "$work/llama" --config "$cfg" --data "$work/tokens.bin" \
      --steps "$loss_steps" --batch_size 8 --block_size 64 --precision bf16 --summary-json "$work/llama_$keys.json"
    rows+=("llama 3 bf16 $keys $work/llama_$keys.json -")
  done
fi

python3 - "$out" "${rows[@]}" <<'EOF'
import json, statistics, sys
out, rows = sys.argv[1], sys.argv[2:]
records, bytes_rows, loss_rows = [], [], []
base, exact_loss = {}, {}
def mb(x): return f"{x / 1e6:.2f}"
for r in rows:
    kind, stage, precision, keys, path, ref = r.split()
    s = json.load(open(path))
    t = s["collective_bytes_per_step"]
    steps = max(1, t["steps"])
    busiest = max(rk["collective_bytes"]["across_nodes"] for rk in s["ranks"]) / steps
    rec = {"kind": kind, "stage": int(stage), "precision": precision, "keys": keys,
           "num_parameters": s["num_parameters"], "within_node": t["within_node"], "across_nodes": t["across_nodes"],
           "busiest_rank_across": busiest, "median_step_s": statistics.median(s["step_time_s"]),
           "final_loss": s["loss_curve"][-1], "last20_loss": statistics.mean(s["loss_curve"][-20:]),
           "loss_curve": s["loss_curve"]}
    if kind == "bytes":
        a = json.load(open(ref))
        rec["same_bits_as_one_node"] = a["loss_curve"] == s["loss_curve"] and a["param_l2"] == s["param_l2"]
        rec["largest_loss_difference"] = max(abs(x / y - 1) for x, y in zip(s["loss_curve"], a["loss_curve"]))
        key = (stage, precision)
        if keys == "none": base[key] = (t["across_nodes"], busiest)
        rec["across_vs_none"] = t["across_nodes"] / base[key][0]
        rec["busiest_vs_none"] = busiest / base[key][1]
        bytes_rows.append(f"| {stage} | {precision} | {keys} | {mb(t['within_node'])} | {mb(t['across_nodes'])} "
                          f"| {rec['across_vs_none']:.2f} | {mb(busiest)} | {rec['busiest_vs_none']:.2f} "
                          f"| {rec['largest_loss_difference']:.1e} | {'yes' if rec['same_bits_as_one_node'] else 'no'} "
                          f"| {rec['median_step_s'] * 1e3:.0f} |")
    else:
        if keys == "none": exact_loss[kind] = (rec["final_loss"], rec["last20_loss"])
        rec["loss_vs_none"] = rec["final_loss"] / exact_loss[kind][0] - 1
        rec["last20_vs_none"] = rec["last20_loss"] / exact_loss[kind][1] - 1
        loss_rows.append(f"| {kind} | {keys} | {len(s['loss_curve'])} | {rec['final_loss']:.4f} | {rec['loss_vs_none'] * 100:+.2f}% "
                         f"| {rec['last20_loss']:.4f} | {rec['last20_vs_none'] * 100:+.2f}% "
                         f"| {mb(t['across_nodes'])} | {rec['median_step_s'] * 1e3:.0f} |")
    records.append(rec)
md = ("| stage | precision | keys | MB a step within | MB a step across | across / none | max rank across MB "
      "| max rank / none | largest loss difference from 1x4 | bits of 1x4 | step ms |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(bytes_rows) + "\n")
if loss_rows:
    md += ("\n| program | keys | steps | last loss | against none | mean of the last 20 | against none "
           "| MB a step across | step ms |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(loss_rows) + "\n")
open(f"{out}/mics.md", "w").write(md)
json.dump(records, open(f"{out}/mics.json", "w"), indent=2)
print(md, end="")
EOF
