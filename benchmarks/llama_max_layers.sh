#!/usr/bin/env bash
# The largest Llama that trains under per-rank budgets, by its number of
# layers (README.md, "The max-parameter benchmark"; issue 37's proof with the
# Llama program). For each configuration of benchmarks/max_params/, the
# search starts where `zero estimate --hf-config` says the model states fit
# (the estimator's largest num_hidden_layers), then trains the model
# (`llama train`, built under zero::Init at stage 3, on random tokens) at
# that depth and steps one layer at a time up while it fits or down until it
# does: a few probes when the estimate is close. A probe that ends with exit
# status 3 (out of memory) does not fit; any other failure ends the search.
# The largest run's report then calibrates the estimator (`zero estimate
# --calibrate`: its measured device peak gives the activations per sample),
# whose largest model whose peak of a step fits is the prediction the
# largest found is held to, as mingpt --find-max-params's "predicted".
# Writes OUT/llama_max_layers.md and OUT/llama_max_layers.json.
#
#   benchmarks/llama_max_layers.sh [--hf-config FILE] [--configs "a b ..."]
#       [--ranks N] [--device-memory B] [--host-memory B] [--nvme-bytes B]
#       [--nvme-path DIR] [--precision 32|bf16] [--batch-size N]
#       [--block-size T] [--steps N] [--out DIR] [--bin DIR]
#       [--checkpoint] [--plan "c ..."] [--layers N]
#
# --plan: for these configurations, where `zero estimate` names a placement
# of the offloaded optimizer that fits a larger model (its planner: the
# gradients on the device, the ratio, max_in_cpu with NVMe), the
# configuration takes it before the search. --checkpoint: every layer's
# activations checkpointed (llama train --checkpoint), for every
# configuration. --layers N: train N layers only, no search (the card's run
# of a 30B model: one probe). The data: random ids of 16 of the vocabulary's tokens,
# whose frequencies the model learns in a few steps (the loss falls).
#
# Defaults: benchmarks/configs/llama_small_config.json (hidden 384, 6 heads,
# MLP 1024, vocabulary 1024), 1 rank with 141 MB of "device", 120 MB of host
# memory and 60 MB of NVMe (1/1000 of the H200 box), bf16, 4 samples of 64
# tokens, 3 steps.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
hf="$here/configs/llama_small_config.json"
configs="zero3_offload_bf16 zero3_placed_bf16_8bit"
ranks=1 device=141MB host=120MB nvme=60MB nvme_path="" precision=bf16 batch=4 block=64 steps=3
out="$root/build/llama_max_layers" bin="$root/build/bin" plan="" checkpoint=() layers=""

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --hf-config) hf=$2; shift 2 ;;
    --configs) configs=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --device-memory) device=$2; shift 2 ;;
    --host-memory) host=$2; shift 2 ;;
    --nvme-bytes) nvme=$2; shift 2 ;;
    --nvme-path) nvme_path=$2; shift 2 ;;
    --precision) precision=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --block-size) block=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --plan) plan=$2; shift 2 ;;
    --layers) layers=$2; shift 2 ;;
    --checkpoint) checkpoint=(--checkpoint); shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "llama_max_layers.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
for b in llama zero; do
  [ -x "$bin/$b" ] || { echo "llama_max_layers.sh: $bin/$b is not built (make build, or --bin DIR)" >&2; exit 1; }
done
[ -f "$hf" ] || { echo "llama_max_layers.sh: --hf-config $hf: no such file" >&2; exit 2; }
for c in $configs; do
  [ -f "$here/max_params/$c.json" ] || { echo "llama_max_layers.sh: no configuration $c (benchmarks/max_params/$c.json)" >&2; exit 2; }
done

mkdir -p "$out"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/llama-max-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
[ -n "$nvme_path" ] || { nvme_path="$scratch/nvme"; mkdir -p "$nvme_path"; }
budgets=(--device-memory "$device" --host-memory "$host" --nvme-bytes "$nvme")
vocab=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$hf")
# Random ids of 16 tokens, enough for every step's global batch (and one more token).
python3 - "$scratch/tokens.bin" "$vocab" $(( (steps + 1) * ranks * batch * (block + 1) + 1 )) <<'EOF'
import random, struct, sys
path, vocab, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(0)
with open(path, "wb") as f:
    f.write(struct.pack("<%dH" % n, *(rng.randrange(min(16, vocab)) for _ in range(n))))
EOF

echo "llama_max_layers: $hf on $ranks rank(s); per rank: device $device, host $host, nvme $nvme; $precision; configurations: $configs"
results="$scratch/results.jsonl"
: > "$results"
for c in $configs; do
  cfg="$out/$c.config.json"
  python3 - "$here/max_params/$c.json" "$cfg" "$nvme_path" "$precision" "$batch" <<'EOF'
import json, sys
src, dst, nvme, precision, batch = sys.argv[1:6]
c = json.load(open(src))
for key in ("offload_optimizer", "offload_param"):  # the swap folder, wherever the config has one
    section = c.get("zero_optimization", {}).get(key, {})
    if section.get("nvme_path") == "@NVME_PATH@":
        section["nvme_path"] = nvme
