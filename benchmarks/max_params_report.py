#!/usr/bin/env python3
"""The max-parameter benchmark's table and chart (benchmarks/max_params.sh).

Reads OUT/NAME.find.json (mingpt --find-max-params) and OUT/NAME.common.json
(a short run at the common size) for each configuration NAME and writes
OUT/max_params.md, OUT/max_params.json and OUT/max_params.png (with
matplotlib; without it the chart is skipped, saying how to get it).
"""
import argparse
import json
import textwrap
import os
import shlex
import sys

LABELS = {
    "ddp": "plain data parallel",
    "zero2": "ZeRO-2",
    "zero3": "ZeRO-3",
    "zero3_offload": "ZeRO-3 + CPU offload",
    "zero3_offload_8bit": "ZeRO-3 + CPU offload, 8-bit Adam states (optim_bits 8)",
    "zero3_offload_bf16": "ZeRO-3 + CPU offload, bf16 master and states (bf16 only)",
    "zero3_offload_bf16_8bit": "ZeRO-3 + CPU offload, bf16 master and 8-bit states (bf16 only)",
    "zero3_opt_offload_bf16_8bit": "ZeRO-3 + optimizer CPU offload, bf16 master and 8-bit states (bf16 only)",
    "zero3_opt_offload_bf16_8bit_devgrads": "the same, gradients on the device (bf16 only)",
    "zero3_placed_bf16_8bit": "ZeRO-3, bf16 master and 8-bit states placed by the planner: gradients on the device, "
    "host memory within max_in_cpu, the rest on NVMe (bf16 only)",
    "zero3_offload_ckpt": "ZeRO-3 + CPU offload + activation ckpt (cpu_checkpointing)",
    "zero3_nvme": "ZeRO-3 + NVMe offload + activation ckpt",
}


def mib(n):
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def human(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def step_time(summary):
    times = summary["step_time_s"][1:] or summary["step_time_s"]
    return sum(times) / len(times)


def load(out, names):
    rows = []
    for name in names:
        with open(os.path.join(out, f"{name}.find.json")) as f:
            found = json.load(f)
        with open(os.path.join(out, f"{name}.common.json")) as f:
            common = json.load(f)
        largest = found["largest"]
        rows.append({
            "name": name,
            "label": LABELS.get(name, name),
            "ranks": found["ranks"],
            "budgets": found["budgets"],
            "largest": largest,
            "capacity": found["capacity"],
            "predicted": found.get("predicted"),
            "probes": len(found["probes"]),
            "search_s": found["seconds"],
            "common": {
                "num_parameters": common["num_parameters"],
                "step_time_s": step_time(common),
                "tokens_per_s": common["tokens_per_step"] / step_time(common),
                "peak_bytes": common["peak_bytes"],
            },
        })
    return rows


def predicted_cell(predicted, found):
    if not predicted:
        return "-"
    n = predicted["num_parameters"]
    return f"{human(n)} ({100 * (n - found) / found:+.0f}%)"


def markdown(rows, seconds):
    base = rows[0]
    b = base["budgets"]
    lines = [
        f"Per rank: device {mib(b['device']) if b['device'] else 'the whole GPU'}, host {mib(b['host'])}, "
        f"NVMe {mib(b['nvme'])}; {base['ranks']} rank(s). Largest: the largest minGPT whose training steps run "
        f"(`mingpt --find-max-params`); capacity: the largest whose model states alone fit the budgets "
        f"(`zero estimate`'s formulas) at the same width; predicted: the largest whose estimated peak of a step "
        f"(states, activations, buffers) fits, against the largest found. Step time at n_layer "
        f"{base['common_shape'][0]}, n_embd {base['common_shape'][1]} "
        f"({human(base['common']['num_parameters'])} parameters). {seconds:.0f} s in all.",
        "",
        "| configuration | largest (L x C) | parameters | x plain DP | of capacity | estimator predicted "
        "| peak device | peak host | peak NVMe | step at common size | x plain DP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        l, c = r["largest"], r["common"]
        ratio = r["capacity"]["ratio"]
        lines.append(
            f"| {r['label']} | {l['n_layer']} x {l['n_embd']} | {human(l['num_parameters'])} "
            f"| {l['num_parameters'] / base['largest']['num_parameters']:.2f} "
            f"| {'-' if ratio is None else f'{100 * ratio:.0f}%'} "
            f"| {predicted_cell(r['predicted'], l['num_parameters'])} "
            f"| {mib(l['peak_bytes']['device'])} | {mib(l['peak_bytes']['host'])} | {mib(l['peak_bytes']['nvme'])} "
            f"| {c['step_time_s']:.3f} s | {c['step_time_s'] / base['common']['step_time_s']:.2f} |")
    return "\n".join(lines) + "\n"


def have_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        # Nothing is installed behind the user's back: the tables are written,
        # the chart is said to be missing and how to get it.
        again = " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)
        print(f"max_params: no chart: matplotlib is not installed for {sys.executable}; "
              f"{sys.executable} -m pip install matplotlib, then {again}", file=sys.stderr)
        return False


def chart(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (Long labels wrapped to the bar's width.)
    names = ["\n".join(textwrap.wrap(r["label"].replace(" (cpu_checkpointing)", ""), 18)) for r in rows]
    params = [r["largest"]["num_parameters"] / 1e6 for r in rows]
    steps = [r["common"]["step_time_s"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(13, 2.4 * len(rows)), 6.5))
    bars = a.bar(range(len(rows)), params, color="#3b6ea5")
    a.bar_label(bars, labels=[f"{p:.1f}M" for p in params], fontsize=8)
    a.set_xticks(range(len(rows)), names, fontsize=7)
    a.set_ylabel("largest trainable minGPT (million parameters)")
    a.set_title("Largest model that trains")
    bars = b.bar(range(len(rows)), steps, color="#c46b2d")
    b.bar_label(bars, labels=[f"{s:.2f}s" for s in steps], fontsize=8)
    b.set_xticks(range(len(rows)), names, fontsize=7)
    b.set_ylabel("seconds per optimizer step")
    shape = rows[0]["common_shape"]
    b.set_title(f"Step time at {human(rows[0]['common']['num_parameters'])} parameters (L={shape[0]}, C={shape[1]})")
    bd = rows[0]["budgets"]
    fig.suptitle(f"minGPT max-parameter benchmark: {rows[0]['ranks']} rank(s), per rank device "
                 f"{mib(bd['device']) if bd['device'] else 'whole GPU'}, host {mib(bd['host'])}, NVMe {mib(bd['nvme'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=0)
    ap.add_argument("--shape", type=int, nargs=2, required=True, metavar=("N_LAYER", "N_EMBD"),
                    help="the common size the step times were taken at")
    ap.add_argument("names", nargs="+")
    args = ap.parse_args()
    rows = load(args.out, args.names)
    for r in rows:
        r["common_shape"] = args.shape
    md = markdown(rows, args.seconds)
    for name, text in (("max_params.md", md), ("max_params.json", json.dumps(rows, indent=2) + "\n")):
        tmp = os.path.join(args.out, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(args.out, name))
    print(md)
    if have_matplotlib():
        chart(rows, os.path.join(args.out, "max_params.png"))
        print(f"chart: {os.path.join(args.out, 'max_params.png')}")
    print(f"table: {os.path.join(args.out, 'max_params.md')}, {os.path.join(args.out, 'max_params.json')}")


if __name__ == "__main__":
    main()
