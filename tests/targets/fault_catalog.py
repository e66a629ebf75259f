"""The planted faults of faults.py: for each, the doctor rule that must name it and how to plant it.

Read by tests/test_doctor.py (which asserts on them) and benchmarks/bench_doctor.py --faults
(which times the doctor on each); one table, so the two cannot drift apart.
"""

FAULTS = [
    # fault, the rule that must name it, words its message must hold (the decisive evidence)
    ("frozen", "mostly_frozen", ["5 of 6 parameter tensors", "requires_grad=False"]),
    ("lr_zero", "lr_zero", ["learning rate 0"]),
    ("not_in_optimizer", "grads_not_optimized", ["in no optimizer"]),
    ("nan_from_data", "params_nonfinite", ["NaN/Inf"]),
    ("memory_growth", "memory_growth", ["peak memory grows"]),
    ("slowdown", "throughput_regression", ["slower"]),
    ("dead_relu", "dead_activations", ["100.0% of the output of module 3 (ReLU", "exactly 0"]),
    ("collapsed", "collapsed_output", ["module 2 (Linear)", "same for every sample", "input from 1 varies"]),
    # CPU stand-in for the CUDA path: the target raises torch's sync warning from its own line
    ("host_sync", "host_syncs", ["of faults.py", "loss.item()", "1 time(s) a step"]),
]
SETTLE = {"memory_growth": "200", "dead_relu": "30", "collapsed": "30", "host_sync": "30"}  # steps the fault needs
TRACE_EVERY = {"dead_relu": "5", "collapsed": "5", "host_sync": "5"}  # rules that read traced steps need a few
NOT_ALSO = {"dead_relu": "collapsed_output"}  # a dead ReLU is not also reported as a collapsed output
# a slowdown is judged against the earlier steps' median: enough fast steps first keep it visible for ~20 s, not ~5 s
FAULT_STEP = {"slowdown": "150"}


def plant(fault: str) -> tuple[list, dict]:
    """``(arguments after the script, environment)`` that start faults.py with ``fault`` planted (PROBE=1)."""
    args = ["--fault", fault, "--settle", SETTLE.get(fault, "60"), "--fault-step", FAULT_STEP.get(fault, "40")]
    return args, {"PROBE": "1", **({"PROBE_TRACE": TRACE_EVERY[fault]} if fault in TRACE_EVERY else {})}
