#!/usr/bin/env bash
# LoRA fine-tuning at ZeRO stage 3 (issue 50; NOTE [frozen groups]): a Llama
# of 8 layers, hidden 1024 (LLaMA's shape: 16 heads, intermediate 2816,
# vocabulary 32000; 170.8M parameters), LoRA r=16 on every projection
# (all-linear), on 1, 2 and 4 ranks at stage 3, and with offload_param and
# offload_optimizer cpu; beside full fine-tuning at stage 3. Per rank: the
# frozen bytes the ledger holds, the model states, the measured device peak,
# the median step time (steps after the first), and `zero estimate`'s
# figures for the same configuration (frozen parameters and model states on
# the device and in host memory) with the ratio measured / estimated.
#
#   benchmarks/lora.sh [--steps N] [--ranks "1 2 4"] [--out DIR] [--bin DIR]
#
# fp32, micro-batch 1 of 128 tokens of random ids, a fresh initialisation
# (the folder has no weights). Writes OUT/lora.md and OUT/lora.json
# (default OUT build/lora). On this machine's 2 cores the step times of
# several ranks share the cores: compare them with each other, not with a GPU.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
steps=4
ranks_list="1 2 4"
out="$root/build/lora"
bin="$root/build/bin"
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --ranks) ranks_list="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "lora.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$steps" in ''|*[!0-9]*|0|1) echo "lora.sh: --steps $steps: expected a whole number of at least 2" >&2; exit 2 ;; esac
for b in zero llama; do
  [ -x "$bin/$b" ] || { echo "lora.sh: $bin/$b not found; build first (make build)" >&2; exit 2; }
done
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/model"
cat > "$work/model/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "vocab_size": 32000,
 "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
 "num_key_value_heads": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
 "tie_word_embeddings": false}
EOF
python3 -c "
import random, struct
random.seed(0)
with open('$work/tokens.bin', 'wb') as f:
    f.write(struct.pack('<%dH' % 200000, *[random.randrange(32000) for _ in range(200000)]))
"

config() {  # $1: offload (none|cpu)
  local off=""
  [ "$1" = cpu ] && off=', "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}'
  cat <<EOF
{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0$off}}
EOF
}

runs=()
for ranks in $ranks_list; do
  for variant in lora lora_cpu full; do
    off=none
    [ "$variant" = lora_cpu ] && off=cpu
    lora="--lora 16 --lora_alpha 32 --lora_targets all-linear"
    [ "$variant" = full ] && lora=""
    config "$off" > "$work/ds_$off.json"
    name="${variant}_${ranks}"
    echo "lora.sh: $name ..." >&2
    launch=""
    [ "$ranks" -gt 1 ] && launch="$bin/zero launch --nproc_per_node $ranks --"
    # shellcheck disable=SC2086
    env OMP_NUM_THREADS=1 $launch "$bin/llama" train --model "$work/model" --config "$work/ds_$off.json" \
      --data "$work/tokens.bin" --block_size 128 --batch_size 1 --steps "$steps" $lora \
      --summary-json "$work/$name.json" > "$work/$name.log" 2>&1 || { tail -20 "$work/$name.log" >&2; exit 1; }
    est_lora=""
    [ "$variant" = full ] || est_lora="--lora 16 --lora-targets all-linear"
    # shellcheck disable=SC2086
    "$bin/zero" estimate --hf-config "$work/model/config.json" --ranks-per-node "$ranks" \
      --config "$work/ds_$off.json" $est_lora --json "$work/$name.estimate.json" > /dev/null
    runs+=("$name")
  done
done

python3 - "$work" "$out" "$steps" "${runs[@]}" <<'EOF'
import json, statistics, sys
work, out, steps, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
rows = []
for n in names:
    s = json.load(open(f"{work}/{n}.json"))
    e = json.load(open(f"{work}/{n}.estimate.json"))
    conf = e["configurations"][0]
    r0 = s["ranks"][0]
    st = r0["model_state_bytes"]
    measured_states = st["parameters"] + st["gradients"] + st["optimizer_states"]
    est_states = sum(conf[t][k] for t in ("device", "host", "nvme") for k in ("parameters", "gradients", "optimizer_states"))
    est_frozen = sum(conf[t]["frozen_parameters"] for t in ("device", "host", "nvme"))
    rows.append({
        "run": n, "ranks": s["world_size"], "trainable": s["trainable_parameters"], "frozen": s["frozen_parameters"],
        "frozen_bytes_rank0": r0["frozen_parameter_bytes"], "frozen_estimate": est_frozen,
        "model_states_rank0": measured_states, "model_states_estimate": est_states,
        "peak_device_rank0": r0["peak_bytes"]["device"], "peak_host_rank0": r0["peak_bytes"]["host"] + r0["peak_bytes"]["pinned_host"],
        "step_s": statistics.median(s["step_time_s"][1:]), "final_loss": s["final_loss"],
    })
json.dump(rows, open(f"{out}/lora.json", "w"), indent=2)
mb = lambda b: f"{b / 2**20:.1f} MiB"
ratio = lambda a, b: f"{a / b:.3f}" if b else ("1.000" if a == 0 else "-")
with open(f"{out}/lora.md", "w") as f:
    f.write("| run | ranks | trainable | frozen bytes / rank (est. ratio) | model states / rank (est. ratio) | device peak / rank | host peak / rank | step (median) |\n")
    f.write("|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        f.write(f"| {r['run']} | {r['ranks']} | {r['trainable']:,} | {mb(r['frozen_bytes_rank0'])} ({ratio(r['frozen_bytes_rank0'], r['frozen_estimate'])}) "
                f"| {mb(r['model_states_rank0'])} ({ratio(r['model_states_rank0'], r['model_states_estimate'])}) "
                f"| {mb(r['peak_device_rank0'])} | {mb(r['peak_host_rank0'])} | {r['step_s']:.2f} s |\n")
print(open(f"{out}/lora.md").read())
EOF
