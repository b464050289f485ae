#!/usr/bin/env bash
# Converting a DeepSpeed checkpoint of ~1B parameters both ways, against
# DeepSpeed's own converter (issue 54; docs/checkpoints.md):
#   DeepSpeed -> zero:  zero checkpoint import-deepspeed   vs  ds_to_universal
#   zero -> DeepSpeed:  zero checkpoint export-deepspeed (stage 2, 2 ranks; and --universal)
# The DeepSpeed checkpoint is stage 2 on 2 ranks, fp32, Adam: DeepSpeed's
# tiny TinyNet checkpoint (tests/deepspeed/ds_train.py) taken as the template
# of every key and type, its tensors replaced by N_PARAMS parameters of
# [4096, 4096] (the files DeepSpeed 0.18.9 would write for that model).
# Each conversion runs after `sync; echo 3 > drop_caches` when that is
# allowed (else from a warm page cache: said in the output).
#   benchmarks/deepspeed_convert.sh [BUILD_DIR] [N_PARAMS] [WORK_DIR]
set -euo pipefail
BUILD=$(cd "${1:-build}" && pwd)
N=${2:-1000000000}
WORK=${3:-/tmp/zero_ds_convert}
SRC=$(cd "$(dirname "$0")/.." && pwd)
ZERO="$BUILD/bin/zero"
export DS_ACCELERATOR=cpu TMPDIR="$WORK/tmp"
rm -rf "$WORK"
mkdir -p "$WORK/tmp"
cd "$WORK"

echo "== template: DeepSpeed's own stage-2 checkpoint of TinyNet (2 ranks)"
python3 -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29901 \
  "$SRC/tests/deepspeed/ds_train.py" --stage 2 --steps 1 --save template --losses template.json > template.log 2>&1

echo "== the ~${N}-parameter checkpoint in that form"
python3 - "$N" <<'PY'
import collections, os, sys, time, torch
n_target = int(sys.argv[1])
side = 4096
count = max(1, round(n_target / (side * side)))
names = [f"layers.{i}.weight" for i in range(count)]
total = count * side * side
t = "template/global_step1"
model = torch.load(f"{t}/mp_rank_00_model_states.pt", weights_only=False)
g = torch.Generator().manual_seed(0)
flat = torch.empty(total).normal_(0, 0.02, generator=g)
model["module"] = collections.OrderedDict((n, flat[i * side * side:(i + 1) * side * side].view(side, side))
                                          for i, n in enumerate(names))
model["module"]["scale"] = torch.ones(3)
model["buffer_names"] = ["scale"]
model["param_shapes"] = [collections.OrderedDict((n, torch.Size([side, side])) for n in names)]
os.makedirs("ds/global_step1", exist_ok=True)
start = time.time()
torch.save(model, "ds/global_step1/mp_rank_00_model_states.pt")
world, align = 2, 4
padded = (total + align - 1) // align * align
part = padded // world
for r in range(world):
    sd = torch.load(f"{t}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
    osd = sd["optimizer_state_dict"]
    lean = min(total, (r + 1) * part) - r * part
    master = flat[r * part:r * part + lean].clone()
    m = torch.zeros(part); m[:lean].normal_(0, 1e-3, generator=g)
    v = torch.zeros(part); v[:lean].uniform_(0, 1e-6, generator=g)
    state = osd["base_optimizer_state"]["state"][0]
    state["exp_avg"], state["exp_avg_sq"] = m, v
    osd["single_partition_of_fp32_groups"] = [master]
    osd["group_paddings"] = [part - lean]
    mapping = collections.OrderedDict()
    for i, n in enumerate(names):
        a, b = max(r * part, i * side * side), min(r * part + lean, (i + 1) * side * side)
        if a < b:
            mapping[n] = type(next(iter(osd["param_slice_mappings"][0].values())))(numel=b - a, start=a - r * part)
    osd["param_slice_mappings"] = [mapping]
    torch.save(sd, f"ds/global_step1/zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
with open("ds/latest", "w") as f:
    f.write("global_step1")
print(f"{total} parameters ({count} x [{side}, {side}]), written in {time.time() - start:.1f} s")
PY
du -sh ds

cold() {
  sync
  if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then echo "(page cache dropped)"; else echo "(warm page cache: drop_caches not allowed)"; fi
}
timed() {  # name, command...
  local name=$1; shift
  cold
  local t0=$(date +%s.%N)
  "$@" > "$name.log" 2>&1 || { echo "$name failed:"; tail -20 "$name.log"; exit 1; }
  local t1=$(date +%s.%N)
  local secs=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  echo "$name: $secs s ($(du -sh "$name.out" 2>/dev/null | cut -f1) written)"
  echo "$name $secs" >> times.txt
}

echo "== DeepSpeed -> zero"
timed import "$ZERO" checkpoint import-deepspeed ds import.out
timed ds_to_universal python3 -m deepspeed.checkpoint.ds_to_universal --input_folder ds/global_step1 \
  --output_folder ds_to_universal.out/global_step1_universal --inject_missing_state
rm -rf ds_to_universal.out
echo "== zero -> DeepSpeed"
timed export "$ZERO" checkpoint export-deepspeed import.out export.out
rm -rf export.out
timed export_universal "$ZERO" checkpoint export-deepspeed import.out export_universal.out --universal
rm -rf export_universal.out import.out
python3 - <<'PY'
t = dict(l.split() for l in open("times.txt"))
t = {k: float(v) for k, v in t.items()}
print("import-deepspeed / ds_to_universal: %.2f" % (t["import"] / t["ds_to_universal"]))
print("export-deepspeed / ds_to_universal: %.2f" % (t["export"] / t["ds_to_universal"]))
print("export-deepspeed --universal / ds_to_universal: %.2f" % (t["export_universal"] / t["ds_to_universal"]))
PY