# "auto" filled as the programs fill it, so that the estimator reads the same config.
c["train_micro_batch_size_per_gpu"] = int(batch)
c.setdefault("fp16", {})["enabled"] = False
c.setdefault("bf16", {})["enabled"] = precision == "bf16"
for k, v in list(c["optimizer"]["params"].items()):
    if v == "auto":
        c["optimizer"]["params"][k] = 1e-3 if k == "lr" else 0.1
json.dump(c, open(dst, "w"), indent=2)
EOF
  estimate() {  # the model states under $cfg: the largest that fits, and the planner's placement
    "$bin/zero" estimate --hf-config "$hf" --config "$cfg" --ranks-per-node "$ranks" "${budgets[@]}" \
      --json "$out/$c.estimate.json" > "$out/$c.estimate.log" 2>&1 ||
      { echo "llama_max_layers.sh: zero estimate failed for $c; see $out/$c.estimate.log" >&2; exit 1; }
  }
  calibrate() {  # the peak of a step, from the run report of $L layers
    "$bin/zero" estimate --hf-config "$hf" --calibrate "$out/$c.r$round.L$L.report.rank0" --config "$cfg" \
      --ranks-per-node "$ranks" "${budgets[@]}" --json "$out/$c.calibrated.json" > "$out/$c.calibrated.log" 2>&1 ||
      { echo "llama_max_layers.sh: zero estimate --calibrate failed for $c; see $out/$c.calibrated.log" >&2; exit 1; }
  }
  planned() { [[ " $plan " == *" $c "* ]]; }
  place() {  # the placement an estimate names, into $cfg; fails when it names none
    python3 - "$1" "$cfg" <<'EOF'
import json, sys
row = json.load(open(sys.argv[1]))["configurations"][0]
if "placement" not in row:
    sys.exit(1)
p, c = row["placement"], json.load(open(sys.argv[2]))
oo = c["zero_optimization"]["offload_optimizer"]
oo["ratio"], oo["gradients_on_device"] = p["ratio"], p["gradients_on_device"]
if "max_in_cpu" in p:
    oo["max_in_cpu"] = p["max_in_cpu"]
json.dump(c, open(sys.argv[2], "w"), indent=2)
print("  the planner's placement: ratio %g, gradients on the %s%s: %d layers" % (
    p["ratio"], "device" if p["gradients_on_device"] else "host",
    ", max_in_cpu %d" % p["max_in_cpu"] if "max_in_cpu" in p else "", p["largest"]["num_hidden_layers"]))
EOF
  }
  # A failure other than out of memory ends the benchmark, but in the second
  # round (--plan), which falls back to the first round's result instead.
  fail() {
    echo "llama_max_layers.sh: $c: $1" >&2
    [ "$round" = 2 ] && return 1
    exit 1
  }
  probe() {  # probe L: fits[L] 0 (fits) or 3 (does not); its summary and run report kept
    local L=$1 dir="$scratch/$c-$round-$1" tag="$out/$c.r$round.L$1"
    mkdir -p "$dir"
    python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c["num_hidden_layers"]=int(sys.argv[2]); json.dump(c, open(sys.argv[3], "w"))' \
      "$hf" "$L" "$dir/config.json"
    local cmd=("$bin/llama" train --model "$dir" --config "$cfg" --data "$scratch/tokens.bin" --steps "$steps"
               --batch_size "$batch" --block_size "$block" --precision "$precision" "${budgets[@]}"
               --summary-json "$tag.json" ${checkpoint[@]+"${checkpoint[@]}"})
    [ "$ranks" -gt 1 ] && cmd=("$bin/zero" launch --nproc_per_node "$ranks" -- "${cmd[@]}")
    local t0=$SECONDS rc=0
    ZERO_RUN_REPORT="$tag.report" "${cmd[@]}" > "$tag.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
      echo "  $L layers: fits ($((SECONDS - t0)) s)"
    elif [ "$rc" -eq 3 ]; then
      echo "  $L layers: does not fit: $(grep -m1 'out of memory' "$tag.log" | cut -c1-160)"
    else
      tail -20 "$tag.log" >&2
      fail "$L layers failed (exit status $rc); above, the end of $tag.log" || return 1
    fi
    fits[$L]=$rc
    probes=$((probes + 1))
  }
  search() {  # from $1 layers, one at a time: L is the largest that fits
    unset fits
    declare -gA fits=()
    L=${layers:-$1}
    probe "$L" || return 1
    if [ -n "$layers" ]; then  # --layers: that one run
      [ "${fits[$L]}" -eq 0 ] || { fail "$L layers do not fit"; return 1; }
      return 0
    fi
    if [ "${fits[$L]}" -eq 0 ]; then
      while probe $((L + 1)) && [ "${fits[$((L + 1))]}" -eq 0 ]; do L=$((L + 1)); done
      [ -n "${fits[$((L + 1))]+set}" ] || return 1  # (the probe above failed)
    else
      while [ "$L" -gt 1 ]; do
        L=$((L - 1))
        probe "$L" || return 1
        [ "${fits[$L]}" -eq 0 ] && break
      done
      [ "${fits[$L]}" -eq 0 ] || { fail "not even 1 layer fits"; return 1; }
    fi
  }
  layers_of() { python3 -c 'import json,sys; r=json.load(open(sys.argv[1]))["configurations"][0]; print(max(1, (r["placement"] if sys.argv[2] == "placement" else r)["largest"]["num_hidden_layers"]))' "$1" "$2"; }
  probes=0 round=1
  estimate
  if planned && place "$out/$c.estimate.json"; then estimate; fi
  start=$(layers_of "$out/$c.estimate.json" row)
  echo "== $c: the estimator's model states fit up to $start layers"
  search "$start"
  calibrate
  # --plan: the calibrated planner (the measured activations counted) may
  # name a placement that fits more; if so, a second search from there, kept
  # where it finds more layers.
  if [ -z "$layers" ] && planned && cp "$cfg" "$scratch/cfg1" && place "$out/$c.calibrated.json"; then
    first=$L
    cp "$out/$c.estimate.json" "$scratch/estimate1"
    cp "$out/$c.calibrated.json" "$scratch/calibrated1"
    round=2
    estimate
    if search "$(layers_of "$scratch/calibrated1" placement)" && [ "$L" -gt "$first" ]; then
      calibrate
    else
      echo "  the first placement's $first layers kept"
      L=$first round=1
      cp "$scratch/cfg1" "$cfg"
      cp "$scratch/estimate1" "$out/$c.estimate.json"
      cp "$scratch/calibrated1" "$out/$c.calibrated.json"
    fi
  fi
  python3 - "$out/$c.r$round.L$L.json" "$out/$c.estimate.json" "$out/$c.calibrated.json" "$cfg" "$c" "$L" "$probes" >> "$results" <<'EOF'
