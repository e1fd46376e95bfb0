"""runtime/scheduling.py: a local-task call's caller waits as a SCHED_BATCH thread, and gets its policy back."""

from __future__ import annotations

import os
import threading

import pytest

from kimi_iree.runtime import Session
from kimi_iree.runtime.scheduling import caller_yields

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")


def _in_thread(body):
    """Run `body` on a fresh thread (its policy starts as SCHED_OTHER, whatever pytest's thread has)."""
    out = {}

    def run():
        try:
            out["value"] = body()
        except BaseException as e:          # re-raised on the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@linux_only
def test_batch_inside_the_block_and_restored_after():
    def body():
        before = os.sched_getscheduler(0)
        with caller_yields(True):
            inside = os.sched_getscheduler(0)
        return before, inside, os.sched_getscheduler(0)

    assert _in_thread(body) == (os.SCHED_OTHER, os.SCHED_BATCH, os.SCHED_OTHER)


@linux_only
def test_restored_when_the_call_raises():
    def body():
        with pytest.raises(RuntimeError):
            with caller_yields(True):
                raise RuntimeError("the module call failed")
        return os.sched_getscheduler(0)

    assert _in_thread(body) == os.SCHED_OTHER


@linux_only
def test_disabled_or_another_policy_is_left_alone():
    def body():
        with caller_yields(False):
            disabled = os.sched_getscheduler(0)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        with caller_yields(True):
            inside = os.sched_getscheduler(0)
        return disabled, inside, os.sched_getscheduler(0)

    assert _in_thread(body) == (os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_IDLE)


@linux_only
def test_session_calls_run_batch_and_the_workers_stay_normal(compiled):
    """The module's calls (prefill, decode, the head) see the caller as SCHED_BATCH; IREE's worker threads,
    created with the device, keep SCHED_OTHER (they must still preempt on wake-up)."""
    def body():
        session = Session(compiled("k3.1")[0])
        seen = []

        def recording(function):
            def call(*args):
                seen.append(os.sched_getscheduler(0))
                return function(*args)
            return call

        session._prefill = {w: recording(f) for w, f in session._prefill.items()}
        session._decode = {w: recording(f) for w, f in session._decode.items()}
        session._head = recording(session._head)
        session.prefill([1, 2, 3], all_logits=True)
        session.decode(4)
        workers = {}
        for tid in os.listdir("/proc/self/task"):
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            if name.startswith("iree-worker"):
                workers[name] = os.sched_getscheduler(int(tid))
        return seen, os.sched_getscheduler(0), workers

    seen, after, workers = _in_thread(body)
    assert seen == [os.SCHED_BATCH] * 3 and after == os.SCHED_OTHER
    assert workers and set(workers.values()) == {os.SCHED_OTHER}
