"""A plain script that never imports probe (for PROBE=1 and inject tests)."""

import os
import sys
import time

print(f"ready {os.getpid()} probe_loaded={'probe' in sys.modules}", flush=True)
while True:
    time.sleep(0.1)  # ok-sleep: the target idles
