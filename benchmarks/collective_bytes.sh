#!/usr/bin/env bash
# Bytes that cross the nodes (issue 38 §5, NOTE [bytes across nodes]): the
# same minGPT run on one node of 4 ranks and on two nodes of 2 ranks
# (`zero launch --nnodes 2` twice on loopback), stages 1, 2 and 3, fp32 and
# bf16 (or fp16). Each run's summary gives the bytes its collectives sent per step,
# summed over the ranks, within a node and across nodes, and its median step
# time (loopback: every "node" is this machine, so the times say nothing of a
# network). The table is the baseline that ZeRO++ and MiCS (issue 38) are
# measured against. Writes OUT/collective_bytes.md and .json.
#
#   benchmarks/collective_bytes.sh [--stages "1 2 3"] [--precisions "fp32 bf16"]
#       [--steps N] [--model "L C H"] [--out DIR] [--bin DIR]
#
# Defaults: stages 1 2 3, fp32 and bf16, 6 steps, 4 layers of width 128
# with 4 heads, OUT build/collective_bytes.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
stages="1 2 3"
precisions="fp32 bf16"
steps=6
model="4 128 4"
out="$root/build/collective_bytes"
bin="$root/build/bin"
while [ $# -gt 0 ]; do
  case "$1" in
    --stages) stages="$2"; shift 2 ;;
    --precisions) precisions="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "collective_bytes.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for b in zero mingpt; do
  [ -x "$bin/$b" ] || { echo "collective_bytes.sh: $bin/$b not found; build first (make build)" >&2; exit 2; }
done
read -r layers width heads <<<"$model"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
rows=()
for stage in $stages; do
  for precision in $precisions; do
    cfg="$work/s${stage}_${precision}.json"
    case "$precision" in
      fp32) extra="" ;;
      bf16|fp16) extra=", \"$precision\": {\"enabled\": true}" ;;
      *) echo "collective_bytes.sh: precision $precision: expected fp32, bf16 or fp16" >&2; exit 2 ;;
    esac
    cat >"$cfg" <<EOF
{"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": $stage, "stage3_param_persistence_threshold": 0}$extra}
EOF
    train=("$bin/mingpt" --config "$cfg" --n_layer "$layers" --n_embd "$width" --n_head "$heads"
           --limit_train_batches "$steps" --max_epochs 1 --stop_after_steps "$steps")
    one="$work/one_${stage}_${precision}.json"
    two="$work/two_${stage}_${precision}.json"
    echo "stage $stage, $precision: 1 node x 4 ranks" >&2
    env OMP_NUM_THREADS=1 "$bin/zero" launch --nproc_per_node 4 -- "${train[@]}" --summary-json "$one" >"$work/log" 2>&1 ||
      { cat "$work/log" >&2; exit 1; }
    echo "stage $stage, $precision: 2 nodes x 2 ranks" >&2
    port=$(free_port)
    node() {
      env OMP_NUM_THREADS=1 "$bin/zero" launch --nnodes 2 --node_rank "$1" --nproc_per_node 2 \
        --master_addr 127.0.0.1 --master_port "$port" -- "${train[@]}" --summary-json "$two"
    }
    node 1 >"$work/log1" 2>&1 &
    other=$!
    node 0 >"$work/log0" 2>&1 || { kill "$other" 2>/dev/null; wait "$other" 2>/dev/null; cat "$work/log0" >&2; exit 1; }
    wait "$other" || { cat "$work/log1" >&2; exit 1; }
    rows+=("$stage $precision $one $two")
  done
done

python3 - "$out" "${rows[@]}" <<'EOF'
import json, statistics, sys
out, rows = sys.argv[1], sys.argv[2:]
table, records = [], []
def mb(x): return f"{x / 1e6:.2f}"
for r in rows:
    stage, precision, one, two = r.split()
    a, b = json.load(open(one)), json.load(open(two))
    ta, tb = a["collective_bytes_per_step"], b["collective_bytes_per_step"]
    sa, sb = statistics.median(a["step_time_s"]), statistics.median(b["step_time_s"])
    records.append({"stage": int(stage), "precision": precision, "num_parameters": a["num_parameters"],
                    "one_node": {"within_node": ta["within_node"], "across_nodes": ta["across_nodes"], "median_step_s": sa},
                    "two_nodes": {"within_node": tb["within_node"], "across_nodes": tb["across_nodes"], "median_step_s": sb},
                    "same_loss_curve": a["loss_curve"] == b["loss_curve"]})
    per_param = (tb["within_node"] + tb["across_nodes"]) / a["num_parameters"]
    table.append(f"| {stage} | {precision} | {mb(ta['within_node'])} | {mb(tb['within_node'])} | {mb(tb['across_nodes'])} "
                 f"| {per_param:.1f} | {tb['across_nodes'] / max(1.0, tb['within_node'] + tb['across_nodes']):.2f} "
                 f"| {sa * 1e3:.0f} | {sb * 1e3:.0f} | {'yes' if a['loss_curve'] == b['loss_curve'] else 'NO'} |")
head = ("| stage | precision | 1x4: MB a step within | 2x2: within | 2x2: across | bytes a parameter | across share "
        "| 1x4 step ms | 2x2 step ms | same losses |\n|---|---|---|---|---|---|---|---|---|---|")
md = head + "\n" + "\n".join(table) + "\n"
open(f"{out}/collective_bytes.md", "w").write(md)
json.dump(records, open(f"{out}/collective_bytes.json", "w"), indent=2)
print(md, end="")
EOF
