"""Prints whether a probe runs here; with --spawn, runs itself once more as a child and prints the child's line."""

import subprocess
import sys

import probe

print(f"probed={probe.is_running()}", flush=True)
if "--spawn" in sys.argv:
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=60)
    print(f"child {child.stdout.strip()}", flush=True)
    if probe.is_running():
        probe.stop()
