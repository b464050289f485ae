"""A small random LlamaForCausalLM saved by transformers, and its logits for a
sequence, for tests/models/llama_test.cpp. Fails (does not skip) without
transformers: scripts/setup.sh installs it.

usage: make_llama.py OUT_DIR --tie 0|1 --kv-heads N --rope default|llama3 --tokens 1,2,3 [--shard-kb K] [--pad ID]
       make_llama.py --logits MODEL_DIR --tokens 1,2,3 --outfile FILE   (logits of a saved model)
       make_llama.py --adamw-step MODEL_DIR --data TOKENS.bin --block-size T --samples G --lr X --weight-decay W
                     [--steps N] --tokens 0 --outfile FILE   (N torch.optim.AdamW steps on llama train's first N
                     global batches of G samples, no decay on the norms and the embedding; the weights after them)
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("out", nargs="?")
p.add_argument("--tie", type=int, default=0)
p.add_argument("--kv-heads", type=int, default=2)
p.add_argument("--rope", default="default")
p.add_argument("--tokens", required=True)
p.add_argument("--shard-kb", type=int, default=20)
p.add_argument("--hidden", type=int, default=32)
p.add_argument("--inter", type=int, default=48)
p.add_argument("--layers", type=int, default=2)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--vocab", type=int, default=64)
p.add_argument("--pad", type=int)  # pad_token_id (nn.Embedding's padding_idx); none by default
p.add_argument("--logits")
p.add_argument("--adamw-step")
p.add_argument("--data")
p.add_argument("--block-size", type=int)
p.add_argument("--samples", type=int)
p.add_argument("--steps", type=int, default=1)
p.add_argument("--lr", type=float)
p.add_argument("--weight-decay", type=float)
p.add_argument("--outfile")
a = p.parse_args()
ids = torch.tensor([[int(t) for t in a.tokens.split(",")]])

if a.adamw_step:
    import numpy
    m = AutoModelForCausalLM.from_pretrained(a.adamw_step, dtype=torch.float32)
    m.train()
    T = a.block_size
    tokens = torch.from_numpy(numpy.fromfile(a.data, dtype=numpy.uint16).astype("int64"))
    windows = (len(tokens) - T - 1) // T + 1  # llama train's windows: sample j starts at (j mod windows) * T
    no_decay = lambda n: n.endswith("norm.weight") or n == "model.embed_tokens.weight" or n.endswith(".bias")
    decay = [p for n, p in m.named_parameters() if not no_decay(n)]
    rest = [p for n, p in m.named_parameters() if no_decay(n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    G = a.samples
    for step in range(a.steps):  # step s takes global samples s*G .. s*G+G-1
        batch = torch.stack([tokens[(j % windows) * T:(j % windows) * T + T + 1] for j in range(step * G, step * G + G)])
        logits = m(batch[:, :T]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_file({n: p.detach().contiguous() for n, p in m.named_parameters()}, a.outfile)
elif a.logits:
    m = AutoModelForCausalLM.from_pretrained(a.logits, dtype=torch.float32).eval()
    with torch.no_grad():
        save_file({"logits": m(ids).logits[0].contiguous()}, a.outfile)
else:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if a.rope == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=bool(a.tie), rope_parameters=rope, pad_token_id=a.pad)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(a.out, max_shard_size="%dKB" % a.shard_kb)
    with torch.no_grad():
        save_file({"logits": m(ids).logits[0].contiguous()}, a.out + "/ref_logits.safetensors")
