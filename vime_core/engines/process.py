"""The lifecycle of a server run as a managed subprocess: start with its output in a log file, wait until an HTTP
route answers 200, terminate its whole process group, and use it as a context manager.

:class:`vime_core.engines.engine.VLLMServer` (a vLLM OpenAI-compatible server) and
:class:`vime_core.engines.router.VLLMRouter` (the vllm-router) are both a :class:`ManagedServer`.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx

from vime_core.sandbox.base import owner_alive, owner_token, processes_with_env

logger = logging.getLogger("vime.rollout")

# environment variable naming the process that started a server (an owner_token); the server's children (vLLM's
# engine-core process) inherit it, so a server whose starter was killed is found by it later
OWNER_ENV = "VIME_SERVER_OWNER"

_S = TypeVar("_S", bound="ManagedServer")


def tail_file(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a text file ("" if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except FileNotFoundError:
        return ""


def reap_orphaned_servers() -> list[int]:
    """Kill (SIGKILL, whole process group) every server process whose starter is gone: a ``kill -9`` of a run takes
    its manager with it, and vLLM's engine-core process, a child of the API server, outlives both (it holds GBs of
    memory). Found by :data:`OWNER_ENV` in the process environment; servers of live owners are left alone.
    :meth:`ManagedServer.start` calls it, so the next run on the machine cleans up after a killed one.

    :return: the pids whose process groups were killed.
    """
    killed = []
    for pid, token in processes_with_env(OWNER_ENV).items():
        if owner_alive(token):
            continue
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        killed.append(pid)
    if killed:
        logger.warning("killed %d server process(es) left by a run that is gone: pids %s", len(killed), killed)
    return killed


def guarded(cmd: list[str], grace_s: float) -> list[str]:
    """``cmd`` run under :mod:`vime_core.engines.process_guard` (by file path: the guard imports nothing of vime),
    which stops the whole process group ``grace_s`` seconds after a SIGTERM once the starter is gone. The starter is
    this process: run the command from here."""
    guard = Path(__file__).with_name("process_guard.py")
    return [sys.executable, str(guard), str(grace_s), str(os.getpid()), "--", *cmd]


#: environment variable naming a run; every process the run starts inherits it (Ray's too, set before ray.init)
RUN_ENV = "VIME_RUN_ID"


def start_run_reaper(grace_s: float = 6.0) -> str:
    """Mark this process's environment with a fresh :data:`RUN_ENV` (before Ray or any server starts, so all of
    them inherit it) and start the run reaper (:func:`vime_core.engines.process_guard.reap_run`, in its own
    session so a terminal's Ctrl-C does not reach it): once this process is gone, however it ended, it waits
    ``grace_s`` seconds and SIGKILLs every process still carrying the marker.

    :return: the run id.
    """
    import uuid

    run_id = uuid.uuid4().hex
    os.environ[RUN_ENV] = run_id
    guard = Path(__file__).with_name("process_guard.py")
    _reapers.append(
        subprocess.Popen(
            [sys.executable, str(guard), "--reap-run", RUN_ENV, run_id, str(grace_s), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    )
    return run_id


_reapers: list[subprocess.Popen] = []


def finish_run_reaper(timeout_s: float = 10.0) -> bool:
    """After the run's own cleanup (a signal ended it): have the run reaper kill what is left of the run at once
    (:data:`~vime_core.engines.process_guard.REAP_NOW_SIGNAL`) and wait for it to exit.

    :return: whether no process of the run is left: the reaper exited within ``timeout_s`` (``True`` when no
        reaper was started: the run started no process).
    """
    from vime_core.engines.process_guard import REAP_NOW_SIGNAL

    done = True
    while _reapers:
        reaper = _reapers.pop()
        if reaper.poll() is None:
            reaper.send_signal(REAP_NOW_SIGNAL)
        try:
            reaper.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            done = False
    return done


def stop_process_group(proc: subprocess.Popen | None, grace_s: float = 20.0) -> None:
    """SIGTERM the process group led by ``proc`` (started with ``start_new_session=True``), SIGKILL after ``grace_s``.

    The group is killed even if the leader already exited, so no child (EngineCore, workers) is left behind.
    """
    if proc is None:
        return
    pgid = proc.pid  # session leader: pgid == pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        logger.warning("process %d did not exit after SIGKILL", proc.pid)
    deadline = time.monotonic() + 5  # until the kernel has reaped every member (a grandchild's parent is init now)
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.05)


class ManagedServer:
    """An HTTP server run as a subprocess in its own session, its stdout and stderr in :attr:`log_path`.

    A subclass sets :attr:`error_cls`, :attr:`display_name` (used in error messages: ``"<display_name> on <url>
    exited ..."``) and :attr:`log_name` (used in log lines), implements :meth:`command` and :meth:`wait_ready`
    (usually with :meth:`_wait_http`), and in ``__init__`` sets ``url``, ``log_path``, ``proc = None``,
    ``_log_file = None`` and ``_http`` (an :class:`httpx.Client` on ``url``).

    :meth:`start` registers :meth:`stop` with ``atexit``, and runs the server under
    :mod:`~vime_core.engines.process_guard`, which leads its process group and stops the whole group when the
    starting process dies, ``kill -9`` included (``proc`` is the guard: its pid is the group's id, its exit code the
    server's).
    """

    error_cls: ClassVar[type[Exception]] = RuntimeError
    display_name: ClassVar[str] = "server"
    log_name: ClassVar[str] = "server"
    default_grace_s: ClassVar[float] = 20.0
    #: seconds the guard gives the server's group between SIGTERM and SIGKILL once the starter is gone
    guard_grace_s: ClassVar[float] = 5.0

    url: str
    log_path: Path
    proc: subprocess.Popen | None
    _log_file: Any
    _http: httpx.Client

    def command(self) -> list[str]:
        """The argv used to start the server."""
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The environment of the server process (default: this process's)."""
        return dict(os.environ)

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Wait until the server serves; return the seconds spent waiting."""
        raise NotImplementedError

    # ---------------------------------------------------------------- lifecycle

    def start(self: _S) -> _S:
        """Start the subprocess (returns at once; call :meth:`wait_ready`). A fresh log file per start, so error
        tails show this run only.

        :raises error_cls: if it is already running.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise self.error_cls(f"{self.display_name} on {self.url} is already running (pid {self.proc.pid})")
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "wb")
        reap_orphaned_servers()
        logger.info("starting %s on %s (log: %s): %s", self.log_name, self.url, self.log_path, " ".join(cmd))
        self.proc = subprocess.Popen(
            guarded(cmd, self.guard_grace_s),
            env={**self.environment(), OWNER_ENV: owner_token()},
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the guard leads the group; it sets its own parent-death signal
        )
        atexit.register(self.stop)
        return self

    def _check_alive(self, what: str) -> None:
        """:raises error_cls: if the server was not started or has exited (with the last 40 lines of its log)."""
        if self.proc is None:
            raise self.error_cls(f"{self.display_name} on {self.url} was not started")
        rc = self.proc.poll()
        if rc is not None:
            raise self.error_cls(
                f"{self.display_name} on {self.url} exited with code {rc} {what}; last lines of {self.log_path}:\n"
                f"{tail_file(self.log_path)}"
            )

    def _wait_http(self, path: str, *, t0: float, timeout_s: float, poll_s: float, state: str) -> None:
        """Poll ``GET path`` every ``poll_s`` seconds until it answers 200, checking the process between polls.

        :param t0: ``time.monotonic()`` when waiting began; ``timeout_s`` counts from there.
        :param state: what is awaited, for the timeout message (``"... not <state> after N s"``).
        :raises error_cls: if the process dies.
        :raises TimeoutError: if not answered within ``timeout_s`` (with the last 40 log lines).
        """
        while True:
            self._check_alive("while starting")
            try:
                if self._http.get(path, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(
                    f"{self.display_name} on {self.url} not {state} after {timeout_s:.0f} s; last lines of "
                    f"{self.log_path}:\n{tail_file(self.log_path)}"
                )
            time.sleep(poll_s)

    def is_running(self) -> bool:
        """Whether the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float | None = None) -> None:
        """Terminate the server's whole process group (SIGTERM, then SIGKILL after ``grace_s`` seconds, default
        :attr:`default_grace_s`). Idempotent."""
        if self.proc is not None:
            logger.info("stopping %s on %s (pid %d)", self.log_name, self.url, self.proc.pid)
            stop_process_group(self.proc, self.default_grace_s if grace_s is None else grace_s)
            self.proc = None
            atexit.unregister(self.stop)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def close(self) -> None:
        """Stop the server and close its HTTP client."""
        self.stop()
        self._http.close()

    def __enter__(self: _S) -> _S:
        if not self.is_running():
            self.start()
            try:
                self.wait_ready()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
