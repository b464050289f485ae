#!/usr/bin/env bash
# offload_optimizer.super_offload (NOTE [speculative step]) against the plain
# offload step, on this machine's CPU ranks: minGPT at stage 3 with the
# optimizer offloaded to the CPU (fp32, 12.8M parameters), super_offload off and on, alternating
# ROUNDS times, on 1 rank (OMP_NUM_THREADS=1: a core is free for the
# speculative steps, as a GPU run's host is while the GPU runs backward) and
# on 2 ranks (both cores busy with backward: nothing to overlap with), with
# clipping off (speculation accepted) and on at a norm every step passes
# (undone and redone each step). Prints the median step time of each run
# (its first 2 steps left out), on/off, and what the speculation did; with
# --trace DIR, writes the 2-rank Chrome trace with super_offload there.
#   benchmarks/super_offload.sh [--bin DIR] [--rounds N] [--trace DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin="$root/build/bin" rounds=3 trace_dir=
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --trace) trace_dir=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "super_offload.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/mingpt" ] || { echo "super_offload.sh: $bin/mingpt is not built (make build, or --bin DIR)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/zero-super-offload.XXXXXX")
trap 'rm -rf "$work"' EXIT
steps=12
config() {  # $1 super_offload, $2 gradient_clipping
  cat <<EOF
{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": $2,
 "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                       "offload_optimizer": {"device": "cpu", "super_offload": $1}}}
EOF
}
# fp32 (bf16 matmuls are slow on CPUs without AMX); a wide model at a small
# micro-batch, so that the CPU step is a good part of the step, as on a GPU.
model=(--vocab_size 256 --block_size 64 --n_layer 4 --n_embd 512 --n_head 8 --limit_train_batches $steps)
median() { python3 -c "import json,statistics,sys; s=json.load(open(sys.argv[1]))['step_time_s'][2:]; print(f'{statistics.median(s):.4f}')" "$1"; }
counts() { python3 -c "import json,sys; c=json.load(open(sys.argv[1])).get('speculation',{}); print(f\"{c.get('validated',0)}/{c.get('redone',0)}/{c.get('undone',0)}\")" "$1"; }
run() {  # $1 ranks, $2 super, $3 clip, $4 summary, [$5 trace]
  config "$2" "$3" >"$work/c.json"
  local launch=("$bin/mingpt")
  [ "$1" -gt 1 ] && launch=("$bin/zero" launch --nproc_per_node "$1" -- "$bin/mingpt")
  env OMP_NUM_THREADS=1 ${5:+ZERO_TRACE=$5} "${launch[@]}" --config "$work/c.json" "${model[@]}" --summary-json "$4" \
    >"$work/log" 2>&1 || { echo "super_offload.sh: the run failed:" >&2; tail -20 "$work/log" >&2; exit 1; }
}
echo "| ranks | gradient_clipping | round | off: step (s) | on: step (s) | on / off | validated/redone/undone |"
echo "|---|---|---|---|---|---|---|"
for ranks in 1 2; do
  for clip in 0 1e-6; do
    for i in $(seq "$rounds"); do
      run "$ranks" false "$clip" "$work/off.json"
      run "$ranks" true "$clip" "$work/on.json"
      off=$(median "$work/off.json") on=$(median "$work/on.json")
      echo "| $ranks | $clip | $i | $off | $on | $(python3 -c "print(f'{$on / $off:.3f}')") | $(counts "$work/on.json") |"
    done
  done
done
if [ -n "$trace_dir" ]; then
  mkdir -p "$trace_dir"
  run 2 true 0 "$work/t.json" "$trace_dir/super_offload_cpu.json"
  echo "traces: $trace_dir/super_offload_cpu.rank0.json, .rank1.json"
fi
