#!/usr/bin/env bash
# ZeRO++ on two nodes (issue 38; NOTE [quantized gather], NOTE [hpZ], NOTE
# [quantized gradients]): the bytes that cross the nodes a step, and the
# loss of a text model, with zero_quantized_weights (qwZ),
# zero_hpz_partition_size (hpZ) and zero_quantized_gradients (qgZ), alone and
# all three ("all"), against the same run without them. Every run is stage 3 on two nodes of 2 ranks
# (`zero launch --nnodes 2` twice, on loopback), the reference one node of 4.
#
# 1. Bytes: minGPT (4 layers of width 128, 797K parameters) on the addition
#    task, 6 steps of 32 samples, fp32 and bf16, with no key, each key, and
#    all three. The summaries give each step's bytes summed over the ranks; hpZ
#    without qwZ must train to the bits of one node of 4. Every config sets
#    stage3_max_reuse_distance 0, so that backward gathers each layer again,
#    as it does in a model larger than the default distance (1e9 elements).
# 2. Loss: after --loss-steps (200) steps of a character-level minGPT on
#    this repository's docs (a text model), and of the Llama program (2
#    layers of benchmarks/configs/llama_small_config.json, byte tokens of the
#    same text), qwZ's loss against the exact run's: the last step's, and
#    the mean of the last 20 steps' (one batch's loss is noisy). With
#    --seeds LIST each seed's runs (initialisation; minGPT's data order
#    too) against that seed's exact run, and each exact run against the
#    first seed's: the spread that two trajectories have without any key.
#
#   benchmarks/zeropp.sh [--loss-steps N] [--skip-loss] [--skip-bytes] [--seeds LIST]
#                        [--programs mingpt,llama] [--loss-keys none,qwz,qgz,all] [--out DIR] [--bin DIR]
#
# Writes OUT/zeropp.md and OUT/zeropp.json (default OUT build/zeropp).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
loss_steps=200
skip_loss=0
skip_bytes=0
seeds=42
programs=mingpt,llama
loss_keys=none,qwz,qgz,all
out="$root/build/zeropp"
bin="$root/build/bin"
while [ $# -gt 0 ]; do
  case "$1" in
    --loss-steps) loss_steps="$2"; shift 2 ;;
    --skip-loss) skip_loss=1; shift ;;
    --skip-bytes) skip_bytes=1; shift ;;
    --seeds) seeds="$2"; shift 2 ;;
    --programs) programs="$2"; shift 2 ;;
    --loss-keys) loss_keys="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "zeropp.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$loss_steps" in ''|*[!0-9]*) echo "zeropp.sh: --loss-steps $loss_steps: expected a whole number" >&2; exit 2 ;; esac
case ",$loss_keys," in *,none,*) ;; *) echo "zeropp.sh: --loss-keys $loss_keys: expected none among them (the reference)" >&2; exit 2 ;; esac
IFS=, read -r -a seed_list <<<"$seeds"
IFS=, read -r -a program_list <<<"$programs"
IFS=, read -r -a loss_key_list <<<"$loss_keys"
for x in "${seed_list[@]}"; do case "$x" in ''|*[!0-9]*) echo "zeropp.sh: --seeds $seeds: expected whole numbers" >&2; exit 2 ;; esac; done
for x in "${program_list[@]}"; do case "$x" in mingpt|llama) ;; *) echo "zeropp.sh: --programs $programs: expected mingpt, llama" >&2; exit 2 ;; esac; done
for x in "${loss_key_list[@]}"; do case "$x" in none|qwz|hpz|qgz|all) ;; *) echo "zeropp.sh: --loss-keys $loss_keys: expected none, qwz, hpz, qgz, all" >&2; exit 2 ;; esac; done
for b in zero mingpt llama; do
  [ -x "$bin/$b" ] || { echo "zeropp.sh: $bin/$b not found; build first (make build)" >&2; exit 2; }
done
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source=benchmarks/two_nodes_lib.sh
. "$here/two_nodes_lib.sh"

