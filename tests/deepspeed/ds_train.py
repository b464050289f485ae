#!/usr/bin/env python3
"""TinyNet trained by DeepSpeed on CPU ranks (Gloo), for deepspeed_test.cpp.

Run under torchrun with DS_ACCELERATOR=cpu:
  ds_train.py --stage S [--offload] [--bf16] [--load DIR] --first F --steps N [--save DIR] [--extra N2] --losses FILE
trains global steps [F, F + N) (after loading DIR when given; F is then the
loaded global step), saves to --save, trains --extra more steps, and writes
the losses of the steps after the save (or after the load, when nothing is
saved) as JSON, each with its hex. The model and batches are tiny_net.h's.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn as nn
import deepspeed
import deepspeed.comm.torch  # noqa: F401

# The CPU accelerator's communication backend compiles a shared-memory op with
# ninja when it starts; Gloo is all these tests use.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

IN, HIDDEN, OUT, BATCH = 5, 9, 3, 8


class TinyNet(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.tensor([0.5, 1.0, 2.0]))

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x)))) * self.scale


def batch(step):
    x = ((torch.arange(BATCH * IN, dtype=torch.float32) + float(step * 1000)) * 0.37).sin()
    y = ((torch.arange(BATCH * OUT, dtype=torch.float32) + float(step * 1000)) * 0.91).cos()
    return x.view(BATCH, IN), y.view(BATCH, OUT)


def config(a, world):
    zero = {"stage": a.stage}
    if a.stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if a.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8,
                                                 "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 5, "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "zero_force_ds_cpu_optimizer": False,
    }
    if a.bf16:
        cfg["bf16"] = {"enabled": True}
    if a.universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--offload", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--save", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--universal", action="store_true")
    p.add_argument("--extra", type=int, default=0)
    p.add_argument("--losses", default=None)
    p.add_argument("--expect-next-step", type=int, default=None,
                   help="the client state load_checkpoint returns must say this next_step")
    p.add_argument("--local_rank", type=int, default=-1)
    a = p.parse_args()

    torch.manual_seed(1234)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = TinyNet()
    # Under no_grad: torch 2.11's Gloo all-gather writes into views of a flat
    # buffer that ZeRO-1/2 builds with autograd on, which autograd refuses.
    with torch.no_grad():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(a, world))
    per_rank = BATCH // world

    def train_step(step):
        x, y = batch(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        if a.bf16:
            x = x.to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        return (mean / world).item()

    first = a.first
    if a.load:
        _, client = engine.load_checkpoint(a.load)
        first = engine.global_steps
        if a.expect_next_step is not None:
            got = (client or {}).get("next_step"), (client or {}).get("data")
            if got != (a.expect_next_step, {"seen": [1, 2]}):
                sys.exit(f"ds_train: the client state's next_step and data are {got}, "
                         f"expected ({a.expect_next_step}, {{'seen': [1, 2]}})")
    losses = [train_step(s) for s in range(first, first + a.steps)]
    if a.save:
        engine.save_checkpoint(a.save)
        losses = []
    losses += [train_step(s) for s in range(first + a.steps, first + a.steps + a.extra)]
    if a.losses and rank == 0:
        with open(a.losses, "w") as f:
            json.dump({"first": first + (a.steps if a.save else 0), "losses": losses,
                       "hex": [float(v).hex() for v in losses]}, f)
    torch.distributed.barrier()
    # Out at once: a rank of DeepSpeed's stage 3 on CPU now and then aborts in
    # its teardown ("terminate called without an active exception") after
    # everything is written; the test reads what it wrote, not how it ended.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
