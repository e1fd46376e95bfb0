"""How the calling thread waits while IREE's CPU workers run a call.

A local-task call submits the work to IREE's worker threads (one per core) and the calling thread
sleeps until the last dispatch signals the call's semaphore. The worker that signals wakes the caller
and then finishes the signal (marks the caller's wait entry done). Linux lets a woken thread preempt the
thread that woke it on that core, and the caller, once running, spins until its entry is marked done
(a `pause` loop after the wait entry is unlinked, in the disassembly of iree-base-runtime 3.13's wait):
spinning on the core of the one thread that can mark it, until the scheduler tick moves one of them.
Measured on a 2-core VM (bench-size K3 decode, `perf sched timehist`): in about one call in five the
caller ran 3-7 ms of CPU inside the call while both workers were off-core (3 alternating pairs of runs:
mean step 8.8-8.9 ms, against 6.7-7.8 ms with the change below).

A SCHED_BATCH thread does not preempt on wake-up (kernel/sched/fair.c: batch and idle tasks leave
preemption to the tick), so while a call runs the caller is made SCHED_BATCH and then restored: the
worker finishes its signal, goes idle, and the caller takes the core. Measured on the same VM, the same
module: the caller's CPU time in a call at most 0.5 ms; kimi-run --bench's code path (a fresh session,
prompt 64, 3 x 32 decodes; 6 alternating processes each) K3 decode 143 -> 171 tok/s, prefill 1149 ->
1226, and DeepSeek-V3.2 decode 144 -> 157 tok/s. The worker threads, created with the device, keep
SCHED_OTHER.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def caller_yields(enabled: bool = True) -> Iterator[None]:
    """The calling thread is SCHED_BATCH inside the block (Linux, and only when it was SCHED_OTHER: a
    real-time or already-batch caller is left as it is), SCHED_OTHER again after it. `enabled` False
    (a driver with no CPU workers) or a sandbox that refuses the switch: nothing changes."""
    switched = False
    if enabled and hasattr(os, "sched_setscheduler"):
        try:
            if os.sched_getscheduler(0) == os.SCHED_OTHER:
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
                switched = True
        except OSError:
            pass
    try:
        yield
    finally:
        if switched:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
