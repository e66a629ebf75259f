"""The per-call recording of a traced step: the forward pre/post hooks that note each module call."""

from __future__ import annotations

import time

from ..util.errorlog import record_error

__all__ = ["call_hooks", "MEM_PERIOD", "MAX_STATS_CALLS"]

MEM_PERIOD = 0.0005
MAX_STATS_CALLS = 20000  # module calls of one traced step that get output statistics (small ones hold a copy)


def call_hooks(tracer, stat) -> tuple:
    """The global forward pre/post hook pair that records each module call of ``tracer``'s sampled step
    (``stat``: a call's output statistics, from ``outstats.recorder``; None: none).

    Every module call of the step runs these two functions, so they do the least
    that keeps a call's record: a perf_counter reading each side, a stack push and
    pop, one tuple appended; names, sequence numbers and the ring write wait for the
    boundary. Two variants (CPU, CUDA) keep a device test out of the hot path. While
    dynamo traces a compiled module the hooks do nothing (``is_dynamo_compiling`` is
    False in eager code and constant-folded to True by dynamo), so a ``fullgraph``
    compile sees no side effect to break on. No ``always_call``: a post hook that a
    raising module skips leaves its entry on the stack, and the next post hook pops
    past it.
    """
    torch = tracer.torch
    stack = tracer.stack
    push, pop = stack.append, stack.pop
    add = tracer.rows.append
    rstack = tracer.rstack
    add_recomputed = tracer.recomputed.append
    graph_task = getattr(torch._C, "_current_graph_task_id", None) or (lambda: -1)  # -1: not in a backward pass
    perf = time.perf_counter
    mem = tracer.mem
    read_mem = tracer.read_mem
    new_event = tracer.new_event
    tc = getattr(torch, "compiler", None)
    compiling = getattr(tc, "is_dynamo_compiling", None) or getattr(tc, "is_compiling", None) or (lambda: False)
    grad_enabled = torch.is_grad_enabled
    watch_backward = tracer.watch_backward
    period = MEM_PERIOD
    out_stats = tracer.out_stats
    failures = [0]
    keep = out_stats.append

    def stats(output):  # the output statistics of the call just added; never raises into the forward
        if len(out_stats) >= MAX_STATS_CALLS:  # a step that never ends (no boundary): keep no more
            keep(None)
            return
        nonlocal stat
        try:
            keep(stat(output))
        except Exception as exc:
            keep(None)
            failures[0] += 1
            record_error("torch trace: output statistics", exc)
            if failures[0] >= 10:  # something in this job's outputs we cannot reduce: stop trying
                tracer.stats_on, stat = False, None

    def recompute_post(module, ev1):
        """The end of a recomputed call: its own stack, its own rows, no statistics or backward watch."""
        t1 = perf()
        while rstack:
            entry = rstack.pop()
            if entry[0] is module:
                add_recomputed((module, entry[1], t1, mem[1]) + ((entry[2], ev1) if ev1 is not None else ()))
                return

    def pre(module, args):
        if compiling():
            return
        if graph_task() != -1:
            rstack.append((module, perf()))
            return
        push((module, perf()))

    def post(module, args, output):
        if compiling():
            return
        if graph_task() != -1:
            recompute_post(module, None)
            return
        if not stack:
            return
        t1 = perf()
        m, t0 = pop()
        while m is not module and stack:  # a call that raised past its own post hook
            m, t0 = pop()
        if m is not module:
            return
        if t1 - mem[0] > period:
            mem[0] = t1
            mem[1] = read_mem()
        if stack:
            add((module, t0, t1, mem[1], len(stack)))
        else:
            add((module, t0, t1, mem[1], 0))
            if grad_enabled():
                watch_backward(module, output)
        if stat is not None:
            stats(output)

    def pre_cuda(module, args):
        if compiling():
            return
        ev = new_event()
        ev.record()
        if graph_task() != -1:
            rstack.append((module, perf(), ev))
            return
        push((module, perf(), ev))

    def post_cuda(module, args, output):
        if compiling():
            return
        if graph_task() != -1:
            ev1 = new_event()
            ev1.record()
            recompute_post(module, ev1)
            return
        if not stack:
            return
        ev1 = new_event()
        ev1.record()
        t1 = perf()
        m, t0, ev0 = pop()
        while m is not module and stack:
            m, t0, ev0 = pop()
        if m is not module:
            return
        if t1 - mem[0] > period:
            mem[0] = t1
            mem[1] = read_mem()
        depth = len(stack)
        add((module, t0, t1, mem[1], depth, ev0, ev1))
        if not depth and grad_enabled():
            watch_backward(module, output)
        if stat is not None:
            stats(output)

    return (pre_cuda, post_cuda) if tracer.cuda else (pre, post)
