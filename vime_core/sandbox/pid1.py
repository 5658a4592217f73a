"""The loop of a sandbox's PID 1: reap orphaned processes until a deadline or SIGTERM/SIGINT.

A process that is PID 1 of a pid namespace (the ``local`` backend's init) or of a VM (the ``localvm`` guest's
``vime-init``) inherits every orphan and must ``wait`` for them, or they stay zombies. :data:`REAPER_SOURCE` is the
Python source of one function, ``vime_reap(deadline)``, that both embed in the script they run as PID 1 (a script
run with ``python3 -I -S`` that cannot import vime); it contains no single quote, so a shell script can pass it in
``'...'``.
"""

from __future__ import annotations

REAPER_SOURCE = r"""
def vime_reap(deadline):
    # PID 1: reap orphans until deadline (time.monotonic() seconds; None: for ever) or SIGTERM/SIGINT
    import os, signal, time
    sigs = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    while deadline is None or time.monotonic() < deadline:
        left = 3600 if deadline is None else max(0.01, deadline - time.monotonic())
        info = signal.sigtimedwait(sigs, left)
        if info is not None and info.si_signo != signal.SIGCHLD:
            return
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
"""
assert "'" not in REAPER_SOURCE
