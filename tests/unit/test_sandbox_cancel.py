"""Cancellation helpers of the sandbox code (:mod:`vime_core.sandbox.cancel`) and the kit's await-point harness
(:mod:`vime_core.testing.sandbox_cancel`), on plain asyncio objects and a tiny in-memory backend."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.sandbox.base import CleanupReport, RawExecResult, Sandbox
from vime_core.sandbox.cancel import finish_then_raise, wait_for
from vime_core.testing.sandbox_cancel import cancel_at_every_await_point

pytestmark = pytest.mark.unit


async def _ready_when_cancelled(waiter):
    """``waiter`` completes in the same loop iteration as the cancellation of the task awaiting it."""
    fut = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(waiter(fut))
    await asyncio.sleep(0)  # the task now waits on fut
    fut.set_result("line")
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


def test_wait_for_never_swallows_a_cancellation():
    # the race of CPython gh-86296: before 3.12 asyncio.wait_for returns the result and drops the cancellation
    assert asyncio.run(_ready_when_cancelled(lambda f: wait_for(f, 30))) == "cancelled"


def test_wait_for_results_and_timeouts():
    async def body():
        assert await wait_for(asyncio.sleep(0, "x"), 5) == "x"
        inner = asyncio.ensure_future(asyncio.sleep(30))
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(inner, 0.05)
        assert inner.cancelled()  # cancelled and awaited before the TimeoutError
        with pytest.raises(KeyError):
            await wait_for(asyncio.ensure_future(_raise(KeyError("k"))), 5)

    asyncio.run(body())


async def _raise(e):
    raise e


def test_finish_then_raise_lets_the_step_finish_then_raises():
    done = []

    async def step():
        await asyncio.sleep(0.1)
        done.append("created")
        return "resource"

    async def body():
        task = asyncio.ensure_future(finish_then_raise(step()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done == ["created"]  # not abandoned halfway
        assert await finish_then_raise(step()) == "resource"

    asyncio.run(body())


class _MemorySandbox(Sandbox):
    """A backend whose resources are entries of a dict; ``swallow`` makes ``_exec_raw`` swallow cancellations."""

    NAME = "memory"
    registry: dict[str, str] = {}
    swallow = False

    async def _create(self) -> None:
        await asyncio.sleep(0)
        self.registry[self.sandbox_id] = "half"
        await asyncio.sleep(0)
        self.registry[self.sandbox_id] = "up"

    async def _destroy(self) -> None:
        await asyncio.sleep(0)
        self.registry.pop(self.sandbox_id, None)

    async def _exec_raw(self, argv, **kw) -> RawExecResult:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
        return RawExecResult(0, b"ok\n", b"")

    @classmethod
    def cleanup(cls, *, everything: bool = False) -> CleanupReport:
        return CleanupReport(cls.NAME)


def _left(ids):
    return {"entries": sum(i in _MemorySandbox.registry for i in ids)}


def test_harness_cancels_at_every_await_point_and_finds_nothing_left():
    report = asyncio.run(cancel_at_every_await_point(_MemorySandbox, _left, concurrency=3))
    # start: two awaits in _create; exec: one; close: the teardown
    assert report.points == 4, report.summary()
    assert [r.cancelled for r in report.rounds] == [3, 3, 3, 3], report.summary()
    assert report.problems == []


def test_harness_reports_swallowed_cancellations_and_leaks(monkeypatch):
    monkeypatch.setattr(_MemorySandbox, "swallow", True)

    async def leaky_destroy(self):  # forgets a half-created sandbox
        if self.registry.get(self.sandbox_id) == "up":
            self.registry.pop(self.sandbox_id)

    monkeypatch.setattr(_MemorySandbox, "_destroy", leaky_destroy)
    report = asyncio.run(cancel_at_every_await_point(_MemorySandbox, _left, concurrency=2))
    problems = "\n".join(report.problems)
    assert problems.count("cancellation swallowed: returned normally") == 2, report.summary()
    assert "left behind: {'entries': 2}" in problems, report.summary()
