"""A run's output directory: one run at a time (:class:`OutputDirLock`), atomic records (:func:`write_atomic`),
and records no command overwrites: a finished run is recognised before anything starts (:func:`finished_run`), the
logs of earlier invocations are rotated, not replaced (:func:`rotate_logs`), and a run started over with
``--no-resume`` (or a second ``vime eval``) first moves the earlier records to ``OUTPUT_DIR/previous/N/``
(:func:`archive_records`).

The lock is ``OUTPUT_DIR/.vime.lock``, a :class:`filelock.FileLock` (``flock``) taken without waiting: the kernel
drops it when its holder dies, however it dies, so a lock left by a killed run is stale by construction (its record,
still in the file, is reported and replaced); while held, the file names the holder (pid, host, start time) for the
refusal message of a second run. docs/checkpoints.md describes it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import filelock

from vime_core.config.errors import ArgumentError
from vime_core.run.checkpoint import complete_checkpoints

LOCK_NAME = ".vime.lock"


class OutputDirBusy(ArgumentError):
    """Another live run holds the output directory (the message names its pid, host and start time)."""


def check_output_dir(out: Path) -> None:
    """Refuse an ``--output-dir`` that cannot be a directory, before anything is written.

    :raises ArgumentError: the path is a file (or under one), or its nearest existing parent is not writable (by
        the permission bits, or, as root, where the filesystem refuses: read-only, ``/proc``).
    """
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == out else f"is under {p}, which is a file"
                raise ArgumentError(f"--output-dir {out} {where}; give a directory")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ArgumentError(f"--output-dir {out}: {p} is not writable")
            _probe_writable(out, p)
            return


def _probe_writable(out: Path, parent: Path) -> None:
    """Create (and remove) a probe file in ``parent``, the nearest existing directory of ``out``: ``os.access``
    says yes to root where the filesystem still refuses.

    :raises ArgumentError: naming ``--output-dir``, ``parent`` and the OS error.
    """
    probe = parent / f".vime-probe-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ArgumentError(f"--output-dir {out}: cannot create it in {parent} ({e.strerror or e})") from None


def make_output_dir(out: Path) -> None:
    """Create ``out`` (and its parents).

    :raises ArgumentError: naming ``--output-dir`` and the OS error (permission, read-only filesystem, a file in
        the way), in one line.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArgumentError(f"--output-dir {out}: cannot create it ({e.strerror or e})") from None


def current_umask() -> int:
    """This process's umask (``/proc/self/status``; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_like_outputs(root: Path) -> None:
    """Give every file and directory under ``root`` the permissions the run's other outputs get (``0o666`` /
    ``0o777`` less the umask): a library that writes through a private temporary file (transformers'
    ``save_pretrained`` leaves ``model.safetensors`` at ``0o600``) would otherwise leave an export that only its
    owner can read. Nothing under ``root`` (a model saved on another node): nothing to do."""
    root = Path(root)
    if not root.exists():
        return
    mask = current_umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            exec_bits = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o666 | exec_bits) & ~mask)


#: what a run (or an evaluation) writes into its output directory: the records :func:`archive_records` moves
RUN_RECORDS = (
    "args.json",
    "plugins.json",
    "plan.json",
    "placement.json",
    "summary.json",
    "metrics.jsonl",
    "trained_prompts.jsonl",
    "report.html",
    "report_files",
    "tensorboard",
    "wandb",
    "checkpoints",
    "final_hf",
    "final_adapter",
    "eval_samples",
    "logs",
    "weights",
)
#: where :func:`archive_records` moves the records of earlier runs
PREVIOUS_DIR = "previous"


def read_summary(out: Path) -> dict[str, Any] | None:
    """``OUTPUT_DIR/summary.json`` (``None``: none, or not a JSON object)."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def next_archive(out: Path) -> Path:
    """``OUTPUT_DIR/previous/N`` with the first ``N >= 1`` not taken: where :func:`archive_records` moves records."""
    n = 1
    while (Path(out) / PREVIOUS_DIR / str(n)).exists():
        n += 1
    return Path(out) / PREVIOUS_DIR / str(n)


