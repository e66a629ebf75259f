"""A small GPT-like language model trained on generated data, with probe attached.

Run it, then talk to it from another shell:

    python examples/train_gpt.py            # prints "ready pid=..." once training runs
    probe list
    probe PID backtrace
    probe PID query "SELECT step, loss, lr FROM torch.steps ORDER BY step DESC LIMIT 5"

The data is a synthetic next-token task (noisy arithmetic sequences), so the loss
falls visibly within a few hundred steps on a CPU. Everything is seeded: two runs
with the same arguments produce the same losses (used by the resume test).
Globals named as in the seed playbooks: ``model``, ``optimizer``, ``scheduler``,
``train_loader``, ``trainer`` (with ``current_step`` and ``grad_clip``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import probe  # no side effects: probe.span below is a no-op unless a probe runs

if os.environ.get("PROBE_EXAMPLE_NO_PROBE") != "1":
    import probe.auto  # noqa: F401  (the one line that attaches probe)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


class ArithmeticSequences(torch.utils.data.IterableDataset):
    """Sequences a, a+d, a+2d, ... mod vocab, with a little noise: learnable, endless, seeded."""

    def __init__(self, vocab: int, seq: int, seed: int):
        self.vocab, self.seq, self.seed = vocab, seq, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        steps = torch.arange(self.seq + 1)
        while True:
            a = torch.randint(0, self.vocab, (1,), generator=g)
            d = torch.randint(1, 5, (1,), generator=g)
            x = (a + d * steps) % self.vocab
            noise = torch.rand(self.seq + 1, generator=g) < 0.05
            x = torch.where(noise, torch.randint(0, self.vocab, (self.seq + 1,), generator=g), x)
            yield x[:-1], x[1:]


class Trainer:
    def __init__(self, grad_clip: float):
        self.current_step = 0
        self.grad_clip = grad_clip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=0, help="Steps to run; 0 runs until stopped.")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="Extra seconds per step (to make a rank slow).")
    p.add_argument("--print-every", type=int, default=50)
    p.add_argument("--resume", help="Restore an emergency checkpoint written by `probe checkpoint`.")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    global model, optimizer, scheduler, train_loader, trainer
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    vocab, seq = 64, 32
    model = TinyGPT(vocab=vocab, layers=args.layers, seq=seq).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 20
    # linear warm-up, then cosine decay to a floor of 10 % at step 5000, held after (a rate of 0 would
    # leave a run that goes on past its schedule changing nothing: the doctor's lr_zero says so)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, 5000) / 5000)))
    )
    train_loader = torch.utils.data.DataLoader(ArithmeticSequences(vocab, seq, args.seed), batch_size=args.batch)
    trainer = Trainer(grad_clip=1.0)

    if args.resume:
        state = probe.load_checkpoint(args.resume, model=model, optimizer=optimizer, scheduler=scheduler)
        trainer.current_step = int(state.get("step") or 0)
        print(f"resumed from {args.resume} at step {trainer.current_step}", flush=True)

    data = iter(train_loader)
    # The data stream is a pure function of the seed: skip what was already consumed.
    for _ in range(trainer.current_step):
        next(data)
    print(f"ready pid={os.getpid()} device={args.device}", flush=True)
    model.train()
    while args.steps == 0 or trainer.current_step < args.steps:
        with probe.span("data"):  # input-pipeline time, in python.spans and the timeline
            batch, target = next(data)
        batch, target = batch.to(args.device), target.to(args.device)
        logits = model(batch)
        loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.grad_clip)
        optimizer.step()
        scheduler.step()
        trainer.current_step += 1
        if trainer.current_step % args.print_every == 0 or trainer.current_step == 1:
            print(f"step {trainer.current_step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.6f}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    print(f"done step={trainer.current_step} loss={loss.item():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
