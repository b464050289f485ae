#!/usr/bin/env python3
"""Runs the shell blocks of the README and docs/ as a reader would (issue 53).

Each page's ```sh blocks run in order, line by line, in a folder of their
own that holds what the pages name: `build/` (this build), `configs/` and
`benchmarks/` (the repository's), HF_DIR (a small Llama in Hugging Face's
layout, made with transformers), `tokens.bin`, `some.txt`, the configs the
pages call `ds_config.json`, `c.json`, `stage2.json`, `stage3.json`, and
`ds_ckpt` (DeepSpeed's layout of a 2-rank minGPT checkpoint). A line later
in a page finds what an earlier one wrote, as the reader's would.

The lines run as written except for the sizes in SHRINK (steps, epochs and
context lengths, so that the suite stays short) and the places in PLACES;
a line in SKIP is not run, and each says why (another test runs it, or it
needs a GPU or minutes). Every other line must exit 0. A page with a line
nobody can run fails here until the line is fixed or skipped with a reason.

usage: run_snippets.py SOURCE_DIR BUILD_DIR [--keep] [--page NAME]
"""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The lines, as docs.shell_snippets reads them.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from shell_snippets_test import commands  # noqa: E402

# (page, a piece of the line, why it is not run here).
SKIP = [
    ("README.md", "make demo", "the demo trains for minutes; the suite tests what it runs"),
    ("README.md", "make test", "the suite itself"),
    ("docs/getting-started.md", "make install", "install.find_package_consumer installs the package"),
    ("docs/getting-started.md", "cmake -S .", "install.find_package_consumer builds this program"),
    ("docs/getting-started.md", "./build/train", "install.find_package_consumer runs this program"),
    ("docs/mingpt.md", "--find-max-params", "a search of many runs (minutes); mingpt_tests covers it"),
    ("docs/mingpt.md", "benchmarks/max_params.sh", "a benchmark of minutes"),
    ("docs/tools.md", "--model mingpt:24,2048", "sized for an 80 GB GPU"),
    ("docs/tools.md", "--nodes 2", "emulates 2 nodes with many trial runs (minutes); tools_tests covers it"),
]

# Sizes made small: (pattern, replacement). Only numbers change.
SHRINK = [
    (r"--steps \d+", "--steps 3"),
    (r"--max_epochs \d+", "--max_epochs 1"),
    (r"--block_size \d+", "--block_size 16"),
    (r"--n_layer \d+", "--n_layer 1"),
    (r"--n_embd \d+", "--n_embd 32"),
]
# minGPT runs stop after a few micro-batches an epoch (the flag comes first,
# so a page's own flags still win).
MINGPT_LIMIT = "--limit_train_batches 3"
PLACES = [("/mnt/nvme", "nvme")]

LLAMA_CONFIG = """{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
  "zero_optimization": {"stage": %d%s}
}
"""
GATHER = ', "stage3_gather_16bit_weights_on_model_save": true'



def adapt(line):
    for pattern, replacement in SHRINK:
        line = re.sub(pattern, replacement, line)
    for place, here in PLACES:
        line = line.replace(place, here)
    line = re.sub(r"(build/bin/mingpt)(?= )", r"\1 " + MINGPT_LIMIT, line)
    line = re.sub(r"^python ", "python3 ", line)
    return line


def run(cmd, cwd, log, env=None, timeout=600):
    """Runs `cmd` in bash (pipefail) in a session of its own: past `timeout`
    the whole session goes (a launcher's ranks with it), what it printed is
    logged, and TimeoutExpired is raised."""
    start = time.time()
    p = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        log.write(f"$ {cmd}\n{out}(killed after {timeout} s)\n\n")
        log.flush()
        raise
    log.write(f"$ {cmd}\n{out}(exit {p.returncode}, {time.time() - start:.1f} s)\n\n")
    log.flush()
    return subprocess.CompletedProcess(p.args, p.returncode, out)


