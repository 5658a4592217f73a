"""``disk`` weight sync: a full HF safetensors file per version, reloaded by each engine's worker extension; with
LoRA a PEFT adapter directory per version, loaded through vLLM's runtime LoRA API."""

from __future__ import annotations

import json
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
    ``/collective_rpc vime_load_weights`` (see :mod:`vime_core.engines.worker_extension`). The directory of a
    version is removed after every engine applied it unless ``--keep-weight-updates``.

    With LoRA (:meth:`push_adapter`) a version is ``weight_v{N:06d}/adapter_model.safetensors`` +
    ``adapter_config.json`` (what ``PeftModel.save_pretrained`` writes), loaded by each engine as its own adapter
    (``POST /v1/load_lora_adapter``, :meth:`vime_core.engines.engine.VLLMServer.load_lora_adapter`); the rollout
    side removes it once no engine serves that adapter (:mod:`vime_core.engines.lora_serving`).
    """

    NAME = "disk"
    CARRIES_LORA = True
    RELOADS_ALL_WEIGHTS = True  # every tensor of the model, each version

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

    def push_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int) -> WeightUpdate:
        """Write ``weight_v{version}/adapter_model.safetensors`` and ``adapter_config.json`` (PEFT's files).

        :raises WeightWriteError: the directory cannot be written (full, read-only), naming it.
        """
        t0 = time.perf_counter()
        out = self._dir(version)
        tensors = {name: t.contiguous() for name, t in tensors.items()}

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))

        write_version_dir(out, write)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        payload = {"path": str(out), "lora": True}
        return WeightUpdate(version, payload, num_bytes=nbytes, seconds=time.perf_counter() - t0)

    def apply(self, engine: Any, update: WeightUpdate, timeout_s: float) -> None:
        """Reload the version's file into every worker of ``engine`` within ``timeout_s`` seconds (an adapter:
        load it as ``update.payload["adapter"]``).

        :raises TimeoutError: if the engine does not answer in time (the step fails; the engine keeps serving).
        """
        if update.payload.get("lora"):
            name = update.payload["adapter"]
            call_with_timeout(
                lambda: engine.load_lora_adapter(name, update.payload["path"]),
                timeout_s,
                f"disk: engine {getattr(engine, 'url', engine)} loading adapter {name} (version {update.version})",
            )
            return
        call_with_timeout(
            lambda: engine.load_weights(update.payload["path"]),
            timeout_s,
            f"disk: engine {getattr(engine, 'url', engine)} loading version {update.version}",
        )

    def read(self, update: WeightUpdate) -> dict[str, torch.Tensor]:
        name = "adapter_model.safetensors" if update.payload.get("lora") else "model.safetensors"
        return load_file(str(Path(update.payload["path"]) / name))

    def cleanup(self, update: WeightUpdate) -> None:
        if not self.config.keep_weight_updates:
            shutil.rmtree(update.payload["path"], ignore_errors=True)
