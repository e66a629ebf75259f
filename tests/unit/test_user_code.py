"""One definition of "user code" (probe.util.usercode), applied by the agent to its frames and by the CLI to
the frames of a backtrace it was sent: both give the same answer for the same file."""

from __future__ import annotations

import doctest
import os
import sys

import probe.util.usercode as usercode
from probe.cli.stacks import user_frame as cli_user_frame


def test_the_rule_s_examples_hold():
    failed, tried = doctest.testmod(usercode)
    assert tried and not failed


def test_the_agent_and_the_cli_pick_the_same_frame_of_one_stack():
    # given: a stack innermost first, as python.backtrace and py-spy give it, through torch and the stdlib
    site = "/opt/venv/lib/python3.12/site-packages"
    files = [
        f"{site}/torch/distributed/distributed_c10d.py",
        "/usr/lib/python3.12/threading.py",
        "<frozen runpy>",
        f"{site}/lightning/pytorch/loops/fit_loop.py",
        f"{site}/mytrainer/loop.py",
        "/home/me/train.py",
    ]
    frames = [{"func": f"f{i}", "file": f, "lineno": i} for i, f in enumerate(files)]

    # when: the CLI picks the user's frame of the stack, and the agent's rule reads each code object's file
    picked = cli_user_frame(frames)
    agent = [usercode.is_user_code(compile("pass", f, "exec")) for f in files]

    # then: both name the user's own installed package, the first frame outside stdlib, torch and frameworks
    assert picked["file"] == f"{site}/mytrainer/loop.py"
    assert agent == [False, False, False, False, True, True]


def test_a_frame_walk_counts_its_hops_to_the_user_s_frame():
    # given: this test's frame (the user's) calling through a stdlib frame (contextlib), as a step hook sees it
    import contextlib

    @contextlib.contextmanager
    def inside():
        yield sys._getframe(1)  # the frame of contextlib's __enter__, called from ours

    with inside() as frame:
        # when
        found, hops = usercode.user_frame(frame)
    # then: the contextlib frame is skipped, and this function's frame is the user's
    assert found.f_code is test_a_frame_walk_counts_its_hops_to_the_user_s_frame.__code__
    assert hops >= 1 and os.path.basename(frame.f_code.co_filename) == "contextlib.py"
