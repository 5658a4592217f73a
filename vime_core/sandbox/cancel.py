"""Cancellation-safe awaiting for sandbox code: a step whose result must be known (a container being created, a
teardown) runs to its end even when the caller is cancelled meanwhile, and the cancellation is raised afterwards —
never swallowed.

Why: ``asyncio.wait_for``, a ``TaskGroup`` or ``asyncio.run`` shutting down cancel a rollout at any ``await``. A
blocking SDK call running in a worker thread or a remote "create" request does not stop when its awaiting task is
cancelled: it finishes later and creates a resource nobody will destroy. Awaiting it with :func:`finish_then_raise`
lets the caller know about (and destroy) what was made, then re-raises ``CancelledError``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_then_raise(aw: Awaitable[T]) -> T:
    """Await ``aw`` to its end; if the caller is cancelled meanwhile, ``CancelledError`` is raised once ``aw`` has
    finished (its result or exception is then dropped: whatever it created must be recorded by ``aw`` itself, on the
    object, for the teardown to find).

    ``aw`` itself being cancelled (e.g. by ``asyncio.run`` cancelling every task at shutdown) ends the wait too.

    :returns: ``aw``'s result when the caller was not cancelled.
    :raises asyncio.CancelledError: the caller was cancelled while waiting (after ``aw`` finished).
    """
    fut = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            cancelled = True
            if not fut.done():
                continue
        except BaseException:
            if not cancelled:
                raise
        else:
            if not cancelled:
                return result
        # the caller was cancelled and ``aw`` has finished: its outcome is dropped, the cancellation goes on
        if not fut.cancelled():
            fut.exception()  # mark it retrieved
        raise asyncio.CancelledError


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for`` that never swallows the caller's cancellation.

    Before Python 3.12, ``asyncio.wait_for`` returns ``aw``'s result instead of raising ``CancelledError`` when
    ``aw`` completes in the same event-loop iteration as the cancellation (CPython gh-86296) — e.g. a pipe whose
    line is already buffered; the cancelled rollout then goes on as if nothing happened. Here a cancellation always
    wins: ``aw`` is cancelled, awaited, and ``CancelledError`` raised.

    :param timeout: seconds; ``None`` waits for ever.
    :raises TimeoutError: ``aw`` did not finish in time (it is cancelled and awaited first); ``asyncio.TimeoutError``
        is that class from Python 3.11 on.
    """
    fut = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    except asyncio.CancelledError:
        await _cancel_and_wait(fut)
        raise
    if not done:
        await _cancel_and_wait(fut)
        if fut.cancelled() or fut.exception() is not None:
            raise asyncio.TimeoutError
    return fut.result()


async def _cancel_and_wait(fut: asyncio.Future) -> None:
    """Cancel ``fut`` and wait until it has finished (its outcome is left for the caller to read)."""
    fut.cancel()
    await asyncio.wait({fut})
    if not fut.cancelled():
        fut.exception()  # mark it retrieved
