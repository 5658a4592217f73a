"""``disk`` weight sync: a full HF safetensors file per version, reloaded by each engine's worker extension."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate, call_with_timeout, write_version_dir


class DiskWeightSync(WeightSyncStrategy):
    """Writes ``<--update-weight-disk-dir>/weight_v{N:06d}/model.safetensors``; engines reload it through
    ``/collective_rpc vime_load_weights`` (see :mod:`vime_core.rollout.worker_extension`). The directory of a
    version is removed after every engine applied it unless ``--keep-weight-updates``.
    """

    NAME = "disk"

    def _dir(self, version: int) -> Path:
        return Path(self.config.update_weight_disk_dir) / f"weight_v{version:06d}"

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightUpdate:
        """Write ``weight_v{version}/model.safetensors``.

        :raises WeightWriteError: the directory cannot be written (full, read-only), naming it.
        """
        t0 = time.perf_counter()
        out = self._dir(version)
        tensors = {name: t.contiguous() for name, t in named_tensors}
        write_version_dir(  # atomic: an engine never sees a half-written version
            out,
            lambda tmp: save_file(
                tensors, str(tmp / "model.safetensors"), metadata={"vime_weight_version": str(version)}
            ),
        )
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return WeightUpdate(version, {"path": str(out)}, num_bytes=nbytes, seconds=time.perf_counter() - t0)

    def apply(self, engine: Any, update: WeightUpdate, timeout_s: float) -> None:
        """Reload the version's file into every worker of ``engine`` within ``timeout_s`` seconds.

        :raises TimeoutError: if the engine does not answer in time (the step fails; the engine keeps serving).
        """
        call_with_timeout(
            lambda: engine.load_weights(update.payload["path"]),
            timeout_s,
            f"disk: engine {getattr(engine, 'url', engine)} loading version {update.version}",
        )

    def read(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        return load_file(str(Path(update.payload["path"]) / "model.safetensors"))

    def cleanup(self, update: WeightUpdate) -> None:
        if not self.config.keep_weight_updates:
            shutil.rmtree(update.payload["path"], ignore_errors=True)