def fixtures(source, build, root, log):
    """What the pages name, made once and linked into each page's folder."""
    (root / "configs").symlink_to(source / "configs")
    (root / "benchmarks").symlink_to(source / "benchmarks")
    (root / "build").symlink_to(build)
    (root / "nvme").mkdir()
    shutil.copy(source / "configs" / "mingpt_zero2.json", root / "c.json")
    for name, stage in (("ds_config.json", 2), ("stage2.json", 2), ("stage3.json", 3)):
        (root / name).write_text(LLAMA_CONFIG % (stage, GATHER if stage == 3 else ""))
    (root / "some.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    made = run(
        "python3 - <<'PY'\n"
        "import numpy, torch, transformers\n"
        "torch.manual_seed(0)\n"
        "c = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,\n"
        "    max_position_embeddings=64, tie_word_embeddings=False)\n"
        "transformers.LlamaForCausalLM(c).save_pretrained('HF_DIR')\n"
        "numpy.random.default_rng(0).integers(0, 128, 8192).astype(numpy.uint16).tofile('tokens.bin')\n"
        "PY\n"
        "ln -s HF_DIR Llama-3.2-1B", root, log)
    if made.returncode != 0:
        raise SystemExit(f"could not make the small Llama (transformers): see {log.name}")
    # DeepSpeed's layout of a minGPT checkpoint saved on 2 ranks, as
    # docs/checkpoints.md's reader has from DeepSpeed.
    made = run("build/bin/zero launch --nproc_per_node 2 -- build/bin/mingpt --config c.json "
               f"--batch_size 32 {MINGPT_LIMIT} --save_dir zero_ckpt && "
               "build/bin/zero checkpoint export-deepspeed zero_ckpt ds_ckpt", root, log)
    if made.returncode != 0:
        raise SystemExit(f"could not make ds_ckpt: see {log.name}")


def main():
    args = sys.argv[1:]
    keep = "--keep" in args
    only = args[args.index("--page") + 1] if "--page" in args else None
    source, build = (pathlib.Path(a).resolve() for a in args[:2])
    work = pathlib.Path(tempfile.mkdtemp(prefix="zero-snippets-"))
    log_path = work / "snippets.log"
    print(f"log: {log_path}", flush=True)
    problems, ran, skipped = [], 0, 0
    with open(log_path, "w") as log:
        common = work / "common"
        common.mkdir()
        fixtures(source, build, common, log)
        pages = [source / "README.md"] + sorted((source / "docs").glob("*.md"))
        for page in pages:
            name = str(page.relative_to(source))
            if only and only not in name:
                continue
            lines = list(commands(page.read_text()))
            if not lines:
                continue
            here = work / name.replace("/", "_")
            shutil.copytree(common, here, symlinks=True)
            for line in lines:
                why = next((w for p, piece, w in SKIP if p == name and piece in line), None)
                if why:
                    skipped += 1
                    log.write(f"# skipped ({why}): {line}\n\n")
                    continue
                cmd = adapt(line)
                ran += 1
                start, failed = time.time(), None
                try:
                    r = run(cmd, here, log)
                    if r.returncode != 0:
                        tail = "\n    ".join(r.stdout.strip().splitlines()[-8:])
                        failed = f"{name}: exit {r.returncode}: {line}\n  ran: {cmd}\n    {tail}"
                except subprocess.TimeoutExpired:
                    failed = f"{name}: still running after 600 s: {line}"
                if failed:
                    problems.append(failed)
                print(f"{'FAILED' if failed else 'ok'} ({time.time() - start:.0f} s) {name}: {line[:100]}",
                      flush=True)
    for p in problems:
        print(p)
    unused = [(p, piece) for p, piece, _ in SKIP
              if not only and not any(piece in line for line in
                                      commands((source / p).read_text()))]
    for p, piece in unused:
        problems.append(f"SKIP names a line that is no longer there: {p}: {piece}")
        print(problems[-1])
    print(f"{ran} lines run, {skipped} skipped with their reason; log: {log_path}"
          + ("" if not problems else f": {len(problems)} problem(s) above"))
    if not problems and not keep:
        shutil.rmtree(work)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
