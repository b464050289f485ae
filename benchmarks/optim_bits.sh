#!/usr/bin/env bash
# Training quality with low-precision optimizer states against fp32 ones:
# 8-bit Adam states (optimizer.params.optim_bits 8, NOTE [8-bit states]) and a
# bf16 master with bf16 states (bf16.bf16_master_weights_and_grads and
# bf16_optimizer_states, NOTE [16-bit master]), stochastically rounded and,
# to show why that is the default, rounded to nearest. minGPT, character-
# level, on a text file for a few hundred steps with each (same seed, data and
# config but the states; the bf16 runs compute in bf16 and are compared with
# bf16 compute and an fp32 master), ZeRO-2 + CPU offload on N ranks; then the
# addition task with each to its held-out accuracy. Writes OUT/optim_bits.md
# and .json.
#
#   benchmarks/optim_bits.sh [--data FILE] [--steps N] [--ranks N] [--out DIR] [--bin DIR]
#
# Defaults: /usr/share/common-licenses/GPL-3 (any text will do), 300 steps,
# 2 ranks: a few minutes on two cores.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
data=/usr/share/common-licenses/GPL-3 steps=300 ranks=2 out="$root/build/optim_bits" bin="$root/build/bin"
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --data) data=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "optim_bits.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/mingpt" ] || { echo "optim_bits.sh: $bin/mingpt is not built (make build, or --bin DIR)" >&2; exit 1; }
[ -r "$data" ] || { echo "optim_bits.sh: cannot read --data $data" >&2; exit 1; }
mkdir -p "$out"

# The demo's config with the optimizer states offloaded, and its 8-bit twin.
python3 - "$root/configs/mingpt_zero2.json" "$out" <<'PY'
import json, sys
base = json.load(open(sys.argv[1]))
base["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
for bits in (32, 8):
    c = json.loads(json.dumps(base))
    c["optimizer"]["params"]["optim_bits"] = bits
    json.dump(c, open(f"{sys.argv[2]}/states{bits}.json", "w"), indent=2)
# bf16 compute: an fp32 master and states; a bf16 master and states,
# stochastically rounded or to nearest.
for name, bf16 in (("bf16_fp32master", {"enabled": True}),
                   ("bf16_master", {"enabled": True, "bf16_master_weights_and_grads": True,
                                    "bf16_optimizer_states": True}),
                   ("bf16_master_nearest", {"enabled": True, "bf16_master_weights_and_grads": True,
                                            "bf16_optimizer_states": True, "stochastic_rounding": False})):
    c = json.loads(json.dumps(base))
    c["bf16"] = bf16
    c["fp16"] = {"enabled": False}
    json.dump(c, open(f"{sys.argv[2]}/{name}.json", "w"), indent=2)
PY

run() {  # NAME CONFIG ARGS...
  local name=$1 cfg=$2; shift 2
  echo "== $name"
  "$bin/zero" launch --nproc_per_node "$ranks" -- "$bin/mingpt" --config "$cfg" --summary-json "$out/$name.json" "$@" \
    > "$out/$name.log" 2>&1 || { echo "optim_bits.sh: $name failed; see $out/$name.log" >&2; tail -5 "$out/$name.log" >&2; exit 1; }
  grep -E "^Final|^Held-out" "$out/$name.log" || true
}
text=(--data "$data" --block_size 64 --n_layer 2 --n_head 4 --n_embd 128 --batch_size 32 --lr 1e-3
      --limit_train_batches "$steps" --max_epochs 1 --seed 1)
run text_fp32 "$out/states32.json" "${text[@]}"
run text_8bit "$out/states8.json" "${text[@]}"
run text_bf16_fp32master "$out/bf16_fp32master.json" "${text[@]}"
run text_bf16_master "$out/bf16_master.json" "${text[@]}"
run text_bf16_master_nearest "$out/bf16_master_nearest.json" "${text[@]}"
addition=(--n_layer 2 --n_head 4 --n_embd 128 --batch_size 64 --max_epochs 12)
run addition_8bit "$out/states8.json" "${addition[@]}"
run addition_bf16_master "$out/bf16_master.json" "${addition[@]}"

python3 - "$out" "$data" "$steps" "$ranks" <<'PY'
import json, sys
out, data, steps, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def load(n):
    return json.load(open(f"{out}/{n}.json"))
def tail_mean(s):  # the last tenth of the steps: one step's loss is noisy
    c = s["loss_curve"]
    k = max(1, len(c) // 10)
    return sum(c[-k:]) / k
f32, add = load("text_fp32"), load("addition_8bit")
rows = {"data": data, "steps": f32["steps"], "ranks": ranks, "num_parameters": f32["num_parameters"]}
runs = (("fp32", "fp32_states", "text_fp32"), ("8-bit (optim_bits 8)", "8bit_states", "text_8bit"),
        ("bf16 compute, fp32 master and states", "bf16_fp32_master", "text_bf16_fp32master"),
        ("bf16 master and states, stochastic rounding", "bf16_master", "text_bf16_master"),
        ("bf16 master and states, to nearest", "bf16_master_nearest", "text_bf16_master_nearest"))
for _, key, run in runs:
    r = load(run)
    rows[key] = {"final_loss": r["final_loss"], "loss_last_tenth": tail_mean(r),
                 "optimizer_state_bytes": r["model_state_bytes"]["optimizer_states"]}
rows["addition_8bit_heldout_accuracy"] = add["eval_accuracy"]
rows["addition_bf16_master_heldout_accuracy"] = load("addition_bf16_master")["eval_accuracy"]
last = lambda k: rows[k]["loss_last_tenth"]
rows["loss_ratio_8bit_vs_fp32"] = last("8bit_states") / last("fp32_states")
rows["loss_ratio_bf16_master_vs_fp32"] = last("bf16_master") / last("fp32_states")
rows["loss_ratio_bf16_master_vs_bf16_fp32_master"] = last("bf16_master") / last("bf16_fp32_master")
rows["loss_ratio_bf16_nearest_vs_bf16_fp32_master"] = last("bf16_master_nearest") / last("bf16_fp32_master")
json.dump(rows, open(f"{out}/optim_bits.json", "w"), indent=2)
md = [f"# Low-precision optimizer states against fp32 states ({rows['steps']} steps of minGPT on {data}, "
      f"{rows['num_parameters']} parameters, ZeRO-2 + CPU offload, {ranks} ranks)", "",
      "| states | loss, last tenth of the steps | final loss | optimizer-state bytes (rank 0) |", "|---|---|---|---|"]
for name, key, _ in runs:
    r = rows[key]
    md.append(f"| {name} | {r['loss_last_tenth']:.4f} | {r['final_loss']:.4f} | {r['optimizer_state_bytes']} |")
md += ["", f"8-bit / fp32 loss (last tenth): {rows['loss_ratio_8bit_vs_fp32']:.4f}; "
       f"bf16 master and states / fp32: {rows['loss_ratio_bf16_master_vs_fp32']:.4f} "
       f"(/ bf16 compute with an fp32 master: {rows['loss_ratio_bf16_master_vs_bf16_fp32_master']:.4f}); "
       f"rounded to nearest instead: {rows['loss_ratio_bf16_nearest_vs_bf16_fp32_master']:.4f}", "",
       f"Addition, held-out accuracy: 8-bit states {100 * add['eval_accuracy']:.2f}%, "
       f"bf16 master and states {100 * rows['addition_bf16_master_heldout_accuracy']:.2f}%"]
open(f"{out}/optim_bits.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
