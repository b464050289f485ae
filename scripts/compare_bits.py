#!/usr/bin/env python3
"""Runs the same small minGPT trainings with two builds of zero and says
whether they give the same bits (parameter L2 norm and loss curve), across
the stages, precisions and offload tiers: the check for a change that must
not change training (a refactor).

  scripts/compare_bits.py OLD_BUILD/bin NEW_BUILD/bin

Each case trains 8 steps (L=2, C=64) on 1 or 2 ranks (`zero launch`); NVMe
cases use a folder under /tmp. Exits 1 when any case differs or fails.
"""
import json, os, shutil, subprocess, sys, tempfile
old, new = sys.argv[1], sys.argv[2]
work = tempfile.mkdtemp(prefix="zero-bits-"); os.makedirs(work, exist_ok=True)
nv = os.path.join(work, "nvme"); os.makedirs(nv, exist_ok=True)
def cfg(stage, prec="32", gas=1, extra=None, top=None):
    c = {"train_batch_size": 32, "gradient_accumulation_steps": gas, "gradient_clipping": 0.05,
         "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95], "weight_decay": 0.01}},
         "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                               "sub_group_size": 4000, "stage3_param_persistence_threshold": 100}}
    if prec == "bf16": c["bf16"] = {"enabled": True}
    if prec == "16": c["fp16"] = {"enabled": True, "initial_scale_power": 12}
    for k, v in (extra or {}).items(): c["zero_optimization"][k] = v
    for k, v in (top or {}).items(): c[k] = v
    return c
cpu = {"device": "cpu"}
nvo = {"device": "nvme", "nvme_path": nv, "pipeline_read": True, "pipeline_write": True, "buffer_count": 3}
nvp = {"device": "nvme", "nvme_path": nv, "buffer_count": 2, "buffer_size": 100000, "max_in_cpu": 0}
cases = [
  ("s0", 2, cfg(0), []), ("s1", 2, cfg(1), []), ("s2", 2, cfg(2), []), ("s3", 2, cfg(3), []),
  ("s1_bf16", 2, cfg(1, "bf16"), []), ("s2_bf16", 2, cfg(2, "bf16"), []), ("s3_bf16", 2, cfg(3, "bf16"), []),
  ("s2_fp16", 2, cfg(2, "16"), []), ("s2_gas2", 2, cfg(2, gas=2), []),
  ("s1_off", 2, cfg(1, extra={"offload_optimizer": cpu}), []), ("s2_off", 2, cfg(2, extra={"offload_optimizer": cpu}), []),
  ("s3_off", 2, cfg(3, extra={"offload_optimizer": cpu}), []),
  ("s3_off_param", 2, cfg(3, extra={"offload_optimizer": cpu, "offload_param": cpu}), []),
  ("s2_nvme", 2, cfg(2, extra={"offload_optimizer": nvo}), []),
  ("s3_nvme_all", 2, cfg(3, extra={"offload_optimizer": nvo, "offload_param": nvp}), []),
  ("s3_one", 1, cfg(3), []), ("s0_one_bf16", 1, cfg(0, "bf16"), []),
  ("s2_ckpt", 2, cfg(2), ["--checkpoint"]), ("s3_off_bf16", 2, cfg(3, "bf16", extra={"offload_optimizer": cpu}), []),
]
def run(binroot, name, world, c, flags, which):
    p = f"{work}/{name}.json"; json.dump(c, open(p, "w"))
    out = f"{work}/{name}.{which}.summary.json"
    cmd = ["env", "OMP_NUM_THREADS=1"]
    if world > 1: cmd += [f"{binroot}/zero", "launch", "--nproc_per_node", str(world), "--"]
    prec = "bf16" if "bf16" in c else ("16" if "fp16" in c else "32")
    cmd += [f"{binroot}/mingpt", "--config", p, "--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--dropout", "0",
            "--max_epochs", "1", "--limit_train_batches", str(8 * c["gradient_accumulation_steps"]),
            "--precision", prec, "--summary-json", out] + flags
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0: return None, r.stderr[-500:]
    j = json.load(open(out)); return (j["param_l2"], j["loss_curve"]), None
allsame = True
for name, world, c, flags in cases:
    a, ea = run(old, name, world, c, flags, "old"); b, eb = run(new, name, world, c, flags, "new")
    same = a is not None and a == b
    allsame &= same
    print(f"{name:14s} world {world}  old {a[0] if a else ea!s:>22}  new {b[0] if b else eb!s:>22}  {'SAME' if same else 'DIFFERENT'}", flush=True)
print("all identical" if allsame else "DIFFERENCES")
shutil.rmtree(work, ignore_errors=True)
sys.exit(0 if allsame else 1)
