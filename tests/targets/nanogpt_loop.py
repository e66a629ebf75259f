"""A loop in the shape of nanoGPT's train.py (our own code; run it with PROBE=1, no probe code).

A tiny causal LM from a config, token ids from a fixed generator (a random start, then each token's
fixed successor: a text it can learn), AdamW with a decay and a
no-decay param group, a warmup-then-cosine learning rate that the loop writes into every group
itself each iteration, gradient accumulation (``loss / accum`` backpropagated per micro-step,
through a disabled GradScaler as nanoGPT does on CPU), the next batch fetched while the
backward runs, and gradient clipping. Every ``--log-every`` iterations it prints
``iter N: loss X, lr Y`` (N counted from 0 as nanoGPT does; X the iteration's loss, the sum of
its backpropagated micro-losses, repr'd) and ``ready`` after iteration 0; ``--leak`` keeps every
micro-step's loss (with its graph) and logits in a list (the classic leak: ``--batch 48``, ~0.4 MB an
iteration); ``--iters`` ends the loop, else it runs until stopped; ``--step-sleep`` sleeps after each iteration.
"""

import argparse
import math
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=0)
p.add_argument("--log-every", type=int, default=5)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--leak", action="store_true")
p.add_argument("--width", type=int, default=32)
p.add_argument("--batch", type=int, default=4)
args = p.parse_args()

torch.manual_seed(1337)
torch.set_num_threads(1)
vocab, block, batch_size, n_embd = 64, 16, args.batch, args.width


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, n_embd)
        self.wpe = torch.nn.Embedding(block, n_embd)
        self.ln = torch.nn.LayerNorm(n_embd)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU(), torch.nn.Linear(4 * n_embd, n_embd)
        )
        self.head = torch.nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.mlp(self.ln(x))
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, vocab), targets.reshape(-1))
        return logits, loss


gen = torch.Generator().manual_seed(0)


successor = torch.randperm(vocab, generator=gen)  # the text: each token is followed by its successor (learnable)


def get_batch():
    first = torch.randint(0, vocab, (batch_size, 1), generator=gen)
    data = [first]
    for _ in range(block):
        data.append(successor[data[-1]])
    data = torch.cat(data, 1)
    return data[:, :-1], data[:, 1:]


model = TinyLM()
decay = [q for q in model.parameters() if q.dim() >= 2]
no_decay = [q for q in model.parameters() if q.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95)
)
scaler = torch.amp.GradScaler("cpu", enabled=False)
learning_rate, min_lr, warmup_iters, lr_decay_iters = 6e-4, 6e-5, 10, 2000


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


hoard = []
X, Y = get_batch()
iter_num = 0
while not args.iters or iter_num < args.iters:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    micro = []
    for _micro_step in range(args.accum):
        logits, loss = model(X, Y)
        loss = loss / args.accum
        X, Y = get_batch()  # the next batch, fetched while the backward would run on a GPU
        scaler.scale(loss).backward()
        micro.append(loss.detach())
        if args.leak:
            hoard.append(
                (loss, logits)
            )  # kept "for logging" with its graph and logits: a leak of batch*block*vocab floats
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % args.log_every == 0:
        lossf = float(torch.stack(micro).sum())
        print(f"iter {iter_num}: loss {lossf!r}, lr {lr!r}", flush=True)
    if iter_num == 0:
        print(f"ready pid={os.getpid()}", flush=True)
    iter_num += 1
    if args.step_sleep:
        time.sleep(args.step_sleep)  # ok-sleep: pacing
print("done", flush=True)
