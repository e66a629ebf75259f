"""A tiny GPT-2 from a config (vocabulary 128, 32 wide: its c_attn is 96 wide) in a plain loop on
uniformly random tokens, so its loss sits at ln(128), chance level: no probe code (PROBE=1).
Prints ``ready`` after ``--steps`` steps and trains on, slowly.
"""

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
config = GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=1, n_head=2)
model = GPT2LMHeadModel(config)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(1, 10**9):
    ids = torch.randint(0, 128, (4, 16))
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step == 60:
        print(f"ready pid={os.getpid()} loss={loss.item():.3f}", flush=True)
    if step > 60:
        time.sleep(0.01)  # ok-sleep: trains on gently while the test reads it
