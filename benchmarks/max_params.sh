#!/usr/bin/env bash
# The minGPT max-parameter benchmark (docs/mingpt.md, "The max-parameter benchmark"):
# the largest minGPT that trains under each of the post's configurations
# (plain data parallel, ZeRO-2, ZeRO-3, ZeRO-3 + CPU offload, the same with
# 8-bit Adam states, with a bf16 master and bf16 states and with a bf16
# master and 8-bit states (zero3_offload_bf16_8bit; the bf16 ones bf16 only),
# + activation checkpointing to the CPU, + NVMe offload)
# with per-rank memory budgets, and
# each configuration's step time at one common size. Writes OUT/max_params.md,
# OUT/max_params.json and OUT/max_params.png (the chart needs matplotlib).
#
#   benchmarks/max_params.sh [--ranks N] [--device-memory B] [--host-memory B]
#                            [--nvme-bytes B] [--nvme-path DIR] [--out DIR]
#                            [--precision 32|16|bf16] [--batch-size N]
#                            [--configs "ddp zero2 ..."] [--bin DIR]
#
# Defaults emulate a small machine on the CPU (2 ranks, each with 256 MiB of
# "device" memory, 640 MiB of host memory and 1 GiB of NVMe): a few minutes on
# two cores. On a GPU give --ranks 1 and the real budgets (or none for the
# device: its whole memory).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
ranks=2 device=256MiB host=640MiB nvme=1GiB nvme_path="" out="$root/build/max_params"
precision="" batch=8 bin="$root/build/bin"
configs="ddp zero2 zero3 zero3_offload zero3_offload_8bit zero3_offload_bf16 zero3_offload_bf16_8bit zero3_offload_ckpt zero3_nvme"
device_given=0

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks=$2; shift 2 ;;
    --device-memory) device=$2; device_given=1; shift 2 ;;
    --host-memory) host=$2; shift 2 ;;
    --nvme-bytes) nvme=$2; shift 2 ;;
    --nvme-path) nvme_path=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --precision) precision=$2; shift 2 ;;
    --batch-size) batch=$2; shift 2 ;;
    --configs) configs=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "max_params.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
done
[ -x "$bin/mingpt" ] || { echo "max_params.sh: $bin/mingpt is not built (make build, or --bin DIR)" >&2; exit 1; }
for c in $configs; do
  [ -f "$here/max_params/$c.json" ] || { echo "max_params.sh: no configuration $c (benchmarks/max_params/$c.json)" >&2; exit 2; }
done

mkdir -p "$out"
scratch=$(mktemp -d "${TMPDIR:-/tmp}/max-params-XXXXXX")
trap 'rm -rf "$scratch"' EXIT
[ -n "$nvme_path" ] || { nvme_path="$scratch/nvme"; mkdir -p "$nvme_path"; }
nvme_sed=$(printf '%s' "$nvme_path" | sed 's/[\\&|]/\\&/g')  # the path as sed's replacement text

# On a GPU without --device-memory the device budget is the device itself.
budgets=(--host-memory "$host" --nvme-bytes "$nvme")
on_gpu=$(python3 -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$device_given" = 1 ] || [ "$on_gpu" = 0 ]; then budgets+=(--device-memory "$device"); fi
common=(--batch_size "$batch" --nproc "$ranks")
[ -n "$precision" ] && common+=(--precision "$precision")

device_text=$device; [ "$device_given" = 0 ] && [ "$on_gpu" = 1 ] && device_text="the whole GPU"
echo "max_params: $ranks rank(s); per rank: device $device_text, host $host, nvme $nvme; configurations: $configs"
start=$(date +%s)
for c in $configs; do
  sed "s|@NVME_PATH@|$nvme_sed|g" "$here/max_params/$c.json" > "$out/$c.config.json"
  extra=()
  case "$c" in *ckpt*|*nvme*) extra+=(--checkpoint) ;; esac
  echo "== $c: searching"
  set +e
  "$bin/mingpt" --config "$out/$c.config.json" --find-max-params "${common[@]}" ${extra[@]+"${extra[@]}"} "${budgets[@]}" \
    --summary-json "$out/$c.find.json" 2>&1 | tee "$out/$c.find.log" |
    { grep --line-buffered -E "^find-max-params|^largest|^step time|^estimator" || true; }
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "max_params.sh: the search for $c failed (exit status $rc); the end of $out/$c.find.log:" >&2
    tail -20 "$out/$c.find.log" >&2
    exit 1
  fi
done

# Step time at one common size: the plain data-parallel largest (or the
# smallest largest found), which every configuration fits.
read -r L C H < <(python3 - "$out" $configs <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
found = [json.load(open(f"{out}/{n}.find.json"))["largest"] for n in names]
best = min(found, key=lambda f: f["num_parameters"])
print(best["n_layer"], best["n_embd"], best["n_head"])
PY
)
for c in $configs; do
  extra=()
  case "$c" in *ckpt*|*nvme*) extra+=(--checkpoint) ;; esac
  run=("$bin/mingpt" --config "$out/$c.config.json" --n_layer "$L" --n_embd "$C" --n_head "$H" --batch_size "$batch"
       --limit_train_batches 6 --stop_after_steps 6 --summary-json "$out/$c.common.json")
  [ -n "$precision" ] && run+=(--precision "$precision")
  run+=(${extra[@]+"${extra[@]}"})
  run+=("${budgets[@]}")
  echo "== $c: 6 steps at n_layer $L, n_embd $C"
  if [ "$ranks" -gt 1 ]; then
    "$bin/zero" launch --nproc_per_node "$ranks" -- "${run[@]}" > "$out/$c.common.log" 2>&1
  else
    "${run[@]}" > "$out/$c.common.log" 2>&1
  fi || { echo "max_params.sh: $c at the common size failed; see $out/$c.common.log" >&2; tail -5 "$out/$c.common.log" >&2; exit 1; }
done

python3 "$here/max_params_report.py" --out "$out" --shape "$L" "$C" --seconds $(( $(date +%s) - start )) $configs
