"""A tiny Lightning run, as a user writes it: no probe code (run it with PROBE=1).

A LightningModule whose ``configure_optimizers`` returns SGD (no momentum) and a LambdaLR
stepped every step (``interval: step``); random data, CPU. Prints ``ready`` after the first
optimizer step and ``pl step N loss X lr Y used Z`` at each step with the loss the module
logs, the LambdaLR's own lr for the step and the lr the step really used,
measured from the update (-(dp . g) / (g . g) over all parameters). ``--stall-file F`` pauses between steps
while F exists (prints ``stalled at step N``); ``--step-sleep S`` sleeps S seconds after each step.
"""

import argparse
import time
import warnings

import torch
import lightning.pytorch as pl
from _report import report, snapshot

warnings.filterwarnings("ignore")
p = argparse.ArgumentParser()
p.add_argument("--max-steps", type=int, default=100000)
p.add_argument("--stall-file")
p.add_argument("--out", default=".")
p.add_argument("--resume", help="a probe checkpoint to restore at the start of training (probe.load_checkpoint)")
p.add_argument("--skip", type=int, default=0, help="batches already consumed (the resumed run starts after them)")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (0: as fast as it goes)")
args = p.parse_args()


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.step_lr = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        self._loss = loss.detach()
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.step_lr = self.trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]  # the schedule's own lr
        self.before = snapshot(self.parameters())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.trainer.global_step
        # what a user's own logger reads here: the optimizer's param_groups
        print(f"pl pg {step} {self.trainer.optimizers[0].param_groups[0]['lr']!r}", flush=True)
        report(step, float(self._loss), self.step_lr, self.before, args.stall_file, prefix="pl ")
        if args.step_sleep:
            time.sleep(args.step_sleep)  # ok-sleep: pacing

    def on_train_start(self):
        if args.resume:
            import probe

            state = probe.load_checkpoint(args.resume, trainer=self.trainer)
            print(f"resumed from step {state['step']} global_step {self.trainer.global_step}", flush=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=g)
    y = x.sum(1, keepdim=True)
    # the data is a fixed sequence, epoch after epoch: a resumed run starts where the checkpoint was taken
    skip = args.skip * 8 % len(x)
    x, y = torch.cat((x[skip:], x[:skip])), torch.cat((y[skip:], y[:skip]))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
