#!/usr/bin/env bash
# What ZERO_TRACE costs (NOTE [trace]): minGPT on 2 ranks at stage 3 with the
# optimizer offloaded to the CPU, the trace off and on, alternating ROUNDS
# times; the median step time of each run (its first 2 steps left out), the
# ratio on/off of each pair, and the trace's events and bytes a step.
#   benchmarks/trace_cost.sh [BIN_DIR (default build/bin)] [ROUNDS (default 4)]
set -euo pipefail
bin=${1:-build/bin}
rounds=${2:-4}
work=$(mktemp -d "${TMPDIR:-/tmp}/zero-trace-cost.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/z3.json" <<'EOF'
{"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": 3, "sub_group_size": 20000, "offload_optimizer": {"device": "cpu"},
                       "stage3_param_persistence_threshold": 0}}
EOF
steps=30
median() { python3 -c "import json,statistics,sys; s=json.load(open(sys.argv[1]))['step_time_s'][2:]; print(f'{statistics.median(s):.4f}')" "$1"; }
echo "| round | off: step (s) | on: step (s) | on / off | events a step | bytes a step |"
echo "|---|---|---|---|---|---|"
for i in $(seq "$rounds"); do
  declare -A t=()
  for mode in off on; do
    rm -f "$work"/trace*.json
    trace_env=()
    [ "$mode" = on ] && trace_env=("ZERO_TRACE=$work/trace.json")
    env OMP_NUM_THREADS=1 "${trace_env[@]}" \
      "$bin/zero" launch --nproc_per_node 2 -- "$bin/mingpt" --config "$work/z3.json" --vocab_size 256 --block_size 128 \
      --n_layer 4 --n_embd 256 --n_head 4 --limit_train_batches $steps --summary-json "$work/s_$mode.json" \
      >"$work/log_$mode" 2>&1 || { echo "the $mode run failed:"; tail -20 "$work/log_$mode"; exit 1; }
    t[$mode]=$(median "$work/s_$mode.json")
  done
  events=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['traceEvents']) // $steps)" "$work/trace.rank0.json")
  bytes=$(( $(stat -c %s "$work/trace.rank0.json") / steps ))
  ratio=$(python3 -c "print(f'{${t[on]} / ${t[off]}:.3f}')")
  echo "| $i | ${t[off]} | ${t[on]} | $ratio | $events | $bytes |"
done
