"""A full copy on disk of each version a GPU strategy (``ipc``, ``nccl``) pushed: what a replacement engine loads.

``disk`` and ``disk-delta`` leave every version on disk anyway; ``ipc`` and ``nccl`` move weights GPU to GPU, so
nothing outside the trainer would hold the current version when an engine dies after step 0. After each push the
trainer-side strategy hands its GPU tensors to :class:`HostCopy`, which copies them to host memory and writes
``<--update-weight-disk-dir>/recovery_v{N:06d}/model.safetensors`` in a background thread (atomically, the newest
complete version kept, older ones removed), off the step's critical path. The update's payload names that
directory (``recovery_dir``); :class:`vime_core.engines.weight_recovery.WeightRecovery` waits for it and loads it
into the replacement through the worker extension's ``vime_load_weights``.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from vime_core.weight_sync.base import write_version_dir

logger = logging.getLogger("vime.weight_sync")

RECOVERY_PREFIX = "recovery_v"
DONE_FILE = "model.safetensors"


def recovery_dir(root: str | Path, version: int) -> Path:
    """``root/recovery_v{version:06d}``."""
    return Path(root) / f"{RECOVERY_PREFIX}{version:06d}"


class HostCopy:
    """Writes the host copy of each pushed version in a background thread (one at a time, the newest wins).

    :param root: ``--update-weight-disk-dir`` (must be readable where replacement engines start; the same node for
        colocated ``ipc``).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._thread: threading.Thread | None = None
        self.last_seconds = 0.0
        self.last_error: BaseException | None = None
        #: ``time.perf_counter()`` when the newest copy started and when it finished (``None``: not yet)
        self.started_at: float | None = None
        self.finished_at: float | None = None

    def start(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Path:
        """Start writing ``version`` (waits for the previous copy first) and return its directory.

        The thread holds ``named_tensors`` (GPU views are fine) until they are copied, so the caller may drop its
        own references at once.
        """
        self.wait()
        tensors = list(named_tensors)
        out = recovery_dir(self.root, version)
        self.started_at, self.finished_at = time.perf_counter(), None
        self._thread = threading.Thread(
            target=self._write, args=(version, tensors, out), name=f"vime-host-copy-{version}", daemon=True
        )
        self._thread.start()
        return out

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for the copy being written (if any)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._thread = None

    def overlap(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` (``time.perf_counter()`` values) during which a copy was being written (the
        newest one; one still running counts up to ``end``): time it shared the trainer's process with a train step."""
        if self.started_at is None:
            return 0.0
        stop = end if self.finished_at is None else min(self.finished_at, end)
        return max(0.0, stop - max(self.started_at, start))

    def _write(self, version: int, tensors: list[tuple[str, torch.Tensor]], out: Path) -> None:
        t0 = time.perf_counter()
        try:
            host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors}
            del tensors
            write_version_dir(
                out, lambda tmp: save_file(host, str(tmp / DONE_FILE), metadata={"vime_weight_version": str(version)})
            )
            for old in self.root.glob(f"{RECOVERY_PREFIX}*"):
                if old != out and old.name[len(RECOVERY_PREFIX) :].isdigit():
                    shutil.rmtree(old, ignore_errors=True)
            self.last_seconds = time.perf_counter() - t0
            self.last_error = None
        except BaseException as e:  # noqa: BLE001 - a replacement engine reports it when it needs the copy
            self.last_error = e
            logger.error("host copy of weight version %d into %s failed: %s", version, out, e)
        finally:
            self.finished_at = time.perf_counter()


def wait_for_copy(path: str | Path, timeout_s: float, done_file: str = DONE_FILE) -> Path:
    """Wait until ``path/<done_file>`` (``model.safetensors``; an adapter's ``adapter_model.safetensors``) exists
    (the background write renamed it into place).

    :raises TimeoutError: naming the directory, when it does not appear within ``timeout_s`` seconds (its write
        failed — the trainer's log says why — or the directory is not shared with this node).
    """
    path = Path(path)
    deadline = time.monotonic() + timeout_s
    while not (path / done_file).is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the host copy {path / done_file} of the current weight version did not appear within "
                f"{timeout_s:g} s (its write failed on the trainer, or --update-weight-disk-dir is not shared with "
                "this node)"
            )
        time.sleep(0.2)
    return path