def archive_records(out: Path) -> Path | None:
    """Move the records of an earlier run (or evaluation) in ``out`` (:data:`RUN_RECORDS`; nothing else of the
    directory) into :func:`next_archive`, so a run that starts over overwrites none of them.

    :return: the archive directory, or ``None`` when ``out`` holds no record.
    """
    out = Path(out)
    present = [name for name in RUN_RECORDS if (out / name).exists()]
    if not present:
        return None
    dest = next_archive(out)
    dest.mkdir(parents=True)
    for name in present:
        os.replace(out / name, dest / name)
    return dest


def is_training_run(out: Path) -> bool:
    """Whether ``out`` holds the records of a ``vime run`` (checkpoints, or a summary with trained steps)."""
    summary = read_summary(out) or {}
    return (Path(out) / "checkpoints").is_dir() or "steps_run" in summary


def finished_run(out: Path, num_rollout: int) -> str | None:
    """Whether ``out`` holds a finished run that a resumed ``vime run`` with ``--num-rollout num_rollout`` has
    nothing to add to: its ``summary.json`` says ``completed`` and its newest checkpoint has ``num_rollout`` steps
    or more. Reads two small files: no Ray, no engine, no torch.

    :return: the one line saying so and how to go on, or ``None`` (not finished: the run resumes or starts).
    :raises ArgumentError: ``out`` holds a completed run without a checkpoint to resume from (``--debug-rollout-only``
        trains nothing and saves none) and ``--num-rollout`` asks for more steps: starting it again from step 0
        would overwrite the finished run's records.
    """
    out = Path(out)
    summary = read_summary(out)
    if summary is None or summary.get("status") != "completed":
        return None
    done = complete_checkpoints(out)
    archive = next_archive(out)
    start_over = f"add --no-resume (the finished run's files move to {archive}/) or give another --output-dir"
    if not done:
        steps = summary.get("steps_run")
        if isinstance(steps, int) and steps < num_rollout:
            raise ArgumentError(
                f"--output-dir {out} holds a finished run of {steps} step(s) without a checkpoint to resume from, "
                f"so --num-rollout {num_rollout} cannot continue it: to start over, {start_over}"
            )
        return (
            f"vime run: nothing to do: --output-dir {out} holds a finished run ({steps} step(s); summary.json). To "
            f"run it again, {start_over}"
        )
    step, ckpt = done[-1]
    if step < num_rollout:
        return None
    return (
        f"vime run: nothing to do: --output-dir {out} holds a finished run of {step} step(s) "
        f"(--num-rollout {num_rollout}; {ckpt.relative_to(out)}). To train on, raise --num-rollout (it resumes from "
        f"step {step}); to start over, {start_over}"
    )


#: a rotated log's name: ``<stem>.<N><suffix>``
_ROTATED = re.compile(r"^(?P<stem>.+)\.(?P<n>\d+)(?P<suffix>\.[^.]+)?$")


def rotate_logs(log_dir: Path) -> list[Path]:
    """Keep the logs of earlier invocations of a run (as logrotate does): each file ``x.log`` of ``log_dir`` (any
    name not already rotated) becomes ``x.1.log`` after ``x.N.log`` became ``x.N+1.log``, so the invocation about
    to start writes fresh files and ``x.1.log`` is always the previous one's.

    :return: the new names of the files that were current (``[]`` without ``log_dir``).
    """
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        return []
    moved = []
    for path in sorted(p for p in log_dir.iterdir() if p.is_file() and not _ROTATED.match(p.name)):
        stem, suffix = (path.stem, path.suffix) if path.suffix else (path.name, "")
        n = 1
        while (log_dir / f"{stem}.{n}{suffix}").exists():
            n += 1
        for k in range(n - 1, 0, -1):
            os.replace(log_dir / f"{stem}.{k}{suffix}", log_dir / f"{stem}.{k + 1}{suffix}")
        os.replace(path, log_dir / f"{stem}.1{suffix}")
        moved.append(log_dir / f"{stem}.1{suffix}")
    return moved


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
        make_output_dir(self.out)
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
