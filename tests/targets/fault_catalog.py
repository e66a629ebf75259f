"""The planted faults of faults.py: for each, the doctor rule that must name it and how to plant it.

Read by tests/doctor/test_doctor_faults_model.py and _runtime.py (which assert on them) and
benchmarks/bench_doctor.py --faults (which times the doctor on each); one table, so the two cannot drift apart.
"""

FAULTS = [
    # fault, the rule that must name it, words its message must hold (the decisive evidence)
    (
        "frozen",
        "mostly_frozen",
        # the body, held by no optimizer and beside nothing that trains, is frozen on purpose: the head's weight is not
        [
            "1 of 2 parameter tensors of model that an optimizer holds or that sit beside ones that train",
            "(4 more frozen outside any optimizer and any training module are left out: frozen on purpose): "
            "4.weight; what trains: 4.bias.",
        ],
    ),
    ("lr_zero", "lr_zero", ["learning rate 0"]),
    (
        "not_in_optimizer",
        "grads_not_optimized",
        ["in no optimizer: 2.* (2 tensors, 1056 elements), 0.* (2 tensors, 544 elements)"],
    ),
    ("nan_from_data", "params_nonfinite", ["NaN/Inf"]),
    ("memory_growth", "memory_growth", ["memory in use grows"]),
    ("slowdown", "throughput_regression", ["slower"]),
    ("dead_relu", "dead_activations", ["100.0% of the output of module 3 (ReLU", "exactly 0"]),
    ("collapsed", "collapsed_output", ["module 2 (Linear)", "same for every sample", "input from 1 varies"]),
    # CPU stand-in for the CUDA path: the target raises torch's sync warning from its own line
    ("host_sync", "host_syncs", ["of faults.py", "loss.item()", "1 time(s) a step"]),
    # a slow Dataset.__getitem__ behind a DataLoader without workers: 32+ ms a batch (sleeps), ~0.5 ms in the model
    (
        "data_wait",
        "input_bound",
        [
            "outside forward/backward",
            "the input pipeline",
            "DataLoader loader (SlowSamples, batch_size 64) has num_workers=0",
        ],
    ),
    # 8 sigmoid layers at the default init: layer 0's gradient is ~1e-5 of layer 14's (the threshold is 1e-3)
    (
        "vanishing",
        "grads_by_layer",
        ["gradients vanish toward the input of model", "layer 0's gradient", "layer 14's", "over 8 layers"],
    ),
    ("grad_zero", "grad_norm_zero", ["exactly 0 on the last 20 measured steps"]),
    # about one batch in 15 has 8 of its 64 labels wrong: single-step outliers the loss comes back from
    ("loss_spike", "loss_spike", ["the loss spiked to", "the median"]),
    # weight decay applied without the lr factor: the loss rises from ~1e-4 to ~0.3 and stays there
    ("diverging", "loss_diverging", ["the loss is diverging", "up from"]),
    # a gradient hook multiplies layer 2's weight gradient by Inf (base lr / a layer lr of 0): that step's loss is
    # finite, the update makes the weights, then the loss, NaN; grad_nonfinite names the gradients, as
    # params_nonfinite and loss_nonfinite name what they fed (all three are true: none is NOT_ALSO)
    # invariants (torch.checks): the gradient of the last layer's bias, the smallest trainable tensor, still holds the
    # steps before at every backward
    (
        "no_zero_grad",
        "grads_not_cleared",
        ["the gradient of 4.bias was never cleared between optimizer steps", "zero_grad()"],
    ),
    # zero_grad() (set_to_none) between backward and step: the optimizer finds no gradient at all
    ("zero_grad_misplaced", "step_without_grads", ["stepped with no gradient on any of its 6 trainable tensors"]),
    # model.eval() for a validation pass and no model.train() after it: dropout and batch norm in eval mode
    (
        "eval_mode",
        "eval_mode_in_training",
        ["2 module(s) of the model being trained were in eval mode", "1, 3 (", "BatchNorm1d, Dropout"],
    ),
    ("grad_inf", "grad_nonfinite", ["parameter tensor(s) of model have NaN/Inf gradients", "most in 2.weight"]),
]
# faults of the model, its gradients, optimizer and loss; the rest are memory, speed, input and activations
# (two test files, so that the test workers run the two halves side by side)
MODEL_FAULTS = (
    "frozen",
    "lr_zero",
    "not_in_optimizer",
    "nan_from_data",
    "vanishing",
    "grad_zero",
    "loss_spike",
    "diverging",
    "grad_inf",
    "no_zero_grad",
    "zero_grad_misplaced",
    "eval_mode",
)

