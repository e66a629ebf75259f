"""The README demo: a real training run with probe attached, driven by the real CLI.

Starts examples/train_gpt.py, waits until it trains, then runs what an engineer
would type at 3 AM — list, backtrace, a SQL query on live step health, an LR change
and an emergency checkpoint — printing each command and its output, and finally
stops the training cleanly. Everything happens in a private runtime directory.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROBE = (
    str(Path(sys.executable).with_name("probe"))
    if Path(sys.executable).with_name("probe").exists()
    else shutil.which("probe")
)


# The latest steps whose gradient norm was measured: probe computes the norm on the steps its budget allows (0.1 % of
# step time by default, docs/torch.md), so the very latest steps usually have none.
STEP_HEALTH = (
    "SELECT step, round(loss, 4) AS loss, round(grad_norm, 3) AS grad_norm, lr, round(duration * 1000, 1) AS step_ms "
    "FROM torch.steps WHERE grad_norm IS NOT NULL ORDER BY step DESC LIMIT 5"
)


def banner(text: str) -> None:
    print(f"\n\033[1m# {text}\033[0m", flush=True)


def run(env: dict, *args: str) -> int:
    shown = " ".join(shlex.quote(a) if " " in a or "*" in a else a for a in args)
    print(f"$ probe {shown}", flush=True)
    r = subprocess.run([PROBE, *args], env=env, text=True, capture_output=True)
    out = (r.stdout + r.stderr).rstrip()
    print(out, flush=True)
    return r.returncode


def main() -> int:
    work = tempfile.mkdtemp(prefix="probe-demo-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
    env.update(PROBE_RUNTIME_DIR=os.path.join(work, "run"), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    banner("start a training job with `import probe.auto` (examples/train_gpt.py)")
    train = subprocess.Popen(
        [sys.executable, str(HERE / "train_gpt.py"), "--print-every", "100"],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []

    def pump():
        for line in train.stdout:
            lines.append(line.rstrip())

    threading.Thread(target=pump, daemon=True).start()
    failures = 0
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("step 100 ") for line in lines):
            if train.poll() is not None or time.monotonic() > deadline:
                print("\n".join(lines))
                print("demo: the training example did not start; see its output above.", file=sys.stderr)
                return 1
            time.sleep(0.1)
        print("\n".join(lines), flush=True)
        pid = str(train.pid)

        banner("which processes are probed on this host?")
        failures += run(env, "list") != 0
        banner("is anything wrong? (the doctor runs its rules over the live tables; exit 0: nothing above info)")
        failures += run(env, pid, "doctor") not in (0, 8)
        banner("where is it right now? (all threads, innermost frame first)")
        failures += run(env, pid, "backtrace", "--thread", "MainThread") != 0
        banner("step health from the live process: loss, grad-norm (on the steps probe measured it), lr, step time")
        failures += run(env, pid, "query", STEP_HEALTH) != 0
        banner("where does the time go? (seed playbook query, verbatim)")
        failures += (
            run(
                env,
                pid,
                "query",
                "SELECT module, stage, COUNT(*) as count, AVG(duration) as avg_time, "
                "SUM(duration) as total_time FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM "
                "python.torch_trace) GROUP BY module, stage ORDER BY total_time DESC LIMIT 10",
            )
            != 0
        )
        banner("calm it down: halve the learning rate at the next step boundary (survives the scheduler)")
        failures += run(env, pid, "lr", "--scale", "0.5") != 0
        failures += (
            run(env, pid, "query", "SELECT optimizer, param_group, lr, initial_lr, scheduler FROM torch.optimizer") != 0
        )
        banner("save it: an emergency checkpoint, atomically, without stopping training")
        ckpt = os.path.join(work, "emergency.pt")
        failures += run(env, pid, "checkpoint", ckpt) != 0
        banner("and the audit trail of what we did")
        failures += run(env, pid, "query", "SELECT id, command, state, step FROM probe.actions ORDER BY id") != 0
    finally:
        banner("stop the training job")
        train.send_signal(signal.SIGTERM)
        try:
            train.wait(10)
        except subprocess.TimeoutExpired:
            train.kill()
        print(f"training stopped (exit {train.returncode}); demo files in {work}")
    if failures:
        print(f"demo: {failures} command(s) failed; see above.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
