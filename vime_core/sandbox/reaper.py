"""The reaper: each backend's :meth:`~vime_core.sandbox.base.Sandbox.cleanup` runs once per process, at the first
sandbox start, and sandboxes still open at interpreter exit are torn down synchronously.

It sees backends and sandboxes through the :class:`SandboxBackend` and :class:`LiveSandbox` protocols (a
:class:`~vime_core.sandbox.base.Sandbox` subclass is the one, its instances the other), so that it imports nothing
back from ``sandbox.base``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import weakref
from typing import Protocol

from vime_core.sandbox.results import CleanupReport

logger = logging.getLogger("vime.sandbox")


class SandboxBackend(Protocol):
    """A sandbox backend class as the reaper sees it (every :class:`~vime_core.sandbox.base.Sandbox` subclass is
    one)."""

    NAME: str

    def cleanup(self) -> CleanupReport:
        """Remove the leftovers of dead vime processes (the backend's class-level reaper)."""


class LiveSandbox(Protocol):
    """A started sandbox as the exit-time teardown sees it (a :class:`~vime_core.sandbox.base.Sandbox` is one)."""

    sandbox_id: str

    def _destroy_sync(self) -> None:
        """Tear the sandbox down without an event loop."""


#: the sandboxes of this process started and not yet torn down
live_sandboxes: weakref.WeakSet[LiveSandbox] = weakref.WeakSet()
# backend class -> its reaper run in this process (once, at the first start; every later start waits for it, so
# that no sandbox is created while the reaper looks at what exists)
_REAPS: dict[SandboxBackend, concurrent.futures.Future] = {}
_REAPS_LOCK = threading.Lock()


def forget_reaps() -> None:
    """Forget which backends this process has reaped: the next start of each runs its reaper again (for tests)."""
    with _REAPS_LOCK:
        _REAPS.clear()


def _reap(cls: SandboxBackend, done: concurrent.futures.Future) -> None:
    try:
        report = cls.cleanup()
        if report.removed:
            logger.warning(
                "%s sandboxes: removed %d leftovers of dead vime processes: %s",
                cls.NAME,
                len(report.removed),
                ", ".join(report.removed[:5]),
            )
    except Exception as e:  # noqa: BLE001 - reaping is best effort; creation decides success
        logger.warning("%s sandboxes: leftover cleanup failed: %s", cls.NAME, e)
    finally:
        done.set_result(None)


async def reap_once(cls: SandboxBackend) -> None:
    """Run ``cls.cleanup()`` once per process (in a daemon thread: a cancelled start does not stop it, and an
    interpreter exit does not wait for it); every start waits until it has finished. ``VIME_SANDBOX_NO_REAP=1``
    skips it."""
    if os.environ.get("VIME_SANDBOX_NO_REAP") == "1":
        return
    with _REAPS_LOCK:
        done = _REAPS.get(cls)
        if done is None:
            done = _REAPS[cls] = concurrent.futures.Future()
            threading.Thread(target=_reap, args=(cls, done), daemon=True, name=f"vime-reap-{cls.NAME}").start()
    if not done.done():
        await asyncio.shield(asyncio.wrap_future(done))


@atexit.register
def _destroy_live_sandboxes_at_exit() -> None:
    for sb in list(live_sandboxes):
        try:
            sb._destroy_sync()
        except Exception as e:  # noqa: BLE001 - best effort at interpreter exit
            logger.warning("sandbox %s: teardown at exit failed: %s", sb.sandbox_id, e)