import json, sys
run, est, cal, cfg, name, layers, probes = sys.argv[1:5] + [sys.argv[5], int(sys.argv[6]), int(sys.argv[7])]
r = json.load(open(run))
e, k = json.load(open(est))["configurations"][0], json.load(open(cal))["configurations"][0]
oo = json.load(open(cfg))["zero_optimization"].get("offload_optimizer", {})
print(json.dumps({"config": name, "layers": layers, "num_parameters": r["num_parameters"],
                  "estimator_layers": e["largest"]["num_hidden_layers"],
                  "estimator_num_parameters": e["largest"]["num_parameters"],
                  "predicted_layers": k["largest"]["num_hidden_layers"],
                  "predicted_num_parameters": k["largest"]["num_parameters"],
                  "offload_optimizer": oo, "probes": probes, "loss_curve": r["loss_curve"],
                  "step_time_s": r["step_time_s"], "peak_bytes": r["peak_bytes"]}))
EOF
done

python3 - "$results" "$out" "$hf" "$device" "$host" "$nvme" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
out, hf, device, host, nvme = sys.argv[2:7]
mib = lambda b: "%.0f MiB" % (b / 2**20)
base = rows[0]["num_parameters"] if rows else 1
lines = ["| configuration | layers | parameters | x %s | estimator: states fit | estimator: peak fits (calibrated) | "
         "found / predicted | loss, first -> last step | step (mean after the first) | peak device | peak host | "
         "peak NVMe |" % rows[0]["config"],
         "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
for r in rows:
    st = r["step_time_s"][1:] or r["step_time_s"]
    p = r["peak_bytes"]
    oo = r["offload_optimizer"]
    placed = " (ratio %g, gradients on the %s, max_in_cpu %d)" % (
        oo.get("ratio", 1), "device" if oo.get("gradients_on_device") else "host", oo.get("max_in_cpu", 0)) \
        if oo.get("device") == "nvme" else ""
    lines.append("| %s | %d | %.2fM | %.2f | %d layers, %.2fM | %d layers, %.2fM | %.0f%% | %.3f -> %.3f | %.2f s | %s | %s | %s |" % (
        r["config"] + placed, r["layers"], r["num_parameters"] / 1e6, r["num_parameters"] / base, r["estimator_layers"],
        r["estimator_num_parameters"] / 1e6, r["predicted_layers"], r["predicted_num_parameters"] / 1e6,
        100.0 * r["num_parameters"] / r["predicted_num_parameters"],
        r["loss_curve"][0], r["loss_curve"][-1], sum(st) / len(st), mib(p["device"]),
        mib(p["host"] + p["pinned_host"]), mib(p["nvme"])))
text = "Largest Llama (%s) per rank with device %s, host %s, NVMe %s:\n\n" % (hf, device, host, nvme) + "\n".join(lines) + "\n"
open(out + "/llama_max_layers.md", "w").write(text)
json.dump(rows, open(out + "/llama_max_layers.json", "w"), indent=2)
print(text)
EOF
