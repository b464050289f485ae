#!/usr/bin/env python3
"""The GPU machine's benchmarks (issue 17, Part 2), run by scripts/gpu/run.sh bench.

  - minGPT of about 1B parameters in bf16 (20 blocks, n_embd 2048, 1024-token
    context, character-level text) at ZeRO stage 0, stage 3, stage 3 with the
    optimizer offloaded to the CPU, and stage 3 with optimizer states and
    parameters on NVMe: step time, tokens/s, model TFLOPS (6 x parameters x
    tokens/s), peak GPU memory, and the share of the step spent waiting for
    transfers (gradient reductions, gathers, device-host copies, NVMe);
  - `zero bench adam` on the machine's cores (CPU Adam against torch and the
    stream triad);
  - `zero bench aio` against fio on the machine's disk.

Writes OUT/bench.json (every figure, and each run's summary) and OUT/bench.md
(the tables). --scale smoke runs tiny models, to check the script anywhere.
Exits 1 when a run fails for another reason than running out of memory.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SCALES = {
    # n_layer, n_embd, n_head, block_size, micro-batch, train steps (the first WARMUP not timed)
    "full": dict(n_layer=20, n_embd=2048, n_head=16, block_size=1024, batch=8, steps=12, nvme_steps=6,
                 adam_numel=400_000_000, aio_size="2GiB", aio_rounds=3, timeout=420),
    "smoke": dict(n_layer=2, n_embd=64, n_head=2, block_size=32, batch=4, steps=4, nvme_steps=4,
                  adam_numel=1_000_000, aio_size="32MiB", aio_rounds=1, timeout=300),
}
WARMUP = 2


def configs(nvme_dir, layer_numel):
    """The post's configurations, as DeepSpeed configs (zero_optimization sections)."""
    base3 = {"stage": 3, "stage3_prefetch_bucket_size": 100_000_000, "stage3_param_persistence_threshold": 100_000}
    return [
        ("stage 0", {"stage": 0}),
        ("stage 3", dict(base3)),
        ("stage 3 + CPU offload", dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True})),
        # NOTE [speculative step]: the CPU step during backward ("_clip", "_gas": the top-level keys).
        ("stage 3 + CPU offload, super_offload",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True, "super_offload": True})),
        ("stage 3 + CPU offload, super_offload, no clipping",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True, "super_offload": True}, _clip=0.0)),
        # NOTE [partial offload]: half the partition's states on the GPU (ZeRO-Offload++'s ratio).
        ("stage 3 + CPU offload, ratio 0.5",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.5})),
        ("stage 3 + CPU offload, ratio 0.5, super_offload",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True, "ratio": 0.5, "super_offload": True})),
        ("stage 0, accumulation 4", {"stage": 0, "_gas": 4}),
        ("stage 3 + CPU offload, super_offload, accumulation 4",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True, "super_offload": True}, _gas=4)),
        # NOTE [16-bit gradients]: stage 3's bf16 gradients against fp32 ones ("_grad_accum": data_types).
        ("stage 3, fp32 gradients", dict(base3, _grad_accum="fp32")),
        ("stage 3 + CPU offload, fp32 gradients",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True}, _grad_accum="fp32")),
        # 8-bit Adam states (optimizer.params.optim_bits 8): "_optim_bits" goes to the optimizer section.
        ("stage 3 + CPU offload, 8-bit states",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True}, _optim_bits=8)),
        # A bf16 master and bf16 states (NOTE [16-bit master]): "_bf16_master" goes to the bf16 section.
        ("stage 3 + CPU offload, bf16 master and states",
         dict(base3, offload_optimizer={"device": "cpu", "pin_memory": True}, _bf16_master=True)),
        ("stage 3, bf16 master and states on the GPU", dict(base3, _bf16_master=True)),
        ("stage 3 + NVMe offload", dict(
            base3,
            offload_optimizer={"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 4,
                               "pipeline_read": True, "pipeline_write": True},
            offload_param={"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True, "buffer_count": 6,
                           "buffer_size": layer_numel, "max_in_cpu": 0})),
    ]


def write_text(path, root):
    """Character-level training text: the repository's own sources."""
    parts = []
    for pattern in ("**/*.cpp", "**/*.h", "**/*.md"):
        for f in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            if "/build" in f or "/.gpu-deps/" in f:
                continue
            with open(f, errors="replace") as fh:
                parts.append(fh.read())
    text = "\n".join(parts)
    while len(text) < 2_000_000:
        text += text
    with open(path, "w") as fh:
        fh.write(text)


