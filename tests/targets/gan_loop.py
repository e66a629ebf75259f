"""A tiny GAN trained as people write it: no probe code (run it with PROBE=1).

Each iteration steps two optimizers, the discriminator's then the generator's:
``opt_d.step()`` then ``opt_g.step()``, each after its own loss's backward. Plain SGD
without momentum, so the lr each step used is measured from the update itself. Each
iteration prints ``iter N d_loss X g_loss Y d_lr A d_used B g_lr C g_used D`` after both
steps; ``ready`` after iteration 1; ``--stall-file F`` pauses between iterations while F exists.
``--watch-g`` names the generator's optimizer with ``probe.watch`` before anything steps.
``stepped`` counts each optimizer's steps, incremented just before its ``step()``: an action
run between the two optimizers' steps sees ``stepped["d"] - stepped["g"] == 1``, after both 0.
"""

import argparse
import time

import torch
from _report import snapshot, step_done, used_lr

p = argparse.ArgumentParser()
p.add_argument("--stall-file")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--watch-g", action="store_true", help="probe.watch(optimizer=opt_g) before training (the last to step)")
args = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)

generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
discriminator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.02)
opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
bce = torch.nn.BCEWithLogitsLoss()
stepped = {"d": 0, "g": 0}


if args.watch_g:
    import probe

    probe.watch(optimizer=opt_g)


def main():
    g = torch.Generator().manual_seed(0)
    it = 0
    while True:
        real = torch.randn(16, 8, generator=g) * 0.5 + 1.0
        z = torch.randn(16, 4, generator=g)
        fake = generator(z)
        # the discriminator's step
        opt_d.zero_grad()
        d_loss = bce(discriminator(real), torch.ones(16, 1)) + bce(discriminator(fake.detach()), torch.zeros(16, 1))
        d_loss.backward()
        d_before = snapshot(list(discriminator.parameters()))
        d_lr = opt_d.param_groups[0]["lr"]
        stepped["d"] += 1
        opt_d.step()
        d_used = used_lr(d_before)
        # the generator's step
        opt_g.zero_grad()
        g_loss = bce(discriminator(fake), torch.ones(16, 1))
        g_loss.backward()
        g_before = snapshot(list(generator.parameters()))
        g_lr = opt_g.param_groups[0]["lr"]
        stepped["g"] += 1
        opt_g.step()
        g_used = used_lr(g_before)
        it += 1
        print(
            f"iter {it} d_loss {float(d_loss)!r} g_loss {float(g_loss)!r} d_lr {d_lr!r} d_used {d_used!r} "
            f"g_lr {g_lr!r} g_used {g_used!r}",
            flush=True,
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)  # ok-sleep: pacing
        step_done(it, args.stall_file)


if __name__ == "__main__":
    main()
