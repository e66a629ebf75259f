"""Installs `probe-autostart.pth` next to the package in site-packages.

The .pth line imports `probe.agent.autostart`, which returns at once unless the PROBE
environment variable is set; it is what lets `PROBE=1 torchrun train.py` start the
probe with no code change. Data files are installed relative to the environment's
prefix, so the target is site-packages expressed relative to that prefix (this works
for regular and editable installs alike).
"""

import os
import sys
import sysconfig

from setuptools import setup
from setuptools.dist import Distribution


class _Distribution(Distribution):
    # setuptools' editable_wheel installs data files only when the distribution
    # answers `has_data()`; without this, `pip install -e .` would skip the .pth.
    def has_data(self):
        return self.has_data_files()


purelib = sysconfig.get_paths()["purelib"]
target = os.path.relpath(purelib, sys.prefix)
setup(distclass=_Distribution, data_files=[(target, ["probe-autostart.pth"])])
