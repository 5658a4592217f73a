"""What a sandbox command returns: :class:`ExecResult` (decoded), :class:`RawExecResult` (a backend's bytes), the
:class:`DetachedProcess` handle, and the reaper's :class:`CleanupReport`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIMEOUT_EXIT_CODE = 137  # exit code reported when a command is killed at its timeout (128 + SIGKILL)


@dataclass(frozen=True)
class ExecResult:
    """What a command did. A failing command is a result, not an exception.

    :ivar exit_code: the exit status; ``128 + N`` when killed by signal N; :data:`TIMEOUT_EXIT_CODE` on timeout.
    :ivar stdout: standard output, UTF-8 decoded (invalid bytes replaced), at most ``max_output_bytes`` bytes.
    :ivar stderr: standard error, likewise.
    :ivar timed_out: the command was killed at its timeout (or at the sandbox's wall-time limit).
    :ivar stdout_truncated: more than ``max_output_bytes`` bytes were written to stdout; the first ones are kept.
    :ivar stderr_truncated: likewise for stderr.
    :ivar duration_s: wall-clock seconds the call took.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Exit code 0 and not timed out."""
        return self.exit_code == 0 and not self.timed_out

    @property
    def truncated(self) -> bool:
        """Either stream was truncated."""
        return self.stdout_truncated or self.stderr_truncated


@dataclass(frozen=True)
class RawExecResult:
    """Backend-level result of :meth:`Sandbox._exec_raw` (bytes, not decoded)."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    def decode(self, duration_s: float) -> ExecResult:
        """This result with its streams decoded as UTF-8 (invalid bytes replaced), taking ``duration_s`` seconds."""
        return ExecResult(
            self.exit_code,
            self.stdout.decode("utf-8", "replace"),
            self.stderr.decode("utf-8", "replace"),
            self.timed_out,
            self.stdout_truncated,
            self.stderr_truncated,
            duration_s,
        )


@dataclass(frozen=True)
class DetachedProcess:
    """Handle of a command started with :meth:`Sandbox.start_detached`.

    :ivar id: handle id (names its control files inside the sandbox).
    :ivar pid: process id inside the sandbox (its process group id too).
    :ivar started_at: host ``time.monotonic()`` at start, seconds.
    :ivar timeout: seconds after which the command is killed, or ``None``.
    """

    id: str
    pid: int
    started_at: float
    timeout: float | None = None


@dataclass
class CleanupReport:
    """What :meth:`Sandbox.cleanup` found and removed.

    :ivar backend: backend name.
    :ivar found: resource descriptions carrying the vime label (all owners).
    :ivar removed: those removed (owner dead, or ``everything=True``).
    :ivar errors: removal failures, as text.
    """

    backend: str
    found: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping (``vime sandbox cleanup`` prints it)."""
        return {"backend": self.backend, "found": self.found, "removed": self.removed, "errors": self.errors}
