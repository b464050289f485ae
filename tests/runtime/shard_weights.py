"""Rewrites a full-weight safetensors file as Hugging Face's save_pretrained
lays out a sharded model: names under a prefix, tensors in another dtype,
spread over N files with model.safetensors.index.json, plus a tensor the model
does not have. Used by tests/runtime/engine_checkpoint_test.cpp.

usage: shard_weights.py IN.safetensors OUT_DIR PREFIX DTYPE N
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

src, out, prefix, dtype, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
tensors = {prefix + k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in load_file(src).items()}
tensors[prefix + "rotary.inv_freq_unused"] = torch.arange(4, dtype=torch.float32)
names = sorted(tensors)
os.makedirs(out, exist_ok=True)
weight_map = {}
for i in range(n):
    part = names[i::n]
    file = "model-%05d-of-%05d.safetensors" % (i + 1, n)
    save_file({k: tensors[k].contiguous() for k in part}, os.path.join(out, file), metadata={"format": "pt"})
    weight_map.update({k: file for k in part})
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
               "weight_map": weight_map}, f, indent=2)