keys_of() {
  case "$1" in
    none) echo "" ;;
    qwz) echo ', "zero_quantized_weights": true' ;;
    hpz) echo ', "zero_hpz_partition_size": 2' ;;
    qgz) echo ', "zero_quantized_gradients": true' ;;
    all) echo ', "zero_quantized_weights": true, "zero_hpz_partition_size": 2, "zero_quantized_gradients": true' ;;
  esac
}
config() {  # config FILE PRECISION KEYS
  local extra=""
  [ "$2" = fp32 ] || extra=", \"$2\": {\"enabled\": true}"
  cat >"$1" <<EOF
{"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0$(keys_of "$3")}$extra}
EOF
}

# 1. Bytes.
rows=()
precisions=(fp32 bf16)
[ "$skip_bytes" = 0 ] || precisions=()
for precision in ${precisions[@]+"${precisions[@]}"}; do
  ref="$work/ref_$precision.json"
  config "$work/none_$precision.json" "$precision" none
  train=("$bin/mingpt" --n_layer 4 --n_embd 128 --n_head 4 --limit_train_batches 6 --max_epochs 1 --stop_after_steps 6)
  echo "bytes, $precision: 1 node x 4 ranks, no key" >&2
  env OMP_NUM_THREADS=1 "$bin/zero" launch --nproc_per_node 4 -- "${train[@]}" --config "$work/none_$precision.json" \
    --summary-json "$ref" >"$work/log" 2>&1 || { cat "$work/log" >&2; exit 1; }
  for keys in none qwz hpz qgz all; do
    config "$work/${keys}_$precision.json" "$precision" "$keys"
    echo "bytes, $precision: 2 nodes x 2 ranks, $keys" >&2
    two_nodes "$work/log" "${train[@]}" --config "$work/${keys}_$precision.json" \
      --summary-json "$work/bytes_${keys}_$precision.json"
    rows+=("bytes $precision $keys $work/bytes_${keys}_$precision.json $ref")
  done
done

# 2. Loss.
if [ "$skip_loss" = 0 ]; then
  text_data "$work"
  for seed in "${seed_list[@]}"; do
  for keys in "${loss_key_list[@]}"; do
    cfg="$work/loss_$keys.json"
    config "$cfg" bf16 "$keys"
    for program in "${program_list[@]}"; do
      echo "loss, $program on text, $loss_steps steps, seed $seed: $keys" >&2
      summary="$work/${program}_${keys}_$seed.json"
      if [ "$program" = mingpt ]; then
        two_nodes "$work/log" "$bin/mingpt" --config "$cfg" --data "$work/text.txt" --n_layer 4 --n_embd 128 --n_head 4 \
          --block_size 64 --limit_train_batches "$loss_steps" --max_epochs 1 --seed "$seed" --summary-json "$summary"
      else
        two_nodes "$work/log" "$bin/llama" train --model "$work/llama" --config "$cfg" --data "$work/tokens.bin" \
          --steps "$loss_steps" --batch_size 8 --block_size 64 --precision bf16 --seed "$seed" --summary-json "$summary"
      fi
      rows+=("$program bf16 $keys $summary - $seed")
    done
  done
  done
fi

python3 - "$out" "${rows[@]}" <<'EOF'
import json, statistics, sys
out, rows = sys.argv[1], sys.argv[2:]
records, bytes_rows, loss_rows = [], [], []
base_across, exact_loss = {}, {}
def mb(x): return f"{x / 1e6:.2f}"
first_seed = {}
for r in rows:
    kind, precision, keys, path, ref, *seed = r.split()
    seed = int(seed[0]) if seed else None
    s = json.load(open(path))
    t = s["collective_bytes_per_step"]
    rec = {"kind": kind, "precision": precision, "keys": keys, "num_parameters": s["num_parameters"],
           "within_node": t["within_node"], "across_nodes": t["across_nodes"],
           "median_step_s": statistics.median(s["step_time_s"]), "final_loss": s["loss_curve"][-1],
           "last20_loss": statistics.mean(s["loss_curve"][-20:]), "loss_curve": s["loss_curve"]}
    if kind == "bytes":
        a = json.load(open(ref))
        rec["same_bits_as_one_node"] = a["loss_curve"] == s["loss_curve"] and a["param_l2"] == s["param_l2"]
        if keys == "none": base_across[precision] = t["across_nodes"]
        ratio = t["across_nodes"] / base_across[precision]
        rec["across_vs_none"] = ratio
        bytes_rows.append(f"| {precision} | {keys} | {mb(t['within_node'])} | {mb(t['across_nodes'])} | {ratio:.2f} "
                          f"| {rec['median_step_s'] * 1e3:.0f} | {'yes' if rec['same_bits_as_one_node'] else 'no'} |")
    else:
        rec["seed"] = seed
        if keys == "none":
            exact_loss[(kind, seed)] = (rec["final_loss"], rec["last20_loss"])
            first_seed.setdefault(kind, exact_loss[(kind, seed)])
        e, f = exact_loss[(kind, seed)], first_seed[kind]
        rec["loss_vs_none"] = rec["final_loss"] / e[0] - 1
        rec["last20_vs_none"] = rec["last20_loss"] / e[1] - 1
        # The seed control: this seed's exact run against the first seed's.
        control = ""
        if keys == "none":
            rec["loss_vs_first_seed"] = rec["final_loss"] / f[0] - 1
            rec["last20_vs_first_seed"] = rec["last20_loss"] / f[1] - 1
            control = f"{rec['loss_vs_first_seed'] * 100:+.2f}% / {rec['last20_vs_first_seed'] * 100:+.2f}%"
        loss_rows.append(f"| {kind} | {seed} | {keys} | {len(s['loss_curve'])} | {rec['final_loss']:.4f} | {rec['loss_vs_none'] * 100:+.2f}% "
                         f"| {rec['last20_loss']:.4f} | {rec['last20_vs_none'] * 100:+.2f}% | {control} "
                         f"| {mb(t['across_nodes'])} | {rec['median_step_s'] * 1e3:.0f} |")
    records.append(rec)
md = ""
if bytes_rows:
    md += ("| precision | keys | MB a step within | MB a step across | across / none | step ms | bits of 1x4 |\n"
           "|---|---|---|---|---|---|---|\n" + "\n".join(bytes_rows) + "\n")
if loss_rows:
    md += ("\n| program | seed | keys | steps | last loss | against none | mean of the last 20 | against none "
           "| none against the first seed's (last / last 20) | MB a step across | step ms |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(loss_rows) + "\n")
open(f"{out}/zeropp.md", "w").write(md)
json.dump(records, open(f"{out}/zeropp.json", "w"), indent=2)
print(md, end="")
EOF
