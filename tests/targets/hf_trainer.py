"""A tiny transformers.Trainer run, as a user writes it: no probe code (run it with PROBE=1).

GPT-2 built from a config (1 layer, 32 wide), random token ids, CPU, no downloads; plain SGD
(``optim="sgd"``, no momentum) so the lr a step really used is measured from the update.
A callback prints ``ready`` after the first optimizer step and, at every logged step,
``hf step N loss X lr Y used Z`` with the loss and lr the Trainer itself logs and the
measured lr (-(dp . g) / (g . g) over all parameters). ``--stall-file F``
pauses between steps while F exists (prints ``stalled at step N``). ``--resume PATH``
restores a probe checkpoint when training begins (``probe.load_checkpoint(path,
trainer=trainer)``) and prints ``resumed from step N global_step G``; ``--skip N`` starts the
data after the N batches already consumed (the data is a fixed sequence, no dropout: a
resumed run computes exactly what the first one did) and ``--stop-at N`` ends training
after step N (``--max-steps`` stays the schedule's length). ``--step-sleep S`` sleeps S seconds after each step.
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from _report import snapshot, step_done, used_lr
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, default=100000)
p.add_argument("--accum", type=int, default=1)
p.add_argument("--scheduler", default="linear")
p.add_argument("--stall-file")
p.add_argument("--out", default=".")
p.add_argument("--resume", help="a probe checkpoint to restore when training begins (probe.load_checkpoint)")
p.add_argument("--skip", type=int, default=0, help="batches already consumed (the resumed run starts after them)")
p.add_argument("--stop-at", type=int, help="end training after this step (the schedule still spans --max-steps)")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (0: as fast as it goes)")
args = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=4096, length=16, vocab=64, skip=0):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (n, length), generator=g)
        skip %= n  # the data is a fixed sequence, epoch after epoch: a resumed run starts where the checkpoint was
        self.ids = torch.cat((ids[skip:], ids[:skip]))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Report(TrainerCallback):
    def __init__(self):
        self.model, self.trainer, self.before, self.used = None, None, None, {}

    def on_train_begin(self, a, state, control, **kw):
        if args.resume:
            import probe

            st = probe.load_checkpoint(args.resume, trainer=self.trainer)
            print(f"resumed from step {st['step']} global_step {state.global_step}", flush=True)

    def on_pre_optimizer_step(self, a, state, control, **kw):
        self.before = snapshot(self.model.parameters())

    def on_optimizer_step(self, a, state, control, **kw):
        self.used[state.global_step + 1] = used_lr(self.before)

    def on_step_end(self, a, state, control, **kw):
        step_done(state.global_step, args.stall_file)
        if args.stop_at is not None and state.global_step >= args.stop_at:
            control.should_training_stop = True
        if args.step_sleep:
            time.sleep(args.step_sleep)  # ok-sleep: pacing

    def on_log(self, a, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            print(
                f"hf step {state.global_step} loss {logs['loss']!r} lr {logs.get('learning_rate')!r} "
                f"used {self.used.get(state.global_step)!r}",
                flush=True,
            )


def main():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # no randomness after the data
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=args.out,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accum,
        learning_rate=0.05,
        warmup_steps=5,
        lr_scheduler_type=args.scheduler,
        logging_steps=1,
        optim="sgd",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to=[],
        train_sampling_strategy="sequential",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    report = Report()
    report.model = model
    skip = args.skip * targs.per_device_train_batch_size * args.accum
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(skip=skip), callbacks=[report])
    report.trainer = trainer
    trainer.train()


if __name__ == "__main__":
    main()