def run(cmd, log, timeout, env=None):
    log.write("\n$ " + "".join(f"{k}={v} " for k, v in (env or {}).items()) + " ".join(cmd) + "\n")
    log.flush()
    t0 = time.time()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=dict(os.environ, **env) if env else None)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    log.write(out[-20000:])
    log.write(f"\n(rc {rc}, {time.time() - t0:.1f} s)\n")
    log.flush()
    return rc, out


def join_traces(parts, out):
    """One Chrome trace of several one-rank runs: each run a process of its own, named, from time 0."""
    events = []
    for pid, (path, label) in enumerate(parts):
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            t = json.load(fh)
        evs = t.get("traceEvents", [])
        t0 = min((e["ts"] for e in evs if "ts" in e), default=0)
        for e in evs:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                continue
            e = dict(e, pid=pid)
            if "ts" in e:
                e["ts"] -= t0
            events.append(e)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
    if events:
        with open(out, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)


def mingpt_figures(s):
    """Step time, throughput and waits from a mingpt summary."""
    steps = s["step_time_s"][WARMUP:] or s["step_time_s"]
    step = statistics.median(steps)
    tokens_per_s = s["tokens_per_step"] / step
    total = sum(s["step_time_s"]) or 1e-9
    nv = s.get("nvme", {})
    waits = {
        "grad_comm_wait_s": s["grad_comm_wait_s"],
        "param_gather_wait_s": s["param_gather_wait_s"],
        "transfer_wait_s": s.get("transfer_wait_s", 0.0),
        "nvme_wait_s": nv.get("read_wait_s", 0.0) + nv.get("write_wait_s", 0.0),
    }
    return {
        "num_parameters": s["num_parameters"],
        "steps_timed": len(steps),
        "step_time_s": step,
        "tokens_per_s": tokens_per_s,
        "model_tflops": 6.0 * s["num_parameters"] * tokens_per_s / 1e12,
        "peak_device_bytes": s["peak_bytes"]["device"],
        "peak_pinned_host_bytes": s["peak_bytes"]["pinned_host"],
        "peak_host_bytes": s["peak_bytes"]["host"],
        "nvme_bytes": s["peak_bytes"]["nvme"],
        "waits": waits,
        "wait_share": sum(waits.values()) / total,
        "final_loss": s["final_loss"],
        "speculation": s.get("speculation"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--nvme", default="/tmp/zero-nvme")
    ap.add_argument("--scale", choices=sorted(SCALES), default="full")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds since the epoch by which to be done: each run gets what is left, a run that "
                         "cannot start 60 s before it is skipped, and the results so far are written after each")
    a = ap.parse_args()
    sc = SCALES[a.scale]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    binary = lambda name: os.path.join(a.build, "bin", name)
    work = tempfile.mkdtemp(prefix="zero-bench-")  # not under OUT: only the results go back
    os.makedirs(a.nvme, exist_ok=True)
    log = open(os.path.join(a.out, "bench.log"), "a")
    text = os.path.join(work, "text.txt")
    write_text(text, root)
    gpu = "cpu"
    try:
        import torch
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except Exception:
        pass
    # The largest layer shard (one rank): what offload_param's buffer_size must hold.
    c = sc["n_embd"]
    layer_numel = 12 * c * c + 13 * c + 4096
    results = {"commit": a.commit, "date": time.strftime("%Y-%m-%d", time.gmtime()), "device": gpu,
               "scale": a.scale, "model": {k: sc[k] for k in ("n_layer", "n_embd", "n_head", "block_size")},
               "micro_batch": sc["batch"], "mingpt": [], "adam": None, "aio": None}
    failed = False

    def time_for(limit):
        """A run's time limit: `limit`, or what is left before the deadline; None when too little is."""
        if not a.deadline:
            return limit
        left = a.deadline - time.time() - 20
        return None if left < 60 else min(limit, left)

    def save():
        with open(os.path.join(a.out, "bench.json"), "w") as fh:
            json.dump(results, fh, indent=1)

    # Host-device copies from the pinned tier, LibTorch's pinned allocator
    # and pageable memory (a GPU only): issue 35's pinned-memory figures.
    results["transfer"] = None
    if gpu != "cpu" and time_for(120):
        transfer_json = os.path.join(work, "transfer.json")
        print("bench: zero bench transfer ...", file=sys.stderr, flush=True)
        rc, _ = run([binary("zero"), "bench", "transfer", "--bytes", str(1 << 30 if a.scale == "full" else 1 << 24),
                     "--json", transfer_json], log, time_for(120))
        if rc == 0:
            results["transfer"] = json.load(open(transfer_json))
        else:
            failed = True
        save()
    for name, zero in configs(a.nvme, layer_numel):
        limit = time_for(sc["timeout"])
        if limit is None:
            results["mingpt"].append({"config": name, "skipped": "out of time (the call's deadline)"})
            print(f"bench: minGPT {name}: skipped, out of time", file=sys.stderr, flush=True)
            continue
        steps = sc["nvme_steps"] if "NVMe" in name else sc["steps"]
        zero = dict(zero)
        optim_bits = zero.pop("_optim_bits", 32)
        clip = zero.pop("_clip", 1.0)
        gas = zero.pop("_gas", 1)
        grad_accum = zero.pop("_grad_accum", None)
        steps *= gas  # --limit_train_batches counts micro-batches: as many optimizer steps at every gas
        bf16 = {"enabled": True}
        if zero.pop("_bf16_master", False):
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        cfg = {"train_micro_batch_size_per_gpu": sc["batch"], "gradient_accumulation_steps": gas,
               "gradient_clipping": clip, "bf16": bf16,
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                         "optim_bits": optim_bits}},
               "zero_optimization": dict(zero, sub_group_size=100_000_000), "steps_per_print": 1000000}
        if grad_accum:
            cfg["data_types"] = {"grad_accum_dtype": grad_accum}
        slug = name.replace(" ", "_").replace("+", "").replace(",", "").replace("__", "_")
        cfg_path = os.path.join(work, slug + ".json")
        summary_path = os.path.join(work, slug + ".summary.json")
        with open(cfg_path, "w") as fh:
            json.dump(cfg, fh, indent=2)
        cmd = [binary("mingpt"), "--config", cfg_path, "--data", text, "--n_layer", str(sc["n_layer"]),
               "--n_embd", str(sc["n_embd"]), "--n_head", str(sc["n_head"]), "--block_size", str(sc["block_size"]),
               "--batch_size", str(sc["batch"]), "--limit_train_batches", str(steps), "--max_epochs", "1",
               "--precision", "bf16", "--dropout", "0", "--summary-json", summary_path]
        print(f"bench: minGPT {name} ...", file=sys.stderr, flush=True)
        # The offload step's timeline (NOTE [trace]), for issue 36: where its time goes, without and with
        # super_offload; joined into one file below (the device tool brings back 8 files).
        traced = {"stage 3 + CPU offload": "plain", "stage 3 + CPU offload, super_offload, no clipping": "super"}
        env = {"ZERO_TRACE": os.path.join(work, f"trace-{traced[name]}.json")} if name in traced else None
        rc, out = run(cmd, log, limit, env)
        entry = {"config": name, "zero_optimization": zero, "rc": rc}
        if rc == 0 and os.path.exists(summary_path):
            with open(summary_path) as fh:
                s = json.load(fh)
            entry.update(mingpt_figures(s))
            entry["summary"] = s
        elif "out of memory" in out.lower() or "OutOfMemory" in out:
            entry["did_not_fit"] = True
        else:
            failed = True
            entry["error"] = out[-2000:]
        results["mingpt"].append(entry)
        shutil.rmtree(a.nvme, ignore_errors=True)
        os.makedirs(a.nvme, exist_ok=True)
        print(f"bench: minGPT {name}: rc {rc}", file=sys.stderr, flush=True)
        save()

    join_traces([(os.path.join(work, "trace-plain.json"), "stage 3 + CPU offload"),
                 (os.path.join(work, "trace-super.json"), "stage 3 + CPU offload, super_offload, no clipping")],
                os.path.join(a.out, "trace-stage3-cpu-offload.json"))

    adam_json = os.path.join(work, "adam.json")
    if time_for(300):
        print("bench: zero bench adam ...", file=sys.stderr, flush=True)
        rc, _ = run([binary("zero"), "bench", "adam", "--numel", str(sc["adam_numel"]), "--json", adam_json], log,
                    time_for(300))
        if rc == 0:
            results["adam"] = json.load(open(adam_json))
        else:
            failed = True
    aio_json = os.path.join(work, "aio.json")
    if time_for(300):
        print("bench: zero bench aio ...", file=sys.stderr, flush=True)
        rc, _ = run([binary("zero"), "bench", "aio", "--path", a.nvme, "--size", sc["aio_size"],
                     "--rounds", str(sc["aio_rounds"]), "--json", aio_json], log, time_for(300))
        if rc == 0:
            results["aio"] = json.load(open(aio_json))
        else:
            failed = True
    shutil.rmtree(a.nvme, ignore_errors=True)
    save()
    gib = 1024.0 ** 3
    md = [f"## Benchmarks on {gpu} ({a.scale} scale, commit {a.commit}, {results['date']})", ""]
    m = results["model"]
    md.append(f"minGPT L={m['n_layer']} C={m['n_embd']} H={m['n_head']} T={m['block_size']}, bf16, micro-batch "
              f"{sc['batch']}, one GPU; median of the steps after the first {WARMUP}.")
    md.append("")
    md.append("| config | parameters | step (s) | tokens/s | model TFLOPS | peak GPU (GiB) | pinned host (GiB) | "
              "waiting for transfers |")
    md.append("|---|---|---|---|---|---|---|---|")
    for e in results["mingpt"]:
        if "step_time_s" in e:
            n = e["num_parameters"]
            size = f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
            sp = e.get("speculation")
            spec = f"; speculation validated/redone {sp['validated']}/{sp['redone']}" if sp else ""
            md.append(f"| {e['config']} | {size} | {e['step_time_s']:.3f} | "
                      f"{e['tokens_per_s']:,.0f} | {e['model_tflops']:.1f} | {e['peak_device_bytes'] / gib:.1f} | "
                      f"{e['peak_pinned_host_bytes'] / gib:.1f} | {100 * e['wait_share']:.0f}%{spec} |")
        elif e.get("did_not_fit"):
            md.append(f"| {e['config']} | | out of memory | | | | | |")
        elif e.get("skipped"):
            md.append(f"| {e['config']} | | not run: {e['skipped']} | | | | | |")
        else:
            md.append(f"| {e['config']} | | FAILED (rc {e['rc']}, see bench.log) | | | | | |")
    md.append("")
    if results["transfer"]:
        tr = results["transfer"]
        md.append(f"`zero bench transfer` ({tr['bytes'] / 2**20:.0f} MiB per copy on the engine's copy stream):")
        md.append("")
        md.append("| host memory | page-locked | host to device (GB/s) | device to host (GB/s) |")
        md.append("|---|---|---|---|")
        for k in tr["kinds"]:
            md.append(f"| {k['name']} | {'yes' if k['page_locked'] else 'no'} | {k['h2d_gb_per_s']:.1f} | "
                      f"{k['d2h_gb_per_s']:.1f} |")
        md.append("")
    if results["adam"]:
        ad = results["adam"]
        md.append(f"`zero bench adam --numel {ad['numel']}` ({ad['isa']}, {ad['threads']} threads): AdamW "
                  f"{ad['ours_adamw_params_per_s']:.3e} params/s, {ad['ratio_vs_fused_adamw']:.2f}x "
                  f"at::_fused_adamw_ (AdamW(fused=True)), {ad['ratio_vs_torch']:.1f}x torch::optim::Adam, "
                  f"{ad['bandwidth_fraction']:.2f} of a pass with Adam's traffic and no arithmetic "
                  f"({ad['adam_pattern_bytes_per_s'] / 1e9:.1f} GB/s; triad {ad['triad_bytes_per_s'] / 1e9:.1f} GB/s).")
    if results["aio"]:
        io = results["aio"]
        md.append(f"`zero bench aio --size {sc['aio_size']}`: write {io['write_gb_per_s']:.2f} GB/s "
                  f"({io['ratio_write_vs_fio']:.2f}x fio), read {io['read_gb_per_s']:.2f} GB/s "
                  f"({io['ratio_read_vs_fio']:.2f}x fio).")
    md.append("")
    with open(os.path.join(a.out, "bench.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print("\n".join(md))
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
