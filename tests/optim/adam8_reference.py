"""An independent reference for zero's 8-bit Adam (NOTE [8-bit states] in
optim/src/adam_kernel.h), in plain PyTorch: blocks of 256 elements, one fp32
scale per block (its largest magnitude), codes torch.float8_e4m3fn of value /
scale * 448, the first moment signed, the second as its square root.

Usage: adam8_reference.py DIR. DIR holds case.json ({"n", "steps", "runs":
[{"start", "numel", "scalars": one list per step of [beta1, 1 - beta1,
beta2, 1 - beta2, eps, weight_decay, decay, sqrt(bias_correction2),
-step_size, decoupled]}]}, the values rounded to fp32 as the kernel does),
param.f32 and grads.f32 (steps x n); it writes the result of all the steps:
param.out.f32, m.codes, m.absmax.f32, v.codes, v.absmax.f32.
"""
import json
import os
import sys

import torch

BLOCK = 256
E4M3_MAX = 448.0


def read(path, dtype, count):
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=dtype)
    assert data.numel() == count, (path, data.numel(), count)
    return data.clone()


def per_element(per_block, n):
    return per_block.repeat_interleave(BLOCK)[:n]


def dequantize(codes, absmax, n):
    scale = absmax / torch.full((1,), E4M3_MAX)
    return codes.view(torch.float8_e4m3fn).float() * per_element(scale, n)


def quantize(values, n):
    blocks = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(blocks * BLOCK)
    padded[:n] = values.abs()
    absmax = padded.view(blocks, BLOCK).amax(dim=1)
    # A scale whose inverse is not finite (a block of values below ~1e-36) is zero.
    inv = torch.full((1,), E4M3_MAX) / absmax
    ok = (absmax > 0) & (inv <= torch.finfo(torch.float32).max)
    absmax = torch.where(ok, absmax, torch.zeros(1))
    inv = torch.where(ok, inv, torch.zeros(1))
    codes = (values * per_element(inv, n)).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, absmax


def main():
    folder = sys.argv[1]
    case = json.load(open(os.path.join(folder, "case.json")))
    n, steps = case["n"], case["steps"]
    blocks = (n + BLOCK - 1) // BLOCK
    p = read(os.path.join(folder, "param.f32"), torch.float32, n)
    grads = read(os.path.join(folder, "grads.f32"), torch.float32, steps * n).view(steps, n)
    m_codes, m_absmax = torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)
    v_codes, v_absmax = torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)
    for step in range(steps):
        m_old = dequantize(m_codes, m_absmax, n)
        s_old = dequantize(v_codes, v_absmax, n)
        v_old = s_old * s_old
        m_new, s_new = torch.empty(n), torch.empty(n)
        for run in case["runs"]:
            a, b = run["start"], run["start"] + run["numel"]
            beta1, omb1, beta2, omb2, eps, wd, decay, bc2, step_size, decoupled = run["scalars"][step]
            g = grads[step, a:b]
            pi = p[a:b]
            if decoupled:
                pi = pi * decay
            else:
                g = g + wd * pi
            mi = m_old[a:b] * beta1 + omb1 * g
            vi = v_old[a:b] * beta2 + (omb2 * g) * g
            sq = vi.double().sqrt().float()  # correctly rounded, as the CPU's sqrt instruction
            ibc2 = torch.ones(1) / torch.full((1,), bc2)  # 1 / sqrt(bias_correction2) in fp32
            denom = sq * ibc2 + eps
            p[a:b] = pi + (step_size * mi) / denom
            m_new[a:b] = mi
            s_new[a:b] = sq
        m_codes, m_absmax = quantize(m_new, n)
        v_codes, v_absmax = quantize(s_new, n)
    for name, t in [("param.out.f32", p), ("m.codes", m_codes), ("m.absmax.f32", m_absmax), ("v.codes", v_codes),
                    ("v.absmax.f32", v_absmax)]:
        open(os.path.join(folder, name), "wb").write(t.contiguous().numpy().tobytes())


if __name__ == "__main__":
    main()