SETTLE = {
    "memory_growth": "200",
    "dead_relu": "30",
    "collapsed": "30",
    "host_sync": "30",
    "grad_zero": "200",
    "data_wait": "5",
    "no_zero_grad": "10",
    "zero_grad_misplaced": "10",
    "eval_mode": "10",
}  # steps the fault needs
TRACE_EVERY = {
    "dead_relu": "5",
    "collapsed": "5",
    "host_sync": "5",
    "data_wait": "5",
}  # rules that read traced steps need a few
# rules that must not also speak: what the fault feeds, or its look-alike (a spike is not a divergence, nor the
# reverse); an exact 0 gradient (dead ReLUs, a zeroed layer, a loss masked to nothing) is no vanishing gradient
NOT_ALSO = {
    "dead_relu": ("collapsed_output", "grads_by_layer"),
    "collapsed": ("grads_by_layer",),
    "grad_zero": ("grads_by_layer",),
    "not_in_optimizer": ("grads_by_layer",),
    "loss_spike": ("loss_diverging",),
    "diverging": ("loss_spike",),
}
# Faults whose rule reads a window of measured steps around the onset (loss_diverging: a 20-step median before and
# after it; loss_spike: the 50 measured steps before a spike; memory_growth: 20 to 100 peak readings after step 100;
# grad_norm_zero: the last 20 measured norms) run with every step measured: the onset comes 40 steps (a fraction of a
# second) into the job, and how many of the steps around it the default budget measures depends on the machine's
# speed (on a loaded host too few: the divergence read as a plateau, the memory growth as nothing). With every step
# measured, what the doctor reads at "planted" is fixed by the target's step count. (A real job trains long before
# it diverges; the budget's own sampling is tested in test_torch_budget.py and the doctor's in test_doctor.py.)
# The invariant faults too (grads_not_cleared, step_without_grads, eval_mode_in_training speak after two failing
# checks in a row, and checks run on measured steps): 10 steps after the onset the default budget may have measured
# none on a fast host. How the checks run under the budget is tested on real-world errors (test_doctor_corpus.py).
STEP_BUDGET = {
    "diverging": "off",
    "loss_spike": "off",
    "memory_growth": "off",
    "grad_zero": "off",
    "no_zero_grad": "off",
    "zero_grad_misplaced": "off",
    "eval_mode": "off",
}
# memory_growth reads the memory of the last 30 s and needs 3 s of them after step 100: a floor under each step's time
# makes the 140 leaking steps before "planted" last 4 s or more however fast the machine is
# and grad_norm_zero's norms are paced by a budget of their own (PROBE_GRAD_NORM, a share of step time that a
# loaded host's slower norms use up): every measured step computes one
GRAD_NORM = {"grad_zero": "all"}
STEP_SLEEP = {"memory_growth": "0.03"}
# a slowdown is judged against the earlier steps' median: enough fast steps first keep it visible for ~20 s, not ~5 s
FAULT_STEP = {"slowdown": "150"}


def plant(fault: str) -> tuple[list, dict]:
    """``(arguments after the script, environment)`` that start faults.py with ``fault`` planted (PROBE=1)."""
    args = ["--fault", fault, "--settle", SETTLE.get(fault, "60"), "--fault-step", FAULT_STEP.get(fault, "40")]
    env = {"PROBE": "1"}
    if fault in STEP_SLEEP:
        args += ["--step-sleep", STEP_SLEEP[fault]]
    if fault in TRACE_EVERY:
        env["PROBE_TRACE"] = TRACE_EVERY[fault]
    if fault in STEP_BUDGET:
        env["PROBE_STEP_BUDGET"] = STEP_BUDGET[fault]
    if fault in GRAD_NORM:
        env["PROBE_GRAD_NORM"] = GRAD_NORM[fault]
    return args, env
