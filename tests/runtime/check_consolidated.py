"""Reads a consolidated checkpoint with Python's safetensors, as a user would,
and compares every tensor with the raw float32 bytes of the engine's parameter
of the same name (RAW_DIR/<name>.bin). Exits 1 naming the first difference.

usage: check_consolidated.py WEIGHTS.safetensors RAW_DIR
"""
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def main() -> int:
    path, raw_dir = sys.argv[1], sys.argv[2]
    weights = load_file(path)  # the plain loader: header, dtypes, shapes
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != "pt":
        print(f"{path}: metadata format {meta.get('format')!r}, expected 'pt'")
        return 1
    raw = {n[: -len(".bin")] for n in os.listdir(raw_dir) if n.endswith(".bin")}
    if set(weights) != raw:
        print(f"{path}: tensors {sorted(set(weights) ^ raw)} are in one of the file and the engine only")
        return 1
    for name, t in weights.items():
        if t.dtype != torch.float32:
            print(f"{path}: {name} is {t.dtype}, expected float32")
            return 1
        with open(os.path.join(raw_dir, name + ".bin"), "rb") as f:
            want = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
        if want.numel() != t.numel() or not torch.equal(t.reshape(-1), want):
            print(f"{path}: {name} differs from the engine's parameter")
            return 1
    print(f"{path}: {len(weights)} tensors, equal bit for bit to the engine's parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
