"""How ``vime run`` / ``vime eval`` end on SIGINT or SIGTERM: both become a :class:`KeyboardInterrupt` in the main
thread (which Ray's blocking calls honour), the run's ``finally`` stops what it started with short timeouts, and
the ``vime`` command prints one line naming the signal and exits 130 (SIGINT) or 143 (SIGTERM).

What the driver cannot stop itself (it was killed with SIGKILL) stops on its own: Ray's processes share the
driver's fate, and every server runs under :mod:`vime_core.engines.process_guard`. docs/engine_health.md ("No
process outlives the run") describes the whole.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: seconds the cleanup after a signal gives a graceful stop before it kills (the rollout manager, Ray)
INTERRUPT_GRACE_S = 5.0
#: the same before the setup has finished: the rollout manager is then inside its engines' start, a call that does
#: not return to serve the graceful stop, so the wait only delays the kill (which takes every engine process along)
SETUP_INTERRUPT_GRACE_S = 1.0

_received: list[tuple[int, float]] = []


def received() -> int | None:
    """The first signal received since :func:`handle_signals` was entered (``None``: none)."""
    return _received[0][0] if _received else None


def interrupted() -> bool:
    """Whether a SIGINT or SIGTERM arrived (the run is ending because of it)."""
    return bool(_received)


def signal_name(signum: int | None) -> str:
    """``"SIGINT"``, ``"SIGTERM"`` (``"an interrupt"`` for ``None``: a KeyboardInterrupt without a signal)."""
    return signal.Signals(signum).name if signum is not None else "an interrupt"


def exit_code(signum: int | None) -> int:
    """The shell's code for a run ended by ``signum``: 128 + its number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + (signum or signal.SIGINT)


def seconds_since_signal() -> float:
    """Seconds since the first signal (0 without one)."""
    return time.monotonic() - _received[0][1] if _received else 0.0


def _on_signal(signum: int, frame: object) -> None:
    first = not _received
    _received.append((signum, time.monotonic()))
    if first:
        raise KeyboardInterrupt(signal_name(signum))
    if len(_received) >= 3:  # a third: leave now (Ray's processes share the driver's fate; the guards stop servers)
        os._exit(exit_code(_received[0][0]))
    # a second signal during the cleanup: ignored (the cleanup is bounded)


def claim_signals() -> None:
    """(Re)install the SIGINT/SIGTERM handlers of :func:`handle_signals`: ``ray.init`` installs its own SIGTERM
    handler in the driver (it aborts the process with a core dump), so :func:`vime_core.run.loop.run` calls this after
    starting Ray. No-op outside :func:`handle_signals` (the ``vime`` command installs them; a library caller keeps
    its own)."""
    if _active:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _on_signal)


_active: list[bool] = []


@contextmanager
def handle_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`KeyboardInterrupt` once in the main thread (a second
    is ignored, a third exits at once); the previous handlers come back afterwards."""
    _received.clear()
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    _active.append(True)
    try:
        yield
    finally:
        _active.pop()
        for s, h in old.items():
            signal.signal(s, h)
