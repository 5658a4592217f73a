"""A run's output directory: one run at a time (:class:`OutputDirLock`) and atomic records (:func:`write_atomic`).

The lock is ``OUTPUT_DIR/.vime.lock``, a :class:`filelock.FileLock` (``flock``) taken without waiting: the kernel
drops it when its holder dies, however it dies, so a lock left by a killed run is stale by construction (its record,
still in the file, is reported and replaced); while held, the file names the holder (pid, host, start time) for the
refusal message of a second run. docs/checkpoints.md describes it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import filelock

from vime_core.argument_errors import ArgumentError

LOCK_NAME = ".vime.lock"


class OutputDirBusy(ArgumentError):
    """Another live run holds the output directory (the message names its pid, host and start time)."""


def check_output_dir(out: Path) -> None:
    """Refuse an ``--output-dir`` that cannot be a directory, before anything is written.

    :raises ArgumentError: the path is a file (or under one), or its nearest existing parent is not writable.
    """
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == out else f"is under {p}, which is a file"
                raise ArgumentError(f"--output-dir {out} {where}; give a directory")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ArgumentError(f"--output-dir {out}: {p} is not writable")
            return


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, flushed and renamed over it:
    a reader (or a crash) sees the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    """:func:`write_atomic` of ``obj`` as indented JSON (paths and other objects as strings)."""
    write_atomic(path, json.dumps(obj, indent=1, default=str))


def _holder_record() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and {"pid", "host"} <= rec.keys() else None


class OutputDirLock:
    """Hold ``OUTPUT_DIR/.vime.lock`` for the life of a run (a context manager; the file stays, emptied, on
    release: ``flock`` waiters must share its inode).

    :param out: the output directory (created on :meth:`acquire`).
    :param command: ``"vime run"`` or ``"vime eval"``, for the refusal message.
    """

    def __init__(self, out: Path, command: str = "vime run") -> None:
        self.out, self.command = Path(out), command
        self.path = self.out / LOCK_NAME
        self.stale: dict[str, Any] | None = None  # the record of a killed holder this lock took over
        self._lock = filelock.FileLock(self.path, blocking=False, thread_local=False, on_acquired=self._claim)

    def _claim(self, fd: int) -> None:
        """``on_acquired``: the flock is ours; note a record a killed holder left, then write ours."""
        with os.fdopen(os.dup(fd), "r+") as f:
            try:
                old = json.loads(f.read() or "null")
            except ValueError:
                old = None
            if isinstance(old, dict):
                self.stale = old
            f.seek(0)
            f.truncate()
            f.write(json.dumps(_holder_record()))
            f.flush()

    def acquire(self) -> OutputDirLock:
        """Take the lock at once or refuse.

        :raises OutputDirBusy: naming the live holder's pid and host.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except filelock.Timeout:
            rec = _read_holder(self.path)
            who = f"pid {rec['pid']} on host {rec['host']}, started {rec.get('started', '?')}" if rec else "a process"
            raise OutputDirBusy(
                f"--output-dir {self.out} is in use by another run ({who}; lock {self.path}): wait for it to end, "
                f"stop it, or give this {self.command} another --output-dir"
            ) from None
        return self

    @property
    def is_locked(self) -> bool:
        """Whether this object holds the lock."""
        return self._lock.is_locked

    def release(self) -> None:
        """Empty the lock file (no holder: the next run finds no record to call stale) and give the lock back
        (idempotent)."""
        if self._lock.is_locked:
            try:
                os.truncate(self.path, 0)
            finally:
                self._lock.release(force=True)

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
