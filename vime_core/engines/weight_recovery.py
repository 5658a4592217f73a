"""What a replacement vLLM engine needs to serve the rollout's current weight version: a full load of that version
(``vime_load_weights(path, version)``) before it takes requests, from wherever the weight-sync strategy keeps the
full weights (the kept ``disk`` version, a ``disk-delta`` recovery file, the ``ipc`` host copy, the LoRA adapters'
files); with no host-side copy (``nccl``, plugins) only at version 0. The rules per strategy: docs/engine_health.md,
"What happens to a dead engine"."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from vime_core.engines.lora_serving import AdapterServing
from vime_core.weight_sync.base import WeightSyncStrategy, WeightUpdate
from vime_core.weight_sync.host_copy import wait_for_copy

logger = logging.getLogger("vime.rollout")

#: weight-sync strategies whose versions a replacement engine can be brought to (``ipc``: while its updates carry a
#: host copy, ``recovery_dir``)
RECOVERABLE = ("disk", "disk-delta", "ipc")


class WeightRecovery:
    """Tracks the engines' weight version and loads it into a replacement engine.

    :param weight_sync: the rollout side's weight-sync strategy object (its ``NAME`` decides how, see the module
        docstring).
    :param work_dir: where ``disk-delta`` recoveries write a full version (``--update-weight-disk-dir``).
    :param adapters: LoRA: the adapters the engines serve (a replacement loads them all).
    """

    def __init__(
        self, weight_sync: WeightSyncStrategy, work_dir: str | Path | None, adapters: AdapterServing | None = None
    ) -> None:
        self.weight_sync = weight_sync
        self.adapters = adapters
        self.kind = getattr(weight_sync, "NAME", "")
        self.work_dir = Path(work_dir) if work_dir else None
        self.version = 0
        self._kept: WeightUpdate | None = None  # disk: the full version last applied
        self._names: list[str] = []  # disk-delta: every tensor name of the current version
        self._host_copy: str | None = None  # ipc: the host copy of the current version (written in the background)
        self.copy_timeout_s = 300.0

    @property
    def supported(self) -> bool:
        """Whether a replacement engine can be brought to the current version (always at version 0)."""
        if self.adapters is not None:  # adapters load from their files; nccl's group would lose a rank
            return self.kind != "nccl" or self.version == 0
        if self.kind == "ipc":
            return self.version == 0 or self._host_copy is not None
        return self.version == 0 or self.kind in RECOVERABLE

    def applied(self, update: WeightUpdate) -> list[WeightUpdate]:
        """Record that every serving engine now holds ``update``.

        :return: the updates whose files may be removed now (the strategy's ``cleanup``): for ``disk`` the version
            before (this one is kept for recoveries), else ``update`` itself.
        :raises DeltaSyncError: (``disk-delta``) if the delta cannot be decoded against the tracked version.
        """
        self.version = update.version
        if update.payload.get("lora") and self.adapters is not None:
            self.adapters.record(update)  # its files stay until AdapterServing retires it
            return []
        if self.kind == "disk":
            if "path" not in update.payload:  # kept for recoveries and removed at close: its directory is needed
                raise ValueError(f"--weight-sync disk: weight update {update.version} has no 'path' in its payload")
            previous, self._kept = self._kept, update
            return [previous] if previous is not None else []
        if self.kind == "disk-delta":
            self._names = list(self.weight_sync.read(update))
        if self.kind == "ipc":
            self._host_copy = update.payload.get("recovery_dir")
        return [update]

    def full_weights(self) -> str | None:
        """A directory holding the full current version, or ``None`` at version 0 (the model directory).

        :raises RuntimeError: if the strategy keeps no host-side copy (see :attr:`supported`).
        """
        if self.version == 0:
            return None
        if self.kind == "disk" and self._kept is not None:
            return self._kept.payload["path"]
        if self.kind == "ipc" and self._host_copy is not None:
            return str(wait_for_copy(self._host_copy, self.copy_timeout_s))
        if self.kind == "disk-delta" and self.work_dir is not None:
            out = self.work_dir / f"recovery_v{self.version:06d}"
            if not (out / "model.safetensors").is_file():
                reader = self.weight_sync._reader  # the decoder DiskDeltaWeightSync.read keeps
                tensors = {n: reader.current_tensor(n).contiguous() for n in self._names}
                tmp = out.with_name(out.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                save_file(tensors, str(tmp / "model.safetensors"), metadata={"vime_weight_version": str(self.version)})
                tmp.rename(out)
            return str(out)
        raise RuntimeError(
            f"--weight-sync {self.kind}: no host-side copy of weight version {self.version} to load into a "
            f"replacement engine (engines can be replaced with {' or '.join(RECOVERABLE)})"
        )

    def load(self, engine: Any) -> float:
        """Bring a fresh, ready ``engine`` to the current version: full load (unless version 0), label it.

        :return: seconds the load took.
        :raises RuntimeError / VLLMServerError: if the load fails.
        """
        t0 = time.monotonic()
        if self.adapters is not None:
            self.adapters.restore(engine)
            engine.set_weight_version(self.version)
            return time.monotonic() - t0
        path = self.full_weights()
        if path is not None:
            engine.collective_rpc("vime_load_weights", args=[str(Path(path).resolve()), self.version])
            engine.reset_prefix_cache()
        engine.set_weight_version(self.version)
        return time.monotonic() - t0

    def close(self) -> None:
        """Remove the kept full version (``disk``; ``ipc``'s host copy) unless ``--keep-weight-updates`` keeps every
        version anyway."""
        if self._kept is not None:
            self.weight_sync.cleanup(self._kept)
            self._kept = None
        if self._host_copy is not None and not self.weight_sync.config.keep_weight_updates:
            shutil.rmtree(self._host_copy, ignore_errors=True)
            self._host_copy = None
