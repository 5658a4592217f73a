"""In-memory LoRA adapter sync shared by ``ipc`` and ``nccl``: the engine side's stage-then-load, and the PEFT files
each version also gets on disk in the background (what a replacement engine loads). docs/lora.md."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from safetensors.torch import save_file

from vime_core.weight_sync.base import WeightUpdate, write_version_dir

logger = logging.getLogger("vime.weight_sync")

ADAPTER_FILE = "adapter_model.safetensors"


def stage_key(engine: Any, name: str) -> str:
    """The staging key of adapter ``name`` on ``engine``: ``<host>_<port>/<name>`` (engines on one node stay apart)."""
    where = urlsplit(str(getattr(engine, "url", "")))
    return f"{where.hostname or 'engine'}_{where.port or 0}/{name}"


def stage_and_load(engine: Any, update: WeightUpdate, source: dict[str, Any]) -> dict[str, Any]:
    """Hand ``update``'s adapter to every worker of ``engine`` in memory (``vime_stage_lora`` with ``source``:
    ``{"handles": ...}`` or ``{"broadcast": ...}``), then load it as ``update.payload["adapter"]`` through vLLM's
    runtime LoRA API.

    :return: the first worker's answer (``path``, ``tensors``, ``bytes``).
    :raises RuntimeError: the workers of one engine staged it under different directories.
    :raises VLLMServerError: the engine refused the stage or the load.
    """
    name = update.payload["adapter"]
    kwargs = {"key": stage_key(engine, name), "config": update.payload["config"], "version": update.version, **source}
    answers = engine.collective_rpc("vime_stage_lora", kwargs=kwargs) or []
    paths = {a["path"] for a in answers}
    if len(paths) != 1:
        raise RuntimeError(f"engine {getattr(engine, 'url', engine)}: adapter {name} staged at {sorted(paths)}")
    engine.load_lora_adapter(name, paths.pop())
    return answers[0]


def drop_staged(engine: Any, update: WeightUpdate) -> None:
    """Free ``update``'s staged adapter on ``engine``'s workers (after the engine stopped serving it)."""
    engine.collective_rpc("vime_drop_lora", kwargs={"key": stage_key(engine, update.payload["adapter"])})


class AdapterCopy:
    """Writes each pushed adapter version as PEFT files, ``<root>/weight_v{N:06d}/`` (``adapter_model.safetensors``
    + ``adapter_config.json``, as ``disk`` does), in a background thread: a replacement engine loads the kept
    versions from there (:meth:`vime_core.engines.lora_serving.AdapterServing.restore` waits for the file).
    Unlike :class:`~vime_core.weight_sync.host_copy.HostCopy` every version stays until it is retired.

    :param root: ``--update-weight-disk-dir``.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None

    def start(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> Path:
        """Start writing ``version`` (after the previous write) and return its directory. The thread holds the
        tensors (GPU views are fine) until they are copied to host memory."""
        self.wait()
        tensors = list(named_tensors)
        out = self.root / f"weight_v{version:06d}"
        self._thread = threading.Thread(
            target=self._write, args=(version, tensors, dict(config), out), name=f"vime-adapter-copy-{version}"
        )
        self._thread.daemon = True
        self._thread.start()
        return out

    def wait(self) -> None:
        """Wait for the write in progress (if any)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, version: int, tensors: list[tuple[str, torch.Tensor]], config: dict, out: Path) -> None:
        t0 = time.perf_counter()
        try:
            host = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors}
            del tensors

            def write(tmp: Path) -> None:
                save_file(host, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
                (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))

            write_version_dir(out, write)
            self.last_error = None
            logger.debug("adapter copy of version %d in %.3f s", version, time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - a replacement engine reports it when it needs the copy
            self.last_error = e
            logger.error("adapter copy of weight version %d into %s failed: %s", version, out, e)

    @staticmethod
    def remove(update: WeightUpdate, keep: bool) -> None:
        """Remove ``update``'s adapter files unless ``keep`` (``--keep-weight-updates``)."""
        if not keep and update.payload.get("path"):
            shutil.rmtree(update.payload["path"], ignore_errors=True)
